/**
 * `pvisor bench vmm`: the VMM itself on the probe guest: start-to-ready time, doorbell (MMIO) exits
 * per second through pvisor's vCPU loop against a native C KVM_RUN loop, and the VMM's memory per
 * VM besides guest RAM, one VM and four VMs each in a fresh process.
 */
import { execFileSync, spawnSync } from 'node:child_process';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { processResident, rangeResident } from '../memory-usage';
import { releaseIdleProcessPages } from '../sys/process-pages';
import { PACKAGE_ROOT } from '../native';
import { pvisorNodeEnv } from '../node-flags';
import { Vm } from '../vm';
import { pvisorBenchArgv } from './bins';
import { printTable, progress, stats } from './report';

const MiB = 2 ** 20;

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

/** One `pvisor bench vmm-memory-case`: VMs in a fresh process, and what the process costs. */
export interface MemoryCase {
  vms: number;
  processPssBeforeBytes: number;
  processPssBytes: number;
  guestRamPssBytes: number;
  /** (process PSS - PSS before any VM - guest RAM PSS) / VMs: what each VM adds besides its RAM. */
  vmmPerVmBytes: number;
  /** (process PSS - guest RAM PSS) / VMs: the whole process's overhead shared among its VMs. */
  processSharePerVmBytes: number;
}

/** `pvisor bench vmm-memory-case VMS`, in a fresh child process so that each case starts from a clean heap. */
export async function memoryCaseChild(vms: number): Promise<MemoryCase> {
  // Load the backend before the "before" reading: it belongs to the process, not to a VM.
  await import('../backends/kvm/kvm-machine');
  // The process gives its idle pages back a moment after a VM starts (sys/process-pages.ts): the
  // "before" reading gets the same, or the VMs would seem to cost less than nothing.
  releaseIdleProcessPages();
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
  const r = spawnSync(process.execPath, pvisorBenchArgv(['vmm-memory-case', String(vms)]), { encoding: 'utf8', env: pvisorNodeEnv() });
  if (r.status !== 0) throw new Error(`memory case with ${vms} VMs failed: ${r.stderr}`);
  return JSON.parse(r.stdout) as MemoryCase;
}

/** `pvisor bench vmm`'s options, checked. */
export interface VmmBenchOptions {
  /** Fresh VMs whose start is timed. */
  runs: number;
  /** Doorbell exits timed. */
  exits: number;
}

/** `pvisor bench vmm`: measures, prints the table, returns the JSON. */
export async function benchVmm({ runs, exits }: VmmBenchOptions): Promise<object> {
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
  return { startToReadyMs: start, exitsPerSecond: { pvisor: rates.pvisor, native: rates.native, ratio: rates.pvisor / rates.native }, memory: [one, four] };
}

