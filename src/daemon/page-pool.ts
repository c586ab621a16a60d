/**
 * The pool's pages: one memfd holding one copy of each page that VMs share, an index from content
 * key to pool page per scope, a reference count per pool page, and the keys offered but not yet
 * pooled (so that the second VM to offer a page is asked for it). Knows nothing of sockets.
 *
 * Pages are handed out in the order they are put, from the start of the memfd, so that a run of a
 * VM's consecutive pages put together lands on consecutive pool pages and is mapped as one VMA.
 * A page whose last reference goes is punched out of the memfd and forgotten at once.
 */
import { readSync, writeSync, ftruncateSync } from 'node:fs';
import { MFD_CLOEXEC } from '../sys/constants';
import { closeFd, createMemfd, punchHole } from '../sys/libc';
import { PAGE_BYTES, type PageKey } from './pool-protocol';

/** The most keys remembered as offered; the oldest are forgotten beyond it. */
const MAX_CANDIDATES = 1 << 20;

/** 52 bits of a key as a Map key: the rest is left to the byte comparison that always follows. */
function keyNumber(k: PageKey): number {
  return (k.hi & 0xfffff) * 0x1_0000_0000 + (k.lo >>> 0);
}

/** The pool's pages and what is known of them. */
export class PagePool {
  /** The memfd every client maps; closed by {@link close}. */
  readonly fd: number;
  readonly pageCount: number;
  private readonly refs: Uint32Array;
  private readonly keys: Float64Array;
  /** Scope of each pool page, by number (0: the page is free). */
  private readonly scopeOf: Uint16Array;
  private readonly scopes = new Map<string, { id: number; index: Map<number, number[]>; offered: Map<number, number> }>();
  private readonly scopeNames: string[] = [''];
  private nextFresh = 0;
  private readonly freePages: number[] = [];
  private used = 0;
  private candidateCount = 0;
  private readonly scratch = Buffer.alloc(PAGE_BYTES);

  constructor(poolBytes: number) {
    this.pageCount = Math.floor(poolBytes / PAGE_BYTES);
    this.refs = new Uint32Array(this.pageCount);
    this.keys = new Float64Array(this.pageCount);
    this.scopeOf = new Uint16Array(this.pageCount);
    this.fd = createMemfd('pvisor-page-pool', MFD_CLOEXEC);
    try {
      // Sparse: a page costs memory once a client's bytes are written into it.
      ftruncateSync(this.fd, this.pageCount * PAGE_BYTES);
    } catch (e) {
      closeFd(this.fd);
      throw e;
    }
  }

  private scope(name: string) {
    let s = this.scopes.get(name);
    if (!s) {
      if (this.scopeNames.length >= 0xffff) throw new RangeError('too many scopes');
      s = { id: this.scopeNames.length, index: new Map(), offered: new Map() };
      this.scopes.set(name, s);
      this.scopeNames.push(name);
    }
    return s;
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
   * A pool page of `scope` holding exactly `bytes` (whose key is `key`, as the caller computed
   * it): an existing one, or a new one written now; undefined when the pool is full. The caller
   * then holds one reference to it ({@link release} gives it back).
   */
  put(scope: string, key: PageKey, bytes: Buffer): number | undefined {
    const existing = this.find(scope, key, bytes);
    if (existing !== undefined) {
      this.refs[existing]++;
      return existing;
    }
    const page = this.nextFresh < this.pageCount ? this.nextFresh++ : this.freePages.pop();
    if (page === undefined) return undefined;
    writeSync(this.fd, bytes, 0, PAGE_BYTES, page * PAGE_BYTES);
    const s = this.scope(scope);
    const k = keyNumber(key);
    this.keys[page] = k;
    this.scopeOf[page] = s.id;
    this.refs[page] = 1;
    this.used++;
    const list = s.index.get(k);
    if (list) list.push(page);
    else s.index.set(k, [page]);
    if (s.offered.delete(k)) this.candidateCount--;
    return page;
  }

  /** A pool page of `scope` that holds exactly `bytes`. */
  private find(scope: string, key: PageKey, bytes: Buffer): number | undefined {
    for (const page of this.lookup(scope, key)) {
      readSync(this.fd, this.scratch, 0, PAGE_BYTES, page * PAGE_BYTES);
      if (this.scratch.equals(bytes)) return page;
    }
    return undefined;
  }

  /** One more reference to a pool page in use. */
  hold(page: number): void {
    if (!this.inUse(page)) throw new RangeError(`pool page ${page} is not in use`);
    this.refs[page]++;
  }

  /** Gives back one reference; the last one frees the page (punched out, forgotten). */
  release(page: number): void {
    if (!this.inUse(page)) throw new RangeError(`pool page ${page} is not in use`);
    if (--this.refs[page] > 0) return;
    const s = this.scopes.get(this.scopeNames[this.scopeOf[page]])!;
    const k = this.keys[page];
    const list = s.index.get(k)!.filter((p) => p !== page);
    if (list.length) s.index.set(k, list);
    else s.index.delete(k);
    this.scopeOf[page] = 0;
    punchHole(this.fd, page * PAGE_BYTES, PAGE_BYTES);
    this.freePages.push(page);
    this.used--;
  }

  inUse(page: number): boolean {
    return Number.isInteger(page) && page >= 0 && page < this.pageCount && this.scopeOf[page] !== 0;
  }

  /** Figures for status. */
  figures(): { pagesUsed: number; references: number; scopes: number; candidates: number } {
    let references = 0;
    for (let p = 0; p < this.nextFresh; p++) references += this.refs[p];
    return { pagesUsed: this.used, references, scopes: this.scopes.size, candidates: this.candidateCount };
  }

  close(): void {
    closeFd(this.fd);
  }
}
