/**
 * The directory a hibernated VM lives in while it has no process ({@link Vm.hibernate}): a sealed
 * snapshot directory (./snapshot-dir.ts) that is private (0700, its files 0400), synced down to
 * its entries (it is the VM's only copy), and consumed by the one restore that claims it.
 */
import { randomBytes } from 'node:crypto';
import { chmodSync, closeSync, constants, fsyncSync, linkSync, lstatSync, mkdirSync, openSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { SnapshotError } from '../errors';
import { processGone } from '../sys/processes';

/** The file a restore holds while it brings a hibernated VM back: its pid. */
const CLAIM = 'restoring.pid';

/**
 * Makes `dir` for a hibernation, 0700: a new directory, or an existing empty one of this user.
 * Says whether it made it, so that a failed hibernation removes only what it made.
 */
export function prepareHibernationDir(dir: string): { created: boolean } {
  const created = mkdirSync(dir, { recursive: true, mode: 0o700 }) !== undefined;
  const st = lstatSync(dir);
  if (!st.isDirectory()) throw new SnapshotError(`${dir} is not a directory`);
  const uid = process.getuid?.() ?? 0;
  if (st.uid !== uid) throw new SnapshotError(`${dir} belongs to uid ${st.uid}, not to this user (${uid}): a hibernated VM goes into a directory of its own user`);
  if (!created && readdirSync(dir).length > 0) throw new SnapshotError(`${dir} is not empty: a hibernated VM goes into a new or empty directory`);
  // mkdir's mode is filtered by the umask, and an existing directory has its own.
  chmodSync(dir, 0o700);
  return { created };
}

/** Syncs `dir` itself, so that the files just written in it survive a crash of the host. */
export function syncDir(dir: string): void {
  const fd = openSync(dir, constants.O_RDONLY | constants.O_DIRECTORY);
  try {
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

/** What the files directly in `dir` take on disk (allocated blocks: the RAM file is sparse). */
export function diskUsageBytes(dir: string): number {
  let bytes = 0;
  for (const name of readdirSync(dir)) {
    const st = lstatSync(join(dir, name));
    if (st.isFile()) bytes += st.blocks * 512;
  }
  return bytes;
}

/** Undoes a failed hibernation: removes the directory if it was made for it, else what was written in it. */
export function clearHibernationDir(dir: string, created: boolean): void {
  try {
    if (created) rmSync(dir, { recursive: true, force: true });
    else for (const name of readdirSync(dir)) rmSync(join(dir, name), { recursive: true, force: true });
  } catch {
    // Best effort: the error that made the hibernation fail is the one to report.
  }
}

/**
 * Claims a hibernated VM's directory for one restore: a hibernated VM continues in one process
 * only, so a second restore of it while the first runs (in this process or another) is refused
 * with a {@link SnapshotError}. A claim left by a process that no longer exists is taken over.
 * Returns the release (for a restore that failed, or one told to keep the directory).
 */
export function claimHibernatedDir(dir: string): () => void {
  const path = join(dir, CLAIM);
  // Written whole under a name of its own, then linked into place (which fails if a claim is
  // there): a claim is never seen empty, as one being written would be.
  const mine = join(dir, `${CLAIM}.${process.pid}.${randomBytes(4).toString('hex')}`);
  try {
    writeFileSync(mine, `${process.pid}\n`, { flag: 'wx', mode: 0o600 });
  } catch (e) {
    throw new SnapshotError(`${dir}: cannot claim the hibernated VM for this restore (${(e as Error).message})`, { cause: e });
  }
  try {
    for (let attempt = 0; ; attempt++) {
      try {
        linkSync(mine, path);
        return () => rmSync(path, { force: true });
      } catch (e) {
        if ((e as NodeJS.ErrnoException).code !== 'EEXIST') throw new SnapshotError(`${dir}: cannot claim the hibernated VM for this restore (${(e as Error).message})`, { cause: e });
      }
      const holder = claimHolder(path);
      if (holder !== undefined && !processGone(holder)) {
        throw new SnapshotError(`${dir} is being restored by process ${holder}: a hibernated VM is restored once (its directory is consumed by the restore)`);
      }
      if (attempt > 0) throw new SnapshotError(`${dir}: cannot claim the hibernated VM for this restore (${path} keeps coming back)`);
      rmSync(path, { force: true });
    }
  } finally {
    rmSync(mine, { force: true });
  }
}

/** The pid in a claim file; undefined if it holds none (being written, or not a claim). */
function claimHolder(path: string): number | undefined {
  try {
    const st = lstatSync(path);
    if (!st.isFile() || st.size > 32) return undefined;
    const m = /^(\d{1,10})\n?$/.exec(readFileSync(path, 'utf8'));
    return m ? Number(m[1]) : undefined;
  } catch {
    return undefined;
  }
}
