/**
 * `pvisor bench soak`: many suspend/resume cycles of probe VMs, one memory strategy at a time,
 * each cycle checked against the digest the guest reported before the first: a cycle that loses
 * a byte, throws or leaves the VM in another state is a failure. It reports the cycles, the
 * failures, the host process's RSS and PSS before the first cycle and after the last, how much
 * the live JavaScript heap grew in between (read after a full garbage collection at both points),
 * and the time per cycle. RSS grows also by garbage V8 has not needed to collect yet and by memory
 * the allocators keep once grown, and levels off; live heap that keeps growing is a leak of the
 * cycles. Each strategy runs in a process of its own, so that its memory figures are its own.
 */
import { spawnSync } from 'node:child_process';
import { mkdirSync } from 'node:fs';
import { CompressedOffload } from '../memory/strategies/compressed-offload';
import { IdleRelease } from '../memory/strategies/idle-release';
import { Offload } from '../memory/strategies/offload';
import type { MemoryStrategy } from '../memory/strategy';
import { processResident, type ResidentBytes } from '../memory-usage';
import { pvisorNodeEnv } from '../node-flags';
import { Vm } from '../vm';
import { pvisorBenchArgv } from './bins';
import { printTable, progress } from './report';

const MiB = 2 ** 20;
/** Guest RAM of each VM: room for the largest working set the bench takes, and the probe's own. */
const VM_MEMORY_MIB = 128;
/** The largest working set `--working-set` takes, MiB. */
export const MAX_WORKING_SET_MIB = 96;

/** The strategies the soak knows, by name: each makes a VM's composition, backing files in `dir`. */
export const SOAK_STRATEGIES: Record<string, (dir: string) => MemoryStrategy[]> = {
  none: () => [],
  'idle-release': () => [new IdleRelease()],
  'offload-eager': (dir) => [new Offload({ dir })],
  'offload-lazy': (dir) => [new Offload({ dir, reload: 'lazy' })],
  'compressed-offload': (dir) => [new CompressedOffload({ dir })],
};

/** What the cycles of one VM came to. */
export interface VmSoak {
  /** Cycles run (fewer than asked only if the VM ended). */
  cycles: number;
  failures: number;
  /** What the first failure said. */
  firstFailure?: string;
  /** Time of each cycle that completed: suspend, release, resume and the digest, ms. */
  cycleMs: number[];
}

/**
 * Suspends and resumes `vm` `cycles` times, each time waiting until the memory is released
 * (so that a strategy really moves the pages), then checks that the guest's digest is still
 * `digestHex`. A cycle that throws or finds another digest counts as a failure and the run goes
 * on, unless the VM has ended.
 */
export async function soakVm(vm: Vm, digestHex: string, cycles: number, onCycle: (done: number) => void = () => {}): Promise<VmSoak> {
  const out: VmSoak = { cycles: 0, failures: 0, cycleMs: [] };
  for (let i = 0; i < cycles && (vm.state === 'running' || vm.state === 'suspended'); i++) {
    out.cycles++;
    const t0 = performance.now();
    try {
      await vm.suspend();
      await vm.memoryReleased();
      await vm.resume();
      const { hex } = await vm.probe.digest();
      if (hex !== digestHex) throw new Error(`the digest is ${hex}, not ${digestHex}`);
      out.cycleMs.push(performance.now() - t0);
    } catch (e) {
      out.failures++;
      out.firstFailure ??= `cycle ${i + 1}: ${(e as Error).message}`;
      // Left suspended by a failed resume: try to go on from running.
      if (vm.state === 'suspended') await vm.resume().catch(() => {});
    }
    onCycle(out.cycles);
  }
  return out;
}

