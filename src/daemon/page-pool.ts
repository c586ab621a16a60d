/**
 * The pool's pages: per scope, one memfd holding one copy of each page that VMs of the scope
 * share, an index from content key to pool page, a reference count per pool page, and the keys
 * offered but not yet pooled (so that the second VM to offer a page is asked for it). Knows
 * nothing of sockets.
 *
 * One memfd per scope: a client gets only its own scope's, so it can read no other scope's pages.
 * It gets a read-only descriptor of it (reopened through /proc/self/fd), and the memfd's mode is
 * 0400: a client of another uid can neither write through what it got nor reopen it read-write
 * (a memfd is created 0777, so without this any client could change every VM's shared pages).
 * The daemon writes through its own read-write mapping, and punches a page out when its last
 * reference goes. Root, and clients of the daemon's own uid, could change the pool anyway (they
 * could as well write into the VM processes): they are trusted.
 *
 * Pages are handed out in the order they are put, so that a run of a VM's consecutive pages put
 * together lands on consecutive pool pages and is mapped as one VMA; freed slots are reused once
 * the fresh ones run out.
 */
import { fchmodSync, ftruncateSync, openSync } from 'node:fs';
import { MAP_SHARED, MFD_CLOEXEC, PROT_READ, PROT_WRITE } from '../sys/constants';
import { closeFd, createMemfd, mmap, munmap, punchHole, viewAt } from '../sys/libc';
import { PAGE_BYTES, type PageKey } from './pool-protocol';

/** The most keys remembered as offered, in all scopes; the oldest are forgotten beyond it. */
const MAX_CANDIDATES = 1 << 20;
/** The most scopes a pool serves at once. */
export const MAX_SCOPES = 4096;
const VIEW_CHUNK_BYTES = 2 ** 30;

/** 52 bits of a key as a Map key: the rest is left to the byte comparison that always follows. */
function keyNumber(k: PageKey): number {
  return (k.hi & 0xfffff) * 0x1_0000_0000 + (k.lo >>> 0);
}

/** One scope's pages. */
class ScopePages {
  /** The daemon's read-write descriptor. */
  readonly fd: number;
  /** A read-only descriptor of the same memfd: what clients get. */
  readonly clientFd: number;
  private readonly addr: number;
  private readonly views: Buffer[] = [];
  private refs = new Uint32Array(1024);
  private keys = new Float64Array(1024);
  /** Slots handed out so far (the next fresh one), and those free again. */
  allocated = 0;
  readonly free: number[] = [];
  used = 0;
  readonly index = new Map<number, number[]>();
  readonly offered = new Map<number, number>();

  constructor(name: string, private readonly bytes: number) {
    this.fd = createMemfd(`pvisor-page-pool:${name.slice(0, 200)}`, MFD_CLOEXEC);
    let clientFd: number | undefined;
    try {
      // Sparse: a page costs memory once a client's bytes are written into it.
      ftruncateSync(this.fd, bytes);
      fchmodSync(this.fd, 0o400);
      clientFd = openSync(`/proc/self/fd/${this.fd}`, 'r');
      this.addr = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, this.fd, 0, 'the page pool (the daemon\'s writable mapping)');
    } catch (e) {
      if (clientFd !== undefined) closeFd(clientFd);
      closeFd(this.fd);
      throw e;
    }
    this.clientFd = clientFd;
    for (let off = 0; off < bytes; off += VIEW_CHUNK_BYTES) this.views.push(viewAt(this.addr + off, Math.min(VIEW_CHUNK_BYTES, bytes - off)));
  }

  page(p: number): Buffer {
    const off = p * PAGE_BYTES;
    const chunk = this.views[Math.floor(off / VIEW_CHUNK_BYTES)];
    return chunk.subarray(off % VIEW_CHUNK_BYTES, (off % VIEW_CHUNK_BYTES) + PAGE_BYTES);
  }

  refsOf(p: number): number {
    return p < this.refs.length ? this.refs[p] : 0;
  }

  setRefs(p: number, n: number): void {
    if (p >= this.refs.length) {
      const size = Math.max(p + 1, this.refs.length * 2);
      const refs = new Uint32Array(size);
      refs.set(this.refs);
      this.refs = refs;
      const keys = new Float64Array(size);
      keys.set(this.keys);
      this.keys = keys;
    }
    this.refs[p] = n;
  }

  keyOf(p: number): number {
    return this.keys[p];
  }

  setKey(p: number, k: number): void {
    this.keys[p] = k;
  }

  inUse(p: number): boolean {
    return Number.isInteger(p) && p >= 0 && p < this.allocated && this.refsOf(p) > 0;
  }

  references(): number {
    let n = 0;
    for (let p = 0; p < this.allocated; p++) n += this.refs[p];
    return n;
  }

  close(): void {
    this.views.length = 0;
    munmap(this.addr, this.bytes);
    closeFd(this.clientFd);
    closeFd(this.fd);
  }
}

