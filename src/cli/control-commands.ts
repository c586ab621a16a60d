/**
 * `pvisor suspend`, `resume`, `stop` and `ps`: the client end of the control socket of VMs started
 * by `pvisor run` (see ../control-socket.ts), with the reference CLI's options for parity; and
 * of hibernated VMs, which have no process (../snapshot/hibernation-record.ts, ./resume-hibernated.ts).
 */
import { readFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { InvalidOptionError, PvisorError, VmNotFoundError } from '../errors';
import {
  controlRequest,
  idOfSocket,
  probeSocket,
  runtimeDir,
  socketPathFor,
  type ControlMemory,
  type ControlRequest,
  type ControlResponse,
  type ControlVmInfo,
} from '../control-socket';
import { processGone } from '../sys/processes';
import { validateVmName } from '../vm-name';
import type { GuestKind } from '../vm-types';
import { formatLabels, type Labels } from '../labels';
import { readHibernationRecord, recordPathFor, type HibernationRecord } from '../snapshot/hibernation-record';
import { parseStoreUrl } from '../store/store-url';
import { entryOfHibernated, entryOfLive, scanRuntimeDir, type HibernatedRow, type LiveRow } from '../vm-list';
import { EXIT_HIBERNATED, parseUsage, RefusedError } from './usage';

/** The commands that act on one VM. */
export type ControlCommand = 'suspend' | 'resume' | 'stop';

/** Parsed arguments of a {@link ControlCommand}. */
export interface ControlArgs {
  id: string;
  socketPath: string;
  /** suspend: offload RAM (Vm.suspend) rather than only pause. */
  offload: boolean;
  /**
   * suspend `--hibernate`: the VM's state goes to disk and its process ends (implies
   * `--vm-offload`: all of its RAM leaves memory).
   */
  hibernate: boolean;
  /** resume `--foreground`: a hibernated VM continues in this process instead of a detached one. */
  foreground: boolean;
  /**
   * suspend `--hibernate --store s3://...`: the VM goes to an object store and leaves this host;
   * resume `--store s3://...`: a VM hibernated there continues here (docs/object-store.md).
   */
  store?: string;
  /** resume `--store --take-over CLAIM`: the claim of a resume that died before its VM ran, taken over. */
  takeOver?: string;
  /** resume: `--vm-load` was given (resume always loads back what a suspend took). */
  load: boolean;
  /** Print the socket's answer as JSON instead of a sentence. */
  json: boolean;
  attemptId?: string;
}

/** A suspend writes all of guest RAM to disk: give a big VM on a slow disk its time. */
const OPERATION_TIMEOUT_MS = 10 * 60 * 1000;

/**
 * Parses `pvisor suspend|resume|stop [ID] [--vm-socket PATH] [--vm-job-id JOB] [--vm-attempt-id A]`
 * (+ `--vm-offload` for suspend, `--vm-load` for resume). The id is ID, else the job id, else the
 * socket's name; ID and a different job id are an error.
 */
export function parseControlArgs(command: ControlCommand, argv: string[], dir: string = runtimeDir()): ControlArgs {
  const { values, positionals } = parseArgs({
    args: argv,
    options: {
      'vm-socket': { type: 'string' },
      'vm-job-id': { type: 'string' },
      'vm-attempt-id': { type: 'string' },
      json: { type: 'boolean', default: false },
      ...(command === 'suspend' ? { 'vm-offload': { type: 'boolean', default: false }, hibernate: { type: 'boolean', default: false }, store: { type: 'string' } } : {}),
      ...(command === 'resume' ? { 'vm-load': { type: 'boolean', default: false }, foreground: { type: 'boolean', default: false }, store: { type: 'string' }, 'take-over': { type: 'string' } } : {}),
    },
    allowPositionals: true,
    strict: true,
  });
  if (positionals.length > 1) throw new InvalidOptionError('id', `one VM at a time, got ${positionals.length}: ${positionals.join(' ')}`);
  const socket = values['vm-socket'] as string | undefined;
  const jobId = values['vm-job-id'] as string | undefined;
  const given = positionals[0];
  if (given !== undefined && jobId !== undefined && given !== jobId) {
    throw new InvalidOptionError('vm-job-id', `${JSON.stringify(jobId)} is not the VM id given (${JSON.stringify(given)}); the job id is the VM id`);
  }
  const id = given ?? jobId ?? (socket !== undefined ? idOfSocket(socket) : undefined);
  if (id === undefined) throw new InvalidOptionError('id', `which VM? e.g. pvisor ${command} ID (pvisor ps lists them)`);
  validateVmName(id, 'id');
  const store = values.store as string | undefined;
  if (store !== undefined) {
    if (command === 'suspend' && values.hibernate !== true) throw new InvalidOptionError('store', 'goes with --hibernate: pvisor suspend ID --hibernate --store s3://BUCKET/PREFIX');
    try {
      parseStoreUrl(store);
    } catch (e) {
      throw new InvalidOptionError('store', (e as Error).message);
    }
  }
  const takeOver = values['take-over'] as string | undefined;
  if (takeOver !== undefined) {
    if (store === undefined) throw new InvalidOptionError('take-over', 'goes with --store: it takes over the claim of a VM hibernated in an object store');
    if (!/^[0-9a-f]{32}$/.test(takeOver)) throw new InvalidOptionError('take-over', 'must be a claim id (32 hex digits, as a refused resume names it)');
  }
  return {
    id,
    socketPath: socket ?? socketPathFor(id, dir),
    // A hibernated VM's RAM is all on disk: --hibernate is the furthest an offload goes.
    offload: values['vm-offload'] === true || values.hibernate === true,
    hibernate: values.hibernate === true,
    foreground: values.foreground === true,
    ...(store !== undefined && { store }),
    ...(takeOver !== undefined && { takeOver }),
    load: values['vm-load'] === true,
    json: values.json === true,
    attemptId: values['vm-attempt-id'] as string | undefined,
  };
}

/** Bytes as KiB below 1 MiB (so that "almost nothing" shows), else MiB with one decimal. */
export function formatBytes(bytes: number): string {
  return bytes < 2 ** 20 ? `${Math.round(bytes / 1024)} KiB` : `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}

/** Runs suspend, resume or stop; resolves with the exit status. */
export async function cmdControl(command: ControlCommand, argv: string[]): Promise<number> {
  const a = parseUsage(command, () => parseControlArgs(command, argv));
  const live = command === 'resume' && (await probeSocket(a.socketPath)) === 'live';
  const store = a.store !== undefined ? { url: a.store, ...(a.takeOver && { takeOver: a.takeOver }) } : undefined;
  if (a.foreground) {
    // The process a `pvisor resume` started: whatever it finds, a refusal too, it reports to that
    // resume, which would otherwise see only an exit status (two resumes at once: the loser's
    // process finds the winner's socket live).
    const { runHibernated } = await import('./resume-hibernated');
    return runHibernated(a.id, a.socketPath, store, { live });
  }
  if (command === 'resume' && !live) {
    // No process answers for it: a hibernated VM is continued in a new one.
    const { startResume } = await import('./resume-hibernated');
    if (!store && !hibernationOf(a)) return cmdControlRequest(command, a);
    const t0 = performance.now();
    const report = await startResume(a.id, a.socketPath, store);
    const tookMs = Math.round((performance.now() - t0) * 10) / 10;
    if (a.json) process.stdout.write(`${JSON.stringify({ id: a.id, tookMs, ...(store && { store: store.url }), ...report })}\n`);
    else {
      const load = report.ramLoad === 'lazy' ? 'guest RAM loading lazily' : `guest RAM ${report.ramLoad}`;
      process.stdout.write(
        `${a.id}${attemptOf(a)} resumed from hibernation${store ? ` in ${store.url}` : ''} in ${tookMs} ms (ready ${report.readyMs} ms after its process began restoring; ${load}): ` +
          `pid ${report.pid}, guest RAM resident ${formatBytes(report.guestRamResidentBytes)}, process ${formatBytes(report.processPssBytes)}; its output goes to ${report.log}\n`,
      );
    }
    return 0;
  }
  if (command === 'resume' && a.store !== undefined) throw new RefusedError(`resume ${a.id} --store refused: a VM named ${a.id} runs on this host (${a.socketPath})`);
  return cmdControlRequest(command, a);
}

/** The hibernation record of the VM of `a`, if it has one (checked). */
function hibernationOf(a: ControlArgs): HibernationRecord | undefined {
  return readHibernationRecord(recordPathFor(a.socketPath), a.id);
}

/** Sends the command to the VM's process, or acts on its hibernation when it has none. */
async function cmdControlRequest(command: ControlCommand, a: ControlArgs): Promise<number> {
  const request: ControlRequest = command === 'suspend' ? (a.hibernate ? { op: 'hibernate', ...(a.store !== undefined && { store: a.store }) } : { op: 'suspend', offload: a.offload }) : { op: command };
  let r: ControlResponse;
  try {
    r = await controlRequest(a.socketPath, a.id, request, OPERATION_TIMEOUT_MS);
  } catch (e) {
    if (!(e instanceof VmNotFoundError)) throw e;
    const record = hibernationOf(a);
    if (!record) throw new VmNotFoundError(a.id, `${e.message.replace(/ is running/, ' is running or hibernated')}`);
    if (command === 'stop') return discard(a);
    if (command === 'resume') throw new RefusedError(`resume ${a.id} refused: ${a.id} was hibernated and is being resumed`);
    throw new RefusedError(`${command} ${a.id} refused: ${a.id} is hibernated (its state is on disk in ${record.dir}, it has no process); pvisor resume ${a.id} continues it`);
  }
  if (!r.ok) {
    // Nothing to resume is the caller's mistake, not a failure: a script can tell it from a
    // resume that failed (a damaged backing file), after which the VM stays suspended.
    if (command === 'resume' && r.error.code === 'PVISOR_VM_STATE' && (r.vm?.state === 'running' || r.vm?.state === 'starting')) {
      throw new RefusedError(`resume ${a.id} refused: ${a.id} is ${r.vm.state}, not paused, suspended or hibernated: nothing to resume`);
    }
    // So is any request the VM's state does not allow (a suspend of a suspended VM).
    if (r.error.code === 'PVISOR_VM_STATE') throw new RefusedError(`${command} ${a.id} refused: ${r.error.message}${r.vm ? ` (${a.id} is ${r.vm.state})` : ''}`);
    throw new PvisorError(r.error.code, `${command} ${a.id} failed: ${r.error.message}${r.vm ? ` (${a.id} is ${r.vm.state})` : ''}`);
  }
  if (request.op === 'hibernate') {
    // The answer comes before the process ends: say so only once it has.
    const ended = await processEnded(r.vm.pid, PROCESS_END_TIMEOUT_MS);
    if (a.json) process.stdout.write(`${JSON.stringify({ ...controlResult(command, r), state: 'hibernated', processEnded: ended, hibernation: r.hibernation })}\n`);
    else process.stdout.write(`${describeHibernation(a, r, ended)}\n`);
    return 0;
  }
  process.stdout.write(`${a.json ? JSON.stringify(controlResult(command, r)) : describe(command, a, r)}\n`);
  return 0;
}

/**
 * What `--json` prints for a suspend, resume or stop: a plain object, the VM's state as the
 * command left it (`stopped` after a stop), and the memory figures before and after.
 */
function controlResult(command: ControlCommand, r: ControlResponse & { ok: true }): Record<string, unknown> {
  const figures = (m: ControlMemory | undefined) => m && { guestRamResidentBytes: m.guestRamResidentBytes, processPssBytes: m.processPssBytes, bytesOnDisk: m.bytesOnDisk };
  return {
    id: r.vm.id,
    command,
    state: command === 'stop' ? 'stopped' : r.vm.state,
    pid: r.vm.pid,
    ...(r.tookMs !== undefined && { tookMs: r.tookMs }),
    ...(r.releasedMs !== undefined && { releasedMs: r.releasedMs }),
    ...(r.before && { before: figures(r.before) }),
    ...(r.memory && { after: figures(r.memory) }),
  };
}

/** `pvisor stop ID` of a hibernated VM: its state and record removed. */
async function discard(a: ControlArgs): Promise<number> {
  const { discardHibernatedVm } = await import('./resume-hibernated');
  const done = await discardHibernatedVm(a.id, a.socketPath);
  // A resume won the race: the VM runs again, and the stop is for it.
  if (done === 'running') return cmdControlRequest('stop', a);
  if (!done) throw new VmNotFoundError(a.id, `no VM named ${a.id} is running or hibernated`);
  const { record } = done;
  if (a.json) process.stdout.write(`${JSON.stringify({ id: a.id, discarded: record })}\n`);
  else process.stdout.write(`${a.id}${attemptOf(a)} discarded (it was hibernated; ${formatBytes(record.bytesOnDisk)} on disk removed with ${record.dir})\n`);
  return 0;
}

/** A hibernating run's process ends right after its answer. */
const PROCESS_END_TIMEOUT_MS = 30_000;

async function processEnded(pid: number, timeoutMs: number): Promise<boolean> {
  for (const t0 = Date.now(); Date.now() - t0 < timeoutMs; await new Promise((r) => setTimeout(r, 20))) if (processGone(pid) || isZombie(pid)) return true;
  return false;
}

/** An ended process that its parent has not reaped yet holds no memory: it has ended. */
function isZombie(pid: number): boolean {
  try {
    // The state follows the command name, which is in parentheses and may itself hold some.
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2).startsWith('Z');
  } catch {
    return false;
  }
}

function describeHibernation(a: ControlArgs, r: ControlResponse & { ok: true }, ended: boolean): string {
  const h = r.hibernation!;
  const before = r.before;
  const took = r.tookMs !== undefined ? ` in ${r.tookMs} ms` : '';
  const memory = before ? `guest RAM resident ${formatBytes(before.guestRamResidentBytes)}, process ${formatBytes(before.processPssBytes)} -> 0` : 'memory -> 0';
  const process = ended ? `its process (pid ${r.vm.pid}) has ended (pvisor run exits ${EXIT_HIBERNATED})` : `its process (pid ${r.vm.pid}) has not ended yet`;
  if (h.store) {
    const t = h.store;
    return (
      `${a.id}${attemptOf(a)} hibernated to ${h.dir}${took}: ${memory}; ${formatBytes(t.bytesTransferred)} sent in ${t.chunksTransferred} objects (${t.chunksPresent} present, ${t.zeroChunks} zero chunks); ` +
      `${process}. pvisor resume ${a.id} --store ${h.dir} continues it, on this host or another`
    );
  }
  return `${a.id}${attemptOf(a)} hibernated${took}: ${memory}; ${formatBytes(h.bytesOnDisk)} on disk in ${h.dir}; ${process}. pvisor resume ${a.id} continues it`;
}

function attemptOf(a: ControlArgs): string {
  return a.attemptId !== undefined ? ` (attempt ${a.attemptId})` : '';
}

function describe(command: ControlCommand, a: ControlArgs, r: ControlResponse & { ok: true }): string {
  const attempt = attemptOf(a);
  const after = r.memory;
  const before = r.before;
  const took = r.tookMs !== undefined ? ` in ${r.tookMs} ms` : '';
  const resident = (m: ControlMemory | undefined) => (m ? formatBytes(m.guestRamResidentBytes) : '?');
  switch (command) {
    case 'suspend':
      if (a.offload) {
        const released = r.releasedMs !== undefined ? `\n${a.id}${attempt} memory released ${r.releasedMs} ms after the request` : '';
        return `${a.id}${attempt} suspended${took}: guest RAM resident ${resident(before)} -> ${resident(after)}, ${formatBytes(after?.bytesOnDisk ?? 0)} on disk${released}`;
      }
      return `${a.id}${attempt} paused${took}: guest RAM resident ${resident(after)}, kept in memory (pvisor suspend --vm-offload drops it)`;
    case 'resume': {
      const loaded = (before?.bytesOnDisk ?? 0) > 0 ? ', loaded back and verified' : '';
      return `${a.id}${attempt} resumed${took}: guest RAM resident ${resident(before)} -> ${resident(after)}${loaded}`;
    }
    case 'stop':
      return `${a.id}${attempt} stopped (it was ${r.vm.state}; guest RAM resident ${resident(after)} freed)`;
  }
}

/**
 * A VM as `pvisor ps --json` prints it: a plain object, the same fields for a live and a
 * hibernated VM (a hibernated one has no process: pid null, 0 bytes of memory).
 */
export interface PsRow {
  id: string;
  state: ControlVmInfo['state'] | 'unresponsive';
  pid: number | null;
  guest?: GuestKind;
  memoryBytes?: number;
  vcpus?: number;
  guestRamResidentBytes?: number;
  processPssBytes?: number;
  bytesOnDisk?: number;
  /** Its labels (`pvisor run --label`); `{}` when it has none or they could not be read. */
  labels: Labels;
  /** When its run began (ISO 8601), if it said. */
  startedAt?: string;
  /** A hibernated VM's directory. */
  dir?: string;
  /** Why the row has no figures (a VM that did not answer, a record that was refused). */
  error?: string;
}

function psRowOfLive(row: LiveRow): PsRow {
  // Checked as Vm.list checks it: the labels and times of another process are its to get wrong.
  const e = entryOfLive(row, Date.now());
  const r = row.response;
  if (e.state === 'unresponsive' || !r?.vm) return { id: row.id, state: 'unresponsive', pid: null, labels: e.labels, error: e.error ?? 'no answer' };
  const m = r.memory;
  return {
    id: row.id,
    state: r.vm.state,
    pid: r.vm.pid,
    guest: r.vm.guest,
    memoryBytes: r.vm.memoryBytes,
    vcpus: r.vm.vcpus,
    labels: e.labels,
    ...(e.startedAt && { startedAt: e.startedAt.toISOString() }),
    ...(m && { guestRamResidentBytes: m.guestRamResidentBytes, processPssBytes: m.processPssBytes, bytesOnDisk: m.bytesOnDisk }),
    ...(e.error !== undefined && { error: e.error }),
  };
}

function psRowOfHibernated(row: HibernatedRow): PsRow {
  const h = row.record;
  const { labels } = entryOfHibernated(row);
  if (!h) return { id: row.id, state: 'hibernated', pid: null, labels, error: row.error };
  return { id: row.id, state: 'hibernated', pid: null, guest: h.guest, memoryBytes: h.memoryBytes, vcpus: h.vcpus, labels, guestRamResidentBytes: 0, processPssBytes: 0, bytesOnDisk: h.bytesOnDisk, dir: h.dir };
}

/** `pvisor ps [--json]`: the live and the hibernated VMs of this user's runtime directory. */
export async function cmdPs(argv: string[]): Promise<number> {
  const { values } = parseUsage('ps', () => parseArgs({ args: argv, options: { json: { type: 'boolean', default: false } }, strict: true }));
  const { live, hibernated } = await scanRuntimeDir(runtimeDir());
  if (values.json) {
    process.stdout.write(`${JSON.stringify([...live.map(psRowOfLive), ...hibernated.map(psRowOfHibernated)])}\n`);
    return 0;
  }
  const table = [['ID', 'STATE', 'GUEST RAM RESIDENT', 'MEMORY', 'ON DISK', 'PID', 'LABELS']];
  for (const row of live) {
    const r = row.response;
    const labels = formatLabels(entryOfLive(row, 0).labels);
    if (!r) table.push([row.id, 'unresponsive', '-', '-', '-', '-', '-']);
    else if (!r.vm) table.push([row.id, 'unknown', '-', '-', '-', '-', '-']);
    else {
      const m = r.memory;
      table.push([row.id, r.vm.state, m ? formatBytes(m.guestRamResidentBytes) : '-', formatBytes(r.vm.memoryBytes), m ? formatBytes(m.bytesOnDisk) : '-', String(r.vm.pid), labels]);
    }
  }
  for (const row of hibernated) {
    const h = row.record;
    // A hibernated VM costs no memory at all: no process, its state on disk.
    if (h) table.push([row.id, 'hibernated', '0 KiB', formatBytes(h.memoryBytes), formatBytes(h.bytesOnDisk), '-', formatLabels(entryOfHibernated(row).labels)]);
    else table.push([row.id, 'hibernated (record refused)', '-', '-', '-', '-', '-']);
  }
  const widths = table[0].map((_, c) => Math.max(...table.map((row) => row[c].length)));
  for (const row of table) process.stdout.write(`${row.map((cell, c) => (c === row.length - 1 ? cell : cell.padEnd(widths[c]))).join('  ')}\n`);
  return 0;
}
