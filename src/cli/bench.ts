/**
 * `pvisor bench ...`: figures measured on real VMs, printed as tables (with the reference's
 * figures beside pvisor's where the study has one) and written as JSON.
 */
import { execFileSync, spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { PACKAGE_ROOT } from '../native';
import { processResident, rangeResident } from '../memory-usage';
import { InvalidOptionError } from '../errors';
import { Vm } from '../vm';
import { BENCH_USAGE, parseUsage, printUsage, PVISOR_USAGE, UsageError, wantsHelp, type BenchName } from './usage';
import { PVISOR_NODE_FLAGS, pvisorNodeEnv } from './node-flags';

const MiB = 2 ** 20;
/** A progress line on stderr (stdout carries the tables and JSON). */
export const progress = (line: string) => process.stderr.write(`bench: ${line}\n`);

/** Min, median and max of some timings. */
export function stats(xs: number[]): { min: number; median: number; max: number } {
  const s = [...xs].sort((a, b) => a - b);
  const mid = s.length >> 1;
  return { min: s[0], median: s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2, max: s[s.length - 1] };
}

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Prints rows as a table on stdout, columns padded to their widest cell. */
export function printTable(rows: string[][]): void {
  const width = rows[0].map((_, i) => Math.max(...rows.map((r) => r[i].length)));
  for (const r of rows) process.stdout.write(`${r.map((c, i) => c.padEnd(width[i])).join(' | ')}\n`);
}

/** Formats ours beside the study's figure: `35.6 (35.6)`. */
export function beside(ours: number | null | undefined, study: number | undefined, digits = 1): string {
  const o = ours === null || ours === undefined ? 'n/a' : ours.toFixed(digits);
  return study === undefined ? o : `${o} (${study.toFixed(1)})`;
}

/** The filesystem type holding `dir`, from /proc/mounts (longest mount point that contains it). */
export function filesystemOf(dir: string): string {
  let best = { point: '', type: 'unknown' };
  for (const line of readFileSync('/proc/mounts', 'utf8').split('\n')) {
    const [, point, type] = line.split(' ');
    if (point && (dir === point || dir.startsWith(point.endsWith('/') ? point : `${point}/`)) && point.length > best.point.length) best = { point, type };
  }
  return best.type;
}

/** Start-to-ready times of `runs` fresh probe VMs (512 MiB, 2 vCPUs), ms. */
async function startTimes(runs: number): Promise<number[]> {
  const out: number[] = [];
  for (let i = 0; i < runs; i++) {
    const t0 = performance.now();
    const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2 });
    out.push(performance.now() - t0);
    await vm.stop();
    progress(`start ${i + 1}/${runs}: ${out[i].toFixed(1)} ms`);
  }
  return out;
}

/** Doorbell (MMIO) exits per second through pvisor's vCPU loop and through a native C loop. */
async function exitRates(count: number): Promise<{ pvisor: number; native: number }> {
  const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2 });
  let pvisor: number;
  try {
    await vm.probe.exitStorm(1000); // warm-up
    const t0 = performance.now();
    await vm.probe.exitStorm(count);
    pvisor = count / ((performance.now() - t0) / 1000);
  } finally {
    await vm.stop();
  }
  progress(`pvisor vCPU loop: ${Math.round(pvisor)} exits/s`);
  const dir = mkdtempSync(join(tmpdir(), 'pvisor-bench-'));
  const exe = join(dir, 'exit-loop');
  execFileSync('gcc', ['-O2', '-o', exe, join(PACKAGE_ROOT, 'native-prebuilds', 'bench', 'exit-loop.c')]);
  const r = JSON.parse(execFileSync(exe, [String(count)], { encoding: 'utf8' })) as { exits: number; seconds: number };
  const native = r.exits / r.seconds;
  progress(`native C loop: ${Math.round(native)} exits/s`);
  return { pvisor, native };
}

interface MemoryCase {
  vms: number;
  processPssBeforeBytes: number;
  processPssBytes: number;
  guestRamPssBytes: number;
  /** (process PSS - PSS before any VM - guest RAM PSS) / VMs: what each VM adds besides its RAM. */
  vmmPerVmBytes: number;
  /** (process PSS - guest RAM PSS) / VMs: the whole process's overhead shared among its VMs. */
  processSharePerVmBytes: number;
}

/** Runs in a fresh child process so that each case starts from a clean heap. */
async function memoryCaseChild(vms: number): Promise<MemoryCase> {
  // Load the backend before the "before" reading: it belongs to the process, not to a VM.
  await import('../backends/kvm/kvm-machine');
  const before = processResident().pssBytes;
  const list: Vm[] = [];
  for (let i = 0; i < vms; i++) list.push(await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2 }));
  await sleep(5000); // the reference study reads 5 s after the operation
  const guest = Vm.liveGuestRam().reduce((sum, r) => sum + rangeResident(r.start, r.length).pssBytes, 0);
  const proc = processResident().pssBytes;
  for (const vm of list) await vm.stop();
  return {
    vms,
    processPssBeforeBytes: before,
    processPssBytes: proc,
    guestRamPssBytes: guest,
    vmmPerVmBytes: (proc - before - guest) / vms,
    processSharePerVmBytes: (proc - guest) / vms,
  };
}

