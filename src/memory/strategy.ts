/**
 * The one interface every memory strategy implements. The KVM backend calls it while guest RAM is
 * mapped, when the VM is suspended and before it resumes; `Vm` validates a composition before
 * anything is allocated.
 * @module
 */
import { PvisorError } from '../errors';

/** How a strategy needs guest RAM to be backed. */
export type RamBackingNeed =
  /** Private anonymous memory (the default): what KSM can merge. */
  | 'private-anonymous'
  /** A file or memfd the strategy provides (offload, snapshots, the pool). */
  | 'file'
  /** Any backing. */
  | 'any';

/** A host resource that only one strategy of a VM may drive. */
export type ExclusiveResource = 'free-page-reporting' | 'userfaultfd' | 'ram-backing' | 'suspend-image';

/** What a strategy sees of guest RAM. */
export interface StrategyRam {
  /** Host address of the guest RAM mapping. */
  readonly hostAddr: number;
  /**
   * A zero-copy view of [offset, offset+length) of the mapping, valid while the VM lives; a range
   * must not cross a 1 GiB boundary (views are per 1 GiB chunk).
   */
  view(offset: number, length: number): Buffer;
  /** Size of the mapping in bytes. */
  readonly sizeBytes: number;
  /** madvise over a range of the mapping (offsets into it). */
  advise(offset: number, length: number, advice: number, name: string): void;
  /** Drops the host pages behind a guest-physical range (page-aligned). */
  discard(gpa: number, length: number): void;
  /** Drops the host pages behind [offset, offset+length) of the mapping (page-aligned). */
  discardHost(offset: number, length: number): void;
}

/** Passed to every hook. */
export interface StrategyContext {
  /** The VM's name, for messages and file names. */
  readonly vmName: string;
  /** Guest RAM. */
  readonly ram: StrategyRam;
  /**
   * Ends the VM as a crash with `error`, for a strategy that finds, while the guest runs, that it
   * cannot go on (e.g. a corrupt piece met during a lazy reload). The VM emits `crash` and `exit`,
   * pending requests fail with `error`, every strategy is closed; the host process goes on.
   * Does nothing once the VM has ended.
   */
  fail(error: PvisorError): void;
}

/** Figures a strategy reports about itself, printed by the CLI and the bench as they are. */
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

/** The interface of every memory strategy. */
export interface MemoryStrategy {
  /** A short stable name, e.g. `ksm-advice`, used in errors and figures. */
  readonly name: string;
  /** How guest RAM must be backed for this strategy to work. */
  readonly ramBacking: RamBackingNeed;
  /** Host resources this strategy drives alone. */
  readonly exclusive: readonly ExclusiveResource[];
  /** Guest RAM has been mapped and registered, no vCPU has run yet. */
  map?(ctx: StrategyContext): void;
  /** The guest reported a free range (needs `free-page-reporting`). */
  freePagesReported?(ctx: StrategyContext, gpa: number, length: number): void;
  /** All vCPUs are stopped; the strategy may write out, compress or drop guest pages. */
  suspend?(ctx: StrategyContext): Promise<void>;
  /** Before any vCPU runs again: bring back and verify what the guest will need. */
  resume?(ctx: StrategyContext): Promise<void>;
  /** What the strategy has done so far. */
  stats(ctx: StrategyContext): StrategyStats;
  /**
   * The VM is ending: release files, descriptors, helpers. Called once, after the VM has stopped
   * handling vCPU exits and before vCPU threads are joined and guest RAM is unmapped, so a
   * strategy that can hold a vCPU in a fault (userfaultfd) must let it go here.
   */
  close?(): void;
}

/** Two strategies of one VM cannot work together; names both. */
export class StrategyConflictError extends PvisorError {
  /** The two strategies, in the order given. */
  readonly strategies: [string, string];
  constructor(a: string, b: string, why: string) {
    super('PVISOR_STRATEGY_CONFLICT', `memory strategies ${a} and ${b} cannot be combined: ${why}`);
    this.strategies = [a, b];
  }
}

/**
 * Checks a composition before anything is allocated: no strategy twice, no resource driven by
 * two strategies, no two incompatible backings. Throws {@link StrategyConflictError}.
 */
export function validateComposition(strategies: readonly MemoryStrategy[]): void {
  for (let i = 0; i < strategies.length; i++) {
    for (let j = i + 1; j < strategies.length; j++) {
      const a = strategies[i];
      const b = strategies[j];
      if (a.name === b.name) throw new StrategyConflictError(a.name, b.name, 'the same strategy is given twice');
      const shared = a.exclusive.find((r) => b.exclusive.includes(r));
      if (shared) throw new StrategyConflictError(a.name, b.name, `both drive ${shared}`);
      if (a.ramBacking !== 'any' && b.ramBacking !== 'any' && a.ramBacking !== b.ramBacking) {
        throw new StrategyConflictError(a.name, b.name, `${a.name} needs ${a.ramBacking} guest RAM, ${b.name} needs ${b.ramBacking}`);
      }
    }
  }
}
