/**
 * The pool's pages: per scope, one memfd holding one copy of each page that VMs of the scope
 * share, an index from content key to pool page, a reference count per pool page, and the keys
 * offered but not yet pooled (so that the second VM to offer a page is asked for it). Knows
 * nothing of sockets.
 *
 * One memfd per scope, sealed against writes: a client holds only its own scope's memfd, so it
 * can read no other scope's pages, and F_SEAL_FUTURE_WRITE keeps it from writing any (reopening
 * /proc/self/fd/N read-write would otherwise give a client write access to every VM's shared
 * pages). The daemon writes through the shared mapping it made before sealing. The seal also
 * forbids punching holes, so a page whose last reference goes is not given back to the host: its
 * slot is reused for the next page put in the scope, and the pool's memory is its high-water mark,
 * bounded by --max-pool.
 *
 * Pages are handed out in the order they are put, so that a run of a VM's consecutive pages put
 * together lands on consecutive pool pages and is mapped as one VMA.
 */
import { ftruncateSync } from 'node:fs';
import { F_SEAL_FUTURE_WRITE, F_SEAL_GROW, F_SEAL_SEAL, F_SEAL_SHRINK, MAP_SHARED, MFD_ALLOW_SEALING, MFD_CLOEXEC, PROT_READ, PROT_WRITE } from '../sys/constants';
import { addSeals, closeFd, createMemfd, mmap, munmap, viewAt } from '../sys/libc';
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
  readonly fd: number;
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
    this.fd = createMemfd(`pvisor-page-pool:${name.slice(0, 200)}`, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    try {
      // Sparse: a page costs memory once a client's bytes are written into it.
      ftruncateSync(this.fd, bytes);
      this.addr = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, this.fd, 0, 'the page pool (the daemon\'s writable mapping)');
      addSeals(this.fd, F_SEAL_FUTURE_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    } catch (e) {
      closeFd(this.fd);
      throw e;
    }
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
    closeFd(this.fd);
  }
}

/** The pool's pages and what is known of them. */
export class PagePool {
  /** Pages the whole pool may hold, over all scopes. */
  readonly pageCount: number;
  private readonly scopes = new Map<string, ScopePages>();
  private allocated = 0;
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

  /** The memfd of `scope`'s pages, the one a client of that scope maps (created on first use). */
  scopeFd(scope: string): number {
    return this.scope(scope).fd;
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
    let page: number | undefined;
    if (this.allocated < this.pageCount) {
      page = s.allocated++;
      this.allocated++;
    } else page = s.free.pop();
    if (page === undefined) return undefined;
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
   * Gives back one reference. After the last, the page is forgotten and its slot serves the next
   * page put in the scope: only call it when no process maps the page any more.
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
    s.free.push(page);
    s.used--;
  }

  inUse(scope: string, page: number): boolean {
    return this.scopes.get(scope)?.inUse(page) ?? false;
  }

  /** Figures for status. */
  figures(): { pagesUsed: number; pagesAllocated: number; references: number; scopes: number; candidates: number } {
    let used = 0;
    let references = 0;
    for (const s of this.scopes.values()) {
      used += s.used;
      references += s.references();
    }
    return { pagesUsed: used, pagesAllocated: this.allocated, references, scopes: this.scopes.size, candidates: this.candidateCount };
  }

  close(): void {
    for (const s of this.scopes.values()) s.close();
    this.scopes.clear();
  }
}
