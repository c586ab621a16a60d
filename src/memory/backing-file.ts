/**
 * What every suspend image shares: where it lives and how it is named, that its directory is on
 * a disk, that nobody else may read or pre-create it, and that a short write is an error. Plain
 * node:fs only, so that the frame workers (which must never load ffi-rs) can import the frame
 * file code that uses it.
 */
import { randomBytes } from 'node:crypto';
import { constants, lstatSync, openSync, readdirSync, renameSync, rm, rmSync, statfsSync, writeSync } from 'node:fs';
import { basename, dirname, extname, join } from 'node:path';
import { BackingFileError, InvalidOptionError } from '../errors';
import { RAMFS_MAGIC, TMPFS_MAGIC } from '../sys/constants';
import { processGone } from '../sys/processes';
import { booleanOption } from '../units';

/**
 * Where backing files go unless a strategy is told otherwise. Not the temp directory: /tmp is
 * tmpfs on many systems, where a backing file would keep guest RAM in RAM, while /var/tmp is for
 * larger temporary files and kept on disk (systemd's file-hierarchy(7), the FHS).
 */
export const DEFAULT_BACKING_DIR = '/var/tmp';

/**
 * Where a strategy that writes guest RAM to a file (Offload, CompressedOffload) puts it.
 * @category Strategies
 */
export interface BackingDirOptions {
  /**
   * Directory for the backing file; it must exist and be on a disk (see
   * {@link allowMemoryBackedDir}). Default `/var/tmp`, which is kept on disk where `/tmp` is
   * often tmpfs.
   */
  dir?: string;
  /**
   * Write the backing file to a tmpfs or ramfs directory anyway. A file there stays in host RAM
   * (as shared memory), so offloading to it frees nothing: each suspend checks `dir` when it
   * makes the file and, unless this is true, refuses a memory-backed one with an
   * {@link InvalidOptionError} (option `dir`) and leaves the VM running as it was. For tests and
   * measurements of the offload path itself. Default false.
   */
  allowMemoryBackedDir?: boolean;
}

/** {@link BackingDirOptions} checked, with their defaults. */
export function backingDirOptions(options: BackingDirOptions): Required<BackingDirOptions> {
  const dir = options.dir ?? DEFAULT_BACKING_DIR;
  if (typeof dir !== 'string' || !dir) throw new InvalidOptionError('dir', `expected a directory path, got ${JSON.stringify(dir)}`);
  const allowMemoryBackedDir = booleanOption('allowMemoryBackedDir', options.allowMemoryBackedDir, false);
  return { dir, allowMemoryBackedDir };
}

/** `tmpfs` or `ramfs` if `dir` is on one of them; undefined otherwise, or if it cannot be read. */
export function memoryBackedFilesystem(dir: string): 'tmpfs' | 'ramfs' | undefined {
  let type: number;
  try {
    type = statfsSync(dir).type;
  } catch {
    return undefined; // creating the file in it will say what is wrong with it
  }
  if (type === TMPFS_MAGIC) return 'tmpfs';
  if (type === RAMFS_MAGIC) return 'ramfs';
  return undefined;
}

/**
 * Refuses a backing directory on tmpfs or ramfs unless the options allow it: there, offloading
 * would move guest RAM into shared memory and free nothing. Checked at each suspend rather than
 * once, because a strategy costs nothing until then (the CLI composes Offload into every VM) and
 * what is mounted at `dir` may change in between.
 */
export function checkBackingDir(options: Required<BackingDirOptions>): void {
  if (options.allowMemoryBackedDir) return;
  const fs = memoryBackedFilesystem(options.dir);
  if (!fs) return;
  throw new InvalidOptionError(
    'dir',
    `${options.dir} is on ${fs}, so a backing file there would stay in host RAM and offloading would free nothing; give a directory on a disk (the default is ${DEFAULT_BACKING_DIR}), or set allowMemoryBackedDir to offload there anyway`,
  );
}

/** `pvisor-NAME-PID-RANDOM.EXT`: how backing files are named, and how a stale one is recognised. */
const BACKING_FILE_NAME = /^pvisor-.+-(\d+)-[0-9a-f]{8}\.(ram|zframes|cold)$/;

/** A fresh, unguessable path for a VM's backing file in `dir`. */
export function backingFilePath(dir: string, vmName: string, extension: string): string {
  return join(dir, `pvisor-${vmName}-${process.pid}-${randomBytes(4).toString('hex')}.${extension}`);
}

/**
 * Creates the backing file for writing: 0600 and O_EXCL, because it holds the guest's memory and
 * nobody else may read or pre-create it (O_EXCL also follows no symlink and opens no fifo: whatever
 * is at the path already is left alone). Removes first the backing files in the same directory
 * that a process which no longer exists left behind (it died while a VM was suspended). A file
 * that cannot be created (something at the path, a missing or read-only directory, no space) is
 * a {@link BackingFileError} with the system's error as its cause.
 */
