/**
 * The frame file: CompressedOffload's backing format (docs/compressed-offload.md). A header, the
 * frames in the order they were written, then a frame table and a footer at the end, so a reader
 * finds any frame from the table without scanning. Each frame is one aligned unit of guest RAM,
 * stored as a flag (all zero), raw (zstd did not shrink it) or zstd, with the CRC32 of its
 * uncompressed bytes.
 *
 * Pure logic over real files and byte buffers: no ffi-rs, so the compression workers load it too.
 */
import { closeSync, constants, fdatasync, fstatSync, ftruncateSync, openSync, readSync, rmSync } from 'node:fs';
import { crc32 } from 'node:zlib';
import type { CCtx, DCtx } from 'zstd-napi/binding';
import { BackingFileError } from '../errors';
import { createBackingFile, writeFully } from './backing-file';

/** `PVZFRAME`: the first and last 8 bytes of every frame file. */
export const FRAME_FILE_MAGIC = Buffer.from('PVZFRAME', 'latin1');
/** Bumped whenever the layout changes; a reader refuses other versions. */
export const FRAME_FILE_VERSION = 1;
export const HEADER_BYTES = 64;
export const ENTRY_BYTES = 32;
export const FOOTER_BYTES = 32;

/** How a frame is stored. The on-disk code is the index in this list. */
export const FRAME_KINDS = ['zero', 'raw', 'zstd'] as const;
export type FrameKind = (typeof FRAME_KINDS)[number];

/** What the header records: a reader needs both to place frames in guest RAM. */
export interface FrameFileHeader {
  frameBytes: number;
  guestRamBytes: number;
}

/** One frame table entry. */
export interface FrameEntry {
  /** Offset of the unit in guest RAM (a multiple of the frame size). */
  guestOffset: number;
  /** Where the stored bytes start in the file (0 for a zero frame: nothing is stored). */
  fileOffset: number;
  /** Bytes stored in the file: 0 (zero), `length` (raw) or the zstd frame's size. */
  storedLength: number;
  /** Uncompressed length: the frame size, or less for the last unit of RAM. */
  length: number;
  /** CRC32 of the uncompressed bytes. */
  crc: number;
  kind: FrameKind;
}

/** The result of encoding one frame: where its stored bytes are and what they are. */
export interface EncodedFrame {
  kind: FrameKind;
  storedLength: number;
  crc: number;
}

let zeros = Buffer.alloc(0);
function isAllZero(bytes: Uint8Array): boolean {
  if (zeros.length < bytes.length) zeros = Buffer.alloc(bytes.length);
  return Buffer.compare(bytes, zeros.subarray(0, bytes.length)) === 0;
}

/**
 * Encodes one frame of `input` into `output` (at least `compressBound(input.length)` bytes):
 * all zero gives a flag, a zstd result no smaller than the input gives raw (the stored bytes are
 * then `input` itself), otherwise zstd at `level`.
 */
export function encodeFrame(cctx: CCtx, level: number, input: Uint8Array, output: Uint8Array): EncodedFrame {
  if (isAllZero(input)) return { kind: 'zero', storedLength: 0, crc: crc32(input) };
  const crc = crc32(input);
  const n = cctx.compress(output, input, level);
  if (n >= input.length) return { kind: 'raw', storedLength: input.length, crc };
  return { kind: 'zstd', storedLength: n, crc };
}

/**
 * Decodes one frame's stored bytes into `output` (zstd) and returns the CRC32 of the uncompressed
 * bytes (for raw frames, of `stored` itself). Throws if zstd fails or yields another length; the
 * caller compares the CRC with the table's before any byte is used.
 */
export function decodeFrame(dctx: DCtx, kind: FrameKind, stored: Uint8Array, length: number, output: Uint8Array): number {
  switch (kind) {
    case 'zero':
      return crc32(zerosOf(length));
    case 'raw':
      if (stored.length !== length) throw new Error(`raw frame of ${stored.length} bytes, ${length} expected`);
      return crc32(stored);
    case 'zstd': {
      const n = dctx.decompress(output.subarray(0, length), stored);
      if (n !== length) throw new Error(`zstd gave ${n} bytes, ${length} expected`);
      return crc32(output.subarray(0, length));
    }
  }
}

