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
 *   followed the one before it (`daemon-pool-arriving` in ./table3-setup.ts).
 * Every VM's digest is checked against the host's model after the operation. Readings: 2 s after
 * the operation (KSM: 60 s), then 2 s after a 100% rewrite in every VM, each with its own seed
 * (KSM also 60 s after it). Then the VMs exit one at a time, and after each exit the others'
 * digests must still be right, or the cell fails. Saving = 1 - scheme / private, same working set,
 * same run. The run of record and what it found: docs/memory-table3.md.
 */
import { mkdirSync } from 'node:fs';
import { InvalidOptionError } from '../errors';
import { CellCgroup } from './cell-cgroup';
import { filesystemOf } from './filesystem';
import { beside, GoalTable, printTableBlock, progress, stats } from './report';
import { STUDY_TABLE3, STUDY_WORKING_SET_MIB, TABLE3_GOALS, savingPercent, type Table3WorkingSet } from './study-figures';
import { perVm, runCell, type GroupReading, type Table3Cell } from './table3-cell';
import { READ_AFTER_MS, SCHEME_NAMES, studyScheme, VMS, type MeasuredScheme, type Table3Options } from './table3-setup';

const MiB = 2 ** 20;

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
  const rows = printTable3(cells, opts);
  printNotes(cells, opts);
  const goals = printGoals(cells, opts);
  return {
    setup: { vms: VMS, memoryMiB: 512, vcpus: 2, workingSetMiB: opts.workingSetMiB, readAfterMs: READ_AFTER_MS, ksmReadAfterMs: opts.ksmReadAfterMs, rewrite: 'fraction 1, each VM its own seed (1001 + VM)', snapshotDir: opts.snapshotDir },
    rows,
    goals,
  };
}

/** The cell of `scheme` with working set `ws`, if it ran. */
const findCell = (cells: Table3Cell[], ws: Table3WorkingSet, scheme: MeasuredScheme) => cells.find((c) => c.workingSet === ws && c.scheme === scheme);
/** When KSM cells are read, in words. */
const ksmReadText = (opts: Table3Options) => `${opts.ksmReadAfterMs / 1000} s`;

