/**
 * `pvisor snapshot ID DIR`: asks a VM started by `pvisor run` to write a snapshot of itself into
 * DIR, through its control socket (../control-socket.ts); `pvisor run --from DIR` restores it.
 */
import { readdirSync } from 'node:fs';
import { resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { InvalidOptionError, PvisorError, StoreError } from '../errors';
import { isStoreUrl, parseStoreUrl } from '../store/store-url';
import { formatMiB } from '../units';
import { validateVmName } from '../vm-name';
import { parseUsage, RefusedError } from './usage';
import { controlRequest, runtimeDir, socketPathFor, type ControlResponse } from '../control-socket';

/** Parsed arguments of `pvisor snapshot`. */
export interface SnapshotArgs {
  id: string;
  socketPath: string;
  /** Where the snapshot goes, absolute: the VM's process resolves nothing against its own cwd. */
  dir: string;
  /** Leave the VM paused afterwards instead of letting it run on. */
  leavePaused: boolean;
  /** Print the socket's answer as JSON instead of a sentence. */
  json: boolean;
}

/**
 * Guest RAM is written out (its non-zero pages) and synced: give a big VM on a slow disk its
 * time, as a suspend gets.
 */
const SNAPSHOT_TIMEOUT_MS = 10 * 60 * 1000;
/** Past this, stderr says that the snapshot is being written, so that a wait does not look hung. */
const PROGRESS_AFTER_MS = 2000;
const PROGRESS_EVERY_MS = 10_000;

/**
 * Parses `pvisor snapshot ID DIR [--leave-paused] [--json] [--vm-socket PATH]`.
 * @param cwd what a relative DIR is relative to (the client's cwd, not the VM's).
 * @param dir the runtime directory the VM's socket is found in.
 */
export function parseSnapshotArgs(argv: string[], cwd: string = process.cwd(), dir: string = runtimeDir()): SnapshotArgs {
  const { values, positionals } = parseArgs({
    args: argv,
    options: {
      'leave-paused': { type: 'boolean', default: false },
      json: { type: 'boolean', default: false },
      'vm-socket': { type: 'string' },
    },
    allowPositionals: true,
    strict: true,
  });
  const [id, target, ...extra] = positionals;
  if (id === undefined) throw new InvalidOptionError('id', 'which VM? e.g. pvisor snapshot ID DIR (pvisor ps lists them)');
  validateVmName(id, 'id');
  if (target === undefined || target === '') throw new InvalidOptionError('dir', `where to? e.g. pvisor snapshot ${id} DIR (a new or empty directory)`);
  if (extra.length) throw new InvalidOptionError('dir', `one snapshot directory, got ${[target, ...extra].join(' ')}`);
  return {
    id,
    socketPath: values['vm-socket'] ?? socketPathFor(id, dir),
    dir: isStoreUrl(target) ? storeLocation(target) : resolve(cwd, target),
    leavePaused: values['leave-paused'],
    json: values.json,
  };
}

/** Runs `pvisor snapshot`; resolves with the exit status. */
export async function cmdSnapshot(argv: string[]): Promise<number> {
  const a = parseUsage('snapshot', () => parseSnapshotArgs(argv));
  // The caller's to change, refused before the VM is paused (the VM's process checks it again).
  if (!isStoreUrl(a.dir) && directoryHasEntries(a.dir)) throw new RefusedError(`snapshot ${a.id} refused: ${a.dir} is not empty; a snapshot goes into a new or empty directory`);
  const progress = reportProgress(a);
  let r: ControlResponse;
  try {
    r = await controlRequest(a.socketPath, a.id, { op: 'snapshot', dir: a.dir, leavePaused: a.leavePaused }, SNAPSHOT_TIMEOUT_MS);
  } finally {
    progress.stop();
  }
  if (!r.ok) {
    // The VM's state, unless the library's message already says it (a state error does).
    const state = r.vm && !r.error.message.includes(`${a.id} is ${r.vm.state}`) ? ` (${a.id} is ${r.vm.state})` : '';
    if (r.error.code === 'PVISOR_VM_STATE') throw new RefusedError(`snapshot ${a.id} refused: ${r.error.message}${state}`);
    throw new PvisorError(r.error.code, `snapshot ${a.id} failed: ${r.error.message}${state}`);
  }
  // --json: a plain object, the snapshot's figures and the state the VM is left in.
  if (a.json) process.stdout.write(`${JSON.stringify({ id: a.id, state: r.vm.state, ...r.snapshot })}\n`);
  else process.stdout.write(`${formatSnapshotAnswer(a, r)}\n`);
  return 0;
}

/** One sentence: where, how many RAM pages, how long, and what state the VM is left in. */
export function formatSnapshotAnswer(a: Pick<SnapshotArgs, 'id'>, r: ControlResponse & { ok: true }): string {
  const s = r.snapshot;
  const written = s ? `${s.ramDataPageCount} RAM pages (${formatMiB(s.ramDataPageCount * 4096)}) written to ${s.dir} in ${s.ms} ms` : 'written';
  const state = r.vm.state === 'paused' ? `is paused (pvisor resume ${a.id} lets it run)` : `is ${r.vm.state}`;
  return `${a.id} snapshot: ${written}; ${a.id} ${state}`;
}

/** Says on stderr, past {@link PROGRESS_AFTER_MS}, that the snapshot is still being written. */
function reportProgress(a: SnapshotArgs): { stop(): void } {
  const t0 = performance.now();
  let every: NodeJS.Timeout | undefined;
  const first = setTimeout(() => {
    process.stderr.write(`pvisor: writing the snapshot of ${a.id} ${isStoreUrl(a.dir) ? 'and sending it to' : 'into'} ${a.dir}...\n`);
    every = setInterval(() => process.stderr.write(`pvisor: still writing the snapshot of ${a.id} (${Math.round((performance.now() - t0) / 1000)} s)\n`), PROGRESS_EVERY_MS);
  }, PROGRESS_AFTER_MS);
  return {
    stop() {
      clearTimeout(first);
      clearInterval(every);
    },
  };
}

/** Whether `dir` exists and holds anything (a missing directory is made by the snapshot). */
function directoryHasEntries(dir: string): boolean {
  try {
    return readdirSync(dir).length > 0;
  } catch {
    // Missing, or not a directory: the VM's process says what is wrong with it.
    return false;
  }
}

/** An `s3://bucket/prefix` target, checked here so that a typo fails before the VM is asked. */
function storeLocation(target: string): string {
  try {
    return parseStoreUrl(target).url;
  } catch (e) {
    if (e instanceof StoreError) throw new InvalidOptionError('dir', e.message);
    throw e;
  }
}
