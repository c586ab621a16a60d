/**
 * `pvisor bench memory --table 3`: Table 3 of the reference study, four 512 MiB / 2 vCPU VMs side
 * by side, measured on pvisor: probe VMs (the memory layer's microbenchmark), or with `--guest
 * linux` the shipped Linux guest, whose working set a process holds (pvisor-workset), as the study's
 * Linux VMs held theirs.
 *
 * One cell per (working set, scheme): a fresh memory cgroup holding four VM processes, one VM
 * each, as four `pvisor run`s would be (`pvisor bench memory-vm`, driven by lines of JSON), so the
 * group's PSS covers four VMMs and group memory is the cgroup's charge. Schemes:
 * - private: four fresh VMs, each fills its working set;
 * - shared snapshot + COW: a source VM (in a cgroup of its own) fills the working set (for unique
 *   random it only boots), snapshots into a directory on disk and exits; the RAM file's page
 *   cache is dropped so that what the clones read is charged to the cell; four clones restore
 *   with SharedSnapshot (for unique random each then fills its own seed);
 * - KSM: four fresh VMs with KsmAdvice fill; KSM is turned on for the cell (its settings put back
 *   after), and the group is read 60 s later; every guest RAM mapping is checked from outside
 *   (VmFlags `mg`);
 * - daemon pool: four fresh VMs with PoolClient fill, then two merge passes of all four, the group's
 *   charge sampled throughout (the peak); the daemon is in the cell and SIGKILLed at its end;
 * - daemon pool, VMs arriving one by one: the same, but each VM fills after the passes that
 *   followed the one before it (see `daemon-pool-arriving` below).
 * Every VM's digest is checked against the host's model after the operation. Readings: 2 s after
 * the operation (KSM: 60 s), then 2 s after a 100% rewrite in every VM, each with its own seed
 * (KSM also 60 s after it). Then the VMs exit one at a time, and after each exit the others'
 * digests must still be right, or the cell fails. Saving = 1 - scheme / private, same working set,
 * same run. The run of record and what it found: docs/memory-table3.md.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { closeSync, fdatasyncSync, mkdirSync, mkdtempSync, openSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { InvalidOptionError } from '../errors';
import { LinuxWorkingSet } from '../guest/linux-workset';
import type { FillOptions, RewriteOptions } from '../guest/probe-client';
import { expectedDigestHex, type ProbeContent, type ProbeWorkingSet } from '../guest/probe-content';
import { KsmAdvice } from '../memory/strategies/ksm-advice';
import { PoolClient } from '../memory/strategies/pool-client';
import { SharedSnapshot } from '../memory/strategies/shared-snapshot';
import type { StrategyStats } from '../memory/strategy';
import { processResident, rangeMappings, rangeResident } from '../memory-usage';
import { dropFileCache } from '../sys/libc';
import { parseDurationMs, parseSize } from '../units';
import { Vm } from '../vm';
import { beside, filesystemOf, printTable, progress, sleep, stats } from './bench';
import { CellCgroup } from './cell-cgroup';
import { CellProcess, parentLink } from './cell-process';
import { KsmHost, ksmCounters, processKsmPages, type KsmCounters } from './ksm-host';
import { STUDY_TABLE3, TABLE3_GOALS, savingPercent, type Table3Scheme, type Table3WorkingSet } from './study-figures';

const MiB = 2 ** 20;
const VMS = 4;
const STUDY_WORKING_SET_MIB = 64;
/** The study reads cross-instance cells 2 s after the operation... */
const READ_AFTER_MS = 2000;
/** ...and KSM 60 s after. */
const KSM_READ_AFTER_MS = 60_000;
/**
 * KSM for the cell: 1000 pages per 20 ms wake-up (the kernel's default is 100) scans the four
 * VMs' resident guest RAM (about 66k pages) in a few seconds, so merging is over well inside the
 * 60 s even with other work on the host's two cores; with the default, the first merges came
 * after about 20 s and the last at about 35 s for 64k pages (host-facts.md).
 */
const KSM_SETTINGS: [string, string][] = [
  ['advisor_mode', 'none'],
  ['pages_to_scan', '1000'],
  ['sleep_millisecs', '20'],
  ['run', '1'],
];

const WORKING_SETS: Table3WorkingSet[] = ['same-repetitive', 'same-random', 'unique-random'];
/**
 * `daemon-pool-arriving` is the pool once more, with the VMs arriving one after another, as an
 * orchestrator's sandboxes do: each fills its working set, then every VM so far runs a pass (what
 * their periodic passes would do). The study's protocol (`daemon-pool`) fills all four before the
 * first pass, so its group holds four private working sets before any merge: for same repetitive
 * that alone is about 4 x 64 MiB above the settled figure, whatever the merge does.
 */
