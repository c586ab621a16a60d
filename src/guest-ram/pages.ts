/**
 * Walking guest RAM page by page, once for every strategy: which pages are the VM's own (what an
 * offload must save), which of them are zero (what it need not write), and how runs of pages are
 * cut into pieces. Offsets are into the guest RAM mapping.
 */
import { closeSync, openSync, readSync } from 'node:fs';
import { MAP_ANONYMOUS, MAP_PRIVATE, PAGE_SIZE, PROT_READ, PROT_WRITE } from '../sys/constants';
import { mincore, mmap, munmap, viewAt } from '../sys/libc';
import type { RamBackingKind } from './ram-backing';

/**
 * A run of pages, as an offset into the guest RAM mapping and a length, both page-aligned.
 * @category Strategies
 */
export interface PageRun {
  offset: number;
  length: number;
}

/** Gathers pages that pass a test, visited once each in address order, into runs. */
export class RunCollector {
  readonly runs: PageRun[] = [];
  private start = -1;

  /** @param base offset of page 0 */
  constructor(private readonly base = 0) {}

  /** Page `p` is in a run (or not). */
  page(p: number, inRun: boolean): void {
    if (inRun && this.start < 0) this.start = p;
    else if (!inRun && this.start >= 0) this.close(p);
  }

  /** Closes the last run at `pages`, the number of pages visited, and returns the runs. */
  end(pages: number): PageRun[] {
    if (this.start >= 0) this.close(pages);
    return this.runs;
  }

  private close(p: number): void {
    this.runs.push({ offset: this.base + this.start * PAGE_SIZE, length: (p - this.start) * PAGE_SIZE });
    this.start = -1;
  }
}

/** /proc/PID/pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst), in the entry's high word. */
const PM_PRESENT_HI = 1 << 31; // bit 63
const PM_FILE_OR_SHARED_HI = 1 << 29; // bit 61
const PAGEMAP_ENTRIES_PER_READ = 64 * 1024;

/**
 * The runs of guest RAM holding the VM's own pages, in address order: what exists nowhere else.
 * - Private anonymous RAM, or a file mapped MAP_PRIVATE (whole, or over runs of anonymous RAM):
 *   the pages present in the page table that are anonymous (pagemap), merged by KSM or not. A page
 *   the guest only read is the file's (or the shared zero page) and not the VM's own.
 * - A memfd: every page resident in the memfd (mincore), mapped or not: all of it is the VM's.
 * mincore alone would count a private file mapping's page-cache pages as the VM's.
 */
export function ownPageRuns(hostAddr: number, sizeBytes: number, backing: RamBackingKind): PageRun[] {
  return backing === 'memfd' ? residentRuns(hostAddr, sizeBytes) : presentAnonymousRuns(hostAddr, sizeBytes);
}

/** Pages present in the page table and anonymous, from /proc/self/pagemap. */
function presentAnonymousRuns(hostAddr: number, sizeBytes: number): PageRun[] {
  const pages = sizeBytes / PAGE_SIZE;
  // The entries are read into a mapping of their own, unmapped after, not into a 512 KiB Buffer
  // per walk (every merge pass, every offload): once glibc has freed a block that large, it serves
  // the next ones from its heap, where freed memory stays resident.
  const bufBytes = Math.min(pages, PAGEMAP_ENTRIES_PER_READ) * 8;
  const bufAddr = mmap(0, bufBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, 'pagemap entries');
  const buf = viewAt(bufAddr, bufBytes);
  const words = new Uint32Array(buf.buffer, buf.byteOffset, buf.length / 4);
  const runs = new RunCollector();
  let fd: number | undefined;
  try {
    fd = openSync('/proc/self/pagemap', 'r');
    for (let first = 0; first < pages; first += PAGEMAP_ENTRIES_PER_READ) {
      const count = Math.min(PAGEMAP_ENTRIES_PER_READ, pages - first);
      const want = count * 8;
      let got = 0;
      while (got < want) {
        const n = readSync(fd, buf, got, want - got, ((hostAddr / PAGE_SIZE) + first) * 8 + got);
        if (n <= 0) throw new Error(`short read of /proc/self/pagemap at page ${first}`);
        got += n;
      }
      for (let i = 0; i < count; i++) {
        const hi = words[2 * i + 1];
        runs.page(first + i, (hi & PM_PRESENT_HI) !== 0 && (hi & PM_FILE_OR_SHARED_HI) === 0);
      }
    }
  } finally {
    if (fd !== undefined) closeSync(fd);
    munmap(bufAddr, bufBytes);
  }
  return runs.end(pages);
}

/** Pages resident in memory (mincore: for a shared mapping, in its file whether mapped or not). */
function residentRuns(hostAddr: number, sizeBytes: number): PageRun[] {
  const pages = Math.ceil(sizeBytes / PAGE_SIZE);
  const vecBytes = Math.ceil(pages / PAGE_SIZE) * PAGE_SIZE;
  const vecAddr = mmap(0, vecBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, 'mincore vector');
  try {
    mincore(hostAddr, sizeBytes, vecAddr);
    const vec = viewAt(vecAddr, pages);
    const runs = new RunCollector();
    for (let p = 0; p < pages; p++) runs.page(p, (vec[p] & 1) === 1);
    return runs.end(pages);
  } finally {
    munmap(vecAddr, vecBytes);
  }
}

/**
 * Cuts runs into pieces that never cross a multiple of `pieceBytes` (a power of two), so a piece
 * never crosses a guest RAM view chunk either.
 */
export function cutRuns(runs: readonly PageRun[], pieceBytes: number): PageRun[] {
  const out: PageRun[] = [];
  for (const run of runs) {
    for (let off = run.offset; off < run.offset + run.length; ) {
      const end = Math.min(run.offset + run.length, (Math.floor(off / pieceBytes) + 1) * pieceBytes);
      out.push({ offset: off, length: end - off });
      off = end;
    }
  }
  return out;
}

const ZERO_PAGE = Buffer.alloc(PAGE_SIZE);

/**
 * Splits `data` (page-aligned length, found at `offset`) into runs of non-zero pages and a count
 * of zero pages: what must be stored, and what reads back as zero anyway. Compares in place, no
 * object per page.
 */
export function splitZeroPages(data: Buffer, offset: number): { nonZero: PageRun[]; zeroPages: number } {
  const pages = data.length / PAGE_SIZE;
  const runs = new RunCollector(offset);
  let zeroPages = 0;
  for (let p = 0; p < pages; p++) {
    const zero = data.compare(ZERO_PAGE, 0, PAGE_SIZE, p * PAGE_SIZE, (p + 1) * PAGE_SIZE) === 0;
    if (zero) zeroPages++;
    runs.page(p, !zero);
  }
  return { nonZero: runs.end(pages), zeroPages };
}

/** Offsets of the `unitBytes`-aligned units that hold at least one page of `runs`, ascending. */
export function unitsTouched(runs: readonly PageRun[], unitBytes: number): number[] {
  const units: number[] = [];
  for (const run of runs) {
    const first = Math.floor(run.offset / unitBytes);
    const last = Math.floor((run.offset + run.length - 1) / unitBytes);
    for (let u = Math.max(first, units.length ? units[units.length - 1] / unitBytes + 1 : 0); u <= last; u++) units.push(u * unitBytes);
  }
  return units;
}
