/**
 * What a Table 3 run is (./table3.ts's header says what it measures): four VMs per cell, the
 * working sets and their seeds, the schemes, when cells are read, and the options type.
 */
import type { ProbeContent, ProbeWorkingSet } from '../guest/probe-content';
import type { Table3Scheme, Table3WorkingSet } from './study-figures';

const MiB = 2 ** 20;
/** VMs in a cell, one process each. */
export const VMS = 4;
/** The study reads cross-instance cells 2 s after the operation... */
export const READ_AFTER_MS = 2000;
/** ...and KSM 60 s after. */
export const KSM_READ_AFTER_MS = 60_000;
/**
 * KSM for the cell: 1000 pages per 20 ms wake-up (the kernel's default is 100) scans the four
 * VMs' resident guest RAM (about 66k pages) in a few seconds, so merging is over well inside the
 * 60 s even with other work on the host's two cores; with the default, the first merges came
 * after about 20 s and the last at about 35 s for 64k pages (host-facts.md).
 */
export const KSM_SETTINGS: [string, string][] = [
  ['advisor_mode', 'none'],
  ['pages_to_scan', '1000'],
  ['sleep_millisecs', '20'],
  ['run', '1'],
];

/** Every working set, in the order the cells run. */
export const WORKING_SETS: Table3WorkingSet[] = ['same-repetitive', 'same-random', 'unique-random'];
/**
 * `daemon-pool-arriving` is the pool once more, with the VMs arriving one after another, as an
 * orchestrator's sandboxes do: each fills its working set, then every VM so far runs a pass (what
 * their periodic passes would do). The study's protocol (`daemon-pool`) fills all four before the
 * first pass, so its group holds four private working sets before any merge: for same repetitive
 * that alone is about 4 x 64 MiB above the settled figure, whatever the merge does.
 */
export type MeasuredScheme = Table3Scheme | 'daemon-pool-arriving';
/** Every scheme, in the order the cells run. */
export const SCHEMES: MeasuredScheme[] = ['private', 'shared-snapshot', 'ksm', 'daemon-pool', 'daemon-pool-arriving'];
/** The study's scheme a measured one is compared with. */
export const studyScheme = (scheme: MeasuredScheme): Table3Scheme => (scheme === 'daemon-pool-arriving' ? 'daemon-pool' : scheme);

/** What each working set fills. */
export const CONTENT: Record<Table3WorkingSet, ProbeContent> = { 'same-repetitive': 'repetitive', 'same-random': 'random', 'unique-random': 'random' };
/** The fill's seed of VM `vm` (0-3): one for all in the "same" sets, each its own in unique random. */
export function fillSeed(ws: Table3WorkingSet, vm: number): number {
  if (ws === 'same-repetitive') return 1;
  return ws === 'same-random' ? 42 : 101 + vm;
}
/** The 100% rewrite's seed: each VM its own, in every working set. */
export const rewriteSeed = (vm: number) => 1001 + vm;

/** Each scheme's name in the tables. */
export const SCHEME_NAMES: Record<MeasuredScheme, string> = {
  private: 'private',
  'shared-snapshot': 'shared snapshot + COW',
  ksm: 'KSM',
  'daemon-pool': 'daemon pool',
  'daemon-pool-arriving': 'daemon pool, VMs arriving one by one',
};

/** The guests Table 3 runs on. */
export type Table3Guest = 'probe' | 'linux';

/** Table 3's options, checked. */
export interface Table3Options {
  guest: Table3Guest;
  workingSets: Table3WorkingSet[];
  schemes: MeasuredScheme[];
  workingSetMiB: number;
  ksmReadAfterMs: number;
  snapshotDir: string;
}

/** The host's model of VM `vm`'s working set, before or after the 100% rewrite. */
export const wsOf = (ws: Table3WorkingSet, vm: number, sizeMiB: number, rewritten: boolean): ProbeWorkingSet => ({
  content: CONTENT[ws],
  seed: fillSeed(ws, vm),
  sizeBytes: sizeMiB * MiB,
  rewrites: rewritten ? [{ permille: 1000, seed: rewriteSeed(vm) }] : [],
});
