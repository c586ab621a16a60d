/**
 * `pvisor bench memory --table 1,2`: Tables 1 and 2 of the reference study, measured on pvisor, on the probe
 * guest (the memory layer's microbenchmark) or the shipped Linux guest (`--guest linux`, whose
 * working set a process in the guest holds: pvisor-workset, checked against the host's model).
 *
 * Every cell is a fresh 512 MiB / 2 vCPU probe VM in a process of its own (the product group, as
 * `pvisor run` would be) inside a memory cgroup made for the cell. The VM fills a 64 MiB working
 * set (repetitive or random), applies the mode's operation, and 5 s later the parent reads:
 * resident = PSS summed over the group's processes, guest RAM PSS (from inside the cell), and the
 * group's charged memory. For offload modes the same cell then measures Table 2: the task
 * (digest, rewrite 100%, digest) timed before the offload, and resume + the same task after it;
 * the digest after resume must equal the one before the offload or the cell fails. Before the
 * cells, the same run measures the physical floors for the working set (./floors.ts), and
 * Table 2 prints pvisor's times as multiples of them.
 *
 * Cold compression cells run no operation: the VM idles (the mix cell reads its first 16 MiB
 * over and over) until the compressed store stops growing, then the same 5 s reading; after it,
 * a host thread touches one byte of every stored block, timing the faults that the native server
 * answers (decompress, check, UFFDIO_COPY) against a native userfaultfd loop that answers the
 * same touches with UFFDIO_COPY alone (native-prebuilds/bench/uffd-fault-loop.c), built and run
 * in the same run (./cold-table.ts prints them); then the guest's digest must equal the one taken
 * before. The cell's own process is ./memory-cell.ts; this module is the parent.
 */
import { mkdirSync } from 'node:fs';
import { processResident } from '../memory-usage';
import type { StrategyStats } from '../memory/strategy';
import { CellCgroup } from './cell-cgroup';
import { CellProcess } from './cell-process';
import { faultPercentOfNative, printColdTable } from './cold-table';
import { filesystemOf } from './filesystem';
import { floorRows, measureMemoryFloors, measureNativeFaultRate, type MemoryFloors, type NativeFaultRate } from './floors';
import { BENCH_COLD_AFTER_MS, READ_AFTER_MS, type BenchGuest, type CellConfig, type CellResult, type Content, type Mode } from './memory-modes';
import { beside, GoalTable, printTableBlock, progress } from './report';
import { GOALS, LINUX_GOALS, STUDY_TABLE1, STUDY_TABLE2, STUDY_WORKING_SET_MIB, savingPercent, studyRowOf, type Goal, type PerContent } from './study-figures';

const MiB = 2 ** 20;

/** Options of Tables 1 and 2, checked. */
export interface Tables12Options {
  guest: BenchGuest;
  /** `default` (the baseline) among them. */
  modes: Mode[];
  /** VMs per process of each cell. */
  placements: number[];
  contents: Content[];
  workingSetMiB: number;
  /** Where offload modes write (absolute). */
  backingDir: string;
  /** Offloaded VMs in one process read after the cells (0: none). */
  sharedVms: number;
  /** Runs of each physical floor (0: none). */
  floorRuns: number;
  /** ColdCompression's cpuShare in the cold cells. */
  coldCpuShare: number;
}

