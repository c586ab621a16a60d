/**
 * The manifest of a snapshot in an object store (`<prefix>/snapshot.json`): which content-addressed
 * chunks make guest RAM, in order, and which hold the local snapshot's two small files
 * (manifest.json with its CRC32C per chunk, and state.json). Written last, create-only, so a
 * snapshot whose upload stopped half-way has no manifest and is never taken for a whole one.
 *
 * Read back, it is hostile input: its size is bounded before it is parsed (by what a manifest of
 * this host's largest guest RAM needs), and its shape is checked field by field before any chunk
 * it names is fetched. Chunks are named by SHA-256, not by the CRC32C the local format carries:
 * a chunk found in the bucket is not uploaded again, so its name must be a hash nobody can make
 * two chunks share (a 32-bit CRC collides by chance once in some 65 000 chunks of a big bucket,
 * and on purpose at will). The CRC32C stays as the local restore's own check.
 */
import { InvalidOptionError, StoreError } from '../errors';
import { RAM_CHUNK_BYTES } from '../snapshot/ram-file';
import { manifestBytesLimit, MAX_STATE_BYTES } from '../snapshot/snapshot-dir';
import { checkGuestMemoryBytes } from '../vm-shape';

/** The version of {@link StoreManifest} this code writes and reads. */
export const STORE_MANIFEST_VERSION = 1;

/** A content-addressed object: its SHA-256 (hex) and size. */
export interface ChunkRef {
  sha256: string;
  sizeBytes: number;
}

/** `<prefix>/snapshot.json`. */
export interface StoreManifest {
  format: 'pvisor-store-snapshot';
  version: typeof STORE_MANIFEST_VERSION;
  /** Guest RAM bytes. */
  ramBytes: number;
  /** Bytes per RAM chunk (the last may be shorter): the local format's checksummed chunk. */
  chunkBytes: typeof RAM_CHUNK_BYTES;
  /** SHA-256 (hex) of each RAM chunk in address order; `null`: all zero, no object stored. */
  ramChunks: (string | null)[];
  /** The local snapshot's manifest.json and state.json, stored as chunks. */
  files: { manifest: ChunkRef; state: ChunkRef };
  /**
   * Indices of RAM chunks in the order the guest first touched them before this snapshot (when
   * its VM was itself restored lazily: the userfaultfd server's touch order), each a non-zero
   * chunk at most once: what a lazy restore prefetches first, before the rest in address order.
   * Optional (manifests written before it have none, and readers before it ignore it), so the
   * format stays version 1.
   */
  touchOrder?: number[];
}

const SHA256_HEX = /^[0-9a-f]{64}$/;

/**
 * The largest manifest read back for guest RAM of up to `maxRamBytes`: fixed fields, and per
 * chunk a quoted hash and a comma (67 bytes) and its place in the touch order (at most 7 bytes
 * with its comma below 10^6 chunks), with room to spare.
 */
export function storeManifestBytesLimit(maxRamBytes: number): number {
  return 4096 + 80 * Math.ceil(maxRamBytes / RAM_CHUNK_BYTES);
}

/** The byte size of RAM chunk `index` of `ramBytes`. */
export function chunkSizeBytes(ramBytes: number, index: number): number {
  return Math.min(RAM_CHUNK_BYTES, ramBytes - index * RAM_CHUNK_BYTES);
}

/**
 * Parses and checks a manifest read from the store (`where`: its URL, for messages): JSON, the
 * format and version, the RAM size as {@link Vm.start} checks a memory option (so no larger than
 * this host's RAM), one well-formed hash or `null` per chunk, and the two files' hashes and sizes
 * within what a snapshot of that RAM can need. Each failure is a {@link StoreError} `malformed`.
 */
