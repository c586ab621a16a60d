/**
 * How guest RAM comes back from a snapshot's RAM file on a restore, decided by the memory
 * strategies: a {@link SharedSnapshot} clone maps the file (it is guest RAM's backing, checked in
 * full once per process per unchanged file); otherwise RAM is loaded lazily through userfaultfd
 * where the composition allows it (see {@link MemoryComposition.canLoadLazily}), or read and
 * checked in full first (`verify`, or a composition that drops or replaces resident pages).
 * `Vm.restore` calls it and names no strategy. It lives with the snapshot files, above the
 * memory layer it drives: in src/memory/ it would be a module of the core that names a strategy,
 * which imports the core.
 * @module
 */
import { InvalidOptionError, SnapshotError, type PvisorError } from '../errors';
import type { DeferredRamFetcher, GuestRam, MemoryComposition } from '../memory/composition';
import type { PageRun } from '../guest-ram/pages';
import type { RamBacking } from '../guest-ram/ram-backing';
import type { MemoryStrategy } from '../memory/strategy';
import { SharedSnapshot } from '../memory/strategies/shared-snapshot';
import type { FileRange } from '../memory/uffd-server';

/** How guest RAM came from the snapshot (`RestoreInfo.ramLoad`). */
export type SnapshotRamLoad = 'read' | 'lazy' | 'mapped';

/** What a restore needs of the snapshot's RAM file (the snapshot reader has it). */
export interface SnapshotRamFile<Ram> {
  /** For messages. */
  readonly ramPath: string;
  /** The RAM file, open read-only. */
  readonly ramFd: number;
  /** Reads all of guest RAM into `ram` (fresh), checking every chunk first. */
  readRam(ram: Ram): void;
  /**
   * The file's size checked, its holes checked; the chunks with data as ranges to load lazily,
   * each checked as it loads. `deferred`: the ranges' bytes are not in the file yet, this fetcher
   * brings them (a snapshot in an object store); `failure` then makes the error the VM ends with.
   */
  openRamForLazyLoad(): { fd: number; ranges: FileRange[]; deferred?: DeferredRamFetcher; failure?: (why: string, offset: number, code: number) => PvisorError };
  /** Checks the file that guest RAM maps as `fd` (unless this process did, and not `again`); its holes. */
  checkMappedRam(fd: number, again: boolean): { checkedBefore: boolean; chunksRead: number; ms: number; holes: PageRun[] };
}

/** How guest RAM will come from the snapshot's RAM file: {@link planSnapshotRam}. */
export interface SnapshotRamPlan<Ram> {
  /**
   * Brings guest RAM (mapped, no vCPU has run) back from the file and runs the strategies' map
   * hooks: in the order a lazy load needs, as they must run before anything touches RAM.
   * Resolves with how RAM came.
   */
  load(memory: MemoryComposition, ram: Ram): Promise<SnapshotRamLoad>;
}

/**
 * Plans guest RAM's restore from `file` for a VM of `strategies`. Call before the composition is
 * planned: a {@link SharedSnapshot} among them is bound to the file here, which makes the file
 * guest RAM's backing.
 */
export function planSnapshotRam<Ram extends GuestRam & { readonly backing: RamBacking }>(
  strategies: readonly MemoryStrategy[],
  file: SnapshotRamFile<Ram>,
  options: { verify: boolean },
): SnapshotRamPlan<Ram> {
  // Bound before the composition is planned: its RAM file is guest RAM's backing.
  const shared = strategies.find((s): s is SharedSnapshot => s instanceof SharedSnapshot);
  shared?.useRamFile(file.ramPath, file.ramFd);
  return {
    async load(memory, ram) {
      const lazy = !shared && !options.verify && memory.canLoadLazily ? file.openRamForLazyLoad() : undefined;
      if (ram.backing.kind === 'private-file' && shared) shared.noteCheck(file.checkMappedRam(ram.backing.fd, shared.verifyAgain));
      else if (!lazy) file.readRam(ram);
      // Strategies map before anything touches RAM: a lazy load needs it untouched.
      memory.attach(ram);
      if (lazy) {
        await memory.loadLazily(
          lazy.fd,
          lazy.ranges,
          lazy.failure ?? ((why, offset) => new SnapshotError(`${file.ramPath}: the RAM chunk at byte ${offset} cannot be loaded (${why}): the file was changed after the snapshot; the guest never saw it, and the VM ends`)),
          lazy.deferred,
        );
      }
      return shared ? 'mapped' : lazy ? 'lazy' : 'read';
    },
  };
}

/** Refuses, at a start, the strategies that only a restore can serve (they map a snapshot's RAM). */
export function refuseRestoreOnlyStrategies(strategies: readonly MemoryStrategy[]): void {
  if (strategies.some((s) => s instanceof SharedSnapshot)) throw new InvalidOptionError('strategies', "SharedSnapshot maps a snapshot's RAM: give it to Vm.restore, not Vm.start");
}