/** One strategy's run, as its process reports it. */
export interface SoakRun {
  strategy: string;
  vms: number;
  cyclesPerVm: number;
  workingSetMiB: number;
  /** Cycles run over all VMs, and how many failed. */
  cycles: number;
  failures: number;
  firstFailure?: string;
  /** The host process once its VMs are filled, before the first cycle. */
  processBefore: ResidentBytes;
  /** The same process after the last cycle, its VMs resumed and still live. */
  processAfter: ResidentBytes;
  /**
   * The process's RSS every tenth of the cycles (after that many over all VMs, read as the cycle
   * ends): memory that levels off is what allocators and V8 keep once grown, memory that keeps
   * rising is a leak of the cycles. One reading says neither.
   */
  rssByCycles: { cycles: number; rssBytes: number }[];
  /**
   * JavaScript heap in use after a full garbage collection, before the first cycle and after the
   * last; null where the process cannot ask for a collection. (Not external memory: it counts
   * the views of guest RAM, and native buffers whose finalisers run some time after a collection.)
   */
  liveHeapBytes: { before: number; after: number } | null;
  /** Time per cycle over all VMs, ms. */
  cycleMs: { median: number; p99: number; max: number };
  wallMs: number;
}

/** What the parent sends one strategy's process, as JSON on its command line. */
export interface SoakConfig {
  strategy: string;
  vms: number;
  cycles: number;
  workingSetMiB: number;
  dir: string;
}

/** The value below which `p` of the sorted `xs` lie (nearest rank). */
function percentile(sorted: number[], p: number): number {
  if (!sorted.length) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.max(0, Math.ceil(p * sorted.length) - 1))];
}

/** The JavaScript heap in use after a full collection; null without --expose-gc (runSoak gives it). */
function liveHeapBytes(): number | null {
  const gc = (globalThis as { gc?: () => void }).gc;
  if (!gc) return null;
  gc();
  return process.memoryUsage().heapUsed;
}

/** `pvisor bench soak-run CONFIG`: runs one strategy's soak in this process (the child's side). */
export async function soakChild(config: SoakConfig): Promise<SoakRun> {
  const make = SOAK_STRATEGIES[config.strategy];
  const vms: Vm[] = [];
  try {
    for (let i = 0; i < config.vms; i++) {
      const vm = await Vm.start({ guest: 'probe', memory: `${VM_MEMORY_MIB}MiB`, vcpus: 1, name: `soak-${config.strategy}-${i}`, strategies: make(config.dir) });
      vms.push(vm);
      await vm.probe.fill({ sizeMiB: config.workingSetMiB, content: 'random', seed: 1000 + i });
    }
    const digests = await Promise.all(vms.map(async (vm) => (await vm.probe.digest()).hex));
    const liveBefore = liveHeapBytes();
    const processBefore = processResident();
    const t0 = performance.now();
    const total = config.vms * config.cycles;
    let done = 0;
    const step = Math.max(1, Math.round(total / 10));
    const rssByCycles = [{ cycles: 0, rssBytes: processBefore.rssBytes }];
    const results = await Promise.all(
      vms.map((vm, i) =>
        soakVm(vm, digests[i], config.cycles, () => {
          if (++done % step !== 0) return;
          const { rssBytes } = processResident();
          rssByCycles.push({ cycles: done, rssBytes });
          progress(`${config.strategy}: ${done}/${total} cycles, host RSS ${(rssBytes / MiB).toFixed(1)} MiB`);
        }),
      ),
    );
    const wallMs = performance.now() - t0;
    const processAfter = processResident();
    const liveAfter = liveHeapBytes();
    const all = results.flatMap((r) => r.cycleMs).sort((a, b) => a - b);
    return {
      strategy: config.strategy,
      vms: config.vms,
      cyclesPerVm: config.cycles,
      workingSetMiB: config.workingSetMiB,
      cycles: results.reduce((n, r) => n + r.cycles, 0),
      failures: results.reduce((n, r) => n + r.failures, 0),
      firstFailure: results.find((r) => r.firstFailure)?.firstFailure,
      processBefore,
      processAfter,
      rssByCycles,
      liveHeapBytes: liveBefore === null || liveAfter === null ? null : { before: liveBefore, after: liveAfter },
      cycleMs: { median: percentile(all, 0.5), p99: percentile(all, 0.99), max: all[all.length - 1] ?? NaN },
      wallMs,
    };
  } finally {
    for (const vm of vms) await vm.stop();
  }
}

