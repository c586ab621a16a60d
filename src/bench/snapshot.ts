/**
 * `pvisor bench snapshot`: what a snapshot costs and what a restore saves, on the probe guest, in
 * one run so that the ratios hold on a noisy host. A 512 MiB / 2 vCPU VM fills a 64 MiB random
 * working set and is snapshotted (timed); then, with the RAM file's page cache dropped before each
 * run, private restores (RAM read into the clone's memory) and SharedSnapshot restores (RAM file
 * mapped) are timed to the first answered request, against fresh starts timed the same way. Every
 * clone's digest must equal the host model's, or the bench fails. Last, a SharedSnapshot clone
 * with Offload rewrites 8 MiB and is suspended: what the offload wrote is the clone's own pages.
 */
import { mkdtempSync, rmSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { Offload } from '../memory/strategies/offload';
import { SharedSnapshot } from '../memory/strategies/shared-snapshot';
import { Vm } from '../vm';
import { dropCache, toReady } from './probe-restore';
import { printTable, progress, stats } from './report';

const MiB = 2 ** 20;
const WORKING_SET_MIB = 64;
const SEED = 42;
const CLONE_WRITES_MIB = 8;

/** `pvisor bench snapshot`'s options, checked. */
export interface SnapshotBenchOptions {
  runs: number;
  /** Where the snapshots (and the clone's offload) go. */
  dir: string;
}

/** `pvisor bench snapshot`: measures, prints the table, returns the JSON. */
export async function benchSnapshot({ runs, dir: parent }: SnapshotBenchOptions): Promise<object> {
  const base = mkdtempSync(join(parent, 'pvisor-bench-snapshot-'));
  try {
    const source = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, name: 'bench-snapshot-source' });
    let expected: string;
    const snapshotMs: number[] = [];
    let dir = '';
    let ramDataPageCount = 0;
    try {
      await source.probe.fill({ sizeMiB: WORKING_SET_MIB, content: 'random', seed: SEED });
      expected = (await source.probe.digest()).hex;
      for (let i = 0; i < runs; i++) {
        dir = join(base, `snap-${i}`);
        const info = await source.snapshot(dir);
        snapshotMs.push(info.ms);
        ramDataPageCount = info.ramDataPageCount;
        progress(`snapshot ${i + 1}/${runs}: ${info.ms.toFixed(0)} ms`);
      }
    } finally {
      await source.stop();
    }
    const ram = join(dir, 'ram');
    const ramFileBytes = statSync(ram).blocks * 512;

    const fresh: number[] = [];
    const privateRestore: number[] = [];
    const sharedFirst: number[] = [];
    const sharedNext: number[] = [];
    const check = async (vm: Vm, what: string) => {
      const got = (await vm.probe.digest()).hex;
      await vm.stop();
      if (got !== expected) throw new Error(`${what}: digest ${got}, the snapshot's guest had ${expected}`);
    };
    for (let i = 0; i < runs; i++) {
      const f = await toReady(() => Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2 }));
      await f.vm.stop();
      fresh.push(f.ms);
      dropCache(ram);
      const p = await toReady(() => Vm.restore(dir));
      privateRestore.push(p.ms);
      await check(p.vm, 'private restore');
      // A fresh snapshot directory's file is unknown to this process: the first clone checks it.
      dropCache(ram);
      const s1 = await toReady(() => Vm.restore(dir, { strategies: [new SharedSnapshot({ verify: true })] }));
      sharedFirst.push(s1.ms);
      const s2 = await toReady(() => Vm.restore(dir, { strategies: [new SharedSnapshot()] }));
      sharedNext.push(s2.ms);
      await check(s2.vm, 'second shared clone');
      await check(s1.vm, 'first shared clone');
      progress(`run ${i + 1}/${runs}: fresh ${f.ms.toFixed(0)} ms, private restore ${p.ms.toFixed(0)} ms, shared clone ${s1.ms.toFixed(0)} ms, next shared clone ${s2.ms.toFixed(0)} ms`);
    }

    progress(`offload of a shared clone that rewrote ${CLONE_WRITES_MIB} MiB`);
    const offload = new Offload({ dir: parent });
    const clone = await Vm.restore(dir, { strategies: [new SharedSnapshot(), offload] });
    let offloadBytes: number;
    try {
      await clone.probe.rewrite({ fraction: CLONE_WRITES_MIB / WORKING_SET_MIB, seed: 7 });
      const rewritten = (await clone.probe.digest()).hex;
      await clone.suspend();
      await clone.memoryReleased();
      offloadBytes = statSync(offload.backingPath!).blocks * 512;
      await clone.resume();
      if ((await clone.probe.digest()).hex !== rewritten) throw new Error('the offloaded clone came back with another digest');
    } finally {
      await clone.stop();
    }

    const s = { snapshot: stats(snapshotMs), fresh: stats(fresh), privateRestore: stats(privateRestore), sharedFirst: stats(sharedFirst), sharedNext: stats(sharedNext) };
    const mmm = (x: { min: number; median: number; max: number }) => `${x.min.toFixed(0)} / ${x.median.toFixed(0)} / ${x.max.toFixed(0)}`;
    const ratio = (x: { median: number }) => (x.median / s.fresh.median).toFixed(2);
    process.stdout.write(`Snapshots: probe guest, 512 MiB / 2 vCPUs, ${WORKING_SET_MIB} MiB random working set, ${runs} runs (ms min / median / max; ready = first request answered; page cache of the RAM file dropped before each restore)\n`);
    printTable([
      ['figure', 'pvisor', 'median / fresh start'],
      ['snapshot (pause, write, seal, resume)', mmm(s.snapshot), '-'],
      ['fresh start to ready', mmm(s.fresh), '1.00'],
      ['private restore to ready (RAM read in)', mmm(s.privateRestore), ratio(s.privateRestore)],
      ['SharedSnapshot clone to ready, file checked', mmm(s.sharedFirst), ratio(s.sharedFirst)],
      ['SharedSnapshot clone to ready, file checked before', mmm(s.sharedNext), ratio(s.sharedNext)],
      ['RAM file on disk, MiB', (ramFileBytes / MiB).toFixed(1), `${ramDataPageCount} pages written`],
      [`offload of a clone that wrote ${CLONE_WRITES_MIB} MiB, MiB on disk`, (offloadBytes / MiB).toFixed(1), 'issue goal: about 8'],
    ]);
    return { workingSetMiB: WORKING_SET_MIB, runs, ms: s, ramFileBytes, ramDataPageCount, cloneWroteMiB: CLONE_WRITES_MIB, cloneOffloadBytes: offloadBytes };
  } finally {
    rmSync(base, { recursive: true, force: true });
  }
}
