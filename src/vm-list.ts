/**
 * The VMs of this host that this user may reach: those of this process ({@link Vm.list} gives
 * them), the `pvisor run` processes whose control sockets are in the runtime directory, and the
 * hibernated VMs whose records are there. `pvisor ps` and {@link Vm.list} both read the runtime
 * directory here.
 *
 * What another process answers is checked as any peer's input is: its answer is bounded in size,
 * and a field of the wrong kind makes the row say so (`error`) instead of passing it on.
 * @module
 */
import { readdirSync } from 'node:fs';
import { join } from 'node:path';
import { controlRequest, idOfSocket, runtimeDir, socketPathFor, type ControlResponse } from './control-socket';
import { VmNotFoundError } from './errors';
import { labelsFromText, matchesLabels, parseLabels, type Labels } from './labels';
import { hibernatedIds, readHibernationRecord, recordPathFor, type HibernationRecord } from './snapshot/hibernation-record';
import type { GuestKind, VmState } from './vm-types';

/**
 * One VM of {@link Vm.list} but the VM object itself, which only vm.ts can name: this module is
 * part of it. {@link VmListEntry} adds it.
 */
export interface VmListRow {
  /** Its name: `vm.name` in this process, the id of `pvisor run --name` (and of {@link VmHandle.connect}) otherwise. */
  name: string;
  /**
   * `this-process`: a {@link Vm} of this process (`vm` is it). `control-socket`: a VM that another
   * process runs, reached with {@link VmHandle.connect}(name, { socketPath }). `hibernated`: a VM
   * with no process, its state on disk (`pvisor resume NAME` continues it).
   */
  where: 'this-process' | 'control-socket' | 'hibernated';
  /** Its state; `unresponsive` for a control socket that did not answer as a pvisor run does (`error` says how). */
  state: VmState | 'hibernated' | 'unresponsive';
  /** The process that runs it; null when none does (hibernated) or it did not say. */
  pid: number | null;
  guest?: GuestKind;
  labels: Labels;
  /** Guest RAM capacity in bytes. */
  memoryBytes?: number;
  /** What its guest RAM costs the host now (PSS), in bytes; absent while it starts or when unknown. A hibernated VM's is 0. */
  residentBytes?: number;
  /** When it started (in this process, or its run did); absent when unknown. */
  startedAt?: Date;
  /** Milliseconds since `startedAt`, when the list was made. */
  ageMs?: number;
  /** Its control socket (`control-socket`). */
  socketPath?: string;
  /** Why the row lacks what it would say (a VM that did not answer, an answer or record that was refused). */
  error?: string;
}

/**
 * Options of {@link Vm.list}.
 * @category VM
 */
export interface VmListOptions {
  /** Only the VMs that have every one of these labels. Default: all. */
  labels?: Record<string, string>;
}

/** A control socket of the runtime directory and what it answered to a status request. */
export interface LiveRow {
  id: string;
  socketPath: string;
  response?: ControlResponse;
  error?: string;
}

/** A hibernation record of the runtime directory, read and checked. */
export interface HibernatedRow {
  id: string;
  record?: HibernationRecord;
  error?: string;
}

/** A status answer is a few KiB (its strategies' figures); a longer one is not a pvisor run's. */
const MAX_STATUS_ANSWER_BYTES = 256 * 1024;
const STATUS_TIMEOUT_MS = 10_000;

/**
 * Asks every control socket of `dir` for its status (at once) and reads the hibernation records.
 * A socket nobody listens on (left by a killed run) is not a VM; a VM being resumed (a socket and
 * a record) is the live one.
 */
export async function scanRuntimeDir(dir: string = runtimeDir()): Promise<{ live: LiveRow[]; hibernated: HibernatedRow[] }> {
  let names: string[];
  try {
    names = readdirSync(dir).filter((n) => n.endsWith('.sock')).sort();
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'ENOENT') throw e;
    names = [];
  }
  const rows = await Promise.all(
    names.map(async (name): Promise<LiveRow | undefined> => {
      const id = idOfSocket(name);
      const socketPath = join(dir, name);
      try {
        return { id, socketPath, response: await controlRequest(socketPath, id, { op: 'status' }, STATUS_TIMEOUT_MS, MAX_STATUS_ANSWER_BYTES) };
      } catch (e) {
        if (e instanceof VmNotFoundError) return undefined;
        return { id, socketPath, error: e instanceof Error ? e.message : String(e) };
      }
    }),
  );
  const live = rows.filter((r) => r !== undefined);
  const hibernated = hibernatedIds(dir)
    .filter((id) => !live.some((r) => r.id === id))
    .map((id): HibernatedRow => {
      try {
        const record = readHibernationRecord(recordPathFor(socketPathFor(id, dir)), id);
        return record ? { id, record } : { id, error: 'its record went away' };
      } catch (e) {
        return { id, error: e instanceof Error ? e.message : String(e) };
      }
    })
    .filter((r) => r.error !== 'its record went away');
  return { live, hibernated };
}