/** Runs one cell in a fresh process and cgroup; resolves with its results. */
async function runCell(config: CellConfig, label: string): Promise<CellResult> {
  const cgroup = CellCgroup.create(`pvisor-bench-${process.pid}-${config.guest}-${config.mode}-${config.content}-${config.vms}`);
  const cell = CellProcess.spawn(cgroup, ['memory-cell', JSON.stringify(config)], `cell ${label}`);
  const result: Partial<CellResult> = { guest: config.guest, mode: config.mode, content: config.content, vms: config.vms };
  try {
    for await (const msg of cell.messages()) {
      if (msg.event === 'filled') progress(`${label}: ${config.content === 'agent' ? 'the agent program is ready' : `${config.workingSetMiB} MiB filled`}`);
      if (msg.event === 'operated') {
        const released = msg.releaseMs === undefined ? '' : `, memory released after ${(msg.releaseMs as number).toFixed(1)} ms`;
        progress(`${label}: operation took ${(msg.operationMs as number).toFixed(1)} ms${released}; reading in ${READ_AFTER_MS / 1000} s`);
      }
      if (msg.event === 'reading') {
        // Read the group from outside while the cell waits, so that reading costs the cell nothing.
        result.groupPssBytes = typeof cgroup === 'string' ? processResident(cell.pid).pssBytes : cgroup.pssBytes();
        result.groupMemoryBytes = typeof cgroup === 'string' ? null : cgroup.memoryBytes();
        result.groupPageCacheBytes = typeof cgroup === 'string' ? null : cgroup.pageCacheBytes();
        result.guestRamPssBytes = msg.guestRamPssBytes as number;
        result.guestRamPssBeforeBytes = msg.guestRamPssBeforeBytes as number;
        result.guestRamPssBootedBytes = msg.guestRamPssBootedBytes as number;
        result.operationMs = msg.operationMs as number;
        result.releaseMs = msg.releaseMs as number | undefined;
        result.taskMs = msg.taskMs as number | undefined;
        result.strategies = msg.strategies as StrategyStats[];
        result.backingBytes = backingBytesOf(result.strategies);
        result.scannerCpuPercent = msg.scannerCpuPercent as number | undefined;
        result.hotRefaultPercentPerSecond = msg.hotRefaultPercentPerSecond as number | undefined;
        cell.send('continue');
      }
      if (msg.event === 'done') {
        result.resumeAndTaskMs = msg.resumeAndTaskMs as number | undefined;
        result.resumeMs = msg.resumeMs as number | undefined;
        result.faultsPerSecond = msg.faultsPerSecond as number | undefined;
        result.faultsTimed = msg.faultsTimed as number | undefined;
        cell.endInput();
      }
    }
    const code = await cell.exited;
    if (code !== 0 || result.groupPssBytes === undefined) throw new Error(`cell ${label} failed (exit ${code}): ${cell.stderr.trim()}`);
    return result as CellResult;
  } finally {
    await cell.kill();
    if (typeof cgroup !== 'string') cgroup.remove();
  }
}

function backingBytesOf(strategies: StrategyStats[]): number | undefined {
  const s = strategies.find((x) => 'bytesOnDisk' in x.figures);
  return s?.figures.bytesOnDisk;
}

/** What Tables 1 and 2 print from: every cell, the floors and the native fault rate when measured. */
interface Tables12Run {
  cells: CellResult[];
  /** The offloaded VMs in one process, when measured. */
  shared?: CellResult;
  floors?: MemoryFloors;
  nativeFaults?: NativeFaultRate;
}

/** Tables 1 and 2: measures, prints the tables, returns the JSON. */
export async function benchTables12(opts: Tables12Options): Promise<object> {
  const { guest, workingSetMiB, backingDir } = opts;
  if (workingSetMiB !== STUDY_WORKING_SET_MIB) progress(`warning: the study's cells use ${STUDY_WORKING_SET_MIB} MiB; with ${workingSetMiB} MiB its figures do not compare`);
  mkdirSync(backingDir, { recursive: true });
  const fsType = filesystemOf(backingDir);
  if (fsType === 'tmpfs') progress(`warning: ${backingDir} is on tmpfs, so offloaded pages stay in RAM (as shmem); use --backing-dir on a disk`);
  const floors = await floorsOf(opts);
  const nativeFaults = await nativeFaultsOf(opts);
  const probe = CellCgroup.create(`pvisor-bench-${process.pid}-probe`);
  if (typeof probe === 'string') progress(`group memory will read n/a: ${probe}`);
  else probe.remove();
  const run: Tables12Run = { cells: await runCells(opts), shared: await runSharedCell(opts), floors, nativeFaults };

  printTable1(run, opts);
  printColdTable(run.cells, nativeFaults, opts.coldCpuShare);
  const floorMs = floors && printFloors(floors, workingSetMiB);
  printTable2(run.cells, floorMs);
  const goals = printGoals(run, opts, floorMs);
  process.stdout.write(`Backing files in ${backingDir} (${fsType}). Resident and group memory are never added together.\n`);
  return {
    setup: { guest, placements: opts.placements, memoryMiB: 512, vcpus: 2, workingSetMiB, readAfterMs: READ_AFTER_MS, backingDir, backingFilesystem: fsType, coldAfterMs: BENCH_COLD_AFTER_MS, coldCpuShare: opts.coldCpuShare },
    floors,
    floorMs,
    nativeFaults,
    cells: run.cells,
    sharedProcess: run.shared,
    goals,
  };
}

