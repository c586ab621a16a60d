/**
 * The process of one cell of Tables 1 and 2 (`pvisor bench memory-cell CONFIG`), in the cell's
 * cgroup: it starts fresh VMs, fills their working sets, applies the mode's operation and tells
 * the parent, by lines of JSON, when to read the group from outside; for offload modes it then
 * times Table 2's task after the resume, for cold compression the faults of the stored blocks
 * (./tables12.ts's header says what each reading means).
 */
import { createHash } from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';
import { LinuxWorkingSet } from '../guest/linux-workset';
import type { FillOptions, RewriteOptions, TouchOptions } from '../guest/probe-client';
import { ColdCompression } from '../memory/strategies/cold-compression';
import type { MemoryStrategy } from '../memory/strategy';
import { Vm } from '../vm';
import { AgentSession, agentRootfsImage } from './agent-workload';
import { parentLink, type ParentLink } from './cell-process';
import { COLD_MIN_SETTLE_MS, COLD_SETTLED_MS, HOT_MIB, HOT_WINDOW_MS, MIX_SETTLE_MS, MODES, READ_AFTER_MS, SEEDS, type BenchGuest, type CellConfig, type Content } from './memory-modes';

const MiB = 2 ** 20;

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
      await vm.stop();
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

/** `pvisor bench memory-cell CONFIG`: runs inside the cell's process: fresh VMs, talking to the parent by lines of JSON. */
export async function memoryCell(config: CellConfig): Promise<void> {
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
    for (const v of vms) await v.stop();
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