function memoryCase(vms: number): MemoryCase {
  const r = spawnSync(process.execPath, [...PVISOR_NODE_FLAGS, join(__dirname, 'main.js'), 'bench', 'vmm-memory-case', String(vms)], { encoding: 'utf8', env: pvisorNodeEnv() });
  if (r.status !== 0) throw new Error(`memory case with ${vms} VMs failed: ${r.stderr}`);
  return JSON.parse(r.stdout) as MemoryCase;
}

async function benchVmm(argv: string[]): Promise<number> {
  const { runs, exits, json } = parseUsage('bench vmm', () => {
    const { values } = parseArgs({ args: argv, options: BENCH_VMM_OPTIONS, strict: true });
    const runs = Number(values.runs);
    if (!Number.isInteger(runs) || runs < 1 || runs > 100) throw new InvalidOptionError('--runs', 'expected 1 to 100');
    const exits = Number(values.exits);
    if (!Number.isInteger(exits) || exits < 1) throw new InvalidOptionError('--exits', 'expected a whole number >= 1');
    return { runs, exits, json: values.json };
  });
  progress(`start-to-ready, ${runs} fresh VMs`);
  const start = stats(await startTimes(runs));
  progress(`exits per second, ${exits} port writes`);
  const rates = await exitRates(exits);
  progress('VMM memory, 1 VM in a fresh process');
  const one = memoryCase(1);
  progress('VMM memory, 4 VMs in a fresh process');
  const four = memoryCase(4);

  const f = (b: number) => (b / MiB).toFixed(1);
  const rows = [
    ['figure', 'pvisor', 'reference'],
    ['start to probe ready, ms (min/median/max)', `${start.min.toFixed(0)} / ${start.median.toFixed(0)} / ${start.max.toFixed(0)}`, '-'],
    ['MMIO exits/s, pvisor vCPU loop', Math.round(rates.pvisor).toString(), '-'],
    ['MMIO exits/s, native C KVM_RUN loop', Math.round(rates.native).toString(), '-'],
    ['ratio pvisor / native', (rates.pvisor / rates.native).toFixed(2), '-'],
    ['VMM PSS per VM besides guest RAM, 1 VM, MiB', f(one.vmmPerVmBytes), 'goal <= 8 (4 VMs)'],
    ['VMM PSS per VM besides guest RAM, 4 VMs, MiB', f(four.vmmPerVmBytes), 'goal <= 8'],
    ['process PSS share per VM (incl. Node), 1 VM, MiB', f(one.processSharePerVmBytes), 'Firecracker <= 5 (no Node)'],
    ['process PSS share per VM (incl. Node), 4 VMs, MiB', f(four.processSharePerVmBytes), '-'],
  ];
  printTable(rows);
  const result = { startToReadyMs: start, exitsPerSecond: { pvisor: rates.pvisor, native: rates.native, ratio: rates.pvisor / rates.native }, memory: [one, four] };
  if (json) writeFileSync(json, JSON.stringify(result, null, 2));
  else process.stdout.write(`${JSON.stringify(result)}\n`);
  return 0;
}

/** `pvisor bench vmm`'s options (its usage in ./usage.ts names each). */
export const BENCH_VMM_OPTIONS = { runs: { type: 'string', default: '5' }, exits: { type: 'string', default: '100000' }, json: { type: 'string' } } as const;

/** Entry of `pvisor bench`. */
export async function cmdBench(argv: string[]): Promise<number> {
  const [what, ...rest] = argv;
  if (what === undefined || what === '--help' || what === '-h') {
    if (what === undefined) throw new UsageError('pvisor', 'bench', `which bench? ${Object.keys(BENCH_USAGE).join(', ')}`);
    return printUsage(PVISOR_USAGE.bench);
  }
  if (what in BENCH_USAGE && wantsHelp(rest)) return printUsage(BENCH_USAGE[what as BenchName]);
  switch (what) {
    case 'vmm':
      return benchVmm(rest);
    case 'linux': {
      const { benchLinux } = await import('./bench-linux');
      return benchLinux(rest);
    }
    case 'memory':
    case 'memory-cell': {
      const { cmdBenchMemory } = await import('./bench-memory');
      return cmdBenchMemory(rest, what === 'memory-cell');
    }
    case 'snapshot': {
      const { benchSnapshot } = await import('./bench-snapshot');
      return benchSnapshot(rest);
    }
    case 'floors': {
      const { benchFloors } = await import('./bench-floors');
      return benchFloors(rest);
    }
    case 'soak':
    case 'soak-run': {
      const { cmdBenchSoak } = await import('./bench-soak');
      return cmdBenchSoak(rest, what === 'soak-run');
    }
    case 'memory-vm': {
      const { vmProcess } = await import('./bench-table3');
      await vmProcess();
      return 0;
    }
    case 'vmm-memory-case':
      process.stdout.write(JSON.stringify(await memoryCaseChild(Number(rest[0]))));
      return 0;
    default:
      throw new UsageError('pvisor', 'bench', `unknown bench ${JSON.stringify(what)}; benches: ${Object.keys(BENCH_USAGE).join(', ')}`);
  }
}