/** The physical floors for the working set, measured first in the same run; undefined if skipped or refused. */
async function floorsOf({ floorRuns, workingSetMiB, backingDir }: Tables12Options): Promise<MemoryFloors | undefined> {
  if (floorRuns === 0) return undefined;
  progress(`physical floors for ${workingSetMiB} MiB, ${floorRuns} runs, files in ${backingDir}`);
  try {
    return await measureMemoryFloors({ dir: backingDir, sizeMiB: workingSetMiB, runs: floorRuns });
  } catch (e) {
    // The cells can still be measured (e.g. on tmpfs, which the floors refuse): say why not.
    progress(`warning: no physical floors, so no ratios or floor-bound goals: ${(e as Error).message}`);
    return undefined;
  }
}

/** The native userfaultfd fault loop, when a cold compression mode runs; undefined if it could not run. */
async function nativeFaultsOf({ modes, workingSetMiB }: Tables12Options): Promise<NativeFaultRate | undefined> {
  if (!modes.some((m) => m.operation === 'cold' || m.operation === 'cold-mix')) return undefined;
  progress(`native userfaultfd fault loop, ${workingSetMiB} MiB in 64 KiB blocks`);
  try {
    return await measureNativeFaultRate(workingSetMiB, 64, 5);
  } catch (e) {
    progress(`warning: no native fault loop, so no fault service ratio: ${(e as Error).message}`);
    return undefined;
  }
}

/** Every cell of Table 1, one after another: placements, then modes, then working sets. */
async function runCells({ guest, modes, contents, placements, workingSetMiB, backingDir, coldCpuShare }: Tables12Options): Promise<CellResult[]> {
  const cells: CellResult[] = [];
  const total = modes.length * contents.length * placements.length;
  for (const vms of placements) {
    for (const mode of modes) {
      for (const content of contents) {
        const label = `[${cells.length + 1}/${total}] ${guest} ${mode.name} ${content}${vms > 1 ? `, ${vms} VMs in one process` : ''}`;
        progress(`${label}: fresh VM${vms > 1 ? 's' : ''}`);
        cells.push(await runCell({ guest, mode: mode.name, content, vms, workingSetMiB, backingDir, coldCpuShare }, label));
      }
    }
  }
  return cells;
}

/** The goal "<= 8 MiB per VM when four VMs share one process", after offload (the probe's issue 9). */
async function runSharedCell({ guest, modes, contents, sharedVms, workingSetMiB, backingDir, coldCpuShare }: Tables12Options): Promise<CellResult | undefined> {
  if (guest !== 'probe' || !modes.some((m) => m.name === 'offload') || sharedVms === 0) return undefined;
  const label = `[shared] ${sharedVms} x offload ${contents[0]} in one process`;
  progress(`${label}: fresh VMs`);
  return runCell({ guest, mode: 'offload', content: contents[0], vms: sharedVms, workingSetMiB, backingDir, coldCpuShare }, label);
}

/** The cell of `mode` with the same working set and placement, if it ran. */
const findCell = (cells: CellResult[], mode: string, content: Content, vms = 1) => cells.find((c) => c.mode === mode && c.content === content && c.vms === vms);
/** The study's figure for a working set; the study has no agent workload: its cells have nothing beside them. */
const studyOf = (p: PerContent | undefined, c: Content) => (c === 'agent' ? undefined : p?.[c]);
/** A cell's figure per VM, MiB. */
const perVm = (c: CellResult, bytes: number) => bytes / c.vms / MiB;

