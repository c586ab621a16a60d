import { FROM_GONE_POOL, PoolPlaces } from '../../src/memory/pool-places';
import { PassScratch } from '../../src/memory/pass-scratch';

describe('PoolPlaces', () => {
  it('keeps a pool page per guest page, forgets it on take, and counts what it holds', () => {
    const places = new PoolPlaces(131072);
    try {
      expect(places.size).toBe(0);
      expect(places.has(5)).toBe(false);
      places.set(5, 0);
      places.set(6, 0xfffffffc); // the highest pool page the protocol can name
      places.set(5, 7); // mapped again: still one page
      expect(places.size).toBe(2);
      expect(places.has(5)).toBe(true);
      expect(places.take(5)).toBe(7);
      expect(places.take(5)).toBeUndefined();
      expect(places.take(6)).toBe(0xfffffffc);
      expect(places.size).toBe(0);
    } finally {
      places.close();
    }
  });

  it('after its pool is gone, a page keeps its place but names no pool page', () => {
    const places = new PoolPlaces(1024);
    try {
      places.set(1, 3);
      places.set(1023, 0);
      places.forgetPool();
      expect(places.size).toBe(2);
      expect(places.has(1)).toBe(true);
      expect(places.take(1)).toBe(FROM_GONE_POOL);
      expect(places.take(1023)).toBe(FROM_GONE_POOL);
      expect(places.has(2)).toBe(false);
      places.set(2, 9);
      expect(places.take(2)).toBe(9);
    } finally {
      places.close();
    }
  });
});

describe('PassScratch', () => {
  // A private anonymous mapping reads zero again only if its pages were given back (MADV_DONTNEED).
  it('gives its pages back on release, and reads zero after', () => {
    const pages = 131072;
    const scratch = new PassScratch(pages);
    try {
      scratch.keys.fill(0x0123456789abcdefn);
      scratch.frame.fill(0xa5);
      expect(scratch.keys[pages - 1]).toBe(0x0123456789abcdefn);
      scratch.release();
      expect(scratch.keys.every((k) => k === 0n)).toBe(true);
      expect(scratch.frame.every((b) => b === 0)).toBe(true);
    } finally {
      scratch.free();
    }
  });
});