const STATES: readonly string[] = ['starting', 'running', 'paused', 'suspended', 'stopped', 'crashed', 'hibernated'];

/** A control socket's row as a list entry, every field of the answer checked. */
export function entryOfLive(row: LiveRow, nowMs: number): VmListRow {
  const base = { name: row.id, where: 'control-socket' as const, socketPath: row.socketPath, labels: parseLabels('labels', undefined) };
  const r = row.response;
  const unresponsive = (error: string): VmListRow => ({ ...base, state: 'unresponsive', pid: null, error });
  if (!r) return unresponsive(row.error ?? 'no answer');
  const vm = (r as { vm?: unknown }).vm as Record<string, unknown> | undefined;
  if (typeof vm !== 'object' || vm === null) return unresponsive(!r.ok && r.error && typeof r.error.message === 'string' ? r.error.message.slice(0, 200) : 'no "vm" in its answer');
  if (typeof vm.state !== 'string' || !STATES.includes(vm.state)) return unresponsive('its answer has no valid "state"');
  if (!(Number.isSafeInteger(vm.pid) && (vm.pid as number) > 0)) return unresponsive('its answer has no valid "pid"');
  const entry: VmListRow = { ...base, state: vm.state as VmListRow['state'], pid: vm.pid as number };
  if (vm.guest === 'linux' || vm.guest === 'probe') entry.guest = vm.guest;
  if (Number.isSafeInteger(vm.memoryBytes) && (vm.memoryBytes as number) >= 0) entry.memoryBytes = vm.memoryBytes as number;
  try {
    entry.labels = parseLabels('labels', vm.labels);
  } catch (e) {
    entry.error = `its labels were refused: ${(e as Error).message}`;
  }
  const started = typeof vm.startedAt === 'string' ? Date.parse(vm.startedAt) : NaN;
  if (Number.isFinite(started)) {
    entry.startedAt = new Date(started);
    entry.ageMs = Math.max(0, nowMs - started);
  }
  const resident = r.ok ? (r.memory as { guestRamResidentBytes?: unknown } | undefined)?.guestRamResidentBytes : undefined;
  if (Number.isSafeInteger(resident) && (resident as number) >= 0) entry.residentBytes = resident as number;
  return entry;
}

/** A hibernated VM's row as a list entry: its labels are the `--label` flags its record carries. */
export function entryOfHibernated(row: HibernatedRow): VmListRow {
  const entry: VmListRow = { name: row.id, where: 'hibernated', state: 'hibernated', pid: null, labels: parseLabels('labels', undefined) };
  const h = row.record;
  if (!h) return { ...entry, error: row.error ?? 'no record' };
  try {
    entry.labels = labelsFromText('labels', h.flags.filter((f) => f.startsWith('--label=')).map((f) => f.slice('--label='.length)));
  } catch (e) {
    entry.error = `its labels were refused: ${(e as Error).message}`;
  }
  return { ...entry, guest: h.guest, memoryBytes: h.memoryBytes, residentBytes: 0 };
}

/**
 * This process's VMs, then the others, without the others' rows for a VM of this process (a
 * `pvisor run` that lists is both); only those with every label of `wanted`.
 */
export function mergeVmLists(own: readonly VmListRow[], others: readonly VmListRow[], pid: number, wanted: Labels): VmListRow[] {
  const ownNames = new Set(own.map((e) => e.name));
  const rest = others.filter((e) => !(e.pid === pid && ownNames.has(e.name)));
  return [...own, ...rest].filter((e) => matchesLabels(e.labels, wanted));
}

/** {@link Vm.list} once this process's VMs are described: every VM this user may reach. */
export async function listVms(own: readonly VmListRow[], options: VmListOptions, dir: string = runtimeDir()): Promise<VmListRow[]> {
  const wanted = parseLabels('labels', options.labels);
  const nowMs = Date.now();
  const { live, hibernated } = await scanRuntimeDir(dir);
  return mergeVmLists(own, [...live.map((r) => entryOfLive(r, nowMs)), ...hibernated.map(entryOfHibernated)], process.pid, wanted);
}