/** Table 1, and the offloaded VMs in one process under it. */
function printTable1({ cells, shared }: Tables12Run, { guest, workingSetMiB }: Tables12Options): void {
  // The probe's table stays as it was; the Linux guest's says where each VM ran and what a booted guest cost before its data.
  const wide = guest === 'linux';
  process.stdout.write(`Table 1: ${wide ? 'Linux guest, ' : ''}512 MiB VM${wide ? 's' : ''}, ${workingSetMiB} MiB working set, read ${READ_AFTER_MS / 1000} s after the operation (MiB${wide ? ' per VM, its process shared among the VMs in it' : ''}; the study's figure in brackets)\n`);
  const t1: string[][] = [['mode', 'working set', ...(wide ? ['VMs per process'] : []), 'resident (group PSS)', 'guest RAM PSS', ...(wide ? ['booted guest RAM'] : []), 'saving %', 'group memory']];
  for (const c of cells) {
    const study = STUDY_TABLE1[studyRowOf(c.mode)];
    const base = findCell(cells, 'default', c.content, c.vms);
    const saving = c.mode === 'default' || !base ? undefined : savingPercent(base.groupPssBytes, c.groupPssBytes);
    t1.push([
      c.mode,
      c.content,
      ...(wide ? [String(c.vms)] : []),
      beside(perVm(c, c.groupPssBytes), studyOf(study?.residentMiB, c.content)),
      perVm(c, c.guestRamPssBytes).toFixed(1),
      ...(wide ? [perVm(c, c.guestRamPssBootedBytes).toFixed(1)] : []),
      c.mode === 'default' ? 'baseline' : beside(saving, studyOf(study?.savingPercent, c.content)),
      beside(c.groupMemoryBytes === null ? null : perVm(c, c.groupMemoryBytes), studyOf(study?.groupMiB, c.content)),
    ]);
  }
  printTableBlock(t1);
  if (shared) {
    process.stdout.write(`${shared.vms} offloaded VMs in one process (${shared.content}): group PSS ${(shared.groupPssBytes / MiB).toFixed(1)} MiB, ${(shared.groupPssBytes / shared.vms / MiB).toFixed(1)} MiB per VM; guest RAM ${(shared.guestRamPssBytes / MiB).toFixed(1)} MiB in all\n\n`);
  }
}

/** The floors (a) and (c) that Table 2 and the goals are multiples of: the fastest way of each, medians, ms. */
type FloorMs = { a: number; c: number };

/** The floors' table and the two floors it comes to. */
function printFloors(floors: MemoryFloors, workingSetMiB: number): FloorMs {
  const floorMs = { a: fastest(floors.a.uffdCopy2M, floors.a.uffdCopy64K, floors.a.copyFaults), c: fastest(floors.c.readCold, floors.c.readColdDirect, floors.c.readColdUffd) };
  process.stdout.write(`Physical floors for the same ${workingSetMiB} MiB, measured in this run (${floors.runs} runs, files in ${floors.dir}, ${floors.filesystem})\n`);
  printTableBlock(floorRows(floors));
  process.stdout.write(`floor (a), placing it into fresh memory: ${floorMs.a.toFixed(1)} ms; floor (c), reading it back cold from the file: ${floorMs.c.toFixed(1)} ms (the fastest way of each, medians)\n\n`);
  return floorMs;
}

/** The smallest median of the ways the host offers to do one thing (a way it refused is null). */
function fastest(...ways: ({ median: number } | null)[]): number {
  return Math.min(...ways.filter((w): w is { median: number } => w !== null).map((w) => w.median));
}

/** Table 2, of the offload cells, with each added time as a multiple of its floor when measured. */
function printTable2(cells: CellResult[], floorMs: FloorMs | undefined): void {
  const ratio = (ms: number | undefined, floor: 'a' | 'c') => (ms === undefined || !floorMs ? '' : ` = ${(ms / floorMs[floor]).toFixed(2)}x ${floor}`);
  const offloads = cells.filter((c) => c.resumeAndTaskMs !== undefined);
  if (!offloads.length) return;
  process.stdout.write('Table 2: cost of offload (ms; task = digest, rewrite 100%, digest of the working set; study in brackets; x a / x c: multiple of the floor;\n');
  process.stdout.write('"task after resume" minus "task without" is what the guest pays to touch its pages again once they are back)\n');
  const t2: string[][] = [['mode', 'working set', 'task without offload', 'resume + task after', 'added', 'to suspended', 'memory released', 'to resumed', 'task after resume', 'backing MiB']];
  for (const c of offloads) {
    const study = STUDY_TABLE2[studyRowOf(c.mode)];
    const added = c.resumeAndTaskMs! - c.taskMs!;
    t2.push([
      c.mode,
      c.content,
      beside(c.taskMs, studyOf(study?.taskMs, c.content)),
      beside(c.resumeAndTaskMs, studyOf(study?.resumeAndTaskMs, c.content)),
      beside(added, studyOf(study?.addedMs, c.content)) + ratio(added, c.mode === 'offload' || c.mode === 'offload-lazy' ? 'c' : 'a'),
      beside(c.operationMs, studyOf(study?.operationMs, c.content)),
      c.releaseMs === undefined ? 'n/a' : c.releaseMs.toFixed(1),
      c.resumeMs === undefined ? 'n/a' : c.resumeMs.toFixed(1),
      c.resumeMs === undefined ? 'n/a' : (c.resumeAndTaskMs! - c.resumeMs).toFixed(1),
      beside(c.backingBytes === undefined ? undefined : c.backingBytes / MiB, studyOf(study?.backingMiB, c.content)),
    ]);
  }
  printTableBlock(t2);
}

