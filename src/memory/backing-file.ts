/**
 * What every suspend image shares: where it lives and how it is named, that nobody else may read
 * or pre-create it, and that a short write is an error. Plain node:fs only, so that the frame
 * workers (which must never load ffi-rs) can import the frame file code that uses it.
 */
import { randomBytes } from 'node:crypto';
import { constants, openSync, readdirSync, renameSync, rm, rmSync, writeSync } from 'node:fs';
import { basename, dirname, extname, join } from 'node:path';
import { BackingFileError } from '../errors';

/** `pvisor-NAME-PID-RANDOM.EXT`: how backing files are named, and how a stale one is recognised. */
const BACKING_FILE_NAME = /^pvisor-.+-(\d+)-[0-9a-f]{8}\.(ram|zframes|cold)$/;

/** A fresh, unguessable path for a VM's backing file in `dir`. */
export function backingFilePath(dir: string, vmName: string, extension: string): string {
  return join(dir, `pvisor-${vmName}-${process.pid}-${randomBytes(4).toString('hex')}.${extension}`);
}

/**
 * Creates the backing file for writing: 0600 and O_EXCL, because it holds the guest's memory and
 * nobody else may read or pre-create it. Removes first the backing files in the same directory
 * that a process which no longer exists left behind (it died while a VM was suspended).
 */
export function createBackingFile(path: string, flags = constants.O_WRONLY): number {
  removeStaleBackingFiles(dirname(path));
  return openSync(path, flags | constants.O_CREAT | constants.O_EXCL, 0o600);
}

/**
 * {@link createBackingFile} for a write-out straight from guest RAM: O_DIRECT when the filesystem
 * accepts it (no copy through the page cache, nothing left there), else buffered.
 */
export function createDirectBackingFile(path: string): { fd: number; direct: boolean } {
  try {
    return { fd: createBackingFile(path, constants.O_RDWR | constants.O_DIRECT), direct: true };
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'EINVAL') throw e;
    // The kernel refuses O_DIRECT after it has created the file: ours, fresh, so remove it first.
    rmSync(path, { force: true });
    return { fd: createBackingFile(path, constants.O_RDWR), direct: false };
  }
}

/** Renamed backing files whose unlink has not finished yet; removed at exit if still there. */
const unlinking = new Set<string>();

/**
 * Removes a backing file without waiting for it: unlinking a large file frees its blocks, which
 * took 16-22 ms for 64 MiB here, too long for a resume to wait. The path is free at once (renamed
 * under a fresh name); the unlink runs on libuv's pool. If the process exits first, the exit
 * removes it; if it is killed first, the sweep of stale files does, next time. A file already
 * gone is fine.
 */
export function removeBackingFile(path: string): void {
  const doomed = backingFilePath(dirname(path), 'removed', extname(path).slice(1) || 'ram');
  try {
    renameSync(path, doomed);
  } catch {
    rmSync(path, { force: true }); // gone already, or elsewhere than its directory allows renaming
    return;
  }
  if (!unlinking.size) process.once('exit', removeUnlinking);
  unlinking.add(doomed);
  rm(doomed, { force: true }, () => {
    unlinking.delete(doomed);
    if (!unlinking.size) process.off('exit', removeUnlinking);
  });
}

function removeUnlinking(): void {
  for (const path of unlinking) rmSync(path, { force: true });
  unlinking.clear();
}

/** Removes pvisor backing files in `dir` whose process is gone. Best effort. */
export function removeStaleBackingFiles(dir: string): void {
  let names: string[];
  try {
    names = readdirSync(dir);
  } catch {
    return; // the create that follows says what is wrong with the directory
  }
  for (const name of names) {
    const m = BACKING_FILE_NAME.exec(name);
    if (!m || !processGone(Number(m[1]))) continue;
    rmSync(join(dir, basename(name)), { force: true });
  }
}

function processGone(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return false;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'ESRCH';
  }
}

/** Writes all of `data` at `position`; a write that makes no progress is a BackingFileError. */
export function writeFully(fd: number, data: Uint8Array, position: number, path: string): void {
  let done = 0;
  while (done < data.length) {
    const n = writeSync(fd, data, done, data.length - done, position + done);
    if (n <= 0) throw new BackingFileError(path, `write failed at offset ${position + done}`);
    done += n;
  }
}