type MeasuredScheme = Table3Scheme | 'daemon-pool-arriving';
const SCHEMES: MeasuredScheme[] = ['private', 'shared-snapshot', 'ksm', 'daemon-pool', 'daemon-pool-arriving'];
/** The study's scheme a measured one is compared with. */
const studyScheme = (scheme: MeasuredScheme): Table3Scheme => (scheme === 'daemon-pool-arriving' ? 'daemon-pool' : scheme);

const CONTENT: Record<Table3WorkingSet, ProbeContent> = { 'same-repetitive': 'repetitive', 'same-random': 'random', 'unique-random': 'random' };
/** The fill's seed of VM `vm` (0-3): one for all in the "same" sets, each its own in unique random. */
function fillSeed(ws: Table3WorkingSet, vm: number): number {
  if (ws === 'same-repetitive') return 1;
  return ws === 'same-random' ? 42 : 101 + vm;
}
/** The 100% rewrite's seed: each VM its own, in every working set. */
const rewriteSeed = (vm: number) => 1001 + vm;

const SCHEME_NAMES: Record<MeasuredScheme, string> = {
  private: 'private',
  'shared-snapshot': 'shared snapshot + COW',
  ksm: 'KSM',
  'daemon-pool': 'daemon pool',
  'daemon-pool-arriving': 'daemon pool, VMs arriving one by one',
};

// --- The VM process: one VM, driven by the parent -------------------------------------------

/** What the parent asks a VM process. */
type VmRequest =
  | { op: 'start'; guest: Table3Guest; ksm: boolean; pool?: string }
  | { op: 'merge' }
  | { op: 'restore'; guest: Table3Guest; dir: string }
  | { op: 'fill'; sizeMiB: number; content: ProbeContent; seed: number }
  | { op: 'rewrite'; seed: number }
  | { op: 'digest' }
  | { op: 'snapshot'; dir: string }
  | { op: 'stats' }
  | { op: 'stop' };

/** The guests Table 3 runs on. */
type Table3Guest = 'probe' | 'linux';

/** What a cell does to a VM's working set: the probe's own ops, or pvisor-workset's in the Linux guest. */
interface Table3Set {
  fill(options: FillOptions): Promise<unknown>;
  rewrite(options: RewriteOptions): Promise<unknown>;
  digest(): Promise<{ hex: string }>;
}

/** A boot or a restore of the Linux guest takes seconds natively and minutes in the nested harness. */
const LINUX_TIMEOUT_MS = 600_000;

/** `pvisor bench memory-vm`: one VM per process, one request per line, one answer each. */
export async function vmProcess(): Promise<void> {
  const link = parentLink();
  let vm: Vm | undefined;
  let set: Table3Set | undefined;
  let pool: PoolClient | undefined;
  const ram = () => Vm.liveGuestRam()[0];
  try {
    for (;;) {
      const line = await link.next();
      if (line === undefined) return; // the parent is gone: stop the VM
      const req = JSON.parse(line) as VmRequest;
      const t0 = performance.now();
      try {
        let reply: Record<string, unknown> = {};
        switch (req.op) {
          case 'start': {
            // Merges only when the parent asks, so that the cell times and watches them.
            pool = req.pool === undefined ? undefined : new PoolClient({ socket: req.pool, intervalMs: 3_600_000 });
            const strategies = [...(req.ksm ? [new KsmAdvice()] : []), ...(pool ? [pool] : [])];
            if (req.guest === 'linux') {
              vm = await Vm.start({ memory: '512MiB', vcpus: 2, strategies, bootTimeoutMs: LINUX_TIMEOUT_MS });
              set = await LinuxWorkingSet.start(vm);
            } else {
              vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, strategies });
              set = vm.probe;
            }
            reply = { guestRam: ram() };
            break;
          }
          case 'merge': {
            if (!pool?.connected) throw new Error('not connected to the pool');
            await pool.mergeNow();
            reply = { pool: vm!.memoryUsage().strategies.find((x) => x.strategy === 'pool-client')!.figures };
            break;
          }
          case 'restore':
            vm = await Vm.restore(req.dir, { strategies: [new SharedSnapshot()], ...(req.guest === 'linux' ? { readyTimeoutMs: LINUX_TIMEOUT_MS } : {}) });
            // The source's holder runs on in the clone: the parent checks its digests with its own model.
            set = req.guest === 'linux' ? LinuxWorkingSet.attach(vm, undefined) : vm.probe;
            reply = { guestRam: ram() };
            break;
          case 'fill':
            await set!.fill({ sizeMiB: req.sizeMiB, content: req.content, seed: req.seed });
            break;
          case 'rewrite':
            await set!.rewrite({ fraction: 1, seed: req.seed });
            break;
          case 'digest':
            reply = { hex: (await set!.digest()).hex };
            break;
          case 'snapshot': {
            const info = await vm!.snapshot(req.dir);
            reply = { ramDataPageCount: info.ramDataPageCount };
            break;
          }
          case 'stats':
            reply = { strategies: vm!.memoryUsage().strategies };
            break;
          case 'stop':
            vm?.stop();
            vm = undefined;
            break;
        }
        link.say({ ok: true, ms: performance.now() - t0, ...reply });
        if (req.op === 'stop') return;
      } catch (e) {
        link.say({ ok: false, error: (e as Error).message });
      }
    }
  } finally {
    vm?.stop();
  }
}

