/**
 * Options and figures of snapshots in an object store ({@link Vm.snapshot} and {@link Vm.restore}
 * with an `s3://bucket/prefix` location).
 */
import type { S3Client } from '@aws-sdk/client-s3';
import { InvalidOptionError } from '../errors';
import { DEFAULT_CACHE_MAX_BYTES, defaultCacheDir } from './chunk-cache';
import { DEFAULT_REQUEST_TIMEOUT_MS } from './object-io';

/**
 * How pvisor reaches an object store. Every field is optional: by default the client comes from
 * the standard AWS environment and config (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
 * `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_PROFILE`...), as `new S3Client({})` reads it.
 * @category VM
 */
export interface StoreOptions {
  /** An S3 client to use instead of one from the environment; pvisor does not destroy it. */
  client?: S3Client;
  /**
   * Bound on each request to the store, retries and body included: past it the operation fails
   * with a {@link StoreError} `timeout`. Default 30000 ms.
   */
  requestTimeoutMs?: number;
  /** Chunks sent or fetched at once. Default 4; 1 to 64. */
  concurrency?: number;
  /**
   * Restore: the host-local chunk cache, shared by every restore that names it (processes
   * included). Default `$PVISOR_CHUNK_CACHE`, else `$XDG_CACHE_HOME/pvisor/chunks`, else
   * `~/.cache/pvisor/chunks`.
   */
  cacheDir?: string;
  /** Restore: the cache's size bound; past it the least recently used chunks are removed. Default 4 GiB. */
  cacheMaxBytes?: number;
  /** Called after each chunk is sent or fetched (or found present), and once at the end. */
  onProgress?: (progress: StoreProgress) => void;
  /**
   * Restore of a hibernated VM: the id of a claim to take over ({@link StoreClaimedError}'s
   * `claim.claimId`), when the process that claimed the VM is known to have ended before the
   * VM ran (else the VM would run twice: the choice is the caller's). Only that claim is
   * replaced, by a compare-and-swap that one of several racing takers wins. Default none.
   */
  takeOverClaim?: string;
}

/**
 * Progress of an upload or a download ({@link StoreOptions.onProgress}).
 * @category VM
 */
export interface StoreProgress {
  direction: 'upload' | 'download';
  /** The `s3://` location. */
  url: string;
  /** RAM chunks dealt with so far (sent, found present, fetched, found cached, or zero). */
  chunksDone: number;
  /** RAM chunks of the snapshot. */
  chunksTotal: number;
  /** Bytes sent to (upload) or received from (download) the store so far. */
  bytesTransferred: number;
}

/**
 * What an upload or a download of a snapshot moved.
 * @category VM
 */
export interface StoreTransfer {
  /** The `s3://` location. */
  url: string;
  /** RAM chunks of the snapshot (2 MiB each, the last maybe shorter). */
  chunksTotal: number;
  /** Of those, all-zero chunks: recorded as zero, never stored nor fetched. */
  zeroChunks: number;
  /** Chunk objects sent or fetched (the two small files included). */
  chunksTransferred: number;
  /** Chunk objects not moved: already in the bucket (upload) or in the cache (download). */
  chunksPresent: number;
  /** Bytes sent to or received from the store, chunks and manifest. */
  bytesTransferred: number;
  /** Milliseconds the transfer took; fractional. */
  ms: number;
  /**
   * A restore with SharedSnapshot: whether the host's chunk cache had the snapshot assembled
   * already (`reused`: its RAM file is the one the other clones map) or it was `assembled` now.
   */
  sharedEntry?: 'reused' | 'assembled';
}

/** {@link StoreOptions}, checked, with their defaults. */
export interface ResolvedStoreOptions {
  client?: S3Client;
  requestTimeoutMs: number;
  concurrency: number;
  cacheDir: string;
  cacheMaxBytes: number;
  onProgress?: (progress: StoreProgress) => void;
  takeOverClaim?: string;
}

const KEYS = new Set(['client', 'requestTimeoutMs', 'concurrency', 'cacheDir', 'cacheMaxBytes', 'onProgress', 'takeOverClaim']);

/** Checks `options` (the `store` option of a snapshot or restore); each failure an {@link InvalidOptionError}. */
export function resolveStoreOptions(options: StoreOptions | undefined): ResolvedStoreOptions {
  const o = options ?? {};
  if (typeof o !== 'object' || o === null) throw new InvalidOptionError('store', 'must be an object');
  for (const k of Object.keys(o)) if (!KEYS.has(k)) throw new InvalidOptionError(`store.${k}`, 'unknown option');
  const int = (name: string, v: unknown, min: number, max: number, dflt: number): number => {
    if (v === undefined) return dflt;
    if (!Number.isSafeInteger(v) || (v as number) < min || (v as number) > max) throw new InvalidOptionError(`store.${name}`, `must be an integer from ${min} to ${max}`);
    return v as number;
  };
  if (o.cacheDir !== undefined && (typeof o.cacheDir !== 'string' || o.cacheDir === '')) throw new InvalidOptionError('store.cacheDir', 'must be a directory path');
  if (o.onProgress !== undefined && typeof o.onProgress !== 'function') throw new InvalidOptionError('store.onProgress', 'must be a function');
  return {
    ...(o.client && { client: o.client }),
    requestTimeoutMs: int('requestTimeoutMs', o.requestTimeoutMs, 1, 3_600_000, DEFAULT_REQUEST_TIMEOUT_MS),
    concurrency: int('concurrency', o.concurrency, 1, 64, 4),
    cacheDir: o.cacheDir ?? defaultCacheDir(),
    cacheMaxBytes: int('cacheMaxBytes', o.cacheMaxBytes, 0, Number.MAX_SAFE_INTEGER, DEFAULT_CACHE_MAX_BYTES),
    ...(o.onProgress && { onProgress: o.onProgress }),
    ...(o.takeOverClaim !== undefined && { takeOverClaim: claimIdOption(o.takeOverClaim) }),
  };
}

function claimIdOption(v: unknown): string {
  if (typeof v !== 'string' || !/^[0-9a-f]{32}$/.test(v)) throw new InvalidOptionError('store.takeOverClaim', 'must be a claim id (32 hex digits, as a StoreClaimedError gives it)');
  return v;
}
