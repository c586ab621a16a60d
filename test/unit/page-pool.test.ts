// The page pool's bookkeeping over a real memfd, and its protocol's bounds. No KVM needed.
import { spawnSync } from 'node:child_process';
import { readSync } from 'node:fs';
import { PagePool } from '../../src/daemon/page-pool';
import { decodeOffer, decodePut, decodeSettle, encodeOffer, encodePut, encodeSettle, MAX_PUT_PAGES, PoolProtocolError } from '../../src/daemon/pool-protocol';

const page = (fill: number) => Buffer.alloc(4096, fill);
const key = (n: number) => ({ lo: n, hi: 0 });

describe('PagePool', () => {
  it('keeps one copy per content and scope; a second offer of a key asks for the page; the last release forgets it', () => {
    const pool = new PagePool(16 * 4096);
    try {
      expect(pool.offered('a', key(1), 1)).toBe(false);
      expect(pool.offered('a', key(1), 1)).toBe(false); // the same client again: nothing to share
      expect(pool.offered('a', key(1), 2)).toBe(true);
      const p = pool.put('a', key(1), page(7))!;
      expect(pool.put('a', key(1), page(7))).toBe(p); // the same bytes: the same page, one more reference
      expect(pool.lookup('a', key(1))).toEqual([p]);
      expect(pool.lookup('b', key(1))).toEqual([]); // scopes never share
      const other = pool.put('a', key(1), page(8))!; // same key, other bytes: its own page
      expect(other).not.toBe(p);
      const got = Buffer.alloc(4096);
      readSync(pool.scopeFd('a'), got, 0, 4096, p * 4096);
      expect(got.equals(page(7))).toBe(true);
      expect(pool.figures()).toMatchObject({ pagesUsed: 2, references: 3 });
      pool.release('a', p);
      pool.release('a', p);
      expect(pool.inUse('a', p)).toBe(false);
      expect(pool.lookup('a', key(1))).toEqual([other]);
      expect(() => pool.release('a', p)).toThrow(RangeError);
      readSync(pool.scopeFd('a'), got, 0, 4096, p * 4096);
      expect(got.equals(page(0))).toBe(true); // punched out: a hole
    } finally {
      pool.close();
    }
  });

  it('gives each scope its own memfd, which a client of another uid can neither write nor reopen to write', () => {
    const pool = new PagePool(4 * 4096);
    try {
      pool.put('a', key(1), page(1));
      pool.put('b', key(2), page(2));
      expect(pool.scopeFd('a')).not.toBe(pool.scopeFd('b'));
      const b = Buffer.alloc(4096);
      readSync(pool.scopeFd('b'), b, 0, 4096, 0);
      expect(b.equals(page(2))).toBe(true); // scope b's file holds scope b's page only
      // What a client gets, as descriptor 3 of a process of another uid.
      const script = `const fs = require('fs'); const out = [];
        for (const [what, f] of [['write', () => fs.writeSync(3, Buffer.alloc(4096, 0xee), 0, 4096, 0)], ['reopen', () => fs.openSync('/proc/self/fd/3', 'r+')], ['chmod', () => fs.fchmodSync(3, 0o666)]]) {
          try { f(); out.push(what + ' ok'); } catch (e) { out.push(what + ' ' + e.code); }
        }
        const got = Buffer.alloc(4096); fs.readSync(3, got, 0, 4096, 0); out.push('read ' + got[0]);
        process.stdout.write(out.join(','));`;
      const r = spawnSync(process.execPath, ['-e', script], { uid: 65534, gid: 65534, stdio: ['ignore', 'pipe', 'pipe', pool.scopeFd('a')], encoding: 'utf8' });
      expect(r.stdout).toBe('write EBADF,reopen EACCES,chmod EPERM,read 1');
      readSync(pool.scopeFd('a'), b, 0, 4096, 0);
      expect(b.equals(page(1))).toBe(true);
    } finally {
      pool.close();
    }
  });

  it('hands out consecutive pages for pages put one after another, and says when it is full', () => {
    const pool = new PagePool(4 * 4096);
    try {
      const pages = [1, 2, 3, 4].map((n) => pool.put('s', key(n), page(n)));
      expect(pages).toEqual([0, 1, 2, 3]);
      expect(pool.put('s', key(5), page(5))).toBeUndefined();
      expect(pool.put('t', key(5), page(5))).toBeUndefined(); // the limit holds over all scopes
      pool.release('s', 2);
      expect(pool.put('s', key(6), page(6))).toBe(2); // a freed slot, rewritten
      const got = Buffer.alloc(4096);
      readSync(pool.scopeFd('s'), got, 0, 4096, 2 * 4096);
      expect(got.equals(page(6))).toBe(true);
    } finally {
      pool.close();
    }
  });
});

describe('pool protocol bounds', () => {
  it('round-trips its payloads and refuses malformed or oversized ones', () => {
    const offer = [{ page: 3, key: { lo: 1, hi: 2 } }];
    expect(decodeOffer(encodeOffer(offer))).toEqual(offer);
    const put = decodePut(encodePut([{ page: 9, bytes: page(1) }]));
    expect(put.pages).toEqual([9]);
    expect(put.data.equals(page(1))).toBe(true);
    expect(decodeSettle(encodeSettle([1], [2, 3]))).toEqual({ keep: [1], drop: [2, 3] });
    expect(() => decodeOffer(Buffer.alloc(13))).toThrow(PoolProtocolError);
    expect(() => decodePut(encodePut(Array.from({ length: MAX_PUT_PAGES + 1 }, (_, i) => ({ page: i, bytes: page(0) }))))).toThrow(PoolProtocolError);
    expect(() => decodePut(Buffer.alloc(4))).toThrow(PoolProtocolError);
    const badSettle = Buffer.alloc(8);
    badSettle.writeUInt32LE(5, 0);
    expect(() => decodeSettle(badSettle)).toThrow(/keeping 5 of 1/);
  });
});