/** The parent's handle on one VM process. */
class VmProcess {
  guestRam: { start: number; length: number } | undefined;
  constructor(readonly proc: CellProcess) {}

  static spawn(cgroup: CellCgroup | string, label: string): VmProcess {
    return new VmProcess(CellProcess.spawn(cgroup, ['memory-vm'], label));
  }

  /** Sends one request and waits for its answer; a refused request is an error naming the VM. */
  async call(req: VmRequest): Promise<Record<string, unknown> & { ms: number }> {
    this.proc.send(req);
    const reply = await this.proc.next();
    if (reply.ok !== true) throw new Error(`${this.proc.label}: ${req.op} failed: ${String(reply.error)}`);
    if (reply.guestRam) this.guestRam = reply.guestRam as { start: number; length: number };
    return reply as Record<string, unknown> & { ms: number };
  }

  /** Checks the guest's digest against the host's model of its working set. */
  async expectDigest(ws: ProbeWorkingSet, when: string): Promise<void> {
    const { hex } = (await this.call({ op: 'digest' })) as unknown as { hex: string };
    const want = expectedDigestHex(ws);
    if (hex !== want) throw new Error(`${this.proc.label}: digest ${when} is ${hex}, the host's model says ${want}`);
  }

  /** Asks it to stop its VM and exit; resolves with its exit status. */
  async stop(): Promise<number> {
    await this.call({ op: 'stop' });
    return this.proc.exited;
  }
}

// --- The parent: cells, readings, the table -------------------------------------------------