/** Each cell's figure for a goal's key, or undefined where the cell has none. */
function goalFigure(key: Goal['key'], c: CellResult, base: CellResult, nativeFaults: NativeFaultRate | undefined): number | undefined {
  return {
    suspendMs: c.mode === 'idle-release' ? undefined : c.operationMs,
    releaseMs: c.releaseMs,
    addedMs: c.resumeAndTaskMs === undefined ? undefined : c.resumeAndTaskMs - c.taskMs!,
    backingMiB: c.backingBytes === undefined ? undefined : c.backingBytes / MiB,
    savingPercent: savingPercent(base.groupPssBytes, c.groupPssBytes),
    groupPssMiB: perVm(c, c.groupPssBytes),
    taskRatio: c.resumeAndTaskMs === undefined ? undefined : c.resumeAndTaskMs / c.taskMs!,
    guestRamReleasedPercent: c.guestRamPssBeforeBytes > 0 ? (1 - c.guestRamPssBytes / c.guestRamPssBeforeBytes) * 100 : undefined,
    faultServicePercentOfNative: faultPercentOfNative(c, nativeFaults),
    hotRefaultPercentPerSecond: c.hotRefaultPercentPerSecond,
  }[key];
}

/** The goals table of Tables 1-2; returns the goals as JSON. */
function printGoals({ cells, shared, nativeFaults }: Tables12Run, { guest }: Tables12Options, floorMs: FloorMs | undefined): object[] {
  const wide = guest === 'linux';
  process.stdout.write(guest === 'linux' ? 'Goals (issue 24; per VM including its share of the process; figure: ours vs bound)\n' : 'Goals (issues 9 and 12, and those of issue 4 that stand; figure: ours vs bound)\n');
  const goals = new GoalTable(['issue', 'goal', 'mode', 'working set', ...(wide ? ['VMs per process'] : []), 'ours', 'bound']);
  for (const g of guest === 'linux' ? LINUX_GOALS : GOALS) {
    // The agent workload has no goal yet (issue 24): its figures are reported, not judged.
    for (const c of cells.filter((x) => g.modes.includes(x.mode) && x.vms === (g.vms ?? 1) && x.content !== 'agent')) {
      const base = findCell(cells, 'default', c.content, c.vms);
      if (!base) continue;
      const ours = goalFigure(g.key, c, base, nativeFaults);
      if (ours === undefined) continue;
      const bound = 'floor' in g.bound ? (floorMs ? g.bound.times * floorMs[g.bound.floor] : undefined) : c.content === 'agent' ? undefined : g.bound[c.content];
      if (bound === undefined) continue; // a bound on a floor that was not measured
      const boundText = 'floor' in g.bound ? `${g.bound.times}x ${g.bound.floor} = ${bound.toFixed(1)}` : String(bound);
      const met = g.kind === 'max' ? ours <= bound : ours >= bound;
      goals.add([String(g.issue), g.figure, c.mode, c.content, ...(wide ? [String(c.vms)] : []), ours.toFixed(g.key === 'taskRatio' ? 2 : 1), `${g.kind === 'max' ? '<=' : '>='} ${boundText}`], met, { issue: g.issue, goal: g.figure, mode: c.mode, content: c.content, vms: c.vms, ours, bound, kind: g.kind, met });
    }
  }
  if (shared) {
    const ours = shared.groupPssBytes / shared.vms / MiB;
    const goal = `whole VM after offload, ${shared.vms} VMs in one process, MiB per VM`;
    goals.add(['9', goal, 'offload', shared.content, ours.toFixed(1), '<= 8'], ours <= 8, { issue: 9, goal, mode: 'offload', content: shared.content, ours, bound: 8, kind: 'max', met: ours <= 8 });
  }
  goals.print();
  return goals.results;
}
