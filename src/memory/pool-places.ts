/**
 * Which guest pages a PoolClient has mapped from a pool, and from which pool page: one 32-bit
 * entry per guest page, in an anonymous mapping of its own, so only the entries' pages that were
 * written are resident (64 KiB for 16k consecutive pages of a 512 MiB VM). A Map of the same
 * entries was 0.5-0.9 MiB of JS heap per VM, kept for the VM's life.
 */
import { MAP_ANONYMOUS, MAP_PRIVATE, PAGE_SIZE, PROT_READ, PROT_WRITE } from '../sys/constants';
import { mmap, munmap, viewAt } from '../sys/libc';

/** The place of a guest page mapped from a pool whose daemon is gone: no reference to give back. */
export const FROM_GONE_POOL = -1;

/** An entry: 0 for a page not mapped from a pool, pool page + 1, or GONE_ENTRY. */
const GONE_ENTRY = 0xffffffff;

/** Guest page -> pool page, for the pages mapped from a pool. */
export class PoolPlaces {
  private readonly entries: Uint32Array;
  private readonly addr: number;
  private readonly bytes: number;
  private count = 0;

  constructor(readonly pages: number) {
    this.bytes = Math.ceil((pages * 4) / PAGE_SIZE) * PAGE_SIZE;
    this.addr = mmap(0, this.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, 'pool places');
    const view = viewAt(this.addr, this.bytes);
    this.entries = new Uint32Array(view.buffer, view.byteOffset, pages);
  }

  /** Guest pages mapped from a pool. */
  get size(): number {
    return this.count;
  }

  has(page: number): boolean {
    return this.entries[page] !== 0;
  }

  /** Notes `page` mapped from pool page `poolPage` of the current pool. */
  set(page: number, poolPage: number): void {
    if (this.entries[page] === 0) this.count++;
    this.entries[page] = poolPage + 1;
  }

  /**
   * Forgets `page`; returns the pool page it was mapped from, {@link FROM_GONE_POOL}, or undefined
   * if it was not mapped from a pool.
   */
  take(page: number): number | undefined {
    const e = this.entries[page];
    if (e === 0) return undefined;
    this.entries[page] = 0;
    this.count--;
    return e === GONE_ENTRY ? FROM_GONE_POOL : e - 1;
  }

  /** The pool's daemon is gone: every page mapped from it keeps its mapping and no reference. */
  forgetPool(): void {
    for (let p = 0; p < this.pages; p++) if (this.entries[p] !== 0) this.entries[p] = GONE_ENTRY;
  }

  /** Unmaps the entries; nothing may use this afterwards. */
  close(): void {
    munmap(this.addr, this.bytes);
  }
}
