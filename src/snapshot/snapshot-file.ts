/**
 * A snapshot's files opened as what they must be: regular files, reached without following a
 * symbolic link, and read, up to a bound checked first, through the one descriptor whose type and
 * size were checked. A snapshot directory is hostile input: a FIFO there blocks a read for ever, a
 * device (`/dev/zero`, `/dev/urandom`) feeds one without end, and a path opened twice may be two
 * different files.
 */
import { closeSync, constants, fstatSync, lstatSync, openSync, readSync, type Stats } from 'node:fs';
import { SnapshotError } from '../errors';

/** One file of a snapshot, open read-only; the caller closes {@link fd}. */
export interface SnapshotFile {
  fd: number;
  /** The path, for messages. */
  path: string;
  /** Its size when it was opened. */
  sizeBytes: number;
}

/**
 * Opens `path` read-only, O_NOFOLLOW | O_NONBLOCK, and checks with fstat that it is a regular
 * file. A symbolic link, a FIFO, a device, a socket or a directory in its place is a
 * {@link SnapshotError} at once; so is a file that cannot be opened. Checked with lstat before the
 * open too, so that a device node is refused without being opened (opening some has effects).
 *
 * (libuv adds O_CLOEXEC.) O_NONBLOCK stays set: a FIFO then opens at once instead of waiting for a writer (and is refused
 * by its type), an open that would wait for another process's lease fails instead, and a regular
 * file's reads ignore the flag (open(2)), so there is nothing to clear.
 */
export function openSnapshotFile(path: string): SnapshotFile {
  let kind: string | undefined;
  try {
    kind = notRegular(lstatSync(path));
  } catch (e) {
    throw new SnapshotError(`${path}: ${(e as Error).message}`, { cause: e });
  }
  if (kind) throw refused(path, kind);
  let fd: number;
  try {
    fd = openSync(path, constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    // ELOOP: a symbolic link (O_NOFOLLOW); ENXIO: a socket. Both were put there since the lstat.
    if (code === 'ELOOP') throw refused(path, 'a symbolic link');
    if (code === 'ENXIO') throw refused(path, 'a socket');
    throw new SnapshotError(`${path}: ${(e as Error).message}`, { cause: e });
  }
  try {
    const st = fstatSync(fd);
    const now = notRegular(st);
    if (now) throw refused(path, now);
    return { fd, path, sizeBytes: st.size };
  } catch (e) {
    closeSync(fd);
    throw e;
  }
}

/**
 * Reads all of `file` through its descriptor, refusing it before any read if it is larger than
 * `maxBytes` (`why` says where the bound comes from), and after, if it changed size meanwhile.
 * `into`: a buffer to read into when it is large enough (the result is a view of it), so that a
 * reader of many large files does not map and fault in fresh memory for each.
 */
export function readSnapshotFile(file: SnapshotFile, maxBytes: number, why: string, into?: Buffer): Buffer {
  const { fd, path } = file;
  const size = fstatSync(fd).size;
  if (size > maxBytes) throw new SnapshotError(`${path}: ${size} bytes, more than the ${maxBytes} that ${why}`);
  const out = into && into.length >= size ? into.subarray(0, size) : Buffer.allocUnsafe(size);
  for (let done = 0; done < size;) {
    const n = readSync(fd, out, done, size - done, done);
    if (n === 0) throw new SnapshotError(`${path}: ends at byte ${done}, before the ${size} it had when opened: the file was changed while it was read`);
    done += n;
  }
  if (readSync(fd, Buffer.alloc(1), 0, 1, size) !== 0) throw new SnapshotError(`${path}: longer than the ${size} bytes it had when opened: the file was changed while it was read`);
  return out;
}

/** Closes each file, whatever happened to the others. */
export function closeSnapshotFiles(...files: (SnapshotFile | undefined)[]): void {
  for (const f of files) {
    if (!f) continue;
    try {
      closeSync(f.fd);
    } catch {
      // Closed already: nothing is left to release.
    }
  }
}

/** What a non-regular file is, in words; undefined for a regular file. */
function notRegular(st: Stats): string | undefined {
  if (st.isFile()) return undefined;
  if (st.isSymbolicLink()) return 'a symbolic link';
  if (st.isFIFO()) return 'a FIFO';
  if (st.isCharacterDevice()) return 'a character device';
  if (st.isBlockDevice()) return 'a block device';
  if (st.isSocket()) return 'a socket';
  if (st.isDirectory()) return 'a directory';
  return 'not a regular file';
}

function refused(path: string, kind: string): SnapshotError {
  return new SnapshotError(`${path}: is ${kind}, not a regular file: a snapshot's files are regular files, written by Vm.snapshot`);
}
