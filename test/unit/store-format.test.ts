// The pure parts of snapshots in an object store (src/store/): s3:// URLs, the store manifest as
// hostile input, the store options, bounded concurrency, and the chunk cache's bound and LRU
// eviction (real files in a temporary directory). No object store, no KVM.
import { mkdirSync, mkdtempSync, readdirSync, rmSync, utimesSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { InvalidOptionError, StoreError } from '../../src';
import { hostMemTotalBytes } from '../../src/memory-usage';
import { ChunkCache, sha256Hex } from '../../src/store/chunk-cache';
import { eachBounded } from '../../src/store/object-io';
import { basesOf, chunkSizeBytes, parseStoreManifest, prefetchOrder, ramChunkRef, storeManifestBytesLimit } from '../../src/store/store-manifest';
import { touchOrderOf } from '../../src/store/upload';
import { resolveStoreOptions } from '../../src/store/store-options';
import { isStoreUrl, parseStoreUrl } from '../../src/store/store-url';

const MiB = 1024 * 1024;

function storeError(f: () => unknown): StoreError {
  try {
    f();
  } catch (e) {
    expect(e).toBeInstanceOf(StoreError);
    return e as StoreError;
  }
  throw new Error('did not throw');
}

describe('s3:// URLs', () => {
  it('parses a bucket and a prefix, one trailing slash allowed', () => {
    expect(parseStoreUrl('s3://pvisor/templates/py-3.12')).toEqual({ url: 's3://pvisor/templates/py-3.12', bucket: 'pvisor', prefix: 'templates/py-3.12', manifestKey: 'templates/py-3.12/snapshot.json' });
    expect(parseStoreUrl('s3://my.bucket-1/a/').prefix).toBe('a');
    expect(isStoreUrl('s3://x')).toBe(true);
    expect(isStoreUrl('/var/snap')).toBe(false);
    expect(isStoreUrl('./s3://x')).toBe(false);
  });

  it.each([
    ['/local/dir', /not an s3:\/\/ URL/],
    ['S3://pvisor/a', /not an s3:\/\/ URL/],
    ['s3://pvisor', /no prefix/],
    ['s3://pvisor/', /no prefix/],
    ['s3://Pvisor/a', /not an S3 bucket name/],
    ['s3://ab/a', /not an S3 bucket name/],
    ['s3://-bucket/a', /not an S3 bucket name/],
    ['s3://a..b/a', /not an S3 bucket name/],
    ['s3://10.0.0.1/a', /not an S3 bucket name/],
    ['s3://pvisor/a//b', /empty, \. or \.\. segment/],
    ['s3://pvisor/a/../b', /empty, \. or \.\. segment/],
    ['s3://pvisor//a', /empty, \. or \.\. segment/],
    ['s3://pvisor/a?versionId=1', /control character, \?, #/],
    ['s3://pvisor/a\nb', /control character/],
    ['s3://pvisor/pvisor-chunks/x', /where pvisor keeps chunks/],
    [`s3://pvisor/${'a'.repeat(1100)}`, /longer than/],
  ])('refuses %j with a StoreError of reason url', (url, message) => {
    const e = storeError(() => parseStoreUrl(url));
    expect(e.reason).toBe('url');
    expect(e.message).toMatch(message);
  });
});

describe('the store manifest read back', () => {
  const sha = (s: string): string => sha256Hex(Buffer.from(s));
  const good = {
    format: 'pvisor-store-snapshot',
    version: 1,
    ramBytes: 5 * MiB,
    chunkBytes: 2 * MiB,
    ramChunks: [sha('a'), null, sha('c')],
    files: { manifest: { sha256: sha('m'), sizeBytes: 300 }, state: { sha256: sha('s'), sizeBytes: 2000 } },
  };
  const parse = (v: unknown): unknown => parseStoreManifest(Buffer.from(typeof v === 'string' ? v : JSON.stringify(v)), 's3://pvisor/x/snapshot.json');

  it('accepts a well-formed manifest, the last chunk shorter', () => {
    expect(parse(good)).toEqual(good);
    expect([0, 1, 2].map((i) => chunkSizeBytes(5 * MiB, i))).toEqual([2 * MiB, 2 * MiB, MiB]);
  });

  it.each([
    ['not JSON', '{"format":', /not JSON/],
    ['an array', '[]', /not a JSON object/],
    ['another format', { ...good, format: 'x' }, /format/],
    ['a newer version', { ...good, version: 3 }, /newer pvisor/],
    ['version 2 without deltas', { ...good, version: 2 }, /version 2 without ramDeltas/],
    ['deltas in version 1', { ...good, ramDeltas: {} }, /ramDeltas: only in version 2/],
    ['deltas that are an array', { ...good, version: 2, ramDeltas: [] }, /ramDeltas: not an object/],
    ['a delta of a chunk the manifest does not name', { ...good, version: 2, ramDeltas: { [sha('x')]: { base: null, sizeBytes: 4108 } } }, /not a chunk of ramChunks/],
    ['a delta keyed by a path', { ...good, version: 2, ramDeltas: { '../../etc/passwd': { base: null, sizeBytes: 4108 } } }, /not a chunk of ramChunks/],
    ['a delta against itself', { ...good, version: 2, ramDeltas: { [sha('a')]: { base: sha('a'), sizeBytes: 4108 } } }, /\.base: not null nor the SHA-256 of another chunk/],
    ['a delta against a path', { ...good, version: 2, ramDeltas: { [sha('a')]: { base: '../x', sizeBytes: 4108 } } }, /\.base/],
    ['a delta larger than every page of its chunk', { ...good, version: 2, ramDeltas: { [sha('c')]: { base: null, sizeBytes: MiB + 8 + 4 * 256 + 1 } } }, /sizeBytes: not an integer from 8 to 1049608/],
    ['a delta of no size', { ...good, version: 2, ramDeltas: { [sha('a')]: { base: null, sizeBytes: 0 } } }, /sizeBytes/],
    ['a delta against a delta', { ...good, version: 2, ramDeltas: { [sha('a')]: { base: sha('c'), sizeBytes: 4108 }, [sha('c')]: { base: null, sizeBytes: 4108 } } }, /is itself stored as a delta/],
    ['another chunk size', { ...good, chunkBytes: 4096 }, /chunkBytes/],
    ['RAM not a multiple of 4 KiB', { ...good, ramBytes: 5 * MiB + 1 }, /ramBytes/],
    ['RAM larger than this host', { ...good, ramBytes: hostMemTotalBytes() * 4 }, /ramBytes/],
    ['too few chunks', { ...good, ramChunks: good.ramChunks.slice(1) }, /ramChunks: must be 3 entries/],
    ['a hash in upper case', { ...good, ramChunks: [sha('a').toUpperCase(), null, null] }, /ramChunks\[0\]/],
    ['a hash that is a path', { ...good, ramChunks: ['../../etc/passwd', null, null] }, /ramChunks\[0\]/],
    ['a number for a chunk', { ...good, ramChunks: [1, null, null] }, /ramChunks\[0\]/],
    ['no files', { ...good, files: null }, /files: not an object/],
    ['a state larger than a restore reads', { ...good, files: { ...good.files, state: { sha256: sha('s'), sizeBytes: 5 * MiB } } }, /files\.state\.sizeBytes/],
    ['an empty manifest file', { ...good, files: { ...good.files, manifest: { sha256: sha('m'), sizeBytes: 0 } } }, /files\.manifest\.sizeBytes/],
    ['a touch order that is not an array', { ...good, touchOrder: { 0: 2 } }, /touchOrder: must be an array of at most 3/],
    ['a touch order longer than there are chunks', { ...good, touchOrder: [0, 2, 0, 2] }, /touchOrder: must be an array of at most 3/],
    ['a touch order past the last chunk', { ...good, touchOrder: [3] }, /touchOrder\[0\]: not a chunk index from 0 to 2/],
    ['a touch order with a fraction', { ...good, touchOrder: [0.5] }, /touchOrder\[0\]/],
    ['a touch order naming a zero chunk', { ...good, touchOrder: [2, 1] }, /touchOrder\[1\]: chunk 1 is all zero/],
    ['a touch order naming a chunk twice', { ...good, touchOrder: [2, 0, 2] }, /touchOrder\[2\]: chunk 2 is named twice/],
  ])('refuses %s as malformed', (_, value, message) => {
    const e = storeError(() => parse(value));
    expect(e.reason).toBe('malformed');
    expect(e.message).toMatch(message);
  });

  it('reads page deltas (version 2): a chunk to fetch carries its delta, and its base is what the next upload diffs against', () => {
    const v2 = { ...good, version: 2, ramDeltas: { [sha('c')]: { base: sha('b'), sizeBytes: 8 + 4 + 4096 } } };
    const m = parseStoreManifest(Buffer.from(JSON.stringify(v2)), 'x');
    expect(m).toEqual(v2);
    expect(Object.getPrototypeOf(m.ramDeltas)).toBeNull();
    expect(ramChunkRef(m, 2)).toEqual({ sha256: sha('c'), sizeBytes: MiB, delta: { base: sha('b'), sizeBytes: 4108 } });
    expect(ramChunkRef(m, 0)).toEqual({ sha256: sha('a'), sizeBytes: 2 * MiB });
    expect(() => ramChunkRef(m, 1)).toThrow(RangeError);
    expect(basesOf(m)).toEqual([sha('a'), null, sha('b')]);
  });

  it('reads a touch order (optional, the format still version 1), and prefetches in it first, then in address order', () => {
    expect(parse({ ...good, touchOrder: [2] })).toEqual({ ...good, touchOrder: [2] });
    expect(prefetchOrder({ ramChunks: good.ramChunks })).toEqual([0, 2]);
    expect(prefetchOrder({ ramChunks: good.ramChunks, touchOrder: [2] })).toEqual([2, 0]);
    const many = [sha('a'), sha('b'), null, sha('d'), sha('e')];
    expect(prefetchOrder({ ramChunks: many, touchOrder: [4, 1] })).toEqual([4, 1, 0, 3]);
  });

  it('records the order faults touched RAM as chunk indices, each once, leaving out chunks now zero or outside RAM', () => {
    const chunks = [sha('a'), sha('b'), null, sha('d')];
    expect(touchOrderOf([3 * 2 * MiB + 4096, 0, 2 * MiB, 3 * 2 * MiB, 2 * 2 * MiB, 9 * 2 * MiB], chunks)).toEqual([3, 0, 1]);
    expect(touchOrderOf(undefined, chunks)).toEqual([]);
  });

  it("bounds the manifest by this host's RAM: a 64 GiB guest's fits in about 8 MiB", () => {
    expect(storeManifestBytesLimit(64 * 1024 * MiB)).toBe(4096 + 256 * 32768);
    // A manifest of a guest of this host's RAM, as written (67 bytes a chunk), fits its bound.
    const chunks = Math.ceil(hostMemTotalBytes() / (2 * MiB));
    // With a touch order naming every chunk, largest indices first (the longest numbers).
    // And every chunk distinct and stored as a delta of the largest size, against another chunk.
    const ramChunks = Array.from({ length: chunks }, (_, i) => sha(`chunk ${i}`));
    const ramDeltas = Object.fromEntries(ramChunks.map((c, i) => [c, { base: sha(`base ${i}`), sizeBytes: 2 * MiB + 8 + 4 * 512 }]));
    const written = JSON.stringify({ ...good, version: 2, ramBytes: chunks * 2 * MiB, ramChunks, ramDeltas, touchOrder: Array.from({ length: chunks }, (_, i) => chunks - 1 - i) });
    expect(written.length).toBeLessThan(storeManifestBytesLimit(hostMemTotalBytes()));
  });
});

describe('store options', () => {
  it('has defaults, and refuses what is out of range or unknown', () => {
    const o = resolveStoreOptions(undefined);
    expect(o).toMatchObject({ requestTimeoutMs: 30000, concurrency: 4, cacheMaxBytes: 4 * 1024 * MiB });
    expect(o.cacheDir).toMatch(/pvisor\/chunks$/);
    for (const bad of [{ concurrency: 0 }, { concurrency: 65 }, { requestTimeoutMs: -1 }, { cacheDir: '' }, { onProgress: 1 }, { bucket: 'x' }]) {
      expect(() => resolveStoreOptions(bad as never)).toThrow(InvalidOptionError);
    }
  });
});

describe('bounded concurrency', () => {
  it('runs at most N at once, every item once, and throws the first failure after the running ones settle', async () => {
    let running = 0;
    let most = 0;
    const seen: number[] = [];
    await eachBounded([...Array(20).keys()], 3, async (i) => {
      running++;
      most = Math.max(most, running);
      await new Promise((r) => setTimeout(r, 2 + (i % 3)));
      seen.push(i);
      running--;
    });
    expect(most).toBe(3);
    expect(seen.sort((a, b) => a - b)).toEqual([...Array(20).keys()]);
    let started = 0;
    await expect(eachBounded([...Array(20).keys()], 2, async (i) => {
      started++;
      await new Promise((r) => setTimeout(r, 5));
      if (i === 1) throw new Error('chunk 1 failed');
    })).rejects.toThrow('chunk 1 failed');
    expect(running).toBe(0);
    expect(started).toBeLessThan(20);
  });
});

describe('the chunk cache', () => {
  let dir: string;
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-chunk-cache-'));
  });
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  const chunk = (n: number): { bytes: Buffer; sha: string } => {
    const bytes = Buffer.alloc(4096, n);
    return { bytes, sha: sha256Hex(bytes) };
  };

  it('reads back what it holds, checked; a damaged or missing entry reads as absent, and the damaged one is removed', () => {
    const cache = ChunkCache.open(dir, MiB);
    const a = chunk(1);
    expect(cache.read(a.sha, 4096)).toBeUndefined();
    cache.write(a.sha, a.bytes);
    expect(cache.read(a.sha, 4096)?.equals(a.bytes)).toBe(true);
    // Expected of another size: not this entry.
    expect(cache.read(a.sha, 8192)).toBeUndefined();
    const b = chunk(2);
    cache.write(b.sha, b.bytes);
    const path = join(dir, 'chunks', b.sha);
    rmSync(path);
    writeFileSync(path, Buffer.alloc(4096, 9));
    expect(cache.read(b.sha, 4096)).toBeUndefined();
    expect(readdirSync(join(dir, 'chunks'))).toEqual([a.sha]);
    expect(() => cache.read('../x', 4096)).toThrow(/not a SHA-256/);
  });

  it('evicts the least recently used chunks past its bound, never a pinned one', () => {
    const cache = ChunkCache.open(dir, 3 * 4096);
    const chunks = [1, 2, 3, 4, 5].map(chunk);
    chunks.forEach((c, i) => {
      cache.write(c.sha, c.bytes);
      // Used at t = 1000 + i s: chunk 0 the least recently.
      utimesSync(join(dir, 'chunks', c.sha), 1000 + i, 1000 + i);
    });
    // A read makes chunk 1 the most recently used; chunk 0 is pinned by a restore.
    expect(cache.read(chunks[1].sha, 4096)).toBeDefined();
    cache.pin(chunks[0].sha);
    expect(cache.evict()).toEqual({ chunksRemoved: 2, sharedSnapshotsRemoved: 0, bytesRemoved: 8192, bytesKept: 12288 });
    expect(readdirSync(join(dir, 'chunks')).sort()).toEqual([chunks[0].sha, chunks[1].sha, chunks[4].sha].sort());
    cache.unpin(chunks[0].sha);
    const small = ChunkCache.open(dir, 4096);
    expect(small.evict().chunksRemoved).toBe(2);
    expect(readdirSync(join(dir, 'chunks'))).toEqual([chunks[1].sha]);
  });

  it('removes a temporary entry or work directory of a process that is gone, keeps those of a live process', () => {
    const cache = ChunkCache.open(dir, MiB);
    const dead = `${'a'.repeat(64)}.999999999.0abc`;
    const alive = `${'b'.repeat(64)}.${process.pid}.0abc`;
    writeFileSync(join(dir, 'tmp', dead), 'x');
    writeFileSync(join(dir, 'tmp', alive), 'x');
    mkdirSync(join(dir, 'work', '999999999-0abc'));
    writeFileSync(join(dir, 'work', '999999999-0abc', 'ram'), 'x');
    const mine = cache.newWorkDir();
    cache.evict();
    expect(readdirSync(join(dir, 'tmp'))).toEqual([alive]);
    expect(readdirSync(join(dir, 'work'))).toEqual([basename(mine)]);
  });
});
