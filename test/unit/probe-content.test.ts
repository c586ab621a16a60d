import { expectedDigest, fmix32, rewritesPage } from '../../src/guest/probe-content';

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
});
