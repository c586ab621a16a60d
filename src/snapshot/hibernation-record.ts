/**
 * A hibernated VM of the CLI (`pvisor suspend ID --hibernate`) has no process: its state is a
 * directory on disk under its backing directory (Vm.hibernate), and a small record beside where
 * its control socket was, `ID.hibernated`, names that directory and says how its run goes on:
 * the memory strategy flags, the probe steps it had left, its command. `pvisor resume ID` reads
 * it, `pvisor stop ID` discards both, `pvisor ps` lists it, `pvisor run --name ID` is refused
 * while it is there.
 *
 * The record and the directory hold what becomes a VM of this user, so both must be this user's
 * and nobody else's: a record that is not a regular file of this uid with mode 0600 (or less),
 * or a directory that is not a directory of this uid with mode 0700 (or less), is refused with a
 * {@link SnapshotError} before anything is read from it. Every field is checked as a guest's
 * values are: the record may have been edited.
 */
import { randomBytes } from 'node:crypto';
import { closeSync, constants, fstatSync, fsyncSync, lstatSync, openSync, readdirSync, readSync, renameSync, rmSync, writeSync } from 'node:fs';
import { basename, dirname, isAbsolute, join, normalize } from 'node:path';
import { SnapshotError } from '../errors';
import type { GuestKind } from '../vm-types';
import { validateVmName } from '../vm-name';
import { isStoreUrl, parseStoreUrl } from '../store/store-url';

const RECORD_SUFFIX = '.hibernated';
const FORMAT = 'pvisor-hibernated';
const VERSION = 1;
/** A record is a few hundred bytes; the steps and the command bound what it may grow to. */
export const MAX_RECORD_BYTES = 64 * 1024;
const MAX_PATH_CHARS = 4096;

/** What `ID.hibernated` holds. */
export interface HibernationRecord {
  format: typeof FORMAT;
  version: typeof VERSION;
  id: string;
  /**
   * The hibernated VM's directory (Vm.hibernate), absolute; or, for a VM hibernated to an object
   * store, its `s3://bucket/prefix` (that record is kept in the store, beside the VM: ../store/run-record.ts).
   */
  dir: string;
  /** When it hibernated (ISO 8601). */
  hibernatedAt: string;
  guest: GuestKind;
  memoryBytes: number;
  vcpus: number;
  /** What `dir` takes on disk. */
  bytesOnDisk: number;
  /** `pvisor run` flags that go on with the VM, each `--name` or `--name=value` (see run-args.ts). */
  flags: string[];
  /** Probe guest: the steps left, as probe-script text. */
  steps?: string;
  /** Linux guest: CMD. It runs on in the guest, detached, and is not started again. */
  command?: string[];
}

/** The record of the VM whose control socket is `socketPath` (`/run/pvisor/T1.sock`: `/run/pvisor/T1.hibernated`). */
export function recordPathFor(socketPath: string): string {
  return join(dirname(socketPath), `${basename(socketPath).replace(/\.sock$/, '')}${RECORD_SUFFIX}`);
}

/** Where the run that resumes the VM of `socketPath` writes its output (`T1.log`). */
export function logPathFor(socketPath: string): string {
  return join(dirname(socketPath), `${basename(socketPath).replace(/\.sock$/, '')}.log`);
}

/** A new directory name for VM `id`'s hibernation under `backingDir`. */
export function hibernationDirFor(backingDir: string, id: string): string {
  return join(backingDir, `pvisor-hibernated-${id}-${randomBytes(4).toString('hex')}`);
}

