/**
 * One cell of Table 3 (./table3.ts's header says what it measures): four VM processes in a fresh
 * cgroup, the scheme's operation, the readings of the group from outside, the rewrite, and the
 * VMs' exits one by one, every digest checked against the host's model.
 */
import { closeSync, fdatasyncSync, openSync, rmSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import type { StrategyStats } from '../memory/strategy';
import { processResident, rangeMappings, rangeResident } from '../memory-usage';
import { dropFileCache } from '../sys/libc';
import { CellCgroup } from './cell-cgroup';
import { KsmHost, ksmCounters, processKsmPages, type KsmCounters } from './ksm-host';
import { PoolDaemon } from './pool-daemon';
import { progress } from './report';
import type { Table3WorkingSet } from './study-figures';
import { CONTENT, fillSeed, KSM_SETTINGS, READ_AFTER_MS, rewriteSeed, studyScheme, VMS, wsOf, type MeasuredScheme, type Table3Options } from './table3-setup';
import { VmProcess } from './table3-vm';

const MiB = 2 ** 20;

/** A figure of all four VMs, per VM, MiB. */
export const perVm = (bytes: number) => (bytes / VMS / MiB).toFixed(1);

/** The group's figures at one moment (all four VMs together). */
export interface GroupReading {
  /** From the end of the operation (or the rewrite) to this reading, ms. */
  afterMs: number;
  /** Resident: PSS summed over the cell's processes. */
  groupPssBytes: number;
  /** The cgroup's charge, page cache included; null without a cgroup. */
  groupMemoryBytes: number | null;
  groupPageCacheBytes: number | null;
  /** Guest RAM mappings of the four VMs, read from outside: PSS, RSS, and anonymous (written) bytes. */
  guestRamPssBytes: number;
  guestRamRssBytes: number;
  guestRamAnonymousBytes: number;
  /** Pages KSM has merged in the cell's processes (/proc/PID/ksm_merging_pages). */
  ksmMergedPages: number;
}

/** What KSM did in a KSM cell. */
export interface KsmCellFigures {
  /** Every setting written for the cell, with the value found (and put back after). */
  settings: { name: string; before: string; now: string }[];
  /** From KSM on to the last change of the cell's merged pages before the reading, ms. */
  settledAfterMs: number;
  /** Host-wide counters when KSM was turned on and at the reading. */
  countersAtStart: KsmCounters;
  countersAtReading: KsmCounters;
  /** Guest RAM mappings of the four VMs, read from outside, and how many of them carry `mg`. */
  guestRamMappings: number;
  advisedMappings: number;
  /** At the reading, KsmAdvice's own figures, VM by VM. */
  strategies: StrategyStats[];
}

/** What the page pool did in a daemon-pool cell. */
export interface PoolCellFigures {
  /**
   * The merge passes, ms: daemon-pool, two of the four VMs at once (the first offers, the second
   * maps what others sent); daemon-pool-arriving, one of the VMs so far after each VM's fill, and
   * one of all four at the end.
   */
  mergeMs: number[];
  /**
   * The group's charged memory: just before the merges (arriving: before the first fill), its
   * highest from then to the last pass (sampled every 20 ms), and settled after. The peak is never
   * below the first: it is the VMs' private memory, plus whatever the merges hold on top of it.
   */
  groupBeforeMergeBytes: number | null;
  groupPeakDuringMergeBytes: number | null;
  groupSettledBytes: number | null;
  /** Per VM after the merges: pages shared, and guest RAM mappings (VMAs). */
  pagesShared: number[];
  guestRamMappings: number[];
  /** The daemon's own PSS, inside the group, at the reading. */
  daemonPssBytes: number;
  /** The merge pass after the rewrite, ms, and what is shared after it. */
  mergeAfterRewriteMs: number;
  /** After SIGKILL of the daemon: VMs whose digests stayed right. */
  vmsKeptAfterDaemonKill: number;
}

/** How the shared snapshot of a cell was made. */
export interface SnapshotFigures {
  dir: string;
  /** Source VM's snapshot call, ms. */
  snapshotMs: number;
  ramDataPageCount: number;
  /** The RAM file's allocated blocks on disk (it is sparse). */
  ramFileAllocatedBytes: number;
  /** Page cache still charged to the source's cgroup after the drop (null without a cgroup). */
  sourcePageCacheAfterDropBytes: number | null;
  /** Each clone's Vm.restore, ms. */
  restoreMs: number[];
}

/** One cell's results. */
export interface Table3Cell {
  workingSet: Table3WorkingSet;
  scheme: MeasuredScheme;
  vms: number;
  /** The operation in all four VMs at once (fill; restore, and fill for unique random; arriving: the fills one by one and the passes after each), ms. */
  operationMs: number;
  after: GroupReading;
  /** The 100% rewrite in all four VMs at once, ms. */
  rewriteMs: number;
  afterRewrite: GroupReading;
  /** KSM only: the same, 60 s (the study's KSM reading) after the rewrite. */
  afterRewriteLate?: GroupReading;
  ksm?: KsmCellFigures;
  snapshot?: SnapshotFigures;
  pool?: PoolCellFigures;
  /** VMs exited one at a time; after each, the digests checked in those still running. */
  exits: { vm: number; exitCode: number; othersChecked: number }[];
}


function readGroup(cgroup: CellCgroup | string, vms: VmProcess[], sinceMs: number): GroupReading {
  const live = vms.filter((v) => v.guestRam);
  const guest = live.map((v) => rangeResident(v.guestRam!.start, v.guestRam!.length, v.proc.pid));
  const sum = (xs: number[]) => xs.reduce((a, b) => a + b, 0);
  return {
    afterMs: performance.now() - sinceMs,
    groupPssBytes: typeof cgroup === 'string' ? sum(vms.map((v) => processResident(v.proc.pid).pssBytes)) : cgroup.pssBytes(),
    groupMemoryBytes: typeof cgroup === 'string' ? null : cgroup.memoryBytes(),
    groupPageCacheBytes: typeof cgroup === 'string' ? null : cgroup.pageCacheBytes(),
    guestRamPssBytes: sum(guest.map((g) => g.pssBytes)),
    guestRamRssBytes: sum(guest.map((g) => g.rssBytes)),
    guestRamAnonymousBytes: sum(guest.map((g) => g.anonymousBytes)),
    ksmMergedPages: sum(vms.map((v) => processKsmPages(v.proc.pid))),
  };
}

/** The shared scheme's source: fills (or only boots), snapshots, exits; its cache is dropped. */
async function prepareSnapshot(ws: Table3WorkingSet, opts: Table3Options, label: string): Promise<SnapshotFigures> {
  const dir = join(opts.snapshotDir, `${process.pid}-${ws}`);
  rmSync(dir, { recursive: true, force: true });
  // A cgroup of its own: what the source wrote is not charged to the cell.
  const cgroup = CellCgroup.create(`pvisor-bench-${process.pid}-t3-${ws}-source`);
  const source = VmProcess.spawn(cgroup, `${label} source VM`);
  let snap: Record<string, unknown>;
  try {
    await source.call({ op: 'start', guest: opts.guest, ksm: false });
    if (ws !== 'unique-random') {
      await source.call({ op: 'fill', sizeMiB: opts.workingSetMiB, content: CONTENT[ws], seed: fillSeed(ws, 0) });
      await source.expectDigest(wsOf(ws, 0, opts.workingSetMiB, false), 'before the snapshot');
    }
    snap = await source.call({ op: 'snapshot', dir });
    const code = await source.stop();
    if (code !== 0) throw new Error(`${label} source VM exited with ${code}: ${source.proc.stderr.trim()}`);
  } finally {
    await source.proc.kill();
  }
  // The snapshot is written and fsynced; drop its clean pages so the clones' reads are charged
  // to the cell, as they would be on a host where the snapshot was made long ago.
  const ram = join(dir, 'ram');
  const fd = openSync(ram, 'r');
  try {
    fdatasyncSync(fd);
    dropFileCache(fd);
  } finally {
    closeSync(fd);
  }
  const sourcePageCacheAfterDropBytes = typeof cgroup === 'string' ? null : cgroup.pageCacheBytes();
  if (typeof cgroup !== 'string') cgroup.remove();
  return { dir, snapshotMs: snap.ms as number, ramDataPageCount: snap.ramDataPageCount as number, ramFileAllocatedBytes: statSync(ram).blocks * 512, sourcePageCacheAfterDropBytes, restoreMs: [] };
}

/** One cell's VMs and what it runs them with, as its steps below share them. */
interface CellRun {
  ws: Table3WorkingSet;
  scheme: MeasuredScheme;
  opts: Table3Options;
  label: string;
  cgroup: CellCgroup | string;
  vms: VmProcess[];
  /** The pool's daemon (daemon-pool schemes), in the cell's cgroup. */
  daemon?: PoolDaemon;
  /** The shared snapshot the clones restore (shared-snapshot). */
  snapshot?: SnapshotFigures;
  /** KSM's settings for the cell while they are changed (ksm), put back at the end. */
  ksm?: KsmHost;
}

/** `f` in every VM of the cell at once. */
const all = <T>(run: CellRun, f: (v: VmProcess, i: number) => Promise<T>) => Promise.all(run.vms.map(f));
/** Every VM's digest against the host's model. */
const expectDigests = (run: CellRun, rewritten: boolean, when: string) => all(run, (v, i) => v.expectDigest(wsOf(run.ws, i, run.opts.workingSetMiB, rewritten), when));

/** Runs one cell (see the header); throws if a digest is wrong or a VM fails. */
export async function runCell(ws: Table3WorkingSet, scheme: MeasuredScheme, opts: Table3Options, label: string): Promise<Table3Cell> {
  const snapshot = scheme === 'shared-snapshot' ? await prepareSnapshot(ws, opts, label) : undefined;
  if (snapshot) progress(`${label}: snapshot of ${snapshot.ramDataPageCount} pages in ${snapshot.snapshotMs.toFixed(0)} ms, page cache dropped`);
  const cgroup = CellCgroup.create(`pvisor-bench-${process.pid}-t3-${ws}-${scheme}`);
  // The pool's daemon is part of the product group: in the cell's cgroup, its PSS in the reading.
  const daemon = studyScheme(scheme) === 'daemon-pool' ? await PoolDaemon.start(cgroup, label) : undefined;
  const vms = Array.from({ length: VMS }, (_, i) => VmProcess.spawn(cgroup, `${label} VM ${i}`));
  const run: CellRun = { ws, scheme, opts, label, cgroup, vms, daemon, snapshot };
  try {
    const { operationMs, merged } = await operate(run);
    // Each guest reads its whole working set: the digest checks it, and a clone maps every page
    // of it (a clone that has not touched a page costs nothing for it yet).
    await expectDigests(run, false, 'after the operation');
    const { after, ksm, pool } = await readAfterOperation(run, operationMs, merged);
    progress(`${label}: ${perVm(after.groupPssBytes)} MiB per VM; 100% rewrite in every VM`);
    const { rewriteMs, rewrittenAt, afterRewrite } = await rewriteAll(run, pool);
    if (pool) pool.vmsKeptAfterDaemonKill = await killDaemon(run);
    let afterRewriteLate: GroupReading | undefined;
    if (scheme === 'ksm') {
      progress(`${label}: ${perVm(afterRewrite.groupPssBytes)} MiB per VM ${READ_AFTER_MS / 1000} s after the rewrite; again at ${opts.ksmReadAfterMs / 1000} s`);
      await watchKsm(vms, rewrittenAt, opts.ksmReadAfterMs, label);
      afterRewriteLate = readGroup(cgroup, vms, rewrittenAt);
    }
    const exits = await exitOneByOne(run);
    return { workingSet: ws, scheme, vms: VMS, operationMs, after, rewriteMs, afterRewrite, afterRewriteLate, ksm, snapshot, pool, exits };
  } finally {
    await Promise.all(vms.map((v) => v.proc.kill()));
    await daemon?.kill();
    run.ksm?.restore();
    if (typeof cgroup !== 'string') cgroup.remove();
    if (snapshot) rmSync(snapshot.dir, { recursive: true, force: true });
  }
}

/**
 * The operation: fill four fresh VMs; restore four clones (and fill, for unique random); or let
 * the VMs arrive one by one, each fill followed by a merge pass. Resolves with its time, and the
 * merges when they were part of it.
 */
async function operate(run: CellRun): Promise<{ operationMs: number; merged?: PoolMerge }> {
  const { ws, scheme, opts, label, vms, daemon, snapshot } = run;
  const start = (v: VmProcess) => v.call({ op: 'start', guest: opts.guest, ksm: scheme === 'ksm', pool: daemon?.socket });
  // Linux guests boot one after another: four kernels booting at once on the nested harness's
  // one emulated CPU stalled (RCU) past their boot timeout. The study's protocol starts with
  // booted VMs either way.
  if (scheme !== 'shared-snapshot' && opts.guest === 'linux') for (const v of vms) await start(v);
  else if (scheme !== 'shared-snapshot') await all(run, start);
  const fill = (v: VmProcess, i: number) => v.call({ op: 'fill', sizeMiB: opts.workingSetMiB, content: CONTENT[ws], seed: fillSeed(ws, i) });
  const t0 = performance.now();
  let merged: PoolMerge | undefined;
  if (scheme === 'daemon-pool-arriving') {
    progress(`${label}: the VMs arrive one by one: each fills, then every VM so far runs a merge pass`);
    merged = await mergeWatched(run.cgroup, label, async (pass) => {
      for (let i = 0; i < VMS; i++) {
        await fill(vms[i], i);
        await pass(vms.slice(0, i + 1));
      }
      await pass(vms); // the earlier arrivals map what the last one sent
    });
  } else {
    await all(run, async (v, i) => {
      if (snapshot) snapshot.restoreMs[i] = (await v.call({ op: 'restore', guest: opts.guest, dir: snapshot.dir })).ms;
      if (!snapshot || ws === 'unique-random') await fill(v, i);
    });
  }
  return { operationMs: performance.now() - t0, merged };
}

/** The reading after the operation: KSM's after it merged, the pool's after its passes, else 2 s after. */
async function readAfterOperation(run: CellRun, operationMs: number, merged: PoolMerge | undefined): Promise<{ after: GroupReading; ksm?: KsmCellFigures; pool?: PoolCellFigures }> {
  if (run.scheme === 'ksm') return readAfterKsm(run, operationMs);
  if (run.daemon) return readAfterMerges(run, run.daemon, operationMs, merged);
  const operatedAt = performance.now();
  progress(`${run.label}: operation took ${operationMs.toFixed(0)} ms, digests right; reading in ${READ_AFTER_MS / 1000} s`);
  await sleep(READ_AFTER_MS - (performance.now() - operatedAt));
  return { after: readGroup(run.cgroup, run.vms, operatedAt) };
}

/** KSM turned on for the cell, the group read `--ksm-read-after` later, every mapping checked for `mg`. */
async function readAfterKsm(run: CellRun, operationMs: number): Promise<{ after: GroupReading; ksm: KsmCellFigures }> {
  const { vms, label, opts } = run;
  const { mappings, advised } = advisedMappings(vms);
  const countersAtStart = ksmCounters();
  const ksm = (run.ksm = KsmHost.apply(KSM_SETTINGS));
  const on = performance.now();
  progress(`${label}: filled and checked in ${operationMs.toFixed(0)} ms; KSM on (${ksm.changed.map((c) => `${c.name} ${c.before} -> ${c.now}`).join(', ') || 'as found'}), reading in ${opts.ksmReadAfterMs / 1000} s`);
  const settledAfterMs = await watchKsm(vms, on, opts.ksmReadAfterMs, label);
  const after = readGroup(run.cgroup, vms, on);
  const strategies = await all(run, async (v) => ((await v.call({ op: 'stats' })).strategies as StrategyStats[]).find((s) => s.strategy === 'ksm-advice')!);
  const atReading = advisedMappings(vms);
  return {
    after,
    ksm: {
      settings: ksm.changed,
      settledAfterMs,
      countersAtStart,
      countersAtReading: ksmCounters(),
      guestRamMappings: Math.max(mappings, atReading.mappings),
      advisedMappings: Math.min(advised, atReading.advised),
      strategies,
    },
  };
}

/** The pool's two passes of all four VMs (unless they ran as the VMs arrived), then the reading. */
async function readAfterMerges(run: CellRun, daemon: PoolDaemon, operationMs: number, merged: PoolMerge | undefined): Promise<{ after: GroupReading; pool: PoolCellFigures }> {
  const { vms, label } = run;
  if (!merged) {
    progress(`${label}: filled and checked in ${operationMs.toFixed(0)} ms; two merge passes of the four VMs`);
    merged = await mergeWatched(run.cgroup, label, async (pass) => {
      await pass(vms); // offers every VM's keys: the pages two VMs have are sent
      await pass(vms); // maps what the others sent
    });
  }
  await expectDigests(run, false, 'after the merges');
  const mergedAt = performance.now();
  await sleep(READ_AFTER_MS - (performance.now() - mergedAt));
  const after = readGroup(run.cgroup, vms, mergedAt);
  return { after, pool: { ...merged, groupSettledBytes: after.groupMemoryBytes, daemonPssBytes: processResident(daemon.pid).pssBytes, mergeAfterRewriteMs: 0, vmsKeptAfterDaemonKill: 0 } };
}

/** The 100% rewrite in every VM at once, each with its own seed, checked, and the reading 2 s after it. */
async function rewriteAll(run: CellRun, pool: PoolCellFigures | undefined): Promise<{ rewriteMs: number; rewrittenAt: number; afterRewrite: GroupReading }> {
  const r0 = performance.now();
  await all(run, (v, i) => v.call({ op: 'rewrite', seed: rewriteSeed(i) }));
  const rewriteMs = performance.now() - r0;
  const rewrittenAt = performance.now();
  await expectDigests(run, true, 'after the rewrite');
  if (pool) {
    // A pass finds the pages written since and gives their references back (the pool frees them).
    const m0 = performance.now();
    await all(run, (v) => v.call({ op: 'merge' }));
    pool.mergeAfterRewriteMs = performance.now() - m0;
  }
  await sleep(READ_AFTER_MS - (performance.now() - rewrittenAt));
  return { rewriteMs, rewrittenAt, afterRewrite: readGroup(run.cgroup, run.vms, rewrittenAt) };
}

/** SIGKILLs the pool's daemon: the VMs must outlive their pool, what they map stays theirs. Resolves with the VMs whose digests stayed right. */
async function killDaemon(run: CellRun): Promise<number> {
  await run.daemon!.kill();
  const kept = await Promise.all(run.vms.map((v, i) => v.expectDigest(wsOf(run.ws, i, run.opts.workingSetMiB, true), 'after the daemon was killed').then(() => 1, () => 0)));
  const n = kept.reduce((a: number, b) => a + b, 0);
  progress(`${run.label}: daemon SIGKILLed; ${n} of ${VMS} VMs kept their digests`);
  return n;
}

/** Each VM exits alone; those still running must keep their working sets. */
async function exitOneByOne(run: CellRun): Promise<Table3Cell['exits']> {
  const { vms } = run;
  const exits: Table3Cell['exits'] = [];
  for (let i = 0; i < VMS; i++) {
    const exitCode = await vms[i].stop();
    if (exitCode !== 0) throw new Error(`${vms[i].proc.label} exited with ${exitCode}: ${vms[i].proc.stderr.trim()}`);
    const rest = vms.slice(i + 1);
    await Promise.all(rest.map((v, k) => v.expectDigest(wsOf(run.ws, i + 1 + k, run.opts.workingSetMiB, true), `after VM ${i} exited`)));
    exits.push({ vm: i, exitCode, othersChecked: rest.length });
  }
  progress(`${run.label}: each VM exited alone; the others' digests stayed right`);
  return exits;
}

/** What the merge passes of a daemon-pool cell did, and the group's memory around them. */
type PoolMerge = Pick<PoolCellFigures, 'mergeMs' | 'groupBeforeMergeBytes' | 'groupPeakDuringMergeBytes' | 'pagesShared' | 'guestRamMappings'>;

/**
 * Runs `work`, whose `pass(group)` is one merge pass of those VMs at once, while the cell's charged
 * memory is sampled every 20 ms: the pool's peak is when the VMs' private copies and the pool's
 * copy coexist. Each VM's pages shared and mappings are those of its last pass.
 */
async function mergeWatched(cgroup: CellCgroup | string, label: string, work: (pass: (group: VmProcess[]) => Promise<void>) => Promise<void>): Promise<PoolMerge> {
  const charged = () => (typeof cgroup === 'string' ? null : cgroup.memoryBytes());
  const before = charged();
  let peak = before;
  const sample = () => {
    const now = charged();
    if (now !== null) peak = Math.max(peak!, now);
  };
  const sampler = setInterval(sample, 20);
  const mergeMs: number[] = [];
  const last = new Map<VmProcess, Record<string, number>>();
  try {
    await work(async (group) => {
      const t0 = performance.now();
      const replies = await Promise.all(group.map((v) => v.call({ op: 'merge' })));
      mergeMs.push(performance.now() - t0);
      group.forEach((v, i) => last.set(v, replies[i].pool as Record<string, number>));
    });
  } finally {
    clearInterval(sampler);
  }
  sample();
  const figures = [...last.values()];
  progress(`${label}: merge passes ${mergeMs.map((m) => m.toFixed(0)).join(' + ')} ms; ${figures.map((f) => f.pagesShared).join(', ')} pages shared`);
  return { mergeMs, groupBeforeMergeBytes: before, groupPeakDuringMergeBytes: peak, pagesShared: figures.map((f) => f.pagesShared), guestRamMappings: figures.map((f) => f.guestRamMappings) };
}

/** Guest RAM mappings of the VMs, read from outside, and how many accepted MADV_MERGEABLE. */
function advisedMappings(vms: VmProcess[]): { mappings: number; advised: number } {
  let mappings = 0;
  let advised = 0;
  for (const v of vms) {
    for (const m of rangeMappings(v.guestRam!.start, v.guestRam!.length, v.proc.pid)) {
      mappings++;
      if (m.flags.includes('mg')) advised++;
    }
  }
  return { mappings, advised };
}

/**
 * Waits until `readAfterMs` after `since`, watching the cell's merged pages each second; resolves
 * with when they last changed (from `since`, ms).
 */
async function watchKsm(vms: VmProcess[], since: number, readAfterMs: number, label: string): Promise<number> {
  let merged = -1;
  let changedAt = since;
  let told = since;
  while (performance.now() - since < readAfterMs) {
    const now = vms.reduce((sum, v) => sum + processKsmPages(v.proc.pid), 0);
    if (now !== merged) {
      merged = now;
      changedAt = performance.now();
    }
    if (performance.now() - told >= 10_000) {
      told = performance.now();
      progress(`${label}: ${((told - since) / 1000).toFixed(0)} s, ${merged} pages merged in the cell`);
    }
    await sleep(Math.min(1000, readAfterMs - (performance.now() - since)));
  }
  return changedAt - since;
}