export function parseStoreManifest(bytes: Buffer, where: string): StoreManifest {
  const bad = (why: string): StoreError => new StoreError('malformed', `${where}: ${why}`);
  let value: unknown;
  try {
    value = JSON.parse(bytes.toString('utf8'));
  } catch (e) {
    throw bad(`not JSON (${(e as Error).message})`);
  }
  if (typeof value !== 'object' || value === null || Array.isArray(value)) throw bad('not a JSON object');
  const o = value as Record<string, unknown>;
  if (o.format !== 'pvisor-store-snapshot') throw bad('format: not a pvisor snapshot manifest');
  if (typeof o.version === 'number' && o.version > STORE_MANIFEST_VERSION) throw bad(`version: ${o.version}, written by a newer pvisor; this one reads ${STORE_MANIFEST_VERSION}`);
  if (o.version !== STORE_MANIFEST_VERSION) throw bad(`version: must be ${STORE_MANIFEST_VERSION}`);
  if (o.chunkBytes !== RAM_CHUNK_BYTES) throw bad(`chunkBytes: must be ${RAM_CHUNK_BYTES}`);
  if (!Number.isSafeInteger(o.ramBytes)) throw bad('ramBytes: not an integer');
  const ramBytes = o.ramBytes as number;
  try {
    checkGuestMemoryBytes(ramBytes);
  } catch (e) {
    if (!(e instanceof InvalidOptionError)) throw e;
    throw bad(`ramBytes: ${e.message.slice(e.option.length + 2)}`);
  }
  const count = Math.ceil(ramBytes / RAM_CHUNK_BYTES);
  if (!Array.isArray(o.ramChunks) || o.ramChunks.length !== count) throw bad(`ramChunks: must be ${count} entries for ${ramBytes} bytes of RAM`);
  o.ramChunks.forEach((h, i) => {
    if (h !== null && (typeof h !== 'string' || !SHA256_HEX.test(h))) throw bad(`ramChunks[${i}]: not null nor a SHA-256 in lower-case hex`);
  });
  if (typeof o.files !== 'object' || o.files === null) throw bad('files: not an object');
  const files = o.files as Record<string, unknown>;
  const ref = (name: 'manifest' | 'state', maxBytes: number): ChunkRef => {
    const f = files[name];
    if (typeof f !== 'object' || f === null) throw bad(`files.${name}: not an object`);
    const { sha256, sizeBytes } = f as Record<string, unknown>;
    if (typeof sha256 !== 'string' || !SHA256_HEX.test(sha256)) throw bad(`files.${name}.sha256: not a SHA-256 in lower-case hex`);
    if (!Number.isSafeInteger(sizeBytes) || (sizeBytes as number) < 1 || (sizeBytes as number) > maxBytes) throw bad(`files.${name}.sizeBytes: not an integer from 1 to ${maxBytes}`);
    return { sha256, sizeBytes: sizeBytes as number };
  };
  const ramChunks = o.ramChunks as (string | null)[];
  const touchOrder = o.touchOrder === undefined ? undefined : parseTouchOrder(o.touchOrder, ramChunks, bad);
  return {
    format: 'pvisor-store-snapshot',
    version: STORE_MANIFEST_VERSION,
    ramBytes,
    chunkBytes: RAM_CHUNK_BYTES,
    ramChunks,
    files: { manifest: ref('manifest', manifestBytesLimit(ramBytes)), state: ref('state', MAX_STATE_BYTES) },
    ...(touchOrder && { touchOrder }),
  };
}

/**
 * Checks a manifest's `touchOrder`: an array no longer than there are chunks, of chunk indices,
 * each naming a non-zero chunk (a zero chunk is never fetched) and given once.
 */
function parseTouchOrder(value: unknown, ramChunks: readonly (string | null)[], bad: (why: string) => StoreError): number[] {
  if (!Array.isArray(value) || value.length > ramChunks.length) throw bad(`touchOrder: must be an array of at most ${ramChunks.length} chunk indices`);
  const seen = new Set<number>();
  value.forEach((i, k) => {
    if (!Number.isSafeInteger(i) || i < 0 || i >= ramChunks.length) throw bad(`touchOrder[${k}]: not a chunk index from 0 to ${ramChunks.length - 1}`);
    if (ramChunks[i] === null) throw bad(`touchOrder[${k}]: chunk ${i} is all zero, never fetched`);
    if (seen.has(i)) throw bad(`touchOrder[${k}]: chunk ${i} is named twice`);
    seen.add(i);
  });
  return value as number[];
}

/**
 * The order in which a lazy restore prefetches the non-zero chunks of `manifest`: its touch
 * order first, then every other non-zero chunk in address order (guest RAM is laid out low to
 * high: the kernel and early allocations first).
 */
export function prefetchOrder(manifest: Pick<StoreManifest, 'ramChunks' | 'touchOrder'>): number[] {
  const first = manifest.touchOrder ?? [];
  const named = new Set(first);
  const rest = manifest.ramChunks.flatMap((sha, i) => (sha !== null && !named.has(i) ? [i] : []));
  return [...first, ...rest];
}
