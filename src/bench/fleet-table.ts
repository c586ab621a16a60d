/**
 * `pvisor bench fleet`'s figures judged against issue 27's goals: one row per figure, the goal
 * beside it and whether it was met. Pure, so that its judgements are unit-tested.
 */

const MiB = 2 ** 20;

/** Goal: a restore from the store to ready takes at most this many times a local lazy restore. */
export const STORE_RESTORE_RATIO_GOAL = 2;
/** Goal: bytes read from the store before ready, as a share of the working set. */
export const BYTES_BEFORE_READY_SHARE_GOAL = 0.1;
/** Goal: bytes a child snapshot that changed {@link CHILD_CHANGED_MIB} MiB sends. */
export const CHILD_UPLOAD_GOAL_BYTES = 10 * MiB;
/**
 * Goal: a SharedSnapshot clone restored from the store costs what a clone of the local snapshot
 * does: its guest RAM PSS at most this share more (the two differ by noise: which pages the probe
 * wrote, timer pages).
 */
export const CLONE_PSS_SLACK = 0.1;
/** What the child snapshot changed of its template. */
export const CHILD_CHANGED_MIB = 8;

/** Min, median and max of some timings, ms. */
export interface MsStats {
  min: number;
  median: number;
  max: number;
}

/** What one run of `pvisor bench fleet` measured. */
export interface FleetFigures {
  runs: number;
  workingSetMiB: number;
  /** Restore to the first answered request: local lazy, from the store with a cold cache, then warm. */
  localMs: MsStats;
  storeColdMs: MsStats;
  storeWarmMs: MsStats;
  /** The most bytes a cold-cache restore of the runs had read from the store when Vm.restore resolved (the VM running; the prefetch starts then). */
  bytesBeforeReady: number;
  /** Bytes the upload of the child snapshot sent, and its chunk objects sent / found present. */
  childSentBytes: number;
  childChunksSent: number;
  childChunksPresent: number;
  /** Indexes of the RAM chunks whose content the child's manifest names differently from the template's. */
  childChangedChunks: number[];
  /** Chunk objects each clone's restore fetched from the store, in order (empty: not measured). */
  cloneChunksFetched: number[];
  /**
   * Guest RAM PSS per clone (mean), bytes, with every clone running and its working set read: of
   * the SharedSnapshot clones from the store, and of as many SharedSnapshot clones of the local
   * snapshot, in the same run. Absent: not measured.
   */
  clonePssBytes?: { store: number; local: number };
}

/**
 * Indexes of the RAM chunks that differ between two store manifests' `ramChunks` (a SHA-256, or
 * null for an all-zero chunk); chunks past the shorter one count as changed.
 */
export function changedChunkIndexes(before: readonly (string | null)[], after: readonly (string | null)[]): number[] {
  const out: number[] = [];
  for (let i = 0; i < Math.max(before.length, after.length); i++) if (i >= before.length || i >= after.length || before[i] !== after[i]) out.push(i);
  return out;
}

/** `a / b / c` of min / median / max, whole ms. */
export function mmm(s: MsStats): string {
  return `${s.min.toFixed(0)} / ${s.median.toFixed(0)} / ${s.max.toFixed(0)}`;
}

/** One judged figure, as the bench's JSON carries it. */
export interface FleetGoal {
  figure: string;
  value: number;
  goal: string;
  met: boolean;
}

/** The goals judged from `f`, in the table's order. */
export function fleetGoals(f: FleetFigures): FleetGoal[] {
  const cold = f.storeColdMs.median / f.localMs.median;
  const warm = f.storeWarmMs.median / f.localMs.median;
  const share = f.bytesBeforeReady / (f.workingSetMiB * MiB);
  const goals: FleetGoal[] = [
    { figure: 'store restore, cold cache / local (median)', value: cold, goal: `<= ${STORE_RESTORE_RATIO_GOAL}x`, met: cold <= STORE_RESTORE_RATIO_GOAL },
    { figure: 'store restore, warm cache / local (median)', value: warm, goal: `<= ${STORE_RESTORE_RATIO_GOAL}x`, met: warm <= STORE_RESTORE_RATIO_GOAL },
    { figure: 'bytes read from the store before ready / working set', value: share, goal: `<= ${BYTES_BEFORE_READY_SHARE_GOAL * 100}%`, met: share <= BYTES_BEFORE_READY_SHARE_GOAL },
    { figure: `child upload (${CHILD_CHANGED_MIB} MiB changed), bytes sent`, value: f.childSentBytes, goal: `<= ${CHILD_UPLOAD_GOAL_BYTES / MiB} MiB`, met: f.childSentBytes <= CHILD_UPLOAD_GOAL_BYTES },
  ];
  if (f.cloneChunksFetched.length > 1) {
    const later = f.cloneChunksFetched.slice(1).reduce((a, b) => a + b, 0);
    goals.push({ figure: `chunks fetched by clones 2..${f.cloneChunksFetched.length}`, value: later, goal: '0 (each chunk fetched once per host)', met: later === 0 });
  }
  if (f.clonePssBytes) {
    const ratio = f.clonePssBytes.store / f.clonePssBytes.local;
    goals.push({ figure: 'guest RAM PSS per clone, store / local SharedSnapshot clones', value: ratio, goal: `<= ${1 + CLONE_PSS_SLACK}x`, met: ratio <= 1 + CLONE_PSS_SLACK });
  }
  return goals;
}

