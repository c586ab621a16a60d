/**
 * The one interface every memory strategy implements. The memory layer (./composition.ts) checks
 * a composition before anything is allocated, lets at most one strategy choose guest RAM's
 * backing, and calls the hooks while guest RAM is mapped, while the VM runs, when it is suspended
 * and before it resumes.
 * @module
 */
import { PvisorError, type SystemCallError } from '../errors';
import type { FileRunOver } from '../guest-ram/file-runs';
import type { PageRun } from '../guest-ram/pages';
import type { DiscardTo, RamBackingKind, RamBackingRequest, RamCapability } from '../guest-ram/ram-backing';
import type { UffdServer } from './uffd-server';

export type { DiscardTo, RamBackingKind, RamBackingRequest, RamCapability } from '../guest-ram/ram-backing';
export type { PageRun } from '../guest-ram/pages';
export type { FileRunOver } from '../guest-ram/file-runs';

/**
 * A host resource that only one strategy of a VM may drive: free page reports, the image a
 * suspend writes, or the pages of running guest RAM themselves (a strategy that drops and refills
 * them behind the guest's back, or maps other memory over them).
 * @category Strategies
 */
export type ExclusiveResource = 'free-page-reporting' | 'suspend-image' | 'resident-pages';

/**
 * What a strategy sees of guest RAM.
 * @category Strategies
 */
export interface StrategyRam {
  /** Host address of the guest RAM mapping. */
  readonly hostAddr: number;
  /** Size of the mapping in bytes. */
  readonly sizeBytes: number;
  /** How guest RAM is backed, and what that backing can do. */
  readonly backing: RamBackingKind;
  readonly capabilities: readonly RamCapability[];
  /**
   * A zero-copy view of [offset, offset+length) of the mapping, valid while the VM lives; a range
   * must not cross a 1 GiB boundary (views are per 1 GiB chunk).
   */
  view(offset: number, length: number): Buffer;
  /** madvise over a range of the mapping (offsets into it). */
  advise(offset: number, length: number, advice: number, name: string): void;
  /**
   * Drops the host pages behind a guest-physical range (page-aligned); the guest then reads what
   * `to` says (default zero; see {@link DiscardTo}).
   */
  discard(gpa: number, length: number, to?: DiscardTo): void;
  /** The offset into the mapping of guest-physical [gpa, gpa+length), or -1 if it is not all RAM. */
  hostOffset(gpa: number, length: number): number;
  /** {@link discard} by offset into the mapping. */
  discardHost(offset: number, length: number, to?: DiscardTo): void;
  /** {@link discardHost} of many runs, in one native call where it can (a restored clone's RAM file holes). */
  discardHostRuns(runs: readonly PageRun[], to?: DiscardTo): void;
  /**
   * Maps each run of the file `fd` privately over guest RAM, [offset, offset+length) from
   * `fileOffset` (all page-aligned), in one native call: the guest then reads the file's pages,
   * shared with every other mapping of them, and a write makes a private copy. What a range held
   * is dropped. The fd stays the caller's. For strategies that hand out shared pages (a page
   * pool); a range mapped so cannot be served by userfaultfd any more. Returns how many runs were
   * mapped, in order, and the error that stopped it, if one did.
   */
  mapFileRuns(fd: number, runs: readonly FileRunOver[]): { mapped: number; error?: SystemCallError };
  /**
   * The runs holding the VM's own pages, in address order: what exists nowhere but in this VM's
   * RAM (a private file mapping's unwritten pages are the file's and not counted).
   */
  ownPageRuns(): PageRun[];
}

/**
 * Passed to every hook.
 * @category Strategies
 */
export interface StrategyContext {
  /** The VM's name, for messages and file names. */
  readonly vmName: string;
  /** Guest RAM. */
  readonly ram: StrategyRam;
  /**
   * The VM's one userfaultfd server, created on first use: a native thread that serves missing
   * pages of guest RAM from the sources strategies register with it (a backing file's pieces,
   * host memory, zero), so several strategies can bring pages back lazily at once and no fault
   * waits on the event loop. Needs the `userfaultfd-missing` capability; closed with the VM, after
   * every strategy's `close`.
   */
  uffd(): Promise<UffdServer>;
  /**
   * Runs `work` (synchronous) with every vCPU stopped, so that the guest writes nothing to RAM
   * meanwhile: for a strategy that replaces guest pages it has just compared (the page pool). A
   * running VM is paused for the call and runs on after; a paused or suspended one stays as it
   * is. Resolves with `work`'s result, or `undefined` without calling it when the VM is between
   * states or has ended (try again at the next tick). Keep `work` short: the guest waits.
   */
  withGuestPaused<T>(work: () => T): Promise<T | undefined>;
  /** Tells the VM's user something went wrong that the VM survives (the VM's `warning` event). */
  warn(message: string): void;
  /**
   * Ends the VM as a crash with `error`, for a strategy that finds, while the guest runs, that it
   * cannot go on (e.g. a corrupt piece met during a lazy reload). The VM emits `crash` and `exit`,
   * pending requests fail with `error`, every strategy is closed; the host process goes on.
   * Does nothing once the VM has ended.
   */
  fail(error: PvisorError): void;
}