function zerosOf(length: number): Buffer {
  if (zeros.length < length) zeros = Buffer.alloc(length);
  return zeros.subarray(0, length);
}

/** `frame 3 (guest offset 0x300000, zstd)`: how errors name a frame. */
export function frameLabel(index: number, entry: FrameEntry): string {
  return `frame ${index} (guest offset 0x${entry.guestOffset.toString(16)}, ${entry.kind})`;
}

/**
 * Runs `decode` (which returns the CRC32 of the decoded frame) and checks the result against the
 * table: a frame that cannot be decoded or whose CRC differs is a {@link BackingFileError} naming
 * it. Nothing decoded may be used before this resolves.
 */
export async function checkFrame(path: string, index: number, entry: FrameEntry, decode: () => number | Promise<number>): Promise<void> {
  let crc: number;
  try {
    crc = await decode();
  } catch (e) {
    throw new BackingFileError(path, `${frameLabel(index, entry)} cannot be decoded (${(e as Error).message})`);
  }
  if (crc !== entry.crc) throw new BackingFileError(path, `${frameLabel(index, entry)} is corrupt (CRC32 mismatch)`);
}

function encodeHeader(h: FrameFileHeader): Buffer {
  const b = Buffer.alloc(HEADER_BYTES);
  FRAME_FILE_MAGIC.copy(b, 0);
  b.writeUInt32LE(FRAME_FILE_VERSION, 8);
  b.writeUInt32LE(h.frameBytes, 12);
  b.writeBigUInt64LE(BigInt(h.guestRamBytes), 16);
  b.writeUInt32LE(HEADER_BYTES, 24);
  b.writeUInt32LE(crc32(b.subarray(0, 28)), 28);
  return b;
}

function encodeTable(entries: readonly FrameEntry[]): Buffer {
  const b = Buffer.alloc(entries.length * ENTRY_BYTES);
  entries.forEach((e, i) => {
    const o = i * ENTRY_BYTES;
    b.writeBigUInt64LE(BigInt(e.guestOffset), o);
    b.writeBigUInt64LE(BigInt(e.fileOffset), o + 8);
    b.writeUInt32LE(e.storedLength, o + 16);
    b.writeUInt32LE(e.length, o + 20);
    b.writeUInt32LE(e.crc, o + 24);
    b.writeUInt8(FRAME_KINDS.indexOf(e.kind), o + 28);
  });
  return b;
}

function decodeTable(b: Buffer): FrameEntry[] {
  const entries: FrameEntry[] = [];
  for (let o = 0; o < b.length; o += ENTRY_BYTES) {
    const kind = FRAME_KINDS[b.readUInt8(o + 28)];
    if (!kind) throw new Error(`frame ${o / ENTRY_BYTES} has an unknown kind ${b.readUInt8(o + 28)}`);
    entries.push({
      guestOffset: Number(b.readBigUInt64LE(o)),
      fileOffset: Number(b.readBigUInt64LE(o + 8)),
      storedLength: b.readUInt32LE(o + 16),
      length: b.readUInt32LE(o + 20),
      crc: b.readUInt32LE(o + 24),
      kind,
    });
  }
  return entries;
}

/**
 * Writes a frame file: frames are appended as they come (in any order), the table and footer at
 * {@link finish}. The file is created 0600 with O_EXCL: it holds the guest's memory, nobody else
 * may read or pre-create it.
 */
export class FrameFileWriter {
  private readonly fd: number;
  private readonly entries: FrameEntry[] = [];
  private end = HEADER_BYTES;
  private closed = false;

  constructor(readonly path: string, readonly header: FrameFileHeader) {
    this.fd = createBackingFile(path);
    try {
      this.writeAt(encodeHeader(header), 0);
    } catch (e) {
      this.abort();
      throw e;
    }
  }