/** The table's rows, header first: figure, pvisor's, the goal, met (`-` where no goal applies). */
export function fleetTableRows(f: FleetFigures): string[][] {
  const goals = fleetGoals(f);
  const g = (i: number) => (goals[i].met ? 'yes' : 'NO');
  const rows: string[][] = [
    ['figure', 'pvisor', 'goal (issue 27)', 'met'],
    ['local lazy restore to ready, ms', mmm(f.localMs), '-', '-'],
    ['store lazy restore to ready, cold cache, ms', `${mmm(f.storeColdMs)} (${goals[0].value.toFixed(2)}x local)`, '<= 2x local', g(0)],
    ['store lazy restore to ready, warm cache, ms', `${mmm(f.storeWarmMs)} (${goals[1].value.toFixed(2)}x local)`, '<= 2x local', g(1)],
    ['read from the store before ready (cold cache, most of the runs)', `${(f.bytesBeforeReady / MiB).toFixed(1)} MiB = ${(goals[2].value * 100).toFixed(0)}% of the ${f.workingSetMiB} MiB working set`, '<= 10% of the working set', g(2)],
    [`child upload, ${CHILD_CHANGED_MIB} MiB changed`, `${(f.childSentBytes / MiB).toFixed(1)} MiB sent (${f.childChunksSent} objects sent, ${f.childChunksPresent} present; RAM chunks changed: ${f.childChangedChunks.join(', ')})`, '<= 10 MiB sent', g(3)],
  ];
  let next = 4;
  if (f.cloneChunksFetched.length > 1) {
    const [first, ...later] = f.cloneChunksFetched;
    rows.push([`${f.cloneChunksFetched.length} clones on one host, chunks fetched`, `1st ${first}, then ${later.join(', ')}`, '0 after the 1st', g(next++)]);
  }
  if (f.clonePssBytes) {
    const n = f.cloneChunksFetched.length;
    rows.push([`${n} SharedSnapshot clones, guest RAM PSS per clone`, `${(f.clonePssBytes.store / MiB).toFixed(1)} MiB from the store, ${(f.clonePssBytes.local / MiB).toFixed(1)} MiB local (${goals[next].value.toFixed(2)}x)`, 'as local SharedSnapshot clones', g(next)]);
  }
  return rows;
}

/** What one run of `pvisor bench fleet --guest linux` measured. */
export interface FleetLinuxFigures {
  runs: number;
  /** The VM's memory, as given to Vm.start. */
  memory: string;
  /** Restore to the agent's answer: local lazy, from the store with a cold cache, then warm. */
  localMs: MsStats;
  storeColdMs: MsStats;
  storeWarmMs: MsStats;
  /** The most bytes a cold-cache restore of the runs had read from the store when Vm.restore resolved (the VM running; the prefetch starts then). */
  bytesBeforeReady: number;
}

/** The Linux row's goals judged from `f`, in the table's order. */
export function fleetLinuxGoals(f: FleetLinuxFigures): FleetGoal[] {
  const cold = f.storeColdMs.median / f.localMs.median;
  const warm = f.storeWarmMs.median / f.localMs.median;
  return [
    { figure: 'Linux: store restore to agent ready, cold cache / local (median)', value: cold, goal: `<= ${STORE_RESTORE_RATIO_GOAL}x`, met: cold <= STORE_RESTORE_RATIO_GOAL },
    { figure: 'Linux: store restore to agent ready, warm cache / local (median)', value: warm, goal: `<= ${STORE_RESTORE_RATIO_GOAL}x`, met: warm <= STORE_RESTORE_RATIO_GOAL },
  ];
}

/** The Linux table's rows, header first, as {@link fleetTableRows}'s. */
export function fleetLinuxRows(f: FleetLinuxFigures): string[][] {
  const goals = fleetLinuxGoals(f);
  const g = (i: number) => (goals[i].met ? 'yes' : 'NO');
  return [
    ['figure', 'pvisor', 'goal (issue 27)', 'met'],
    ['Linux: local lazy restore to agent ready, ms', mmm(f.localMs), '-', '-'],
    ['Linux: store restore to agent ready, cold cache, ms', `${mmm(f.storeColdMs)} (${goals[0].value.toFixed(2)}x local; ${(f.bytesBeforeReady / MiB).toFixed(1)} MiB read)`, '<= 2x local', g(0)],
    ['Linux: store restore to agent ready, warm cache, ms', `${mmm(f.storeWarmMs)} (${goals[1].value.toFixed(2)}x local)`, '<= 2x local', g(1)],
  ];
}
