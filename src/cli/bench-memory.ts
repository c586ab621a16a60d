/**
 * `pvisor bench memory`: Tables 1 and 2 of the reference study, measured on pvisor, on the probe
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
 * cells, the same run measures the physical floors for the working set (bench-floors.ts), and
 * Table 2 prints pvisor's times as multiples of them.
 *
 * Cold compression cells run no operation: the VM idles (the mix cell reads its first 16 MiB
 * over and over) until the compressed store stops growing, then the same 5 s reading; after it,
 * a host thread touches one byte of every stored block, timing the faults that the native server
 * answers (decompress, check, UFFDIO_COPY) against a native userfaultfd loop that answers the
 * same touches with UFFDIO_COPY alone (native-prebuilds/bench/uffd-fault-loop.c), built and run
 * in the same run; then the guest's digest must equal the one taken before.
 */
import { createHash } from 'node:crypto';
import { existsSync, mkdirSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { InvalidOptionError } from '../errors';
import { DEFAULT_BACKING_DIR } from '../memory/backing-file';
import { processResident } from '../memory-usage';
import { beside, filesystemOf, printTable as printRows } from './bench';
import { floorRows, measureMemoryFloors, measureNativeFaultRate, type MemoryFloors, type NativeFaultRate } from './bench-floors';
import { ColdCompression } from '../memory/strategies/cold-compression';
import { CompressedOffload } from '../memory/strategies/compressed-offload';
import { IdleRelease } from '../memory/strategies/idle-release';
import { LinuxWorkingSet } from '../guest/linux-workset';
import type { FillOptions, RewriteOptions, TouchOptions } from '../guest/probe-client';
import { Offload } from '../memory/strategies/offload';
import type { MemoryStrategy, StrategyStats } from '../memory/strategy';
import { parseSize } from '../units';
import { Vm } from '../vm';
import { AGENT_ROOTFS_SCRIPT, AgentSession, agentRootfsImage } from './agent-workload';
import { CellCgroup } from './cell-cgroup';
import { CellProcess, parentLink, type ParentLink } from './cell-process';
import { GOALS, LINUX_GOALS, STUDY_TABLE1, STUDY_TABLE2, savingPercent, studyRowOf, type PerContent } from './study-figures';
import { parseUsage, UsageError } from './usage';

const MiB = 2 ** 20;
const STUDY_WORKING_SET_MIB = 64;
const READ_AFTER_MS = 5000;
/** `compressible` (distinct pages that lz4 shrinks to about 31%) is the study's extra cold case. */
const SEEDS = { repetitive: 1, random: 42, compressible: 7 } as const;
/** Short, so that a cell settles in seconds; what it measures does not depend on it. */
const BENCH_COLD_AFTER_MS = 2000;
/** ColdCompression's default cpuShare (cold-compression.ts). */
const DEFAULT_COLD_CPU_SHARE = 0.05;
/** The mix cell's hot part, read over and over while the rest goes cold (the study's case). */
const HOT_MIB = 16;
/** A cold cell is settled when its store has not grown for this long... */
const COLD_SETTLED_MS = 3000;
/** ...and not before this long after the fill (a few scans past coldAfter)... */
const COLD_MIN_SETTLE_MS = BENCH_COLD_AFTER_MS + 5000;
/**
 * ...or, in the mix cell, this long: the hot part has come back a few times by then and waits
 * 4^k x coldAfter before the next try. Its refaults are then counted over HOT_WINDOW_MS.
 */
const MIX_SETTLE_MS = 45_000;
const HOT_WINDOW_MS = 60_000;
/**
 * A cell's working set: data of one of the study's kinds that pvisor-workset (or the probe)
 * holds, or `agent`, the agent workload (./agent-workload.ts), whose heap is its working set.
 */
type Content = keyof typeof SEEDS | 'agent';

/** A mode of Table 1: the strategies a VM starts with and what is done after the fill. */
interface Mode {
  name: string;
  strategies(backingDir: string, coldCpuShare: number): MemoryStrategy[];
  operation: 'none' | 'release' | 'suspend' | 'cold' | 'cold-mix';
}

const MODES: Mode[] = [
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
const LINUX_MODES = ['default', 'idle-release', 'cold-compression', 'offload', 'compressed-offload'];

/** What the parent sends a cell, as JSON on its command line. */
interface CellConfig {
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
interface CellResult {
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

const progress = (line: string) => process.stderr.write(`bench: ${line}\n`);
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** The guests the tables run on: the probe (the memory layer's microbenchmark) or the shipped Linux guest. */
export type BenchGuest = 'probe' | 'linux';

/**
 * What a cell does to a VM's working set: the probe's own ops, or `pvisor-workset` in the Linux
 * guest, which takes the same options and holds the same content in a process's memory.
 */
interface CellWorkingSet {
  fill(options: FillOptions): Promise<unknown>;
  rewrite(options: RewriteOptions): Promise<unknown>;
  touch(options: TouchOptions): Promise<unknown>;
  digest(): Promise<{ hex: string }>;
  /** The probe reports the range free; the Linux program frees it and the guest reports it. */
  release(): Promise<unknown>;
}

/** A cell's VM and its working set. */
interface CellVm {
  vm: Vm;
  ws: CellWorkingSet;
}

/**
 * The agent workload as a cell's working set: the program compiled its project and holds the
 * result on its heap from its ready line on, so there is nothing to fill. Table 2's task is its
 * `work` (compile again from scratch, keep the new program); its digest is what it holds (files,
 * source files, outputs), which an offload must bring back unchanged.
 */
class AgentCellWorkload implements CellWorkingSet {
  constructor(
    private readonly vm: Vm,
    private readonly session: AgentSession,
  ) {}

  async fill(): Promise<void> {}

  async rewrite(): Promise<void> {
    await this.session.request('work', { timeoutMs: AGENT_REQUEST_TIMEOUT_MS });
  }

  async touch(): Promise<void> {
    await this.session.status({ timeoutMs: AGENT_REQUEST_TIMEOUT_MS });
  }

  async digest(): Promise<{ hex: string }> {
    const s = await this.session.request('status', { timeoutMs: AGENT_REQUEST_TIMEOUT_MS });
    return { hex: createHash('sha256').update(JSON.stringify([s.files, s.sourceFiles, s.outputs])).digest('hex').slice(0, 16) };
  }

  /** An idle agent frees nothing of its own: the guest drops its page cache, and reports it free. */
  async release(): Promise<void> {
    const r = await this.vm.exec(['sh', '-c', 'sync; echo 3 > /proc/sys/vm/drop_caches'], { timeoutMs: AGENT_REQUEST_TIMEOUT_MS });
    if (r.exitCode !== 0) throw new Error(`dropping the guest's caches failed: ${r.stderr.trim()}`);
  }
}

/** The agent program's answers and its start, in the nested harness 10-50x slower than on hardware. */
const AGENT_REQUEST_TIMEOUT_MS = 600_000;
const AGENT_READY_TIMEOUT_MS = 1_800_000;

/** A fresh 512 MiB / 2 vCPU VM of `guest` with `strategies`, booted and ready for its working set. */
async function startCellVm(guest: BenchGuest, strategies: MemoryStrategy[], content: Content): Promise<CellVm> {
  if (content === 'agent') {
    // The image read-only, as a fleet of agents shares one; the program's files are page cache.
    const vm = await Vm.start({ memory: '512MiB', vcpus: 2, strategies, rootfs: { path: agentRootfsImage(), readOnly: true }, bootTimeoutMs: 600_000 });
    try {
      return { vm, ws: new AgentCellWorkload(vm, await AgentSession.start(vm, { readyTimeoutMs: AGENT_READY_TIMEOUT_MS })) };
    } catch (e) {
      vm.stop();
      throw e;
    }
  }
  if (guest === 'probe') {
    const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, strategies });
    return { vm, ws: vm.probe };
  }
  // A boot takes seconds natively and minutes in the nested harness.
  const vm = await Vm.start({ memory: '512MiB', vcpus: 2, strategies, bootTimeoutMs: 600_000 });
  return { vm, ws: await LinuxWorkingSet.start(vm) };
}

/** The task of Table 2 (digest, rewrite all, digest); returns its time and the first digest. */
async function task(ws: CellWorkingSet): Promise<{ ms: number; firstDigest: string }> {
  const t0 = performance.now();
  const first = await ws.digest();
  await ws.rewrite({ fraction: 1 });
  await ws.digest();
  return { ms: performance.now() - t0, firstDigest: first.hex };
}

/** The Linux guest's working set digests as the host's model says (the probe's are compared before and after). */
async function checkModel(ws: CellWorkingSet): Promise<void> {
  if (ws instanceof LinuxWorkingSet) await ws.check();
}

/** Runs inside the cell's process: fresh VMs, talking to the parent by lines of JSON. */
async function cellChild(config: CellConfig): Promise<void> {
  const mode = MODES.find((m) => m.name === config.mode);
  if (!mode) throw new Error(`unknown mode ${config.mode}`);
  const link = parentLink();
  const say = link.say;
  const cellVms: CellVm[] = [];
  const vms: Vm[] = [];
  try {
    let firstStrategies: MemoryStrategy[] = [];
    for (let i = 0; i < config.vms; i++) {
      const strategies = mode.strategies(config.backingDir, config.coldCpuShare);
      if (i === 0) firstStrategies = strategies;
      const c = await startCellVm(config.guest, strategies, config.content);
      cellVms.push(c);
      vms.push(c.vm);
    }
    const guestRamPssBootedBytes = vms.reduce((sum, v) => sum + v.memoryUsage().guestRamPssBytes, 0);
    const [{ vm, ws }] = cellVms;
    const content = config.content;
    if (content !== 'agent') for (const c of cellVms) await c.ws.fill({ sizeMiB: config.workingSetMiB, content, seed: SEEDS[content] });
    const filledAt = performance.now();
    say({ event: 'filled' });
    // Table 2's task is timed on a lone VM only.
    const timed = mode.operation === 'suspend' && vms.length === 1;
    let taskMs: number | undefined;
    let digestBefore: string | undefined;
    if (timed) {
      taskMs = (await task(ws)).ms;
      digestBefore = (await ws.digest()).hex;
    }
    const guestRamPssBeforeBytes = vms.reduce((sum, v) => sum + v.memoryUsage().guestRamPssBytes, 0);
    if (mode.operation === 'cold' || mode.operation === 'cold-mix') {
      const cold = firstStrategies.find((s): s is ColdCompression => s instanceof ColdCompression)!;
      await coldCell(vm, ws, cold, config, mode.operation === 'cold-mix', filledAt, guestRamPssBeforeBytes, guestRamPssBootedBytes, link);
      return;
    }
    let operationMs = 0;
    let releaseMs: number | undefined;
    for (const { vm: v, ws: w } of cellVms) {
      const t0 = performance.now();
      if (mode.operation === 'release') await w.release();
      if (mode.operation === 'suspend') await v.suspend();
      operationMs += performance.now() - t0;
      if (mode.operation === 'suspend') {
        await v.memoryReleased();
        releaseMs = (releaseMs ?? 0) + performance.now() - t0;
      }
    }
    operationMs /= vms.length;
    if (releaseMs !== undefined) releaseMs /= vms.length;
    say({ event: 'operated', operationMs, releaseMs });
    await sleep(READ_AFTER_MS);
    const guestRamPssBytes = vms.reduce((sum, v) => sum + v.memoryUsage().guestRamPssBytes, 0);
    say({ event: 'reading', guestRamPssBytes, guestRamPssBeforeBytes, guestRamPssBootedBytes, strategies: vm.memoryUsage().strategies, operationMs, releaseMs, taskMs });
    await link.next(); // the parent has read the group's figures
    let resumeAndTaskMs: number | undefined;
    let resumeMs: number | undefined;
    if (timed) {
      const t1 = performance.now();
      await vm.resume();
      resumeMs = performance.now() - t1;
      const after = await task(ws);
      resumeAndTaskMs = performance.now() - t1;
      if (after.firstDigest !== digestBefore) throw new Error(`digest after resume ${after.firstDigest} != ${digestBefore} before the offload`);
    }
    // Every Linux VM of the cell still holds what the host's model says (resumed where suspended).
    if (config.guest === 'linux' && mode.operation !== 'release') {
      for (const c of cellVms) {
        if (c.vm.state === 'suspended') await c.vm.resume();
        await checkModel(c.ws);
      }
    }
    say({ event: 'done', resumeAndTaskMs, resumeMs, strategies: vm.memoryUsage().strategies });
  } finally {
    for (const v of vms) v.stop();
  }
}

const coldFigures = (vm: Vm) => vm.memoryUsage().strategies.find((s) => s.strategy === 'cold-compression')!.figures;

/** A cold compression cell, after the fill (see the header). */
async function coldCell(vm: Vm, ws: CellWorkingSet, cold: ColdCompression, config: CellConfig, mix: boolean, filledAt: number, guestRamPssBeforeBytes: number, guestRamPssBootedBytes: number, link: ParentLink): Promise<void> {
  const say = link.say;
  const digestBefore = (await ws.digest()).hex;
  let hot = mix;
  const hotLoop = (async () => {
    while (hot) {
      await ws.touch({ hotMiB: HOT_MIB });
      await sleep(100);
    }
  })();
  // Settled: nothing more stored for a while; operationMs is when the store last grew, from the
  // end of the fill.
  const t0 = filledAt;
  let stored = -1;
  let grewAt = t0;
  const minSettleMs = mix ? MIX_SETTLE_MS : COLD_MIN_SETTLE_MS;
  while (performance.now() - grewAt < COLD_SETTLED_MS || performance.now() - t0 < minSettleMs) {
    if (performance.now() - t0 > 180_000) break;
    const now = coldFigures(vm).blocksStored;
    if (now !== stored) {
      stored = now;
      grewAt = performance.now();
    }
    await sleep(250);
  }
  const operationMs = grewAt - t0;
  say({ event: 'operated', operationMs });
  // Once settled, how much of the hot part still comes back: pages per second, % of its pages.
  let hotRefaultPercentPerSecond: number | undefined;
  if (mix) {
    const refaultsBefore = coldFigures(vm).refaults;
    const w0 = performance.now();
    await sleep(HOT_WINDOW_MS);
    const hotPages = (HOT_MIB * MiB) / 4096;
    const pagesBack = ((coldFigures(vm).refaults - refaultsBefore) * (64 * 1024)) / 4096;
    hotRefaultPercentPerSecond = (pagesBack / hotPages / ((performance.now() - w0) / 1000)) * 100;
  }
  const busy = () => coldFigures(vm).scanMs + coldFigures(vm).compressMs;
  const busyBefore = busy();
  let t = performance.now();
  await sleep(READ_AFTER_MS);
  const scannerCpuPercent = ((busy() - busyBefore) / (performance.now() - t)) * 100;
  say({ event: 'reading', guestRamPssBytes: vm.memoryUsage().guestRamPssBytes, guestRamPssBeforeBytes, guestRamPssBootedBytes, strategies: vm.memoryUsage().strategies, operationMs, scannerCpuPercent, hotRefaultPercentPerSecond });
  await link.next(); // the parent has read the group's figures
  hot = false;
  await hotLoop;
  // Faults served as the native loop serves them: a host thread touching one byte per block.
  const touched = cold.touchStoredBlocks();
  const faultsPerSecond = touched.blocks / (Math.max(touched.ms, 0.001) / 1000);
  const digestAfter = (await ws.digest()).hex;
  if (digestAfter !== digestBefore) throw new Error(`digest after the cold blocks came back ${digestAfter} != ${digestBefore} before`);
  await checkModel(ws);
  say({ event: 'done', faultsTimed: touched.blocks, faultsPerSecond, strategies: vm.memoryUsage().strategies });
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

function printTable(rows: string[][]): void {
  printRows(rows);
  process.stdout.write('\n');
}

/** Options of Tables 1 and 2 (`--table` and `--json` are the dispatcher's, {@link cmdBenchMemory}). */
export const TABLE12_OPTIONS = {
  // The probe guest (default), or the shipped Linux guest with pvisor-workset holding the data.
  guest: { type: 'string', default: 'probe' },
  // Default: every mode on the probe, the study's on Linux (LINUX_MODES).
  modes: { type: 'string' },
  // VMs per process of each Table 1 cell: 1 is the study's placement; the Linux guest also runs 8
  // in one process (an orchestrator embedding the SDK) by default.
  placements: { type: 'string' },
  contents: { type: 'string', default: 'repetitive,random' },
  'backing-dir': { type: 'string', default: join(DEFAULT_BACKING_DIR, 'pvisor-bench-backing') },
  // The study's cells use 64 MiB; a smaller set makes a quick check (the study's figures then
  // do not compare).
  'working-set': { type: 'string', default: `${STUDY_WORKING_SET_MIB}MiB` },
  // Also N offloaded VMs in one process (the SDK's case), read per VM; 0 skips it.
  'shared-vms': { type: 'string', default: '4' },
  // Runs of each physical floor, measured first in the same run (0 skips them).
  'floor-runs': { type: 'string', default: '5' },
  // ColdCompression's share of a CPU in the cold cells: the product's default, or more where the
  // host is much slower than hardware (the nested harness), so that compression keeps up within
  // the study's reading time as it does on hardware at the default (docs/cold-compression.md).
  'cold-cpu-share': { type: 'string', default: String(DEFAULT_COLD_CPU_SHARE) },
} as const;

/** Tables 1 and 2: measures, prints the tables, returns the JSON. */
async function benchMemory(argv: string[]): Promise<object> {
  const { values, guest, modes, placements, contents, workingSetMiB, backingDir, sharedVms, floorRuns, coldCpuShare } = parseUsage('bench memory', () => {
    const { values } = parseArgs({ args: argv, options: TABLE12_OPTIONS, strict: true });
    if (values.guest !== 'probe' && values.guest !== 'linux') throw new InvalidOptionError('--guest', `expected probe or linux, got ${JSON.stringify(values.guest)}`);
    const guest: BenchGuest = values.guest;
    const modes = (values.modes ?? (guest === 'linux' ? LINUX_MODES : MODES.map((m) => m.name)).join(',')).split(',').map((name) => {
      const m = MODES.find((x) => x.name === name);
      if (!m) throw new InvalidOptionError('--modes', `unknown mode ${name}; modes: ${MODES.map((x) => x.name).join(', ')}`);
      return m;
    });
    if (!modes.some((m) => m.name === 'default')) modes.unshift(MODES[0]); // savings need the baseline
    const contents = values.contents.split(',') as Content[];
    for (const c of contents) {
      if (c === 'agent') {
        if (guest !== 'linux') throw new InvalidOptionError('--contents', 'agent runs in the Linux guest: add --guest linux');
        if (!existsSync(agentRootfsImage())) throw new InvalidOptionError('--contents', `agent needs the agent rootfs ${agentRootfsImage()}: bash ${AGENT_ROOTFS_SCRIPT} builds it (as root, about 5 minutes)`);
      } else if (!(c in SEEDS)) throw new InvalidOptionError('--contents', `unknown working set ${c}; use repetitive, random, compressible or agent (--guest linux)`);
    }
    const workingSetMiB = parseSize('--working-set', values['working-set']) / MiB;
    if (!Number.isInteger(workingSetMiB) || workingSetMiB < 1) throw new InvalidOptionError('--working-set', 'expected whole MiB, at least 1MiB');
    const backingDir = resolve(values['backing-dir']);
    const sharedVms = Number(values['shared-vms']);
    if (!Number.isInteger(sharedVms) || sharedVms < 0 || sharedVms > 8) throw new InvalidOptionError('--shared-vms', 'expected 0 to 8');
    const floorRuns = Number(values['floor-runs']);
    if (!Number.isInteger(floorRuns) || floorRuns < 0 || floorRuns > 100) throw new InvalidOptionError('--floor-runs', 'expected 0 to 100');
    const placements = (values.placements ?? (guest === 'linux' ? '1,8' : '1')).split(',').map(Number);
    for (const n of placements) if (!Number.isInteger(n) || n < 1 || n > 8) throw new InvalidOptionError('--placements', 'expected a list of VMs per process, each 1 to 8');
    const coldCpuShare = Number(values['cold-cpu-share']);
    if (!(coldCpuShare >= 0.001 && coldCpuShare <= 1)) throw new InvalidOptionError('--cold-cpu-share', 'expected 0.001 to 1');
    return { values, guest, modes, placements, contents, workingSetMiB, backingDir, sharedVms, floorRuns, coldCpuShare };
  });
  if (workingSetMiB !== STUDY_WORKING_SET_MIB) progress(`warning: the study's cells use ${STUDY_WORKING_SET_MIB} MiB; with ${workingSetMiB} MiB its figures do not compare`);
  mkdirSync(backingDir, { recursive: true });
  const fsType = filesystemOf(backingDir);
  if (fsType === 'tmpfs') progress(`warning: ${backingDir} is on tmpfs, so offloaded pages stay in RAM (as shmem); use --backing-dir on a disk`);
  let floors: MemoryFloors | undefined;
  if (floorRuns > 0) {
    progress(`physical floors for ${workingSetMiB} MiB, ${floorRuns} runs, files in ${backingDir}`);
    try {
      floors = await measureMemoryFloors({ dir: backingDir, sizeMiB: workingSetMiB, runs: floorRuns });
    } catch (e) {
      // The cells can still be measured (e.g. on tmpfs, which the floors refuse): say why not.
      progress(`warning: no physical floors, so no ratios or floor-bound goals: ${(e as Error).message}`);
    }
  }
  let nativeFaults: NativeFaultRate | undefined;
  if (modes.some((m) => m.operation === 'cold' || m.operation === 'cold-mix')) {
    progress(`native userfaultfd fault loop, ${workingSetMiB} MiB in 64 KiB blocks`);
    try {
      nativeFaults = await measureNativeFaultRate(workingSetMiB, 64, 5);
    } catch (e) {
      progress(`warning: no native fault loop, so no fault service ratio: ${(e as Error).message}`);
    }
  }
  const probe = CellCgroup.create(`pvisor-bench-${process.pid}-probe`);
  if (typeof probe === 'string') progress(`group memory will read n/a: ${probe}`);
  else probe.remove();

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
  // The goal "<= 8 MiB per VM when four VMs share one process", after offload (the probe's issue 9).
  let shared: CellResult | undefined;
  if (guest === 'probe' && modes.some((m) => m.name === 'offload') && sharedVms > 0) {
    const label = `[shared] ${sharedVms} x offload ${contents[0]} in one process`;
    progress(`${label}: fresh VMs`);
    shared = await runCell({ guest, mode: 'offload', content: contents[0], vms: sharedVms, workingSetMiB, backingDir, coldCpuShare }, label);
  }

  const find = (mode: string, content: Content, vms = 1) => cells.find((c) => c.mode === mode && c.content === content && c.vms === vms);
  // The study has no agent workload: its cells have nothing beside them.
  const pick = (p: PerContent | undefined, c: Content) => (c === 'agent' ? undefined : p?.[c]);
  const perVm = (c: CellResult, bytes: number) => bytes / c.vms / MiB;
  // The probe's table stays as it was; the Linux guest's says where each VM ran and what a booted guest cost before its data.
  const wide = guest === 'linux';
  process.stdout.write(`Table 1: ${wide ? 'Linux guest, ' : ''}512 MiB VM${wide ? 's' : ''}, ${workingSetMiB} MiB working set, read ${READ_AFTER_MS / 1000} s after the operation (MiB${wide ? ' per VM, its process shared among the VMs in it' : ''}; the study's figure in brackets)\n`);
  const t1: string[][] = [['mode', 'working set', ...(wide ? ['VMs per process'] : []), 'resident (group PSS)', 'guest RAM PSS', ...(wide ? ['booted guest RAM'] : []), 'saving %', 'group memory']];
  for (const c of cells) {
    const study = STUDY_TABLE1[studyRowOf(c.mode)];
    const base = find('default', c.content, c.vms);
    const saving = c.mode === 'default' || !base ? undefined : savingPercent(base.groupPssBytes, c.groupPssBytes);
    t1.push([
      c.mode,
      c.content,
      ...(wide ? [String(c.vms)] : []),
      beside(perVm(c, c.groupPssBytes), pick(study?.residentMiB, c.content)),
      perVm(c, c.guestRamPssBytes).toFixed(1),
      ...(wide ? [perVm(c, c.guestRamPssBootedBytes).toFixed(1)] : []),
      c.mode === 'default' ? 'baseline' : beside(saving, pick(study?.savingPercent, c.content)),
      beside(c.groupMemoryBytes === null ? null : perVm(c, c.groupMemoryBytes), pick(study?.groupMiB, c.content)),
    ]);
  }
  printTable(t1);
  if (shared) {
    process.stdout.write(`${shared.vms} offloaded VMs in one process (${shared.content}): group PSS ${(shared.groupPssBytes / MiB).toFixed(1)} MiB, ${(shared.groupPssBytes / shared.vms / MiB).toFixed(1)} MiB per VM; guest RAM ${(shared.guestRamPssBytes / MiB).toFixed(1)} MiB in all\n\n`);
  }

  const colds = cells.filter((c) => c.faultsPerSecond !== undefined);
  // A rate over a handful of blocks (random content leaves almost nothing stored) says nothing.
  const timedEnough = (c: CellResult) => c.faultsPerSecond !== undefined && (c.faultsTimed ?? 0) >= 64;
  const faultPercent = (c: CellResult) => (nativeFaults && timedEnough(c) ? (c.faultsPerSecond! / nativeFaults.faultsPerSecond.median) * 100 : undefined);
  if (colds.length) {
    const native = nativeFaults ? `${Math.round(nativeFaults.faultsPerSecond.median)} faults/s (median of ${nativeFaults.faultsPerSecond.runsMs.length} runs)` : 'not measured';
    process.stdout.write(`Cold compression (coldAfter ${BENCH_COLD_AFTER_MS / 1000} s, cpuShare ${coldCpuShare}; "settled" = from the fill until the store last grew; hot refaults counted over ${HOT_WINDOW_MS / 1000} s from ${MIX_SETTLE_MS / 1000} s after the fill; native userfaultfd loop, 64 KiB blocks, this run: ${native})\n`);
    const tc: string[][] = [['mode', 'working set', 'settled after ms', 'blocks stored', 'store MiB', 'incompressible blocks', 'scanner CPU % at idle', 'hot refaults, % of hot pages/s', 'faults/s (host thread touching)', '% of native']];
    for (const c of colds) {
      const f = c.strategies.find((s) => s.strategy === 'cold-compression')?.figures ?? {};
      const pct = faultPercent(c);
      tc.push([c.mode, c.content, c.operationMs.toFixed(0), String(f.blocksStored ?? 'n/a'), ((f.storeBytes ?? 0) / MiB).toFixed(2), String(f.blocksIncompressible ?? 'n/a'), (c.scannerCpuPercent ?? 0).toFixed(2), c.hotRefaultPercentPerSecond === undefined ? 'n/a' : c.hotRefaultPercentPerSecond.toFixed(3), timedEnough(c) ? `${Math.round(c.faultsPerSecond!)} (${c.faultsTimed} blocks)` : `n/a (${c.faultsTimed} blocks)`, pct === undefined ? 'n/a' : pct.toFixed(0)]);
    }
    printTable(tc);
  }

  const floorOf = floors && { a: fastest(floors.a.uffdCopy2M, floors.a.uffdCopy64K, floors.a.copyFaults), c: fastest(floors.c.readCold, floors.c.readColdDirect, floors.c.readColdUffd) };
  if (floors) {
    process.stdout.write(`Physical floors for the same ${workingSetMiB} MiB, measured in this run (${floors.runs} runs, files in ${floors.dir}, ${floors.filesystem})\n`);
    printTable(floorRows(floors));
    process.stdout.write(`floor (a), placing it into fresh memory: ${floorOf!.a.toFixed(1)} ms; floor (c), reading it back cold from the file: ${floorOf!.c.toFixed(1)} ms (the fastest way of each, medians)\n\n`);
  }
  const ratio = (ms: number | undefined, floor: 'a' | 'c') => (ms === undefined || !floorOf ? '' : ` = ${(ms / floorOf[floor]).toFixed(2)}x ${floor}`);
  const offloads = cells.filter((c) => c.resumeAndTaskMs !== undefined);
  if (offloads.length) {
    process.stdout.write('Table 2: cost of offload (ms; task = digest, rewrite 100%, digest of the working set; study in brackets; x a / x c: multiple of the floor;\n');
    process.stdout.write('"task after resume" minus "task without" is what the guest pays to touch its pages again once they are back)\n');
    const t2: string[][] = [['mode', 'working set', 'task without offload', 'resume + task after', 'added', 'to suspended', 'memory released', 'to resumed', 'task after resume', 'backing MiB']];
    for (const c of offloads) {
      const study = STUDY_TABLE2[studyRowOf(c.mode)];
      const added = c.resumeAndTaskMs! - c.taskMs!;
      t2.push([
        c.mode,
        c.content,
        beside(c.taskMs, pick(study?.taskMs, c.content)),
        beside(c.resumeAndTaskMs, pick(study?.resumeAndTaskMs, c.content)),
        beside(added, pick(study?.addedMs, c.content)) + ratio(added, c.mode === 'offload' || c.mode === 'offload-lazy' ? 'c' : 'a'),
        beside(c.operationMs, pick(study?.operationMs, c.content)),
        c.releaseMs === undefined ? 'n/a' : c.releaseMs.toFixed(1),
        c.resumeMs === undefined ? 'n/a' : c.resumeMs.toFixed(1),
        c.resumeMs === undefined ? 'n/a' : (c.resumeAndTaskMs! - c.resumeMs).toFixed(1),
        beside(c.backingBytes === undefined ? undefined : c.backingBytes / MiB, pick(study?.backingMiB, c.content)),
      ]);
    }
    printTable(t2);
  }

  process.stdout.write(guest === 'linux' ? 'Goals (issue 24; per VM including its share of the process; figure: ours vs bound)\n' : 'Goals (issues 9 and 12, and those of issue 4 that stand; figure: ours vs bound)\n');
  const goals: string[][] = [['issue', 'goal', 'mode', 'working set', ...(wide ? ['VMs per process'] : []), 'ours', 'bound', 'met']];
  const goalResults: object[] = [];
  for (const g of guest === 'linux' ? LINUX_GOALS : GOALS) {
    // The agent workload has no goal yet (issue 24): its figures are reported, not judged.
    for (const c of cells.filter((x) => g.modes.includes(x.mode) && x.vms === (g.vms ?? 1) && x.content !== 'agent')) {
      const base = find('default', c.content, c.vms);
      if (!base) continue;
      const ours = {
        suspendMs: c.mode === 'idle-release' ? undefined : c.operationMs,
        releaseMs: c.releaseMs,
        addedMs: c.resumeAndTaskMs === undefined ? undefined : c.resumeAndTaskMs - c.taskMs!,
        backingMiB: c.backingBytes === undefined ? undefined : c.backingBytes / MiB,
        savingPercent: savingPercent(base.groupPssBytes, c.groupPssBytes),
        groupPssMiB: perVm(c, c.groupPssBytes),
        taskRatio: c.resumeAndTaskMs === undefined ? undefined : c.resumeAndTaskMs / c.taskMs!,
        guestRamReleasedPercent: c.guestRamPssBeforeBytes > 0 ? (1 - c.guestRamPssBytes / c.guestRamPssBeforeBytes) * 100 : undefined,
        faultServicePercentOfNative: faultPercent(c),
        hotRefaultPercentPerSecond: c.hotRefaultPercentPerSecond,
      }[g.key];
      if (ours === undefined) continue;
      const bound = 'floor' in g.bound ? (floorOf ? g.bound.times * floorOf[g.bound.floor] : undefined) : c.content === 'agent' ? undefined : g.bound[c.content];
      if (bound === undefined) continue; // a bound on a floor that was not measured
      const boundText = 'floor' in g.bound ? `${g.bound.times}x ${g.bound.floor} = ${bound.toFixed(1)}` : String(bound);
      const met = g.kind === 'max' ? ours <= bound : ours >= bound;
      goals.push([String(g.issue), g.figure, c.mode, c.content, ...(wide ? [String(c.vms)] : []), ours.toFixed(g.key === 'taskRatio' ? 2 : 1), `${g.kind === 'max' ? '<=' : '>='} ${boundText}`, met ? 'yes' : 'NO']);
      goalResults.push({ issue: g.issue, goal: g.figure, mode: c.mode, content: c.content, vms: c.vms, ours, bound, kind: g.kind, met });
    }
  }
  if (shared) {
    const ours = shared.groupPssBytes / shared.vms / MiB;
    goals.push(['9', `whole VM after offload, ${shared.vms} VMs in one process, MiB per VM`, 'offload', shared.content, ours.toFixed(1), '<= 8', ours <= 8 ? 'yes' : 'NO']);
    goalResults.push({ issue: 9, goal: `whole VM after offload, ${shared.vms} VMs in one process, MiB per VM`, mode: 'offload', content: shared.content, ours, bound: 8, kind: 'max', met: ours <= 8 });
  }
  printTable(goals);
  process.stdout.write(`Backing files in ${backingDir} (${fsType}). Resident and group memory are never added together.\n`);

  const json = { setup: { guest, placements, memoryMiB: 512, vcpus: 2, workingSetMiB, readAfterMs: READ_AFTER_MS, backingDir, backingFilesystem: fsType, coldAfterMs: BENCH_COLD_AFTER_MS, coldCpuShare }, floors, floorMs: floorOf, nativeFaults, cells, sharedProcess: shared, goals: goalResults };
  return json;
}

/** The smallest median of the ways the host offers to do one thing (a way it refused is null). */
function fastest(...ways: ({ median: number } | null)[]): number {
  return Math.min(...ways.filter((w): w is { median: number } => w !== null).map((w) => w.median));
}

/** Entry of `pvisor bench memory` and of its internal cell command. */
export async function cmdBenchMemory(argv: string[], cell: boolean): Promise<number> {
  if (cell) {
    await cellChild(JSON.parse(argv[0]) as CellConfig);
    return 0;
  }
  const { TABLE3_OPTIONS, benchTable3, parseTable3Options } = await import('./bench-table3');
  const { values, tokens } = parseUsage('bench memory', () =>
    parseArgs({
      args: argv,
      options: { table: { type: 'string', default: '1,2' }, json: { type: 'string' }, ...TABLE12_OPTIONS, ...TABLE3_OPTIONS },
      strict: true,
      tokens: true,
    }),
  );
  const tables = new Set(values.table.split(','));
  for (const t of tables) if (!['1', '2', '3'].includes(t)) throw new UsageError('pvisor', 'bench memory', `--table: expected a list of 1, 2 and 3, got ${JSON.stringify(values.table)}`);
  // Tables 1 and 2 come from the same cells: either selects both.
  const want12 = tables.has('1') || tables.has('2');
  const want3 = tables.has('3');
  // Each table gets the options it knows; one the selected tables do not know is refused.
  const given = tokens.filter((t) => t.kind === 'option' && t.name !== 'table' && t.name !== 'json');
  const argsOf = (names: object) => given.flatMap((t) => (t.kind === 'option' && t.name in names ? [`--${t.name}`, ...(t.value === undefined ? [] : [t.value])] : []));
  for (const t of given) {
    if (t.kind !== 'option') continue;
    if (!(want12 && t.name in TABLE12_OPTIONS) && !(want3 && t.name in TABLE3_OPTIONS)) throw new UsageError('pvisor', 'bench memory', `--${t.name}: is not an option of --table ${values.table}`);
  }
  // Table 3's options are checked before Tables 1-2 spend their minutes.
  const table3 = want3 ? parseUsage('bench memory', () => parseTable3Options(argsOf(TABLE3_OPTIONS))) : undefined;
  const table12 = want12 ? await benchMemory(argsOf(TABLE12_OPTIONS)) : undefined;
  const json3 = table3 ? await benchTable3(table3) : undefined;
  const json = table12 && json3 ? { ...table12, table3: json3 } : (table12 ?? json3);
  if (values.json) writeFileSync(values.json, JSON.stringify(json, null, 2));
  else process.stdout.write(`${JSON.stringify(json)}\n`);
  return 0;
}