  /** Appends one frame: `stored` is empty for a zero frame. */
  append(guestOffset: number, length: number, frame: EncodedFrame, stored: Uint8Array): FrameEntry {
    if (stored.length !== frame.storedLength) throw new Error(`stored ${stored.length} bytes, the frame says ${frame.storedLength}`);
    const entry: FrameEntry = { guestOffset, fileOffset: frame.storedLength ? this.end : 0, length, ...frame };
    if (frame.storedLength) {
      this.writeAt(stored, this.end);
      this.end += frame.storedLength;
    }
    this.entries.push(entry);
    return entry;
  }

  /**
   * Makes what was appended so far durable (fdatasync, on libuv's pool): after this, the units of
   * those frames may leave RAM. Rejects with a {@link BackingFileError}.
   */
  sync(): Promise<void> {
    return new Promise((resolve, reject) => {
      if (this.closed) return resolve();
      fdatasync(this.fd, (err) => (err ? reject(new BackingFileError(this.path, `fdatasync failed (${err.message}); what was not made durable stays in RAM`, { cause: err })) : resolve()));
    });
  }

  /**
   * Writes the table (sorted by guest offset) and the footer, closes the file and returns what a
   * reader must find in it. No fsync of the table: the file lives as long as this process's VM
   * (the frames themselves were made durable by {@link sync} before their units left RAM).
   */
  finish(): { entries: FrameEntry[]; fileBytes: number; allocatedBytes: number } {
    // A frame whose write failed part way (a full disk) may have left bytes past the last whole
    // one: the table goes right after that, and the file ends with the footer, as a reader checks.
    ftruncateSync(this.fd, this.end);
    const entries = [...this.entries].sort((a, b) => a.guestOffset - b.guestOffset);
    const table = encodeTable(entries);
    const footer = Buffer.alloc(FOOTER_BYTES);
    footer.writeBigUInt64LE(BigInt(this.end), 0);
    footer.writeUInt32LE(entries.length, 8);
    footer.writeUInt32LE(crc32(table), 12);
    FRAME_FILE_MAGIC.copy(footer, 24);
    this.writeAt(table, this.end);
    this.writeAt(footer, this.end + table.length);
    const allocatedBytes = fstatSync(this.fd).blocks * 512;
    this.closed = true;
    closeSync(this.fd);
    return { entries, fileBytes: this.end + table.length + FOOTER_BYTES, allocatedBytes };
  }

  /** Closes and removes a file that will not be finished. */
  abort(): void {
    if (!this.closed) closeSync(this.fd);
    this.closed = true;
    rmSync(this.path, { force: true });
  }

  private writeAt(data: Uint8Array, position: number): void {
    writeFully(this.fd, data, position, this.path);
  }
}

/**
 * Reads a frame file. {@link open} checks its structure (size, footer, header, table CRC) and,
 * given what the writer returned, that the table is exactly that one: a truncated, corrupt or
 * replaced file is a {@link BackingFileError} before any frame is read.
 */
export class FrameFileReader {
  private constructor(
    readonly path: string,
    private readonly fd: number,
    readonly header: FrameFileHeader,
    readonly entries: FrameEntry[],
  ) {}

  /** Opens `path` read-only; never changes the file. */
  static open(path: string, expected?: { header: FrameFileHeader; entries: readonly FrameEntry[] }): FrameFileReader {
    let fd: number;
    try {
      fd = openSync(path, constants.O_RDONLY);
    } catch (e) {
      throw new BackingFileError(path, 'the backing file is missing or cannot be opened', { cause: e });
    }
    try {
      const { header, entries } = readStructure(path, fd, expected);
      return new FrameFileReader(path, fd, header, entries);
    } catch (e) {
      closeSync(fd);
      throw e;
    }
  }

  /** Reads entry `index`'s stored bytes into `into` and returns the filled part. */
  readStored(index: number, into: Buffer): Buffer {
    const e = this.entries[index];
    let done = 0;
    while (done < e.storedLength) {
      const n = readSync(this.fd, into, done, e.storedLength - done, e.fileOffset + done);
      if (n <= 0) throw new BackingFileError(this.path, `${frameLabel(index, e)}: short read`);
      done += n;
    }
    return into.subarray(0, e.storedLength);
  }