/** The pool's pages and what is known of them. */
export class PagePool {
  /** Pages the whole pool may hold, over all scopes. */
  readonly pageCount: number;
  private readonly scopes = new Map<string, ScopePages>();
  private used = 0;
  private candidateCount = 0;

  constructor(poolBytes: number) {
    this.pageCount = Math.floor(poolBytes / PAGE_BYTES);
  }

  private scope(name: string): ScopePages {
    let s = this.scopes.get(name);
    if (!s) {
      if (this.scopes.size >= MAX_SCOPES) throw new RangeError(`the pool serves at most ${MAX_SCOPES} scopes`);
      s = new ScopePages(name, this.pageCount * PAGE_BYTES);
      this.scopes.set(name, s);
    }
    return s;
  }

  /** A read-only descriptor of `scope`'s memfd, the one its clients map (created on first use). */
  scopeFd(scope: string): number {
    return this.scope(scope).clientFd;
  }

  /** The pool pages of `scope` whose key is `key` (their content still to be compared). */
  lookup(scope: string, key: PageKey): readonly number[] {
    return this.scopes.get(scope)?.index.get(keyNumber(key)) ?? [];
  }

  /**
   * Notes that `client` offered a page of `key` the pool does not hold; returns true if another
   * client of the scope offered it before (so it is worth pooling now).
   */
  offered(scope: string, key: PageKey, client: number): boolean {
    const s = this.scope(scope);
    const k = keyNumber(key);
    const first = s.offered.get(k);
    if (first !== undefined) return first !== client;
    if (this.candidateCount >= MAX_CANDIDATES) this.forgetOldestCandidate();
    s.offered.set(k, client);
    this.candidateCount++;
    return false;
  }

  private forgetOldestCandidate(): void {
    for (const s of this.scopes.values()) {
      const oldest = s.offered.keys().next();
      if (!oldest.done) {
        s.offered.delete(oldest.value);
        this.candidateCount--;
        return;
      }
    }
  }

  /**
   * A pool page of `scope` holding exactly `bytes` (whose key is `key`, as the daemon computed
   * it): an existing one, or one written now; undefined when the pool is full. The caller then
   * holds one reference to it ({@link release} gives it back).
   */
  put(scope: string, key: PageKey, bytes: Buffer): number | undefined {
    const s = this.scope(scope);
    const k = keyNumber(key);
    for (const p of s.index.get(k) ?? []) {
      if (s.page(p).equals(bytes)) {
        s.setRefs(p, s.refsOf(p) + 1);
        return p;
      }
    }
    // The limit is on pages held, over all scopes; within a scope, fresh slots first (they keep
    // runs consecutive), then slots freed.
    if (this.used >= this.pageCount) return undefined;
    const page = s.allocated < this.pageCount ? s.allocated++ : s.free.pop();
    if (page === undefined) return undefined;
    this.used++;
    bytes.copy(s.page(page), 0, 0, PAGE_BYTES);
    s.setKey(page, k);
    s.setRefs(page, 1);
    s.used++;
    const list = s.index.get(k);
    if (list) list.push(page);
    else s.index.set(k, [page]);
    if (s.offered.delete(k)) this.candidateCount--;
    return page;
  }

  /** One more reference to a pool page in use. */
  hold(scope: string, page: number): void {
    const s = this.scopes.get(scope);
    if (!s?.inUse(page)) throw new RangeError(`pool page ${page} of scope ${scope} is not in use`);
    s.setRefs(page, s.refsOf(page) + 1);
  }

  /**
   * Gives back one reference. After the last, the page is punched out and forgotten, and its slot
   * serves a later page: only call it when no process maps the page any more.
   */
  release(scope: string, page: number): void {
    const s = this.scopes.get(scope);
    if (!s?.inUse(page)) throw new RangeError(`pool page ${page} of scope ${scope} is not in use`);
    const left = s.refsOf(page) - 1;
    s.setRefs(page, left);
    if (left > 0) return;
    const k = s.keyOf(page);
    const list = s.index.get(k)!.filter((p) => p !== page);
    if (list.length) s.index.set(k, list);
    else s.index.delete(k);
    punchHole(s.fd, page * PAGE_BYTES, PAGE_BYTES);
    s.free.push(page);
    s.used--;
    this.used--;
  }

  inUse(scope: string, page: number): boolean {
    return this.scopes.get(scope)?.inUse(page) ?? false;
  }

  /** Figures for status. */
  figures(): { pagesUsed: number; references: number; scopes: number; candidates: number } {
    let references = 0;
    for (const s of this.scopes.values()) references += s.references();
    return { pagesUsed: this.used, references, scopes: this.scopes.size, candidates: this.candidateCount };
  }

  close(): void {
    for (const s of this.scopes.values()) s.close();
    this.scopes.clear();
  }
}
