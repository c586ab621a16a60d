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
import { maxDeltaSizeBytes } from './chunk-delta';
import { RAM_CHUNK_BYTES } from '../snapshot/ram-file';
import { manifestBytesLimit, MAX_STATE_BYTES } from '../snapshot/snapshot-dir';
import { checkGuestMemoryBytes } from '../vm-shape';

/**
 * The newest version of {@link StoreManifest} this code writes and reads. A manifest is written
 * as version 1 unless it has {@link StoreManifest.ramDeltas}, which a reader of version 1 would
 * not know to apply: such a manifest is version 2, and a pvisor before it refuses it, saying it
 * was written by a newer one, instead of failing at a chunk it cannot find.
 */
export const STORE_MANIFEST_VERSION = 2;

/** A content-addressed object: its SHA-256 (hex) and size. */
export interface ChunkRef {
  sha256: string;
  sizeBytes: number;
  /** Stored as a page delta (chunk-delta.ts) against `base` (`null`: zeros), of `sizeBytes` bytes. */
  delta?: RamDelta;
}

/** How a RAM chunk stored as a page delta is stored: its base (a chunk stored whole, or `null`: zeros) and the delta's size. */
export interface RamDelta {
  base: string | null;
  sizeBytes: number;
}

/** `<prefix>/snapshot.json`. */
export interface StoreManifest {
  format: 'pvisor-store-snapshot';
  /** 2 when {@link ramDeltas} is there, else 1. */
  version: 1 | 2;
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
  /**
   * RAM chunks stored as page deltas rather than whole, by their SHA-256 (a key of `ramChunks`):
   * each against a base stored whole (never itself a delta here, so a chunk is one read or two).
   * Version 2 only.
   */
  ramDeltas?: Record<string, RamDelta>;
}

/**
 * Per RAM chunk of a VM, the chunk stored whole that a delta of it goes against next time (`null`:
 * zeros): what it was last stored as, or restored from (a chunk stored as a delta keeps its base).
 */
export type ChunkBases = (string | null)[];

/** The bases of a manifest's chunks: each chunk's own hash, or its delta's base. */
export function basesOf(manifest: Pick<StoreManifest, 'ramChunks' | 'ramDeltas'>): ChunkBases {
  return manifest.ramChunks.map((sha) => (sha === null ? null : manifest.ramDeltas?.[sha] ? manifest.ramDeltas[sha].base : sha));
}

const SHA256_HEX = /^[0-9a-f]{64}$/;

/**
 * The largest manifest read back for guest RAM of up to `maxRamBytes`: fixed fields, and per
 * chunk a quoted hash and a comma (67 bytes), its place in the touch order (at most 7 bytes with
 * its comma below 10^6 chunks) and its delta (`"<64>":{"base":"<64>","sizeBytes":<7>},`, 160
 * bytes), with room to spare.
 */
export function storeManifestBytesLimit(maxRamBytes: number): number {
  return 4096 + 256 * Math.ceil(maxRamBytes / RAM_CHUNK_BYTES);
}

/** RAM chunk `index` of `manifest` (not a zero chunk) as the chunk to fetch: its hash, size and, if it is stored as a delta, how. */
export function ramChunkRef(manifest: Pick<StoreManifest, 'ramBytes' | 'ramChunks' | 'ramDeltas'>, index: number): ChunkRef {
  const sha256 = manifest.ramChunks[index];
  if (sha256 === null) throw new RangeError(`RAM chunk ${index} is all zero: it has no object`);
  const delta = manifest.ramDeltas?.[sha256];
  return { sha256, sizeBytes: chunkSizeBytes(manifest.ramBytes, index), ...(delta && { delta }) };
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
  if (typeof o.version === 'number' && o.version > STORE_MANIFEST_VERSION) throw bad(`version: ${o.version}, written by a newer pvisor; this one reads up to ${STORE_MANIFEST_VERSION}`);
  if (o.version !== 1 && o.version !== 2) throw bad('version: must be 1 or 2');
  if (o.version === 1 && o.ramDeltas !== undefined) throw bad('ramDeltas: only in version 2');
  if (o.version === 2 && o.ramDeltas === undefined) throw bad('version 2 without ramDeltas');
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
  const ramDeltas = o.ramDeltas === undefined ? undefined : parseRamDeltas(o.ramDeltas, ramChunks, ramBytes, bad);
  return {
    format: 'pvisor-store-snapshot',
    version: ramDeltas ? 2 : 1,
    ramBytes,
    chunkBytes: RAM_CHUNK_BYTES,
    ramChunks,
    files: { manifest: ref('manifest', manifestBytesLimit(ramBytes)), state: ref('state', MAX_STATE_BYTES) },
    ...(touchOrder && { touchOrder }),
    ...(ramDeltas && { ramDeltas }),
  };
}

/**
 * Checks a manifest's `ramDeltas`: an object of at most as many entries as there are chunks, each
 * keyed by a chunk that `ramChunks` names, with a base that is `null` or a SHA-256 other than its
 * own and not itself stored as a delta, and a size no larger than a delta of every page of that
 * chunk. Returned as a new object with no prototype: keys come from the store.
 */
function parseRamDeltas(value: unknown, ramChunks: readonly (string | null)[], ramBytes: number, bad: (why: string) => StoreError): Record<string, RamDelta> {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) throw bad('ramDeltas: not an object');
  const sizeOf = new Map<string, number>();
  ramChunks.forEach((sha, i) => sha !== null && sizeOf.set(sha, chunkSizeBytes(ramBytes, i)));
  const entries = Object.entries(value);
  if (entries.length > sizeOf.size) throw bad(`ramDeltas: ${entries.length} entries for ${sizeOf.size} distinct chunks`);
  const out: Record<string, RamDelta> = Object.create(null);
  for (const [sha, d] of entries) {
    const where = `ramDeltas[${JSON.stringify(sha.slice(0, 70))}]`;
    if (!SHA256_HEX.test(sha) || !sizeOf.has(sha)) throw bad(`${where}: not a chunk of ramChunks`);
    if (typeof d !== 'object' || d === null) throw bad(`${where}: not an object`);
    const { base, sizeBytes } = d as Record<string, unknown>;
    if (base !== null && (typeof base !== 'string' || !SHA256_HEX.test(base) || base === sha)) throw bad(`${where}.base: not null nor the SHA-256 of another chunk`);
    const max = maxDeltaSizeBytes(sizeOf.get(sha)!);
    if (!Number.isSafeInteger(sizeBytes) || (sizeBytes as number) < 8 || (sizeBytes as number) > max) throw bad(`${where}.sizeBytes: not an integer from 8 to ${max}`);
    out[sha] = { base: base as string | null, sizeBytes: sizeBytes as number };
  }
  for (const [sha, d] of Object.entries(out)) if (d.base !== null && d.base in out) throw bad(`ramDeltas[${sha}].base: is itself stored as a delta`);
  return out;
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