  close(): void {
    closeSync(this.fd);
  }
}

function readStructure(path: string, fd: number, expected?: { header: FrameFileHeader; entries: readonly FrameEntry[] }): { header: FrameFileHeader; entries: FrameEntry[] } {
  const fail = (why: string): never => {
    throw new BackingFileError(path, why);
  };
  const size = fstatSync(fd).size;
  const readAt = (position: number, length: number) => {
    const b = Buffer.alloc(length);
    const n = readSync(fd, b, 0, length, position);
    if (n !== length) fail(`short read of ${length} bytes at offset ${position}`);
    return b;
  };
  if (expected) {
    const dataEnd = expected.entries.reduce((end, e) => Math.max(end, e.fileOffset + e.storedLength), HEADER_BYTES);
    const need = dataEnd + expected.entries.length * ENTRY_BYTES + FOOTER_BYTES;
    if (size !== need) fail(`the backing file is ${size < need ? 'truncated' : 'longer than written'} (${size} bytes, ${need} written)`);
  }
  if (size < HEADER_BYTES + FOOTER_BYTES) fail(`the backing file is truncated (${size} bytes, not even a header and footer)`);
  const head = readAt(0, HEADER_BYTES);
  if (!head.subarray(0, 8).equals(FRAME_FILE_MAGIC)) fail('bad header: not a pvisor frame file (magic)');
  if (head.readUInt32LE(28) !== crc32(head.subarray(0, 28))) fail('bad header: CRC32 mismatch');
  const version = head.readUInt32LE(8);
  if (version !== FRAME_FILE_VERSION) fail(`bad header: format version ${version}, this pvisor reads ${FRAME_FILE_VERSION}`);
  const header: FrameFileHeader = { frameBytes: head.readUInt32LE(12), guestRamBytes: Number(head.readBigUInt64LE(16)) };
  const foot = readAt(size - FOOTER_BYTES, FOOTER_BYTES);
  if (!foot.subarray(24, 32).equals(FRAME_FILE_MAGIC)) fail('bad footer: the file is truncated or was not finished');
  const tableOffset = Number(foot.readBigUInt64LE(0));
  const count = foot.readUInt32LE(8);
  if (tableOffset < HEADER_BYTES || tableOffset + count * ENTRY_BYTES + FOOTER_BYTES !== size) fail('bad footer: the frame table does not fit the file');
  const table = readAt(tableOffset, count * ENTRY_BYTES);
  if (crc32(table) !== foot.readUInt32LE(12)) fail('bad frame table: CRC32 mismatch');
  let entries: FrameEntry[];
  try {
    entries = decodeTable(table);
  } catch (e) {
    return fail(`bad frame table: ${(e as Error).message}`);
  }
  entries.forEach((e, i) => {
    if (e.fileOffset + e.storedLength > tableOffset || (e.storedLength && e.fileOffset < HEADER_BYTES)) fail(`${frameLabel(i, e)}: stored bytes outside the data area`);
    if (e.guestOffset + e.length > header.guestRamBytes || e.length > header.frameBytes) fail(`${frameLabel(i, e)}: outside guest RAM`);
  });
  if (expected) {
    if (header.frameBytes !== expected.header.frameBytes || header.guestRamBytes !== expected.header.guestRamBytes) {
      fail(`bad header: frame size ${header.frameBytes} and RAM ${header.guestRamBytes} bytes, written with ${expected.header.frameBytes} and ${expected.header.guestRamBytes}`);
    }
    if (!table.equals(encodeTable(expected.entries))) {
      const i = entries.findIndex((e, k) => !sameEntry(e, expected.entries[k]));
      fail(i < 0 ? 'bad frame table: it differs from the one written' : `${frameLabel(i, expected.entries[i] ?? entries[i])}: the table entry differs from the one written`);
    }
  }
  return { header, entries };
}

function sameEntry(a: FrameEntry, b: FrameEntry | undefined): boolean {
  return !!b && a.guestOffset === b.guestOffset && a.fileOffset === b.fileOffset && a.storedLength === b.storedLength && a.length === b.length && a.crc === b.crc && a.kind === b.kind;
}