/** The group's figures at one moment (all four VMs together). */
interface GroupReading {
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
interface KsmCellFigures {
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
interface PoolCellFigures {
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
interface SnapshotFigures {
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
interface Table3Cell {
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

/** Table 3's options, checked. */
export interface Table3Options {
  guest: Table3Guest;
  workingSets: Table3WorkingSet[];
  schemes: MeasuredScheme[];
  workingSetMiB: number;
  ksmReadAfterMs: number;
  snapshotDir: string;
}

const wsOf = (ws: Table3WorkingSet, vm: number, sizeMiB: number, rewritten: boolean): ProbeWorkingSet => ({
  content: CONTENT[ws],
  seed: fillSeed(ws, vm),
  sizeBytes: sizeMiB * MiB,
  rewrites: rewritten ? [{ permille: 1000, seed: rewriteSeed(vm) }] : [],
});

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

/** Runs one cell (see the header); throws if a digest is wrong or a VM fails. */
async function runCell(ws: Table3WorkingSet, scheme: MeasuredScheme, opts: Table3Options, label: string): Promise<Table3Cell> {
  const size = opts.workingSetMiB;
  const snapshot = scheme === 'shared-snapshot' ? await prepareSnapshot(ws, opts, label) : undefined;
  if (snapshot) progress(`${label}: snapshot of ${snapshot.ramDataPageCount} pages in ${snapshot.snapshotMs.toFixed(0)} ms, page cache dropped`);
  const cgroup = CellCgroup.create(`pvisor-bench-${process.pid}-t3-${ws}-${scheme}`);
  // The pool's daemon is part of the product group: in the cell's cgroup, its PSS in the reading.
  const daemon = studyScheme(scheme) === 'daemon-pool' ? await PoolDaemon.start(cgroup, label) : undefined;
  const vms = Array.from({ length: VMS }, (_, i) => VmProcess.spawn(cgroup, `${label} VM ${i}`));
  let ksm: KsmHost | undefined;
  try {
    const all = <T>(f: (v: VmProcess, i: number) => Promise<T>) => Promise.all(vms.map(f));
    // The operation: fill four fresh VMs; restore four clones (and fill, for unique random).
    const start = (v: VmProcess) => v.call({ op: 'start', guest: opts.guest, ksm: scheme === 'ksm', pool: daemon?.socket });
    // Linux guests boot one after another: four kernels booting at once on the nested harness's
    // one emulated CPU stalled (RCU) past their boot timeout. The study's protocol starts with
    // booted VMs either way.
    if (scheme !== 'shared-snapshot' && opts.guest === 'linux') for (const v of vms) await start(v);
    else if (scheme !== 'shared-snapshot') await all(start);
    const fill = (v: VmProcess, i: number) => v.call({ op: 'fill', sizeMiB: size, content: CONTENT[ws], seed: fillSeed(ws, i) });
    const t0 = performance.now();
    let merged: PoolMerge | undefined;
    if (scheme === 'daemon-pool-arriving') {
      progress(`${label}: the VMs arrive one by one: each fills, then every VM so far runs a merge pass`);
      merged = await mergeWatched(cgroup, label, async (pass) => {
        for (let i = 0; i < VMS; i++) {
          await fill(vms[i], i);
          await pass(vms.slice(0, i + 1));
        }
        await pass(vms); // the earlier arrivals map what the last one sent
      });
    } else {
      await all(async (v, i) => {
        if (snapshot) snapshot.restoreMs[i] = (await v.call({ op: 'restore', guest: opts.guest, dir: snapshot.dir })).ms;
        if (!snapshot || ws === 'unique-random') await fill(v, i);
      });
    }
    const operationMs = performance.now() - t0;
    // Each guest reads its whole working set: the digest checks it, and a clone maps every page
    // of it (a clone that has not touched a page costs nothing for it yet).
    await all((v, i) => v.expectDigest(wsOf(ws, i, size, false), 'after the operation'));
    const operatedAt = performance.now();
    let ksmFigures: KsmCellFigures | undefined;
    let poolFigures: PoolCellFigures | undefined;
    let after: GroupReading;
    if (scheme === 'ksm') {
      const { mappings, advised } = advisedMappings(vms);
      const countersAtStart = ksmCounters();
      ksm = KsmHost.apply(KSM_SETTINGS);
      const on = performance.now();
      progress(`${label}: filled and checked in ${operationMs.toFixed(0)} ms; KSM on (${ksm.changed.map((c) => `${c.name} ${c.before} -> ${c.now}`).join(', ') || 'as found'}), reading in ${opts.ksmReadAfterMs / 1000} s`);
      const settledAfterMs = await watchKsm(vms, on, opts.ksmReadAfterMs, label);
      after = readGroup(cgroup, vms, on);
      const strategies = await all(async (v) => ((await v.call({ op: 'stats' })).strategies as StrategyStats[]).find((s) => s.strategy === 'ksm-advice')!);
      const atReading = advisedMappings(vms);
      ksmFigures = {
        settings: ksm.changed,
        settledAfterMs,
        countersAtStart,
        countersAtReading: ksmCounters(),
        guestRamMappings: Math.max(mappings, atReading.mappings),
        advisedMappings: Math.min(advised, atReading.advised),
        strategies,
      };
    } else if (daemon) {
      if (!merged) {
        progress(`${label}: filled and checked in ${operationMs.toFixed(0)} ms; two merge passes of the four VMs`);
        merged = await mergeWatched(cgroup, label, async (pass) => {
          await pass(vms); // offers every VM's keys: the pages two VMs have are sent
          await pass(vms); // maps what the others sent
        });
      }
      await all((v, i) => v.expectDigest(wsOf(ws, i, size, false), 'after the merges'));
      const mergedAt = performance.now();
      await sleep(READ_AFTER_MS - (performance.now() - mergedAt));
      after = readGroup(cgroup, vms, mergedAt);
      poolFigures = { ...merged, groupSettledBytes: after.groupMemoryBytes, daemonPssBytes: processResident(daemon.pid).pssBytes, mergeAfterRewriteMs: 0, vmsKeptAfterDaemonKill: 0 };
    } else {
      progress(`${label}: operation took ${operationMs.toFixed(0)} ms, digests right; reading in ${READ_AFTER_MS / 1000} s`);
      await sleep(READ_AFTER_MS - (performance.now() - operatedAt));
      after = readGroup(cgroup, vms, operatedAt);
    }
    progress(`${label}: ${perVm(after.groupPssBytes)} MiB per VM; 100% rewrite in every VM`);
    const r0 = performance.now();
    await all((v, i) => v.call({ op: 'rewrite', seed: rewriteSeed(i) }));
    const rewriteMs = performance.now() - r0;
    const rewrittenAt = performance.now();
    await all((v, i) => v.expectDigest(wsOf(ws, i, size, true), 'after the rewrite'));
    if (poolFigures) {
      // A pass finds the pages written since and gives their references back (the pool frees them).
      const m0 = performance.now();
      await all((v) => v.call({ op: 'merge' }));
      poolFigures.mergeAfterRewriteMs = performance.now() - m0;
    }
    await sleep(READ_AFTER_MS - (performance.now() - rewrittenAt));
    const afterRewrite = readGroup(cgroup, vms, rewrittenAt);
    if (daemon && poolFigures) {
      // The VMs must outlive their pool: what they map stays theirs.
      await daemon.kill();
      const kept = await Promise.all(vms.map((v, i) => v.expectDigest(wsOf(ws, i, size, true), 'after the daemon was killed').then(() => 1, () => 0)));
      poolFigures.vmsKeptAfterDaemonKill = kept.reduce((a: number, b) => a + b, 0);
      progress(`${label}: daemon SIGKILLed; ${poolFigures.vmsKeptAfterDaemonKill} of ${VMS} VMs kept their digests`);
    }
    let afterRewriteLate: GroupReading | undefined;
    if (scheme === 'ksm') {
      progress(`${label}: ${perVm(afterRewrite.groupPssBytes)} MiB per VM ${READ_AFTER_MS / 1000} s after the rewrite; again at ${opts.ksmReadAfterMs / 1000} s`);
      await watchKsm(vms, rewrittenAt, opts.ksmReadAfterMs, label);
      afterRewriteLate = readGroup(cgroup, vms, rewrittenAt);
    }
    // Each VM exits alone; those still running must keep their working sets.
    const exits: Table3Cell['exits'] = [];
    for (let i = 0; i < VMS; i++) {
      const exitCode = await vms[i].stop();
      if (exitCode !== 0) throw new Error(`${vms[i].proc.label} exited with ${exitCode}: ${vms[i].proc.stderr.trim()}`);
      const rest = vms.slice(i + 1);
      await Promise.all(rest.map((v, k) => v.expectDigest(wsOf(ws, i + 1 + k, size, true), `after VM ${i} exited`)));
      exits.push({ vm: i, exitCode, othersChecked: rest.length });
    }
    progress(`${label}: each VM exited alone; the others' digests stayed right`);
    return { workingSet: ws, scheme, vms: VMS, operationMs, after, rewriteMs, afterRewrite, afterRewriteLate, ksm: ksmFigures, snapshot, pool: poolFigures, exits };
  } finally {
    await Promise.all(vms.map((v) => v.proc.kill()));
    await daemon?.kill();
    ksm?.restore();
    if (typeof cgroup !== 'string') cgroup.remove();
    if (snapshot) rmSync(snapshot.dir, { recursive: true, force: true });
  }
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

/** pvisor-daemon serve --memory-pool in the cell's cgroup, on a socket of its own. */
class PoolDaemon {
  private constructor(private readonly child: ChildProcess, readonly socket: string, private readonly dir: string) {}

  static async start(cgroup: CellCgroup | string, label: string): Promise<PoolDaemon> {
    const dir = mkdtempSync(join(tmpdir(), 'pvisor-bench-pool-'));
    const socket = join(dir, 'pool.sock');
    const argv = [join(__dirname, 'daemon-main.js'), 'serve', '--memory-pool', '--socket', socket, '--max-pool', '1GiB'];
    const [cmd, full] = typeof cgroup === 'string' ? [process.execPath, argv] : cgroup.wrap(process.execPath, argv);
    const child = spawn(cmd, full, { stdio: ['ignore', 'ignore', 'pipe'] });
    let err = '';
    await new Promise<void>((resolve, reject) => {
      child.stderr!.on('data', (d: Buffer) => {
        err += d.toString();
        if (/page pool of up to/.test(err)) resolve();
      });
      child.once('exit', (code) => reject(new Error(`${label}: pvisor-daemon exited with ${code}: ${err.trim()}`)));
    });
    return new PoolDaemon(child, socket, dir);
  }

  get pid(): number {
    return this.child.pid!;
  }

  /** SIGKILL, and waits until it is gone. */
  async kill(): Promise<void> {
    if (this.child.exitCode === null && this.child.signalCode === null) {
      const gone = new Promise((r) => this.child.once('exit', r));
      this.child.kill('SIGKILL');
      await gone;
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
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

const perVm = (bytes: number) => (bytes / VMS / MiB).toFixed(1);

/** Table 3's options (those of `pvisor bench memory --table 3`). */
export const TABLE3_OPTIONS = {
  // Shared with Tables 1-2 (bench-memory.ts): the same option, the same meaning.
  guest: { type: 'string', default: 'probe' },
  'working-sets': { type: 'string', default: WORKING_SETS.join(',') },
  schemes: { type: 'string', default: SCHEMES.join(',') },
  // The study's cells use 64 MiB; a smaller set makes a quick check (its figures then do not compare).
  'working-set': { type: 'string', default: `${STUDY_WORKING_SET_MIB}MiB` },
  // When KSM cells are read (after KSM is turned on, and again after the rewrite).
  'ksm-read-after': { type: 'string', default: `${KSM_READ_AFTER_MS / 1000}s` },
  'snapshot-dir': { type: 'string', default: '/var/tmp/pvisor-bench-snapshots' },
} as const;

/** Checks Table 3's options; nothing starts. */
export function parseTable3Options(argv: string[]): Table3Options {
  const { values } = parseArgs({ args: argv, options: TABLE3_OPTIONS, strict: true });
  const list = <T extends string>(option: string, text: string, known: readonly T[]): T[] => {
    const out = text.split(',').filter(Boolean);
    for (const x of out) if (!known.includes(x as T)) throw new InvalidOptionError(option, `unknown ${x}; expected ${known.join(', ')}`);
    return out as T[];
  };
  if (values.guest !== 'probe' && values.guest !== 'linux') throw new InvalidOptionError('--guest', `expected probe or linux, got ${JSON.stringify(values.guest)}`);
  const guest: Table3Guest = values.guest;
  const workingSets = list('--working-sets', values['working-sets'], WORKING_SETS);
  const schemes = list('--schemes', values.schemes, SCHEMES);
  if (!schemes.includes('private')) schemes.unshift('private'); // savings need the baseline
  const workingSetMiB = parseSize('--working-set', values['working-set']) / MiB;
  if (!Number.isInteger(workingSetMiB) || workingSetMiB < 1 || workingSetMiB > 256) throw new InvalidOptionError('--working-set', 'expected whole MiB, 1MiB to 256MiB');
  const ksmReadAfterMs = parseDurationMs('--ksm-read-after', values['ksm-read-after']);
  const snapshotDir = resolve(values['snapshot-dir']);
  return { guest, workingSets, schemes: SCHEMES.filter((s) => schemes.includes(s)), workingSetMiB, ksmReadAfterMs, snapshotDir };
}

/** `pvisor bench memory --table 3`: measures, prints the tables, returns the JSON. */
export async function benchTable3(opts: Table3Options): Promise<object> {
  if (opts.workingSetMiB !== STUDY_WORKING_SET_MIB) progress(`warning: the study's cells use ${STUDY_WORKING_SET_MIB} MiB; with ${opts.workingSetMiB} MiB its figures do not compare`);
  if (opts.schemes.includes('shared-snapshot')) {
    mkdirSync(opts.snapshotDir, { recursive: true });
    const fs = filesystemOf(opts.snapshotDir);
    // On tmpfs the RAM file is shmem: its pages cannot be dropped and are charged where written.
    if (fs === 'tmpfs' || fs === 'ramfs') throw new InvalidOptionError('--snapshot-dir', `${opts.snapshotDir} is on ${fs}; use a directory on a disk`);
  }
  const probe = CellCgroup.create(`pvisor-bench-${process.pid}-t3-probe`);
  if (typeof probe === 'string') progress(`group memory will read n/a: ${probe}`);
  else probe.remove();

  const cells: Table3Cell[] = [];
  const total = opts.workingSets.length * opts.schemes.length;
  for (const ws of opts.workingSets) {
    for (const scheme of opts.schemes) {
      const label = `[${cells.length + 1}/${total}] ${ws} ${scheme}`;
      progress(`${label}: ${VMS} VM processes in a fresh cgroup`);
      cells.push(await runCell(ws, scheme, opts, label));
    }
  }
  return printTable3(cells, opts);
}

function printTable3(cells: Table3Cell[], opts: Table3Options): object {
  const find = (ws: Table3WorkingSet, scheme: MeasuredScheme) => cells.find((c) => c.workingSet === ws && c.scheme === scheme);
  const ksmRead = `${opts.ksmReadAfterMs / 1000} s`;
  process.stdout.write(`Table 3: four 512 MiB / 2 vCPU ${opts.guest === 'linux' ? 'Linux' : 'probe'} VMs, one process each, in one cgroup per cell; ${opts.workingSetMiB} MiB working set (MiB per VM = group PSS / ${VMS}; the study's figure in brackets)\n`);
  process.stdout.write(`read ${READ_AFTER_MS / 1000} s after the operation (KSM: ${ksmRead} after KSM was turned on, right after the fill), then ${READ_AFTER_MS / 1000} s after a 100% rewrite in every VM, each VM with its own rewrite seed\n`);
  const rows: string[][] = [['working set', 'scheme', 'per VM', 'saving %', 'per VM after rewrite', 'saving after rewrite %', 'guest RAM PSS per VM (after rewrite)', 'rest of the process per VM', 'group memory per VM (after rewrite)']];
  const json: object[] = [];
  for (const ws of opts.workingSets) {
    const base = find(ws, 'private')!;
    for (const scheme of opts.schemes) {
      const study = STUDY_TABLE3[ws][studyScheme(scheme)];
      const name = ws.replace('-', ' ');
      const c = find(ws, scheme)!;
      const saving = scheme === 'private' ? undefined : savingPercent(base.after.groupPssBytes, c.after.groupPssBytes);
      const savingRewrite = scheme === 'private' ? undefined : savingPercent(base.afterRewrite.groupPssBytes, c.afterRewrite.groupPssBytes);
      const mem = (r: GroupReading) => (r.groupMemoryBytes === null ? 'n/a' : perVm(r.groupMemoryBytes));
      rows.push([
        name,
        scheme === 'private' ? 'private (baseline)' : SCHEME_NAMES[scheme],
        beside(c.after.groupPssBytes / VMS / MiB, study.perVmMiB),
        saving === undefined ? '-' : beside(saving, study.savingPercent),
        beside(c.afterRewrite.groupPssBytes / VMS / MiB, study.perVmAfterRewriteMiB),
        savingRewrite === undefined ? '-' : beside(savingRewrite, study.savingAfterRewritePercent),
        `${perVm(c.after.guestRamPssBytes)} (${perVm(c.afterRewrite.guestRamPssBytes)})`,
        perVm(c.after.groupPssBytes - c.after.guestRamPssBytes),
        `${mem(c.after)} (${mem(c.afterRewrite)})`,
      ]);
      json.push({ ...c, savingPercent: saving, savingAfterRewritePercent: savingRewrite, study });
    }
  }
  printTable(rows);
  process.stdout.write('\n');

  const notes: string[] = [];
  // What no guest RAM scheme can save: each VM's process around its guest RAM (Node, pvisor, the VMM).
  const rest = cells.map((c) => (c.after.groupPssBytes - c.after.guestRamPssBytes) / VMS);
  const privates = cells.filter((c) => c.scheme === 'private');
  const ceiling = Math.max(...privates.map((c) => savingPercent(c.after.groupPssBytes, c.after.groupPssBytes - c.after.guestRamPssBytes)));
  notes.push(`each VM's process besides its guest RAM (Node, pvisor, the VMM): ${(Math.min(...rest) / MiB).toFixed(1)}-${(Math.max(...rest) / MiB).toFixed(1)} MiB per VM; a scheme whose guest RAM cost nothing would save at most ${ceiling.toFixed(1)}% against private here`);
  for (const c of cells.filter((x) => x.ksm)) {
    const k = c.ksm!;
    const base = find(c.workingSet, 'private')!;
    const late = c.afterRewriteLate!;
    notes.push(
      `KSM, ${c.workingSet}: ${k.settledAfterMs < opts.ksmReadAfterMs - 1500 ? `merging settled ${(k.settledAfterMs / 1000).toFixed(0)} s after KSM was turned on` : 'still merging at the reading'}; ${c.after.ksmMergedPages} pages merged in the cell; guest RAM mappings advised: ${k.advisedMappings} of ${k.guestRamMappings} (VmFlags mg, read from outside); ${ksmRead} after the rewrite: ${perVm(late.groupPssBytes)} MiB per VM, saving ${savingPercent(base.afterRewrite.groupPssBytes, late.groupPssBytes).toFixed(1)}%, ${late.ksmMergedPages} pages merged`,
    );
  }
  const ksmCell = cells.find((x) => x.ksm);
  if (ksmCell) notes.push(`KSM settings for each KSM cell, put back after it: ${ksmCell.ksm!.settings.map((s) => `${s.name} ${s.before} -> ${s.now}`).join(', ') || 'none changed'}`);
  for (const c of cells.filter((x) => x.snapshot)) {
    const s = c.snapshot!;
    const r = stats(s.restoreMs);
    const left = s.sourcePageCacheAfterDropBytes === null ? 'n/a' : (s.sourcePageCacheAfterDropBytes / MiB).toFixed(1);
    notes.push(
      `shared snapshot, ${c.workingSet}: snapshot ${s.snapshotMs.toFixed(0)} ms, RAM file ${(s.ramFileAllocatedBytes / MiB).toFixed(1)} MiB on disk, source's page cache left after the drop ${left} MiB; Vm.restore ${r.min.toFixed(0)}-${r.max.toFixed(0)} ms per clone (4 at once); cell page cache ${c.after.groupPageCacheBytes === null ? 'n/a' : (c.after.groupPageCacheBytes / MiB).toFixed(1)} MiB, clones' written guest RAM ${perVm(c.after.guestRamAnonymousBytes)} MiB per VM (${perVm(c.afterRewrite.guestRamAnonymousBytes)} after the rewrite)`,
    );
  }
  for (const c of cells.filter((x) => x.pool)) {
    const p = c.pool!;
    const arriving = c.scheme === 'daemon-pool-arriving';
    const peak =
      p.groupPeakDuringMergeBytes === null || p.groupSettledBytes === null || p.groupBeforeMergeBytes === null
        ? 'n/a'
        : `${(p.groupPeakDuringMergeBytes / MiB).toFixed(1)} MiB, ${((p.groupPeakDuringMergeBytes - p.groupSettledBytes) / MiB).toFixed(1)} above the settled ${(p.groupSettledBytes / MiB).toFixed(1)} and ${((p.groupPeakDuringMergeBytes - p.groupBeforeMergeBytes) / MiB).toFixed(1)} above the group before ${arriving ? 'the first fill' : 'the merge'}`;
    const passes = arriving ? `merge passes after each arrival and of all four at the end ${p.mergeMs.map((m) => m.toFixed(0)).join(', ')} ms` : `merge of four VMs ${p.mergeMs.map((m) => m.toFixed(0)).join(' + ')} ms (two passes)`;
    notes.push(
      `${SCHEME_NAMES[c.scheme]}, ${c.workingSet}: ${passes}, ${p.mergeAfterRewriteMs.toFixed(0)} ms after the rewrite; group peak during the merge ${peak}; pages shared per VM ${Math.min(...p.pagesShared)}-${Math.max(...p.pagesShared)}, guest RAM mappings per VM ${Math.min(...p.guestRamMappings)}-${Math.max(...p.guestRamMappings)}; the daemon's PSS ${(p.daemonPssBytes / MiB).toFixed(1)} MiB (in the group); daemon SIGKILLed at the end: ${p.vmsKeptAfterDaemonKill} of ${VMS} VMs kept their digests`,
    );
  }
  // A write to a shared page is a copy-on-write fault (a clone's file page, a KSM page): what it costs the guest.
  for (const ws of opts.workingSets) {
    const times = opts.schemes.map((sc) => `${SCHEME_NAMES[sc]} ${find(ws, sc)!.rewriteMs.toFixed(0)}`);
    notes.push(`100% rewrite, ${VMS} VMs at once, ${ws}: ${times.join(', ')} ms`);
  }
  notes.push(`every cell: ${VMS} digests right after the operation and after the rewrite; each VM exited alone and the others' digests stayed right (${cells.reduce((n, c) => n + c.exits.reduce((m, e) => m + e.othersChecked, 0), 0)} checks)`);
  for (const n of notes) process.stdout.write(`${n}\n`);
  process.stdout.write('\n');

  process.stdout.write('Goals of Table 3 (issues 11 and 13; saving per VM against private, same working set, same run)\n');
  const goalRows: string[][] = [['issue', 'goal', 'working set', 'ours', 'bound', 'met']];
  const goals: object[] = [];
  for (const g of TABLE3_GOALS) {
    const c = find(g.workingSet, g.scheme);
    if (!c) continue;
    const ours = savingPercent(find(g.workingSet, 'private')!.after.groupPssBytes, c.after.groupPssBytes);
    const verified = !c.ksm || (c.ksm.guestRamMappings > 0 && c.ksm.advisedMappings === c.ksm.guestRamMappings);
    const met = ours >= g.minSavingPercent && verified;
    const goal = `${SCHEME_NAMES[g.scheme]} saving per VM, %${c.ksm ? `, at ${ksmRead}, every mapping advised` : ''}`;
    goalRows.push([String(g.issue), goal, g.workingSet.replace('-', ' '), `${ours.toFixed(1)}${c.ksm ? (verified ? ', all mg' : ', NOT all mg') : ''}`, `>= ${g.minSavingPercent} (${g.why})`, met ? 'yes' : 'NO']);
    goals.push({ issue: g.issue, goal, workingSet: g.workingSet, scheme: g.scheme, ours, bound: g.minSavingPercent, everyMappingAdvised: c.ksm ? verified : undefined, met });
  }
  for (const c of cells.filter((x) => x.pool)) {
    const p = c.pool!;
    if (p.groupPeakDuringMergeBytes !== null && p.groupSettledBytes !== null) {
      const above = (p.groupPeakDuringMergeBytes - p.groupSettledBytes) / MiB;
      // With all four filled first, the group before the merge is already this far above settled.
      const floor = c.scheme === 'daemon-pool' && p.groupBeforeMergeBytes !== null ? (p.groupBeforeMergeBytes - p.groupSettledBytes) / MiB : undefined;
      const ours = floor === undefined ? above.toFixed(1) : `${above.toFixed(1)} (before the merge: ${floor.toFixed(1)})`;
      goalRows.push(['13', `${SCHEME_NAMES[c.scheme]}: group peak during the merge above the settled figure, MiB`, c.workingSet.replace('-', ' '), ours, '<= 200 (study: about 540 in all)', above <= 200 ? 'yes' : 'NO']);
      goals.push({ issue: 13, goal: 'group peak during the merge above settled, MiB', workingSet: c.workingSet, scheme: c.scheme, ours: above, groupBeforeMergeAboveSettled: floor, bound: 200, met: above <= 200 });
    }
    goalRows.push(['13', `${SCHEME_NAMES[c.scheme]}: VMs lost when the daemon is killed`, c.workingSet.replace('-', ' '), String(VMS - p.vmsKeptAfterDaemonKill), '0', p.vmsKeptAfterDaemonKill === VMS ? 'yes' : 'NO']);
    goals.push({ issue: 13, goal: 'VMs lost when the daemon is killed', workingSet: c.workingSet, scheme: c.scheme, ours: VMS - p.vmsKeptAfterDaemonKill, bound: 0, met: p.vmsKeptAfterDaemonKill === VMS });
  }
  printTable(goalRows);
  process.stdout.write('\n');
  return {
    setup: { vms: VMS, memoryMiB: 512, vcpus: 2, workingSetMiB: opts.workingSetMiB, readAfterMs: READ_AFTER_MS, ksmReadAfterMs: opts.ksmReadAfterMs, rewrite: 'fraction 1, each VM its own seed (1001 + VM)', snapshotDir: opts.snapshotDir },
    rows: json,
    goals,
  };
}
