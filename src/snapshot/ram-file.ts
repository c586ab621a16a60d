/**
 * Guest RAM as one sparse file: its bytes at their host offsets, all-zero pages left as holes, so
 * the file costs the disk what the guest wrote (a 512 MiB VM with a 64 MiB working set: about
 * 64 MiB). Each fixed-size chunk has a CRC32C, written with it and checked before a restored
 * guest sees any byte of it.
 */
import { closeSync, fstatSync, fsyncSync, ftruncateSync, openSync, readSync, writeSync } from 'node:fs';
import type { GuestMemory } from '../backends/kvm/guest-memory';
import { SnapshotError } from '../errors';
import { crc32c } from '../memory/uffd-server';

/** Bytes per checksummed chunk: a huge page, and small enough that one bad byte costs little to find. */
export const RAM_CHUNK_BYTES = 2 * 1024 * 1024;
const PAGE_BYTES = 4096;
const ZERO_PAGE = Buffer.alloc(PAGE_BYTES);

/** What {@link writeRamFile} wrote. */
export interface RamFileInfo {
  /** CRC32C of each {@link RAM_CHUNK_BYTES} chunk (the last may be shorter), zeros included. */
  chunkCrc32c: number[];
  /** Pages written (not holes). */
  dataPageCount: number;
}

/**
 * Writes `mem` to a new file at `path` (which must not exist), skipping all-zero pages, and
 * syncs it. The guest must be paused: its RAM is read in place.
 */
export function writeRamFile(mem: GuestMemory, path: string): RamFileInfo {
  const fd = openSync(path, 'wx', 0o600);
  try {
    const chunkCrc32c: number[] = [];
    let dataPageCount = 0;
    for (let off = 0; off < mem.sizeBytes; off += RAM_CHUNK_BYTES) {
      const len = Math.min(RAM_CHUNK_BYTES, mem.sizeBytes - off);
      const view = mem.hostView(off, len);
      chunkCrc32c.push(crc32c({ addr: mem.hostAddr + off, length: len }));
      // Runs of non-zero pages, each written at once; zero pages stay holes.
      let runStart = -1;
      for (let p = 0; p <= len; p += PAGE_BYTES) {
        const zero = p === len || view.subarray(p, p + PAGE_BYTES).equals(ZERO_PAGE);
        if (!zero && runStart < 0) runStart = p;
        if (zero && runStart >= 0) {
          writeAll(fd, view.subarray(runStart, p), off + runStart);
          dataPageCount += (p - runStart) / PAGE_BYTES;
          runStart = -1;
        }
      }
    }
    ftruncateSync(fd, mem.sizeBytes);
    fsyncSync(fd);
    return { chunkCrc32c, dataPageCount };
  } finally {
    closeSync(fd);
  }
}

/**
 * Reads the file at `path` into `mem` (fresh, all zero), checking every chunk against
 * `chunkCrc32c` before any of its bytes reach guest RAM; only non-zero pages are copied, so the
 * restored guest's RAM is as resident as the snapshot's working set. A file of another size, or
 * a chunk whose checksum differs, is a {@link SnapshotError}.
 */
export function readRamFile(path: string, mem: GuestMemory, chunkCrc32c: readonly number[]): void {
  const fd = openSync(path, 'r');
  try {
    const size = fstatSync(fd).size;
    if (size !== mem.sizeBytes) throw new SnapshotError(`${path}: guest RAM is ${mem.sizeBytes} bytes, the file ${size}`);
    const scratch = Buffer.allocUnsafe(RAM_CHUNK_BYTES);
    for (let off = 0, i = 0; off < mem.sizeBytes; off += RAM_CHUNK_BYTES, i++) {
      const len = Math.min(RAM_CHUNK_BYTES, mem.sizeBytes - off);
      const chunk = scratch.subarray(0, len);
      readAll(fd, chunk, off, path);
      const crc = crc32c(chunk);
      if (crc !== chunkCrc32c[i]) {
        throw new SnapshotError(`${path}: RAM chunk ${i} (bytes ${off} to ${off + len}) has CRC32C ${hex32(crc)}, the manifest says ${hex32(chunkCrc32c[i])}: the file was changed`);
      }
      const view = mem.hostView(off, len);
      for (let p = 0; p < len; p += PAGE_BYTES) {
        const page = chunk.subarray(p, p + PAGE_BYTES);
        if (!page.equals(ZERO_PAGE)) page.copy(view, p);
      }
    }
  } finally {
    closeSync(fd);
  }
}

function writeAll(fd: number, data: Buffer, position: number): void {
  for (let done = 0; done < data.length;) done += writeSync(fd, data, done, data.length - done, position + done);
}

function readAll(fd: number, into: Buffer, position: number, path: string): void {
  for (let done = 0; done < into.length;) {
    const n = readSync(fd, into, done, into.length - done, position + done);
    if (n === 0) throw new SnapshotError(`${path}: ends at byte ${position + done}, before guest RAM does`);
    done += n;
  }
}

/** How a checksum is shown in messages and written in the manifest. */
export function hex32(v: number): string {
  return `0x${(v >>> 0).toString(16).padStart(8, '0')}`;
}