/** Runs one strategy's soak in a fresh process; its progress lines go to our stderr. */
function runSoak(config: SoakConfig): SoakRun {
  const r = spawnSync(process.execPath, pvisorBenchArgv(['soak-run', JSON.stringify(config)], ['--expose-gc']), { encoding: 'utf8', stdio: ['ignore', 'pipe', 'inherit'], maxBuffer: 16 * MiB, env: pvisorNodeEnv() });
  if (r.status !== 0) throw new Error(`the soak of ${config.strategy} failed (exit ${r.status ?? r.signal})`);
  return JSON.parse(r.stdout) as SoakRun;
}

/** `pvisor bench soak`'s options, checked. */
export interface SoakBenchOptions {
  cycles: number;
  vms: number;
  /** Names in {@link SOAK_STRATEGIES}, each run in a process of its own. */
  strategies: string[];
  workingSetMiB: number;
  /** Where the backing files go (absolute). */
  dir: string;
}

/** What `pvisor bench soak` found: its JSON. */
export interface SoakReport {
  setup: { cycles: number; vms: number; vmMemoryMiB: number; workingSetMiB: number; backingDir: string };
  runs: SoakRun[];
}

/** `pvisor bench soak`: runs each strategy's soak, prints the table, returns the JSON. */
export async function benchSoak({ cycles, vms, strategies, workingSetMiB, dir }: SoakBenchOptions): Promise<SoakReport> {
  mkdirSync(dir, { recursive: true });

  const runs: SoakRun[] = [];
  for (const strategy of strategies) {
    progress(`${strategy}: ${vms} VM(s) of ${VM_MEMORY_MIB} MiB, ${workingSetMiB} MiB working set, ${cycles} cycles each`);
    runs.push(runSoak({ strategy, vms, cycles, workingSetMiB, dir }));
  }

  const f = (b: number) => (b / MiB).toFixed(1);
  const ms = (x: number) => x.toFixed(1);
  process.stdout.write(`Soak: suspend, release, resume and digest check, ${cycles} cycles per VM, ${vms} VM(s) of ${VM_MEMORY_MIB} MiB per process, ${workingSetMiB} MiB working set; backing files in ${dir}\n`);
  const rows = [['strategy', 'cycles', 'failures', 'host RSS MiB before -> after', 'host PSS MiB before -> after', 'live JS heap MiB growth', 'cycle ms median', 'p99', 'max']];
  for (const r of runs) {
    rows.push([
      r.strategy,
      String(r.cycles),
      String(r.failures),
      `${f(r.processBefore.rssBytes)} -> ${f(r.processAfter.rssBytes)}`,
      `${f(r.processBefore.pssBytes)} -> ${f(r.processAfter.pssBytes)}`,
      r.liveHeapBytes ? `${r.liveHeapBytes.after >= r.liveHeapBytes.before ? '+' : ''}${f(r.liveHeapBytes.after - r.liveHeapBytes.before)}` : 'n/a',
      ms(r.cycleMs.median),
      ms(r.cycleMs.p99),
      ms(r.cycleMs.max),
    ]);
  }
  printTable(rows);
  for (const r of runs) process.stdout.write(`${r.strategy}: host RSS MiB after N cycles: ${r.rssByCycles.map((x) => `${x.cycles}: ${f(x.rssBytes)}`).join(', ')}\n`);
  for (const r of runs) if (r.firstFailure) process.stdout.write(`${r.strategy}: first failure: ${r.firstFailure}\n`);
  return { setup: { cycles, vms, vmMemoryMiB: VM_MEMORY_MIB, workingSetMiB, backingDir: dir }, runs };
}
