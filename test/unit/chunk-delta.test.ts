// Page deltas between RAM chunks (src/store/chunk-delta.ts): which pages differ, found by the
// base's page hashes alone; a delta put onto its base gives the chunk back; a delta read back
// from a store is hostile, and every way its layout can lie is a StoreError corrupt.
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { StoreError } from '../../src';
import { ChunkCache, sha256Hex } from '../../src/store/chunk-cache';
import { applyDelta, changedPages, deltaSizeBytes, encodeDelta, maxDeltaSizeBytes, pageHashesOf } from '../../src/store/chunk-delta';

const MiB = 1024 * 1024;
const PAGE = 4096;

describe('page deltas', () => {
  const base = randomBytes(2 * MiB);
  const target = Buffer.from(base);
  for (const p of [0, 7, 511]) randomBytes(PAGE).copy(target, p * PAGE);
  // A page written with the bytes it had is no change.
  base.copy(target, 9 * PAGE, 9 * PAGE, 10 * PAGE);

  it('finds the changed pages by the base page hashes, and the base with the delta put in is the target', () => {
    const pages = changedPages(target, pageHashesOf(base));
    expect(pages).toEqual([0, 7, 511]);
    const delta = encodeDelta(target, pages);
    expect(delta.length).toBe(deltaSizeBytes(target.length, pages));
    expect(delta.length).toBe(8 + 3 * (4 + PAGE));
    expect(applyDelta(base, delta, target.length, 'd').equals(target)).toBe(true);
    // The base is not changed in place: it may be a cached chunk other restores read.
    expect(base.equals(target)).toBe(false);
  });

  it('against zeros holds the pages that are not all zero, a short last chunk included', () => {
    const chunk = Buffer.alloc(MiB + 2 * PAGE);
    chunk[3 * PAGE + 5] = 1;
    chunk[chunk.length - 1] = 9;
    const pages = changedPages(chunk, null);
    expect(pages).toEqual([3, 257]);
    expect(applyDelta(null, encodeDelta(chunk, pages), chunk.length, 'd').equals(chunk)).toBe(true);
    expect(maxDeltaSizeBytes(chunk.length)).toBe(8 + 4 * 258 + chunk.length);
  });

  const delta = encodeDelta(target, [0, 7, 511]);
  const lie = (f: (d: Buffer) => Buffer | void): Buffer => {
    const d = Buffer.from(delta);
    return f(d) ?? d;
  };
  it.each([
    ['no header', Buffer.alloc(4), /no delta header/],
    ['another magic', lie((d) => void d.writeUInt32LE(0x12345678, 0)), /no delta header/],
    ['more pages than the chunk has', lie((d) => void d.writeUInt32LE(513, 4)), /513 pages/],
    ['a count its indexes do not fit', lie((d) => d.subarray(0, 12)), /\(3 pages\)/],
    ['a page past the chunk', lie((d) => void d.writeUInt32LE(512, 16)), /page index 512 at 2/],
    ['pages out of order', lie((d) => void d.writeUInt32LE(7, 8)), /page index 7 at 1/],
    ['a page named twice', lie((d) => void d.writeUInt32LE(0, 12)), /page index 0 at 1/],
    ['a byte too few', lie((d) => d.subarray(0, d.length - 1)), /bytes for 3 pages/],
    ['a byte too many', lie((d) => Buffer.concat([d, Buffer.alloc(1)])), /bytes for 3 pages/],
  ])('refuses a delta with %s as corrupt', (_, bytes, message) => {
    let e: unknown;
    try {
      applyDelta(base, bytes, base.length, 's3://pvisor/x: delta k');
    } catch (x) {
      e = x;
    }
    expect(e).toBeInstanceOf(StoreError);
    expect((e as StoreError).reason).toBe('corrupt');
    expect((e as StoreError).message).toMatch(message);
  });

  it('refuses a base of another size', () => {
    expect(() => applyDelta(base.subarray(0, MiB), delta, base.length, 'd')).toThrow(/its base is 1048576 bytes/);
  });
});

describe("the chunk cache's page hashes", () => {
  let dir: string;
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-pages-test-'));
  });
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  it('computes them from a cached chunk and keeps them; a damaged file is removed and computed again; none without the chunk', () => {
    const cache = ChunkCache.open(dir);
    const chunk = randomBytes(2 * MiB);
    const sha = sha256Hex(chunk);
    expect(cache.pageHashes(sha, chunk.length)).toBeUndefined();
    cache.write(sha, chunk);
    expect(cache.hasPageHashes(sha)).toBe(false);
    expect(cache.pageHashes(sha, chunk.length)!.equals(pageHashesOf(chunk))).toBe(true);
    expect(cache.hasPageHashes(sha)).toBe(true);
    // A damaged page-hash file would leave a changed page out of a delta: it is not used.
    const path = join(dir, 'pages', sha);
    const wrong = Buffer.concat([Buffer.alloc(512 * 8, 1), Buffer.alloc(32)]);
    rmSync(path, { force: true });
    writeFileSync(path, wrong);
    expect(cache.pageHashes(sha, chunk.length)!.equals(pageHashesOf(chunk))).toBe(true);
    // Without the chunk and with a damaged file: none.
    rmSync(join(dir, 'chunks', sha));
    rmSync(path, { force: true });
    writeFileSync(path, wrong);
    expect(cache.pageHashes(sha, chunk.length)).toBeUndefined();
  });

  it('counts them in its bound and evicts them as it does chunks', () => {
    const cache = ChunkCache.open(dir, 0);
    const chunk = randomBytes(MiB);
    cache.writePageHashes(sha256Hex(chunk), pageHashesOf(chunk));
    const ev = cache.evict();
    expect(ev.bytesRemoved).toBe(256 * 8 + 32);
    expect(ev.chunksRemoved).toBe(0);
    expect(cache.hasPageHashes(sha256Hex(chunk))).toBe(false);
  });
});