/**
 * Figures a strategy reports about itself, printed by the CLI and the bench as they are.
 * @category Strategies
 */
export interface StrategyStats {
  /** The strategy's name. */
  strategy: string;
  /** Numbers by name, with units in the names (`pagesReleased`, `bytesOnDisk`, `lastSuspendMs`). */
  figures: Record<string, number>;
  /** Plain-language notes, e.g. that KSM is off on this host so nothing will merge. */
  notes: string[];
}

/** A duration for {@link StrategyStats.figures}: milliseconds to a tenth. */
export function roundMs(ms: number): number {
  return Math.round(ms * 10) / 10;
}

/**
 * What a suspend hook may leave running when it returns: the VM counts as suspended as soon as
 * every hook has returned, while memory is still being given back.
 * @category Strategies
 */
export interface SuspendWork {
  /**
   * Settles when the strategy has released all it will release (or was cancelled by a resume or
   * a stop); rejects if it could not finish, e.g. the disk is full. Until then the pages it has
   * not released stay resident, so nothing is lost either way.
   */
  released: Promise<void>;
}

/**
 * How often a strategy's {@link MemoryStrategy.tick} runs while the VM runs, and how much CPU it may take.
 * @category Strategies
 */
export interface PeriodicWork {
  /** Time between the end of one tick and the start of the next, at least. */
  intervalMs: number;
  /**
   * Share of one CPU the ticks may use, from 0 to 1: after a tick that took `t` ms the next waits
   * at least `t / cpuShare - t` ms, whatever `intervalMs` says.
   */
  cpuShare: number;
}

/**
 * The interface of every memory strategy.
 * @category Strategies
 */
export interface MemoryStrategy {
  /** A short stable name, e.g. `ksm-advice`, used in errors and figures. */
  readonly name: string;
  /** What this strategy needs guest RAM's backing to do; checked before anything is allocated. */
  readonly needs: readonly RamCapability[];
  /** Host resources this strategy drives alone. */
  readonly exclusive: readonly ExclusiveResource[];
  /**
   * The backing this strategy provides for guest RAM, if any (at most one strategy of a VM may
   * provide one; without one, guest RAM is private anonymous memory).
   */
  readonly ramBacking?: RamBackingRequest | undefined;
  /** Guest RAM has been mapped and registered, no vCPU has run yet. */
  map?(ctx: StrategyContext): void;
  /**
   * The guest reported a free range. Reports exist only when a strategy drives them (claims
   * `free-page-reporting`, and drops the range); that strategy hears of a range first, then every
   * other strategy with this hook, e.g. to forget what it keeps of the range.
   */
  freePagesReported?(ctx: StrategyContext, gpa: number, length: number): void;
  /**
   * All vCPUs are stopped; the strategy may write out, compress or drop guest pages. It may leave
   * the release of memory running ({@link SuspendWork}); a resume before that ends must cancel it
   * and keep what is still resident.
   */
  suspend?(ctx: StrategyContext): Promise<SuspendWork | void>;
  /** Before any vCPU runs again: bring back and verify what the guest will need. */
  resume?(ctx: StrategyContext): Promise<void>;
  /** Work done while the guest runs (cold-page scans, pool rescans), within {@link periodic}'s budget. */
  readonly periodic?: PeriodicWork;
  tick?(ctx: StrategyContext): Promise<void> | void;
  /** What the strategy has done so far. */
  stats(ctx: StrategyContext): StrategyStats;
  /**
   * The VM is ending: release files, descriptors, helpers. Called once, after the VM has stopped
   * handling vCPU exits and before vCPU threads are joined and guest RAM is unmapped, so a
   * strategy that can hold a vCPU in a fault must let it go here.
   */
  close?(): void;
}

/**
 * Two strategies of one VM cannot work together; names both.
 * @category Errors
 */
export class StrategyConflictError extends PvisorError {
  /** The two strategies (or a strategy and the guest RAM it would run on), in the order given. */
  readonly strategies: [string, string];
  constructor(a: string, b: string, why: string) {
    super('PVISOR_STRATEGY_CONFLICT', `memory strategies ${a} and ${b} cannot be combined: ${why}`);
    this.strategies = [a, b];
  }
}
