// The lazy loader's native CRC32 (C, in libpvisor-uffd.so) must agree with zlib's, which the
// offload uses when it writes pieces: any difference would fail every lazy reload. No KVM needed.
import { randomBytes } from 'node:crypto';
import { crc32 } from 'node:zlib';
import { nativeCrc32 } from '../../src/memory/lazy-loader';

describe('native CRC32 of the lazy loader', () => {
  it('matches zlib on empty, short, unaligned and 4 MiB inputs', () => {
    const big = randomBytes(4 * 1024 * 1024 + 13);
    for (const [start, len] of [[0, 0], [0, 1], [3, 7], [1, 4096], [5, 65536 + 3], [0, 4 * 1024 * 1024], [13, 4 * 1024 * 1024]]) {
      const slice = big.subarray(start, start + len);
      expect(nativeCrc32(slice)).toBe(crc32(slice));
    }
  });

  it('sees a single flipped bit', () => {
    const data = randomBytes(1 << 20);
    const before = nativeCrc32(data);
    data[777777] ^= 0x10;
    expect(nativeCrc32(data)).not.toBe(before);
    expect(nativeCrc32(data)).toBe(crc32(data));
  });
});
