/**
 * What the cells of Tables 1 and 2 are made of, shared by the parent that runs them
 * (./tables12.ts) and the cell's own process (./memory-cell.ts): the modes, the working sets and
 * their seeds, the timings, what a cell is told and what it reports.
 */
import { ColdCompression } from '../memory/strategies/cold-compression';
import { CompressedOffload } from '../memory/strategies/compressed-offload';
import { IdleRelease } from '../memory/strategies/idle-release';
import { Offload } from '../memory/strategies/offload';
import type { MemoryStrategy, StrategyStats } from '../memory/strategy';

/** The study reads a cell this long after the operation. */
export const READ_AFTER_MS = 5000;
/** `compressible` (distinct pages that lz4 shrinks to about 31%) is the study's extra cold case. */
export const SEEDS = { repetitive: 1, random: 42, compressible: 7 } as const;
/** Short, so that a cell settles in seconds; what it measures does not depend on it. */
export const BENCH_COLD_AFTER_MS = 2000;
/** ColdCompression's default cpuShare (cold-compression.ts), the default of --cold-cpu-share. */
export const DEFAULT_COLD_CPU_SHARE = 0.05;
/** The mix cell's hot part, read over and over while the rest goes cold (the study's case). */
export const HOT_MIB = 16;
/** A cold cell is settled when its store has not grown for this long... */
export const COLD_SETTLED_MS = 3000;
/** ...and not before this long after the fill (a few scans past coldAfter)... */
export const COLD_MIN_SETTLE_MS = BENCH_COLD_AFTER_MS + 5000;
/**
 * ...or, in the mix cell, this long: the hot part has come back a few times by then and waits
 * 4^k x coldAfter before the next try. Its refaults are then counted over HOT_WINDOW_MS.
 */
export const MIX_SETTLE_MS = 45_000;
export const HOT_WINDOW_MS = 60_000;
/**
 * A cell's working set: data of one of the study's kinds that pvisor-workset (or the probe)
 * holds, or `agent`, the agent workload (./agent-workload.ts), whose heap is its working set.
 */
export type Content = keyof typeof SEEDS | 'agent';

/** A mode of Table 1: the strategies a VM starts with and what is done after the fill. */
export interface Mode {
  name: string;
  strategies(backingDir: string, coldCpuShare: number): MemoryStrategy[];
  operation: 'none' | 'release' | 'suspend' | 'cold' | 'cold-mix';
}

/** Every mode the bench knows, `default` (the baseline) first. */
export const MODES: Mode[] = [
  { name: 'default', strategies: () => [], operation: 'none' },
  { name: 'idle-release', strategies: () => [new IdleRelease()], operation: 'release' },
  { name: 'cold-compression', strategies: (_, cpuShare) => [new ColdCompression({ coldAfterMs: BENCH_COLD_AFTER_MS, cpuShare })], operation: 'cold' },
  { name: 'cold-compression-mix', strategies: (_, cpuShare) => [new ColdCompression({ coldAfterMs: BENCH_COLD_AFTER_MS, cpuShare })], operation: 'cold-mix' },
  { name: 'offload', strategies: (dir) => [new Offload({ dir })], operation: 'suspend' },
  { name: 'offload-lazy', strategies: (dir) => [new Offload({ dir, reload: 'lazy' })], operation: 'suspend' },
  { name: 'offload-cached', strategies: (dir) => [new Offload({ dir, pageCache: 'keep' })], operation: 'suspend' },
  { name: 'compressed-offload', strategies: (dir) => [new CompressedOffload({ dir })], operation: 'suspend' },
  { name: 'compressed-offload-warm', strategies: (dir) => [new CompressedOffload({ dir, keepWorkers: true })], operation: 'suspend' },
];

/** The modes of the Linux guest's Table 1 by default: the study's. */
export const LINUX_MODES = ['default', 'idle-release', 'cold-compression', 'offload', 'compressed-offload'];

/** What the parent sends a cell, as JSON on its command line. */
export interface CellConfig {
  guest: BenchGuest;
  mode: string;
  content: Content;
  /** VMs in the cell's one process (1 but for the shared-process row). */
  vms: number;
  workingSetMiB: number;
  backingDir: string;
  /** ColdCompression's cpuShare in the cold cells (--cold-cpu-share). */
  coldCpuShare: number;
}

/** One cell's results. */
export interface CellResult {
  guest: BenchGuest;
  mode: string;
  content: Content;
  /** VMs in the cell's process; the figures below are for all of them together. */
  vms: number;
  /** Resident: PSS of every process of the cell's group, 5 s after the operation. */
  groupPssBytes: number;
  /** PSS of the guest RAM mapping alone. */
  guestRamPssBytes: number;
  /** The cgroup's charge (includes page cache); null when no cgroup could be made. */
  groupMemoryBytes: number | null;
  /** Of the group's charge, page cache (e.g. a backing file not yet dropped); null without a cgroup. */
  groupPageCacheBytes: number | null;
  /** Time of the operation (release request; suspend: until the VM is suspended), ms. */
  operationMs: number;
  /** Guest RAM PSS just before the operation, bytes. */
  guestRamPssBeforeBytes: number;
  /** Guest RAM PSS of the booted VMs before the fill, bytes (all of them). */
  guestRamPssBootedBytes: number;
  /** Offload modes: from the suspend request until the memory was released, ms. */
  releaseMs?: number;
  /** Offload modes: how long resume took (until the VM runs), ms. */
  resumeMs?: number;
  /** Offload modes: the task before the offload, resume + task after it, ms. */
  taskMs?: number;
  resumeAndTaskMs?: number;
  /** Offload modes: the backing's allocated size after suspend, bytes. */
  backingBytes?: number;
  /** Cold modes: share of one CPU the strategy's scans and compression took during the reading, %. */
  scannerCpuPercent?: number;
  /** Cold modes: blocks brought back by touching the working set, per second of the time they added. */
  faultsPerSecond?: number;
  /** Cold modes: blocks that touch brought back. */
  faultsTimed?: number;
  /** The mix cell: pages of the hot part brought back per second during the reading, % of the hot part. */
  hotRefaultPercentPerSecond?: number;
  strategies: StrategyStats[];
}

/** The guests the tables run on: the probe (the memory layer's microbenchmark) or the shipped Linux guest. */
export type BenchGuest = 'probe' | 'linux';
