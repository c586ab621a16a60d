/**
 * A jailed VM's snapshot, handed back to its launcher. The jailed VMM can write only in its own
 * backing directory (bound into its jail, its uid's), so it writes the snapshot into a staging
 * directory there; the launcher then copies the three files into the directory asked for, as
 * new files of its own, and removes the staging directory.
 *
 * A copy, not a rename: the jailed VMM may still hold the files open for writing, and a renamed
 * file would go on changing (or be truncated under a SharedSnapshot clone that maps it, which
 * checks only the file's owner). Every file is read as hostile input, as a restore reads a
 * snapshot from elsewhere: the staging directory must be a real directory of the jail's uid
 * holding exactly the snapshot's three names, each opened O_NOFOLLOW|O_NONBLOCK (no symlink to a
 * host file, no FIFO to hang on), fstat'ed as a regular file, and bounded by what a snapshot of
 * this VM can be. What the files say is the VMM's word, as it always is: the restore checks it.
 * @module
 */
import { randomBytes } from 'node:crypto';
import { constants as fsConstants, lstatSync, mkdirSync, readdirSync, rmSync, rmdirSync } from 'node:fs';
import { open, type FileHandle } from 'node:fs/promises';
import { join } from 'node:path';
import { SnapshotError } from '../errors';
import { manifestBytesLimit, MAX_STATE_BYTES } from '../snapshot/snapshot-dir';

/** The files of a snapshot directory (src/snapshot/snapshot-dir.ts), each with its largest size for `ramBytes` of guest RAM. */
function snapshotFiles(ramBytes: number): Record<string, number> {
  return { 'manifest.json': manifestBytesLimit(ramBytes), 'state.json': MAX_STATE_BYTES, ram: ramBytes };
}

/** Copies are made in blocks of this size; a block of zeros is left a hole (guest RAM is sparse). */
const COPY_BLOCK_BYTES = 1024 * 1024;

/** A new staging directory's path in the jail's backing directory (not made: the jailed VMM makes it). */
export function stagingDirIn(backingDir: string): string {
  return join(backingDir, `snapshot-${randomBytes(6).toString('hex')}`);
}

/**
 * Checks that `target` can take a snapshot (a new or empty directory), making it if it is new.
 * Returns whether it was made, for {@link discardTarget}. Throws a {@link SnapshotError}.
 */
export function prepareTarget(target: string): boolean {
  let made = false;
  try {
    made = mkdirSync(target, { recursive: true }) !== undefined;
  } catch (e) {
    throw new SnapshotError(`cannot make ${target}: ${(e as Error).message}`, { cause: e });
  }
  const st = lstatSync(target);
  if (!st.isDirectory()) throw new SnapshotError(`${target} is not a directory`);
  if (readdirSync(target).length > 0) throw new SnapshotError(`${target} is not empty: a snapshot goes into a new or empty directory`);
  return made;
}

/** Undoes {@link prepareTarget} and a partial copy: removes what was copied, and the directory if it was made. */
export function discardTarget(target: string, made: boolean): void {
  for (const name of Object.keys(snapshotFiles(0))) rmSync(join(target, name), { force: true });
  if (made) {
    try {
      rmdirSync(target);
    } catch {
      // Something else was put there meanwhile: it stays.
    }
  }
}

/**
 * Copies the snapshot the jailed VMM wrote in `staging` into `target` (prepared by
 * {@link prepareTarget}), as this process's files, mode 0444, synced; then removes `staging`.
 * `jailUid` owns the staging directory; `ramBytes` is the VM's guest RAM. Throws a
 * {@link SnapshotError} naming what is wrong (`target` is then left as it was found).
 */
export async function takeSnapshot(staging: string, target: string, jailUid: number, ramBytes: number): Promise<void> {
  try {
    let st;
    try {
      st = lstatSync(staging);
    } catch (e) {
      throw new SnapshotError(`the jailed VMM wrote no snapshot directory (${staging}): ${(e as Error).message}`, { cause: e });
    }
    if (!st.isDirectory() || st.uid !== jailUid) throw new SnapshotError(`${staging}: not a directory of the jail's uid ${jailUid}`);
    const limits = snapshotFiles(ramBytes);
    const names = readdirSync(staging).sort();
    const expected = Object.keys(limits).sort();
    if (names.length !== expected.length || names.some((n, i) => n !== expected[i])) {
      throw new SnapshotError(`${staging}: expected exactly ${expected.join(', ')}, found ${names.slice(0, 8).map((n) => JSON.stringify(n)).join(', ')}${names.length > 8 ? ', ...' : ''}`);
    }
    for (const name of expected) await copyFile(join(staging, name), join(target, name), limits[name]);
  } finally {
    rmSync(staging, { recursive: true, force: true });
  }
}

/** Copies one file of the staging directory, checked as described above, leaving zero blocks as holes. */
async function copyFile(from: string, to: string, maxBytes: number): Promise<void> {
  let src: FileHandle;
  try {
    src = await open(from, fsConstants.O_RDONLY | fsConstants.O_NOFOLLOW | fsConstants.O_NONBLOCK);
  } catch (e) {
    throw new SnapshotError(`${from}: ${(e as NodeJS.ErrnoException).code === 'ELOOP' ? 'a symbolic link' : (e as Error).message}`, { cause: e });
  }
  let dst: FileHandle | undefined;
  try {
    const st = await src.stat();
    if (!st.isFile()) throw new SnapshotError(`${from}: not a regular file`);
    if (st.size > maxBytes) throw new SnapshotError(`${from}: ${st.size} bytes, more than the ${maxBytes} a snapshot of this VM can have`);
    dst = await open(to, 'wx', 0o600);
    const block = Buffer.alloc(COPY_BLOCK_BYTES);
    const zeros = Buffer.alloc(COPY_BLOCK_BYTES);
    let at = 0;
    // The size read once: a file that grows meanwhile is copied up to it, one that shrinks ends the copy short.
    while (at < st.size) {
      const { bytesRead } = await src.read(block, 0, Math.min(block.length, st.size - at), at);
      if (bytesRead === 0) break;
      const data = block.subarray(0, bytesRead);
      if (!data.equals(zeros.subarray(0, bytesRead))) await dst.write(data, 0, bytesRead, at);
      at += bytesRead;
    }
    await dst.truncate(at);
    await dst.sync();
    await dst.chmod(0o444);
  } finally {
    await src.close();
    await dst?.close();
  }
}

/** What {@link handOffSnapshot} needs of the jail: its backing directory (bound in, its uid's) and its uid. */
export interface SnapshotJail {
  backingDir: string;
  uid: number;
}

/**
 * A jailed VM's snapshot into `target`: checks `target` ({@link prepareTarget}), has the jailed
 * VMM write into a new staging directory (`write`, which says whether it did), and copies it out
 * ({@link takeSnapshot}). On any failure nothing is left: not the staging directory, not a
 * partial copy, not `target` if it was made here. Resolves with what `write` resolved with.
 */
export async function handOffSnapshot<T>(jail: SnapshotJail, ramBytes: number, target: string, write: (staging: string) => Promise<{ written: boolean; value: T }>): Promise<T> {
  const made = prepareTarget(target);
  const staging = stagingDirIn(jail.backingDir);
  try {
    const { written, value } = await write(staging);
    if (written) await takeSnapshot(staging, target, jail.uid, ramBytes);
    else {
      rmSync(staging, { recursive: true, force: true });
      discardTarget(target, made);
    }
    return value;
  } catch (e) {
    rmSync(staging, { recursive: true, force: true });
    discardTarget(target, made);
    throw e;
  }
}
