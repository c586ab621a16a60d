/**
 * The two reads of a restore from an object store, shared by the fetch-all restore (download.ts)
 * and the lazy one (lazy-ram.ts, and its fetcher thread): the snapshot's manifest, bounded and
 * checked; and one content-addressed chunk, from the host's chunk cache or the store, its
 * SHA-256 checked before it is cached or used anywhere.
 */
import { StoreError } from '../errors';
import { hostMemTotalBytes } from '../memory-usage';
import { sha256Hex, type ChunkCache } from './chunk-cache';
import { applyDelta } from './chunk-delta';
import type { ObjectStore } from './object-io';
import { parseStoreManifest, storeManifestBytesLimit, type ChunkRef, type StoreManifest } from './store-manifest';
import { chunkKey, deltaKey, type StoreUrl } from './store-url';

/** The manifest at `url`, checked, and its size in bytes. No snapshot there is a {@link StoreError} `not-found`. */
export async function readStoreManifest(url: StoreUrl, store: ObjectStore): Promise<{ manifest: StoreManifest; sizeBytes: number }> {
  const body = await fetchManifestBody(url, store);
  return { manifest: parseStoreManifest(body, `${url.url}/snapshot.json`), sizeBytes: body.length };
}

/** The manifest's bytes at `url`, bounded by the host's memory; a missing one is `not-found`. */
export async function fetchManifestBody(url: StoreUrl, store: ObjectStore): Promise<Buffer> {
  try {
    return await store.get(url.manifestKey, storeManifestBytesLimit(hostMemTotalBytes()));
  } catch (e) {
    if (e instanceof StoreError && e.reason === 'not-found') throw new StoreError('not-found', `${url.url}: no snapshot there (no ${url.manifestKey})`, { cause: e });
    throw e;
  }
}

/** What {@link fetchCheckedChunk} moved. */
export interface ChunkCounts {
  chunksTransferred: number;
  chunksPresent: number;
  bytesTransferred: number;
}

/**
 * The chunk `ref`: from `cache` if it holds it whole and unchanged, else from the store, read no
 * further than its size, its SHA-256 checked, then cached. A chunk stored as a page delta is its
 * base (fetched the same way, or zeros) with the delta's pages put in, checked the same way.
 * Bytes of another hash or size are a {@link StoreError} `corrupt`, and are neither cached nor
 * returned. Adds what it did to `counts`.
 */
export async function fetchCheckedChunk(ref: ChunkRef, url: StoreUrl, store: ObjectStore, cache: ChunkCache, counts: ChunkCounts): Promise<Buffer> {
  const cached = cache.read(ref.sha256, ref.sizeBytes);
  if (cached) {
    counts.chunksPresent++;
    return cached;
  }
  let bytes: Buffer;
  let key: string;
  if (ref.delta) {
    const { base, sizeBytes } = ref.delta;
    key = deltaKey(ref.sha256, base);
    // The base is a chunk stored whole (the manifest was checked to say so): one level, no chain.
    const [baseBytes, delta] = await Promise.all([base === null ? null : fetchCheckedChunk({ sha256: base, sizeBytes: ref.sizeBytes }, url, store, cache, counts), store.get(key, sizeBytes, true)]);
    counts.bytesTransferred += delta.length;
    if (delta.length !== sizeBytes) throw new StoreError('corrupt', `${url.url}: delta ${key} is ${delta.length} bytes, the manifest says ${sizeBytes}; nothing was restored from it`);
    bytes = applyDelta(baseBytes, delta, ref.sizeBytes, `${url.url}: delta ${key}`);
  } else {
    key = chunkKey(ref.sha256);
    bytes = await store.get(key, ref.sizeBytes, true);
    counts.bytesTransferred += bytes.length;
  }
  const sha = sha256Hex(bytes);
  if (bytes.length !== ref.sizeBytes || sha !== ref.sha256) {
    throw new StoreError('corrupt', `${url.url}: chunk ${key} makes ${bytes.length} bytes with SHA-256 ${sha}, the manifest says ${ref.sizeBytes} bytes with ${ref.sha256}: the store returned other bytes than were stored; nothing was restored from it`);
  }
  cache.write(ref.sha256, bytes);
  counts.chunksTransferred++;
  return bytes;
}
