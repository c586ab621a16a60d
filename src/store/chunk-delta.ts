/**
 * Page deltas between RAM chunks, so that a child snapshot sends the 4 KiB pages it changed
 * rather than every 2 MiB chunk they fall in (issue 27: a child that changed 8 MiB sent 12 MiB in
 * whole chunks). A delta names its target chunk (by SHA-256) and its base: a chunk stored whole,
 * or zeros. It holds the target's pages that differ from the base's, so the target is the base
 * with those pages put in, checked against its SHA-256 like any chunk before it is used.
 *
 * Which pages differ is found without the base's bytes: by the base's page hashes (the first 8
 * bytes of each page's SHA-256), kept beside the chunk cache (see {@link PageHashes}). A page whose
 * hash matched by chance would be left out of the delta, and the restore would then find the
 * target's SHA-256 wrong and refuse it (`corrupt`): such a collision can stop a restore, never
 * make a wrong one. Finding one on purpose is a second preimage of 64 bits, out of reach.
 *
 * A delta's bytes are hostile input when read back: its layout is checked whole (magic, count,
 * page indexes strictly increasing and inside the chunk, the exact length) before a byte of it is
 * used, and anything else is a {@link StoreError} `corrupt`.
 */
import { createHash } from 'node:crypto';
import { StoreError } from '../errors';

/** The page a delta is made of: a guest page. */
export const DELTA_PAGE_BYTES = 4096;
/** Bytes of one page's hash. */
export const PAGE_HASH_BYTES = 8;
/** 'PVD1', the first 4 bytes of a delta (little-endian u32). */
const MAGIC = 0x31445650;
const HEADER_BYTES = 8;

/** Pages in a chunk of `chunkBytes` (the last may be short). */
export function pagesIn(chunkBytes: number): number {
  return Math.ceil(chunkBytes / DELTA_PAGE_BYTES);
}

function pageOf(chunk: Buffer, p: number): Buffer {
  return chunk.subarray(p * DELTA_PAGE_BYTES, Math.min(chunk.length, (p + 1) * DELTA_PAGE_BYTES));
}

/** The size of a delta of `pages` pages of a chunk of `chunkBytes`. */
export function deltaSizeBytes(chunkBytes: number, pages: readonly number[]): number {
  let size = HEADER_BYTES + 4 * pages.length;
  for (const p of pages) size += Math.min(DELTA_PAGE_BYTES, chunkBytes - p * DELTA_PAGE_BYTES);
  return size;
}

/** The largest delta a chunk of `chunkBytes` can have: every page. */
export function maxDeltaSizeBytes(chunkBytes: number): number {
  return HEADER_BYTES + 4 * pagesIn(chunkBytes) + chunkBytes;
}

/** Each page's hash, {@link PAGE_HASH_BYTES} each, in order. */
export function pageHashesOf(chunk: Buffer): Buffer {
  const n = pagesIn(chunk.length);
  const out = Buffer.alloc(n * PAGE_HASH_BYTES);
  for (let p = 0; p < n; p++) createHash('sha256').update(pageOf(chunk, p)).digest().copy(out, p * PAGE_HASH_BYTES, 0, PAGE_HASH_BYTES);
  return out;
}

/**
 * The pages of `chunk` that differ from its base: `baseHashes` (that base's {@link pageHashesOf}),
 * or `null` for a base of zeros (every page that is not all zero).
 */
export function changedPages(chunk: Buffer, baseHashes: Buffer | null): number[] {
  const n = pagesIn(chunk.length);
  if (baseHashes !== null && baseHashes.length !== n * PAGE_HASH_BYTES) throw new RangeError(`page hashes for ${baseHashes.length / PAGE_HASH_BYTES} pages, the chunk has ${n}`);
  const zero = Buffer.alloc(DELTA_PAGE_BYTES);
  const out: number[] = [];
  for (let p = 0; p < n; p++) {
    const page = pageOf(chunk, p);
    const same = baseHashes === null
      ? page.equals(zero.subarray(0, page.length))
      : createHash('sha256').update(page).digest().subarray(0, PAGE_HASH_BYTES).equals(baseHashes.subarray(p * PAGE_HASH_BYTES, (p + 1) * PAGE_HASH_BYTES));
    if (!same) out.push(p);
  }
  return out;
}

/** The delta holding `pages` (strictly increasing) of `chunk`. */
export function encodeDelta(chunk: Buffer, pages: readonly number[]): Buffer {
  const out = Buffer.alloc(deltaSizeBytes(chunk.length, pages));
  out.writeUInt32LE(MAGIC, 0);
  out.writeUInt32LE(pages.length, 4);
  let at = HEADER_BYTES;
  for (const p of pages) at = out.writeUInt32LE(p, at);
  for (const p of pages) at += pageOf(chunk, p).copy(out, at);
  return out;
}

/**
 * The chunk made by putting `delta`'s pages into a copy of `base` (`null`: zeros) of
 * `chunkBytes`. `where` names the delta in messages. A delta of any other layout is a
 * {@link StoreError} `corrupt`; the result's SHA-256 is the caller's to check.
 */
export function applyDelta(base: Buffer | null, delta: Buffer, chunkBytes: number, where: string): Buffer {
  const bad = (why: string): StoreError => new StoreError('corrupt', `${where}: not a page delta of a ${chunkBytes}-byte chunk (${why}); nothing was restored from it`);
  if (base !== null && base.length !== chunkBytes) throw bad(`its base is ${base.length} bytes`);
  if (delta.length < HEADER_BYTES || delta.readUInt32LE(0) !== MAGIC) throw bad('no delta header');
  const count = delta.readUInt32LE(4);
  const n = pagesIn(chunkBytes);
  if (count > n || delta.length < HEADER_BYTES + 4 * count) throw bad(`${count} pages`);
  const pages: number[] = [];
  for (let k = 0; k < count; k++) {
    const p = delta.readUInt32LE(HEADER_BYTES + 4 * k);
    if (p >= n || (k > 0 && p <= pages[k - 1])) throw bad(`page index ${p} at ${k}`);
    pages.push(p);
  }
  if (delta.length !== deltaSizeBytes(chunkBytes, pages)) throw bad(`${delta.length} bytes for ${count} pages`);
  const out = base === null ? Buffer.alloc(chunkBytes) : Buffer.from(base);
  let at = HEADER_BYTES + 4 * count;
  for (const p of pages) {
    const len = Math.min(DELTA_PAGE_BYTES, chunkBytes - p * DELTA_PAGE_BYTES);
    delta.copy(out, p * DELTA_PAGE_BYTES, at, at + len);
    at += len;
  }
  return out;
}
