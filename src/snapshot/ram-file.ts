/**
 * Guest RAM as one sparse file: its bytes at their host offsets, all-zero pages left as holes, so
 * the file costs the disk what the guest wrote (a 512 MiB VM with a 64 MiB working set: about
 * 64 MiB). Each fixed-size chunk has a CRC32C, written with it and checked before a restored
 * guest sees any byte of it.
 */
import { closeSync, fstatSync, fsyncSync, ftruncateSync, openSync, readSync, writeSync } from 'node:fs';
import type { GuestMemory } from '../backends/kvm/guest-memory';
import { SnapshotError } from '../errors';
import type { FileRange } from '../memory/uffd-server';
import { crc32c } from '../native/crc32c';
import { adviseRandomAccess } from '../sys/libc';
import { fileDataRuns } from '../guest-ram/file-runs';

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
    // A page of a clone's own RAM file that was gone read zero (see GuestMemory.lostBacking):
    // what was written is not the guest's RAM.
    const lost = mem.lostBacking();
    if (lost) throw new SnapshotError(`guest RAM cannot be saved: ${lost}`);
    ftruncateSync(fd, mem.sizeBytes);
    fsyncSync(fd);
    return { chunkCrc32c, dataPageCount };
  } finally {
    closeSync(fd);
  }
}

/**
 * Reads the RAM file open as `fd` (`path` for messages) into `mem` (fresh, all zero), checking
 * every chunk against `chunkCrc32c` before any of its bytes reach guest RAM; only non-zero pages
 * are copied, so the restored guest's RAM is as resident as the snapshot's working set. A file
 * of another size, or a chunk whose checksum differs, is a {@link SnapshotError}.
 */
export function readRamFile(fd: number, path: string, mem: GuestMemory, chunkCrc32c: readonly number[]): void {
  const size = fstatSync(fd).size;
  if (size !== mem.sizeBytes) throw new SnapshotError(`${path}: guest RAM is ${mem.sizeBytes} bytes, the file ${size}`);
  forEachCheckedChunk(fd, path, size, chunkCrc32c, (off, chunk) => {
    const view = mem.hostView(off, chunk.length);
    for (let p = 0; p < chunk.length; p += PAGE_BYTES) {
      const page = chunk.subarray(p, p + PAGE_BYTES);
      if (!page.equals(ZERO_PAGE)) page.copy(view, p);
    }
  });
}

/** What {@link checkRamFile} did. */
export interface RamFileCheck {
  /** Chunks read and checked. */
  chunksRead: number;
  /** Chunks that are holes in the file, checked against the checksum of zeros without reading. */
  chunksHoles: number;
}

/**
 * Checks every chunk of the RAM file open as `fd` (`path` for messages) against `chunkCrc32c`,
 * reading only its data: what a guest mapping the file directly will read. A chunk whose checksum
 * differs is a {@link SnapshotError}.
 */
export function checkRamFile(fd: number, path: string, chunkCrc32c: readonly number[]): RamFileCheck {
  const size = fstatSync(fd).size;
  const out: RamFileCheck = { chunksRead: 0, chunksHoles: chunkCrc32c.length };
  forEachCheckedChunk(fd, path, size, chunkCrc32c, () => {
    out.chunksRead++;
    out.chunksHoles--;
  });
  return out;
}

/**
 * The chunks of the RAM file open as `fd` (`path` for messages, `size` bytes) that hold data, as
 * ranges for a userfaultfd source that loads each whole and checks it against its CRC32C before
 * the guest sees a byte of it (a lazy restore). Chunks that are all hole read as zeros without
 * loading; each is checked here, against the checksum of zeros, so a chunk whose data was punched
 * out is refused now.
 */
export function dataChunkRanges(fd: number, path: string, size: number, chunkCrc32c: readonly number[]): FileRange[] {
  const data = fileDataRuns(fd, size);
  // Only the data is read, without readahead (see forEachCheckedChunk).
  adviseRandomAccess(fd);
  const ranges: FileRange[] = [];
  let run = 0;
  for (let off = 0, i = 0; off < size; off += RAM_CHUNK_BYTES, i++) {
    const len = Math.min(RAM_CHUNK_BYTES, size - off);
    while (run < data.length && data[run][1] <= off) run++;
    if (run < data.length && data[run][0] < off + len) ranges.push({ offset: off, length: len, fileOffset: off, checksum: chunkCrc32c[i] });
    else if (zeroChunkCrc32c(len) !== chunkCrc32c[i]) {
      throw new SnapshotError(`${path}: RAM chunk ${i} (bytes ${off} to ${off + len}) is a hole, which reads as zeros with CRC32C ${hex32(zeroChunkCrc32c(len))}, the manifest says ${hex32(chunkCrc32c[i])}: the file was changed`);
    }
  }
  return ranges;
}

/**
 * Calls `use` with every chunk of the file that holds data, after checking it; a chunk that is
 * all hole is not read (it reads as zeros), only its checksum compared with that of zeros. This
 * keeps a restore's cost to the snapshot's working set, not to guest RAM's size.
 */
function forEachCheckedChunk(fd: number, path: string, size: number, chunkCrc32c: readonly number[], use: (offset: number, chunk: Buffer) => void): void {
  const data = fileDataRuns(fd, size);
  // Only the data is read, without readahead: a hole read (or read ahead) is a zero page in the
  // page cache, which every clone would then pay for.
  adviseRandomAccess(fd);
  const scratch = Buffer.allocUnsafe(RAM_CHUNK_BYTES);
  let run = 0;
  for (let off = 0, i = 0; off < size; off += RAM_CHUNK_BYTES, i++) {
    const len = Math.min(RAM_CHUNK_BYTES, size - off);
    while (run < data.length && data[run][1] <= off) run++;
    const hasData = run < data.length && data[run][0] < off + len;
    const chunk = scratch.subarray(0, len);
    if (hasData) {
      chunk.fill(0);
      for (let r = run; r < data.length && data[r][0] < off + len; r++) {
        const from = Math.max(off, data[r][0]);
        const to = Math.min(off + len, data[r][1]);
        readAll(fd, chunk.subarray(from - off, to - off), from, path);
      }
    }
    const crc = hasData ? crc32c(chunk) : zeroChunkCrc32c(len);
    if (crc !== chunkCrc32c[i]) {
      throw new SnapshotError(`${path}: RAM chunk ${i} (bytes ${off} to ${off + len}) has CRC32C ${hex32(crc)}, the manifest says ${hex32(chunkCrc32c[i])}: the file was changed`);
    }
    if (hasData) use(off, chunk);
  }
}

const zeroCrcs = new Map<number, number>();

/** CRC32C of `length` zero bytes, computed once per length. */
export function zeroChunkCrc32c(length: number): number {
  let crc = zeroCrcs.get(length);
  if (crc === undefined) zeroCrcs.set(length, (crc = crc32c(Buffer.alloc(length))));
  return crc;
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