/** Table 3 itself; returns its rows as JSON (each cell with its savings and the study's figures). */
function printTable3(cells: Table3Cell[], opts: Table3Options): object[] {
  process.stdout.write(`Table 3: four 512 MiB / 2 vCPU ${opts.guest === 'linux' ? 'Linux' : 'probe'} VMs, one process each, in one cgroup per cell; ${opts.workingSetMiB} MiB working set (MiB per VM = group PSS / ${VMS}; the study's figure in brackets)\n`);
  process.stdout.write(`read ${READ_AFTER_MS / 1000} s after the operation (KSM: ${ksmReadText(opts)} after KSM was turned on, right after the fill), then ${READ_AFTER_MS / 1000} s after a 100% rewrite in every VM, each VM with its own rewrite seed\n`);
  const rows: string[][] = [['working set', 'scheme', 'per VM', 'saving %', 'per VM after rewrite', 'saving after rewrite %', 'guest RAM PSS per VM (after rewrite)', 'rest of the process per VM', 'group memory per VM (after rewrite)']];
  const json: object[] = [];
  for (const ws of opts.workingSets) {
    const base = findCell(cells, ws, 'private')!;
    for (const scheme of opts.schemes) {
      const study = STUDY_TABLE3[ws][studyScheme(scheme)];
      const name = ws.replace('-', ' ');
      const c = findCell(cells, ws, scheme)!;
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
  printTableBlock(rows);
  return json;
}

/** The notes under Table 3: what each scheme's cells did besides their figures. */
function printNotes(cells: Table3Cell[], opts: Table3Options): void {
  const notes = [processNote(cells), ...ksmNotes(cells, opts), ...snapshotNotes(cells), ...poolNotes(cells)];
  // A write to a shared page is a copy-on-write fault (a clone's file page, a KSM page): what it costs the guest.
  for (const ws of opts.workingSets) {
    const times = opts.schemes.map((sc) => `${SCHEME_NAMES[sc]} ${findCell(cells, ws, sc)!.rewriteMs.toFixed(0)}`);
    notes.push(`100% rewrite, ${VMS} VMs at once, ${ws}: ${times.join(', ')} ms`);
  }
  notes.push(`every cell: ${VMS} digests right after the operation and after the rewrite; each VM exited alone and the others' digests stayed right (${cells.reduce((n, c) => n + c.exits.reduce((m, e) => m + e.othersChecked, 0), 0)} checks)`);
  for (const n of notes) process.stdout.write(`${n}\n`);
  process.stdout.write('\n');
}

/** What no guest RAM scheme can save: each VM's process around its guest RAM (Node, pvisor, the VMM). */
function processNote(cells: Table3Cell[]): string {
  const rest = cells.map((c) => (c.after.groupPssBytes - c.after.guestRamPssBytes) / VMS);
  const privates = cells.filter((c) => c.scheme === 'private');
  const ceiling = Math.max(...privates.map((c) => savingPercent(c.after.groupPssBytes, c.after.groupPssBytes - c.after.guestRamPssBytes)));
  return `each VM's process besides its guest RAM (Node, pvisor, the VMM): ${(Math.min(...rest) / MiB).toFixed(1)}-${(Math.max(...rest) / MiB).toFixed(1)} MiB per VM; a scheme whose guest RAM cost nothing would save at most ${ceiling.toFixed(1)}% against private here`;
}

/** How KSM merged in each KSM cell, and the settings it ran with. */
function ksmNotes(cells: Table3Cell[], opts: Table3Options): string[] {
  const notes: string[] = [];
  for (const c of cells.filter((x) => x.ksm)) {
    const k = c.ksm!;
    const base = findCell(cells, c.workingSet, 'private')!;
    const late = c.afterRewriteLate!;
    notes.push(
      `KSM, ${c.workingSet}: ${k.settledAfterMs < opts.ksmReadAfterMs - 1500 ? `merging settled ${(k.settledAfterMs / 1000).toFixed(0)} s after KSM was turned on` : 'still merging at the reading'}; ${c.after.ksmMergedPages} pages merged in the cell; guest RAM mappings advised: ${k.advisedMappings} of ${k.guestRamMappings} (VmFlags mg, read from outside); ${ksmReadText(opts)} after the rewrite: ${perVm(late.groupPssBytes)} MiB per VM, saving ${savingPercent(base.afterRewrite.groupPssBytes, late.groupPssBytes).toFixed(1)}%, ${late.ksmMergedPages} pages merged`,
    );
  }
  const ksmCell = cells.find((x) => x.ksm);
  if (ksmCell) notes.push(`KSM settings for each KSM cell, put back after it: ${ksmCell.ksm!.settings.map((s) => `${s.name} ${s.before} -> ${s.now}`).join(', ') || 'none changed'}`);
  return notes;
}

/** How each shared snapshot was made and restored. */
function snapshotNotes(cells: Table3Cell[]): string[] {
  return cells
    .filter((x) => x.snapshot)
    .map((c) => {
      const s = c.snapshot!;
      const r = stats(s.restoreMs);
      const left = s.sourcePageCacheAfterDropBytes === null ? 'n/a' : (s.sourcePageCacheAfterDropBytes / MiB).toFixed(1);
      return `shared snapshot, ${c.workingSet}: snapshot ${s.snapshotMs.toFixed(0)} ms, RAM file ${(s.ramFileAllocatedBytes / MiB).toFixed(1)} MiB on disk, source's page cache left after the drop ${left} MiB; Vm.restore ${r.min.toFixed(0)}-${r.max.toFixed(0)} ms per clone (4 at once); cell page cache ${c.after.groupPageCacheBytes === null ? 'n/a' : (c.after.groupPageCacheBytes / MiB).toFixed(1)} MiB, clones' written guest RAM ${perVm(c.after.guestRamAnonymousBytes)} MiB per VM (${perVm(c.afterRewrite.guestRamAnonymousBytes)} after the rewrite)`;
    });
}

/** What the pool's merges did in each daemon-pool cell. */
function poolNotes(cells: Table3Cell[]): string[] {
  return cells
    .filter((x) => x.pool)
    .map((c) => {
      const p = c.pool!;
      const arriving = c.scheme === 'daemon-pool-arriving';
      const peak =
        p.groupPeakDuringMergeBytes === null || p.groupSettledBytes === null || p.groupBeforeMergeBytes === null
          ? 'n/a'
          : `${(p.groupPeakDuringMergeBytes / MiB).toFixed(1)} MiB, ${((p.groupPeakDuringMergeBytes - p.groupSettledBytes) / MiB).toFixed(1)} above the settled ${(p.groupSettledBytes / MiB).toFixed(1)} and ${((p.groupPeakDuringMergeBytes - p.groupBeforeMergeBytes) / MiB).toFixed(1)} above the group before ${arriving ? 'the first fill' : 'the merge'}`;
      const passes = arriving ? `merge passes after each arrival and of all four at the end ${p.mergeMs.map((m) => m.toFixed(0)).join(', ')} ms` : `merge of four VMs ${p.mergeMs.map((m) => m.toFixed(0)).join(' + ')} ms (two passes)`;
      return `${SCHEME_NAMES[c.scheme]}, ${c.workingSet}: ${passes}, ${p.mergeAfterRewriteMs.toFixed(0)} ms after the rewrite; group peak during the merge ${peak}; pages shared per VM ${Math.min(...p.pagesShared)}-${Math.max(...p.pagesShared)}, guest RAM mappings per VM ${Math.min(...p.guestRamMappings)}-${Math.max(...p.guestRamMappings)}; the daemon's PSS ${(p.daemonPssBytes / MiB).toFixed(1)} MiB (in the group); daemon SIGKILLed at the end: ${p.vmsKeptAfterDaemonKill} of ${VMS} VMs kept their digests`;
    });
}

/** The goals table of Table 3; returns the goals as JSON. */
function printGoals(cells: Table3Cell[], opts: Table3Options): object[] {
  process.stdout.write('Goals of Table 3 (issues 11 and 13; saving per VM against private, same working set, same run)\n');
  const goals = new GoalTable(['issue', 'goal', 'working set', 'ours', 'bound']);
  for (const g of TABLE3_GOALS) {
    const c = findCell(cells, g.workingSet, g.scheme);
    if (!c) continue;
    const ours = savingPercent(findCell(cells, g.workingSet, 'private')!.after.groupPssBytes, c.after.groupPssBytes);
    const verified = !c.ksm || (c.ksm.guestRamMappings > 0 && c.ksm.advisedMappings === c.ksm.guestRamMappings);
    const met = ours >= g.minSavingPercent && verified;
    const goal = `${SCHEME_NAMES[g.scheme]} saving per VM, %${c.ksm ? `, at ${ksmReadText(opts)}, every mapping advised` : ''}`;
    goals.add([String(g.issue), goal, g.workingSet.replace('-', ' '), `${ours.toFixed(1)}${c.ksm ? (verified ? ', all mg' : ', NOT all mg') : ''}`, `>= ${g.minSavingPercent} (${g.why})`], met, { issue: g.issue, goal, workingSet: g.workingSet, scheme: g.scheme, ours, bound: g.minSavingPercent, everyMappingAdvised: c.ksm ? verified : undefined, met });
  }
  for (const c of cells.filter((x) => x.pool)) {
    const p = c.pool!;
    if (p.groupPeakDuringMergeBytes !== null && p.groupSettledBytes !== null) {
      const above = (p.groupPeakDuringMergeBytes - p.groupSettledBytes) / MiB;
      // With all four filled first, the group before the merge is already this far above settled.
      const floor = c.scheme === 'daemon-pool' && p.groupBeforeMergeBytes !== null ? (p.groupBeforeMergeBytes - p.groupSettledBytes) / MiB : undefined;
      const ours = floor === undefined ? above.toFixed(1) : `${above.toFixed(1)} (before the merge: ${floor.toFixed(1)})`;
      goals.add(['13', `${SCHEME_NAMES[c.scheme]}: group peak during the merge above the settled figure, MiB`, c.workingSet.replace('-', ' '), ours, '<= 200 (study: about 540 in all)'], above <= 200, { issue: 13, goal: 'group peak during the merge above settled, MiB', workingSet: c.workingSet, scheme: c.scheme, ours: above, groupBeforeMergeAboveSettled: floor, bound: 200, met: above <= 200 });
    }
    goals.add(['13', `${SCHEME_NAMES[c.scheme]}: VMs lost when the daemon is killed`, c.workingSet.replace('-', ' '), String(VMS - p.vmsKeptAfterDaemonKill), '0'], p.vmsKeptAfterDaemonKill === VMS, { issue: 13, goal: 'VMs lost when the daemon is killed', workingSet: c.workingSet, scheme: c.scheme, ours: VMS - p.vmsKeptAfterDaemonKill, bound: 0, met: p.vmsKeptAfterDaemonKill === VMS });
  }
  goals.print();
  return goals.results;
}
