import { createHash } from 'node:crypto';
import { compressSync } from 'lz4-napi';
import { expectedDigest, fmix32, pageWords, rewritesPage, type ProbeContent } from '../../src/guest/probe-content';

function pages(content: ProbeContent, seed: number, firstPage: number, pageCount: number): Buffer {
  const words = new Uint32Array(pageCount * 1024);
  for (let p = 0; p < pageCount; p++) pageWords(content, seed, firstPage + p, words.subarray(p * 1024, (p + 1) * 1024));
  return Buffer.from(words.buffer);
}

// Golden values printed by the probe's own C implementation (native-prebuilds/probe/selftest.c,
// built and run by native-prebuilds/probe/build.sh): the host's JavaScript must agree bit for bit.
describe('probe content and digest, host side', () => {
  it('fmix32 matches the C implementation', () => {
    expect([0, 1, 42].map((x) => fmix32(x).toString(16).padStart(8, '0'))).toEqual(['00000000', '514e28b7', '087fcd5c']);
  });

  it.each([
    ['random', [], 0x93d1145a, 0xf7aaf584],
    ['random', [{ permille: 250, seed: 7 }], 0xff7e61b3, 0x0a0e985f],
    ['repetitive', [], 0x34129dc5, 0x9ea20193],
    ['repetitive', [{ permille: 250, seed: 7 }], 0x81f95dc5, 0xa5720193],
    ['compressible', [], 0x3b8084fb, 0xb3396802],
    ['compressible', [{ permille: 250, seed: 7 }], 0x5f1237cd, 0x9da2f507],
  ] as const)('1 MiB %s, rewrites %j', (content, rewrites, h1, h2) => {
    expect(expectedDigest({ content, seed: 42, sizeBytes: 1024 * 1024, rewrites: [...rewrites] })).toEqual({ h1, h2 });
  });

  it('rewrite selects pages evenly: exactly permille/1000 of them', () => {
    for (const permille of [0, 1, 250, 333, 1000]) {
      let n = 0;
      for (let p = 0; p < 16384; p++) if (rewritesPage(p, permille)) n++;
      expect(n).toBe(Math.floor((16384 * permille) / 1000));
    }
  });

  // What `compressible` is for: cold compression shrinks it, page sharing (KSM, a pool) cannot.
  it('compressible: no two pages alike, across the working set and across seeds', () => {
    const seen = new Set<string>();
    // The first pages, and the last of the largest working set (RAM below the 3 GiB hole).
    const starts = [0, 3 * 2 ** 18 - 512];
    for (const seed of [42, 43]) {
      for (const first of starts) {
        for (let p = 0; p < 512; p++) seen.add(createHash('sha256').update(pages('compressible', seed, first + p, 1)).digest('hex'));
      }
    }
    expect(seen.size).toBe(2 * starts.length * 512);
  });

  it.each([
    [1, 0],
    [42, 4096],
    [0xdeadbeef, 300_000],
  ])('compressible (seed %d, from page %d): lz4 keeps 25-35%% of a 64 KiB block', (seed, firstPage) => {
    const block = pages('compressible', seed, firstPage, 16);
    const ratio = compressSync(block).length / block.length;
    expect(ratio).toBeGreaterThan(0.25);
    expect(ratio).toBeLessThan(0.35);
  });
});