/** Writes the record 0600, whole or not at all (a temporary file renamed over it), synced. */
export function writeHibernationRecord(path: string, record: HibernationRecord): void {
  const bytes = Buffer.from(`${JSON.stringify(record, null, 1)}\n`);
  if (bytes.length > MAX_RECORD_BYTES) throw new SnapshotError(`the hibernation record of ${record.id} would be ${bytes.length} bytes, more than ${MAX_RECORD_BYTES}: its command or steps are too long to carry`);
  const temp = `${path}.${randomBytes(4).toString('hex')}.tmp`;
  const fd = openSync(temp, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW, 0o600);
  try {
    for (let done = 0; done < bytes.length;) done += writeSync(fd, bytes, done);
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
  try {
    renameSync(temp, path);
  } catch (e) {
    rmSync(temp, { force: true });
    throw e;
  }
}

/**
 * Reads and checks the record at `path` for VM `id`; undefined if there is none. A record that is
 * not `ownerUid`'s alone (default this user's; a jailed VMM's launcher reads the jail uid's), or
 * not well formed, is a {@link SnapshotError}.
 */
export function readHibernationRecord(path: string, id: string, ownerUid: number = process.getuid?.() ?? 0): HibernationRecord | undefined {
  let fd: number;
  try {
    // O_NOFOLLOW: a symlink planted in place of the record is refused, not followed.
    fd = openSync(path, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    if (code === 'ENOENT') return undefined;
    throw new SnapshotError(`${path}: cannot read the hibernation record (${code === 'ELOOP' ? 'it is a symbolic link' : (e as Error).message})`, { cause: e });
  }
  let text: string;
  try {
    const st = fstatSync(fd);
    checkOwn(path, st, 'a regular file', st.isFile(), 0o600, ownerUid);
    if (st.size > MAX_RECORD_BYTES) throw new SnapshotError(`${path}: ${st.size} bytes, more than a hibernation record's ${MAX_RECORD_BYTES}`);
    const buf = Buffer.alloc(MAX_RECORD_BYTES + 1);
    let n = 0;
    for (let r; n < buf.length && (r = readSync(fd, buf, n, buf.length - n, null)) > 0;) n += r;
    if (n > MAX_RECORD_BYTES) throw new SnapshotError(`${path}: more than a hibernation record's ${MAX_RECORD_BYTES} bytes`);
    text = buf.subarray(0, n).toString('utf8');
  } finally {
    closeSync(fd);
  }
  const record = parseHibernationRecord(text, path, id);
  if (isStoreUrl(record.dir)) throw new SnapshotError(`${path}: dir: expected an absolute, normalised directory path`);
  return record;
}

/**
 * Checks the text of a hibernation record of VM `id` read from `where` (a file, or an object
 * store); `dir` may be an `s3://` location, which the caller accepts or not.
 */
export function parseHibernationRecord(text: string, where: string, id: string): HibernationRecord {
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch (e) {
    throw new SnapshotError(`${where}: not a hibernation record (not JSON: ${(e as Error).message})`);
  }
  return parseRecord(value, where, id);
}

/**
 * Checks the directory a record names: a directory (not a link to one) of this user that nobody
 * else may enter. `missing` if it is gone (discarded by hand, or a crash between the removal of
 * the directory and of the record).
 */
export function checkHibernatedDir(dir: string): 'ok' | 'missing' {
  let st;
  try {
    st = lstatSync(dir);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return 'missing';
    throw new SnapshotError(`${dir}: ${(e as Error).message}`, { cause: e });
  }
  checkOwn(dir, st, 'a directory', st.isDirectory(), 0o700);
  return 'ok';
}

/** Removes a hibernated VM: its directory, then its record (a record left alone says what to clean up). */
export function discardHibernated(recordPath: string, record: HibernationRecord): void {
  if (checkHibernatedDir(record.dir) === 'ok') rmSync(record.dir, { recursive: true, force: true });
  rmSync(recordPath, { force: true });
}

/** The ids of the records in `dir` (unchecked: each is read with {@link readHibernationRecord}). */
export function hibernatedIds(dir: string): string[] {
  let names: string[];
  try {
    names = readdirSync(dir);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return [];
    throw e;
  }
  return names.filter((n) => n.endsWith(RECORD_SUFFIX)).map((n) => n.slice(0, -RECORD_SUFFIX.length)).sort();
}

function storeUrlOk(url: string): boolean {
  try {
    parseStoreUrl(url);
    return true;
  } catch {
    return false;
  }
}

function checkOwn(path: string, st: { uid: number; mode: number }, kind: string, isKind: boolean, maxMode: number, uid: number = process.getuid?.() ?? 0): void {
  if (!isKind) throw new SnapshotError(`${path} is not ${kind}: refused as a hibernated VM's`);
  if (st.uid !== uid) throw new SnapshotError(`${path} belongs to uid ${st.uid}, not to this user (${uid}): refused as a hibernated VM's`);
  if (st.mode & 0o777 & ~maxMode) throw new SnapshotError(`${path} has mode ${(st.mode & 0o777).toString(8)}, more open than ${maxMode.toString(8)}: refused as a hibernated VM's`);
}

function parseRecord(value: unknown, path: string, id: string): HibernationRecord {
  const bad = (field: string, what: string) => new SnapshotError(`${path}: ${field}: ${what}`);
  if (typeof value !== 'object' || value === null || Array.isArray(value)) throw bad('record', 'expected a JSON object');
  const o = value as Record<string, unknown>;
  if (o.format !== FORMAT) throw bad('format', `expected ${JSON.stringify(FORMAT)}`);
  if (o.version !== VERSION) throw bad('version', `expected ${VERSION}, got ${JSON.stringify(o.version)} (a record of another pvisor version)`);
  if (o.id !== id) throw bad('id', `expected ${JSON.stringify(id)} (the record's own name), got ${JSON.stringify(o.id)}`);
  try {
    validateVmName(o.id, 'id');
  } catch (e) {
    throw bad('id', (e as Error).message);
  }
  const dir = o.dir;
  const storeDir = typeof dir === 'string' && isStoreUrl(dir) && storeUrlOk(dir);
  if (!storeDir && (typeof dir !== 'string' || !isAbsolute(dir) || dir.length > MAX_PATH_CHARS || dir.includes('\0') || normalize(dir) !== dir || dir === '/')) throw bad('dir', 'expected an absolute, normalised directory path');
  const hibernatedAt = o.hibernatedAt;
  if (typeof hibernatedAt !== 'string' || hibernatedAt.length > 64 || Number.isNaN(Date.parse(hibernatedAt))) throw bad('hibernatedAt', 'expected a date');
  if (o.guest !== 'probe' && o.guest !== 'linux') throw bad('guest', 'expected "probe" or "linux"');
  const int = (field: string, min: number, max: number) => {
    const v = o[field];
    if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < min || v > max) throw bad(field, `expected a whole number from ${min} to ${max}`);
    return v;
  };
  const strings = (field: string, maxCount: number) => {
    const v = o[field];
    if (!Array.isArray(v) || v.length > maxCount || !v.every((w) => typeof w === 'string' && w.length <= MAX_PATH_CHARS && !w.includes('\0'))) throw bad(field, `expected at most ${maxCount} strings`);
    return v as string[];
  };
  const record: HibernationRecord = {
    format: FORMAT,
    version: VERSION,
    id,
    dir,
    hibernatedAt,
    guest: o.guest,
    memoryBytes: int('memoryBytes', 4096, Number.MAX_SAFE_INTEGER),
    vcpus: int('vcpus', 1, 8),
    bytesOnDisk: int('bytesOnDisk', 0, Number.MAX_SAFE_INTEGER),
    flags: strings('flags', 64),
  };
  if (o.guest === 'probe') {
    if (typeof o.steps !== 'string' || o.steps.length > MAX_RECORD_BYTES) throw bad('steps', 'expected the probe steps left, as text');
    record.steps = o.steps;
  } else {
    record.command = strings('command', 4096);
  }
  return record;
}