export function createBackingFile(path: string, flags = constants.O_WRONLY): number {
  removeStaleBackingFiles(dirname(path));
  try {
    return openSync(path, flags | constants.O_CREAT | constants.O_EXCL, 0o600);
  } catch (e) {
    throw new BackingFileError(path, `cannot create the backing file (${(e as Error).message})`, { cause: e });
  }
}

/**
 * {@link createBackingFile} for a write-out straight from guest RAM: O_DIRECT when the filesystem
 * accepts it (no copy through the page cache, nothing left there), else buffered.
 */
export function createDirectBackingFile(path: string): { fd: number; direct: boolean } {
  try {
    return { fd: createBackingFile(path, constants.O_RDWR | constants.O_DIRECT), direct: true };
  } catch (e) {
    if (((e as Error).cause as NodeJS.ErrnoException | undefined)?.code !== 'EINVAL') throw e;
    // The kernel refuses O_DIRECT after it has created the file: ours, fresh, so remove it first.
    rmSync(path, { force: true });
    return { fd: createBackingFile(path, constants.O_RDWR), direct: false };
  }
}

/** Renamed backing files whose unlink has not finished yet; removed at exit if still there. */
const unlinking = new Set<string>();
/**
 * Backing files that could not be removed (a disk that fails with EIO, a filesystem shut down):
 * the next sweep of their directory tries again (the next backing file created there), and so
 * does the exit. Without this a file of a live process would stay for good: the sweep removes
 * only those of processes that are gone.
 */
const unremoved = new Set<string>();

/**
 * Removes a backing file without waiting for it: unlinking a large file frees its blocks, which
 * takes too long for a resume to wait (docs/design-figures.md). The path is free at once (renamed
 * under a fresh name); the unlink runs on libuv's pool. If the process exits first, the exit
 * removes it; if it is killed first, the sweep of stale files does, next time. A file already
 * gone is fine; one that cannot be removed now is tried again later (see `unremoved`). Never throws.
 */
export function removeBackingFile(path: string): void {
  const doomed = backingFilePath(dirname(path), 'removed', extname(path).slice(1) || 'ram');
  try {
    renameSync(path, doomed);
  } catch {
    removeNow(path); // gone already, elsewhere than its directory allows renaming, or a failing disk
    return;
  }
  unlinking.add(doomed);
  removeAtExit();
  rm(doomed, { force: true }, (e) => {
    unlinking.delete(doomed);
    if (e) unremoved.add(doomed);
    removeAtExit();
  });
}

/** Removes `path` now; if it cannot be, remembers it in `unremoved`. */
function removeNow(path: string): void {
  try {
    rmSync(path, { force: true });
    unremoved.delete(path);
  } catch {
    unremoved.add(path);
  }
  removeAtExit();
}

/** Listens for the exit while some file is still to be removed, and only then. */
function removeAtExit(): void {
  process.off('exit', removeLeftovers);
  if (unlinking.size || unremoved.size) process.once('exit', removeLeftovers);
}

function removeLeftovers(): void {
  for (const path of [...unlinking, ...unremoved]) {
    try {
      rmSync(path, { force: true });
    } catch {
      // The disk still fails: nothing more can be done from here; a later sweep will.
    }
  }
  unlinking.clear();
  unremoved.clear();
}

/**
 * Removes pvisor backing files in `dir` whose process is gone, and those of this process that
 * could not be removed before (see `unremoved`). Best effort, and only regular
 * files: anyone who can write to a shared directory such as /var/tmp can make a directory or a
 * fifo of that name, which must neither stop this sweep nor the suspend that runs it.
 */
export function removeStaleBackingFiles(dir: string): void {
  for (const path of unremoved) if (dirname(path) === dir) removeNow(path);
  let names: string[];
  try {
    names = readdirSync(dir);
  } catch {
    return; // the create that follows says what is wrong with the directory
  }
  for (const name of names) {
    const m = BACKING_FILE_NAME.exec(name);
    if (!m || !processGone(Number(m[1]))) continue;
    const path = join(dir, basename(name));
    try {
      if (lstatSync(path).isFile()) rmSync(path, { force: true });
    } catch {
      // Gone meanwhile, or not ours to remove: the next sweep tries again.
    }
  }
}

/** Writes all of `data` at `position`; a failed write (a full disk) or one that makes no progress is a BackingFileError. */
export function writeFully(fd: number, data: Uint8Array, position: number, path: string): void {
  let done = 0;
  while (done < data.length) {
    let n: number;
    try {
      n = writeSync(fd, data, done, data.length - done, position + done);
    } catch (e) {
      throw new BackingFileError(path, `write failed at offset ${position + done} (${(e as Error).message})`, { cause: e });
    }
    if (n <= 0) throw new BackingFileError(path, `write made no progress at offset ${position + done}`);
    done += n;
  }
}
