/**
 * `pvisor suspend`, `resume`, `stop` and `ps`: the client end of the control socket of VMs started
 * by `pvisor run` (see ../control-socket.ts), with the reference CLI's options for parity.
 */
import { readdirSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { InvalidOptionError, PvisorError, VmNotFoundError } from '../errors';
import {
  controlRequest,
  idOfSocket,
  runtimeDir,
  socketPathFor,
  type ControlMemory,
  type ControlRequest,
  type ControlResponse,
} from '../control-socket';
import { validateVmName } from '../vm-name';
import { parseUsage } from './usage';

/** The commands that act on one VM. */
export type ControlCommand = 'suspend' | 'resume' | 'stop';

/** Parsed arguments of a {@link ControlCommand}. */
export interface ControlArgs {
  id: string;
  socketPath: string;
  /** suspend: offload RAM (Vm.suspend) rather than only pause. */
  offload: boolean;
  /** resume: `--vm-load` was given (resume always loads back what a suspend took). */
  load: boolean;
  /** Print the socket's answer as JSON instead of a sentence. */
  json: boolean;
  attemptId?: string;
}

/** A suspend writes all of guest RAM to disk: give a big VM on a slow disk its time. */
const OPERATION_TIMEOUT_MS = 10 * 60 * 1000;
const STATUS_TIMEOUT_MS = 10 * 1000;

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
      ...(command === 'suspend' ? { 'vm-offload': { type: 'boolean', default: false } } : {}),
      ...(command === 'resume' ? { 'vm-load': { type: 'boolean', default: false } } : {}),
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
  return {
    id,
    socketPath: socket ?? socketPathFor(id, dir),
    offload: values['vm-offload'] === true,
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
  const request: ControlRequest = command === 'suspend' ? { op: 'suspend', offload: a.offload } : { op: command };
  const r = await controlRequest(a.socketPath, a.id, request, OPERATION_TIMEOUT_MS);
  if (a.json) process.stdout.write(`${JSON.stringify(r)}\n`);
  if (!r.ok) throw new PvisorError(r.error.code, `${command} ${a.id} failed: ${r.error.message}${r.vm ? ` (${a.id} is ${r.vm.state})` : ''}`);
  if (!a.json) process.stdout.write(`${describe(command, a, r)}\n`);
  return 0;
}

function describe(command: ControlCommand, a: ControlArgs, r: ControlResponse & { ok: true }): string {
  const attempt = a.attemptId !== undefined ? ` (attempt ${a.attemptId})` : '';
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

/** `pvisor ps [--json]`: the live VMs of this user's runtime directory. */
export async function cmdPs(argv: string[]): Promise<number> {
  const { values } = parseUsage('ps', () => parseArgs({ args: argv, options: { json: { type: 'boolean', default: false } }, strict: true }));
  const dir = runtimeDir();
  let names: string[];
  try {
    names = readdirSync(dir).filter((n) => n.endsWith('.sock')).sort();
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'ENOENT') throw e;
    names = [];
  }
  const rows = await Promise.all(
    names.map(async (name): Promise<{ id: string; response?: ControlResponse; error?: string } | undefined> => {
      const id = idOfSocket(name);
      try {
        return { id, response: await controlRequest(join(dir, name), id, { op: 'status' }, STATUS_TIMEOUT_MS) };
      } catch (e) {
        // A socket nobody listens on is left from a run that was killed: not a live VM.
        if (e instanceof VmNotFoundError) return undefined;
        return { id, error: e instanceof Error ? e.message : String(e) };
      }
    }),
  );
  const live = rows.filter((r) => r !== undefined);
  if (values.json) {
    process.stdout.write(`${JSON.stringify(live)}\n`);
    return 0;
  }
  const table = [['ID', 'STATE', 'GUEST RAM RESIDENT', 'MEMORY', 'ON DISK', 'PID']];
  for (const row of live) {
    const r = row.response;
    if (!r) table.push([row.id, 'unresponsive', '-', '-', '-', '-']);
    else if (!r.vm) table.push([row.id, 'unknown', '-', '-', '-', '-']);
    else {
      const m = r.memory;
      table.push([row.id, r.vm.state, m ? formatBytes(m.guestRamResidentBytes) : '-', formatBytes(r.vm.memoryBytes), m ? formatBytes(m.bytesOnDisk) : '-', String(r.vm.pid)]);
    }
  }
  const widths = table[0].map((_, c) => Math.max(...table.map((row) => row[c].length)));
  for (const row of table) process.stdout.write(`${row.map((cell, c) => (c === row.length - 1 ? cell : cell.padEnd(widths[c]))).join('  ')}\n`);
  return 0;
}
