/**
 * Which pages of guest RAM are resident on the host (mincore), as runs: what an offload writes
 * out and what a strategy reports. Shared by the strategies that walk guest RAM.
 */
import { MAP_ANONYMOUS, MAP_PRIVATE, PAGE_SIZE, PROT_READ, PROT_WRITE } from '../sys/constants';
import { mincore, mmap, munmap, viewAt } from '../sys/libc';
import type { StrategyRam } from './strategy';

/** A run of resident pages, as offsets into the guest RAM mapping. */
export interface PageRun {
  offset: number;
  length: number;
}

/** The resident runs of guest RAM, in address order. */
export function residentRuns(ram: StrategyRam): PageRun[] {
  const pages = Math.ceil(ram.sizeBytes / PAGE_SIZE);
  const vecBytes = Math.ceil(pages / PAGE_SIZE) * PAGE_SIZE;
  const vecAddr = mmap(0, vecBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, 'mincore vector');
  try {
    mincore(ram.hostAddr, ram.sizeBytes, vecAddr);
    const vec = viewAt(vecAddr, pages);
    const runs: PageRun[] = [];
    let start = -1;
    for (let p = 0; p <= pages; p++) {
      const resident = p < pages && (vec[p] & 1) === 1;
      if (resident && start < 0) start = p;
      else if (!resident && start >= 0) {
        runs.push({ offset: start * PAGE_SIZE, length: (p - start) * PAGE_SIZE });
        start = -1;
      }
    }
    return runs;
  } finally {
    munmap(vecAddr, vecBytes);
  }
}
