/**
 * What every suspend image shares: where it lives and how it is named, that nobody else may read
 * or pre-create it, and that a short write is an error. Plain node:fs only, so that the frame
 * workers (which must never load ffi-rs) can import the frame file code that uses it.
 */
import { randomBytes } from 'node:crypto';
import { constants, openSync, writeSync } from 'node:fs';
import { join } from 'node:path';
import { BackingFileError } from '../errors';

/** A fresh, unguessable path for a VM's backing file in `dir`. */
export function backingFilePath(dir: string, vmName: string, extension: string): string {
  return join(dir, `pvisor-${vmName}-${process.pid}-${randomBytes(4).toString('hex')}.${extension}`);
}

/**
 * Creates the backing file for writing: 0600 and O_EXCL, because it holds the guest's memory and
 * nobody else may read or pre-create it.
 */
export function createBackingFile(path: string, flags = constants.O_WRONLY): number {
  return openSync(path, flags | constants.O_CREAT | constants.O_EXCL, 0o600);
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
