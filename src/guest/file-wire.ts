/**
 * The files ops of the Linux agent on the wire (docs/agent-protocol.md, "Files"): the request
 * payloads the host builds and the guest's answers it reads. Pure functions, no I/O: every value
 * the guest supplies is checked here (lengths, counts, names, types, safe-integer sizes), and a
 * malformed answer is a {@link GuestRequestError} naming what was wrong.
 */
import { GuestRequestError, InvalidOptionError } from '../errors';

/** Files op codes. */
export const enum FileOp {
  Read = 0x0210,
  Write = 0x0211,
  List = 0x0212,
  Stat = 0x0213,
  Mkdir = 0x0214,
  Remove = 0x0215,
  Rename = 0x0216,
  WriteOpen = 0x0217,
  WriteData = 0x0218,
  WriteClose = 0x0219,
  Cancel = 0x021a,
}

/** The longest path the agent takes, in bytes (Linux's PATH_MAX less its NUL). */
export const MAX_PATH_BYTES = 4095;
/** The longest name of a directory entry, in bytes (Linux's NAME_MAX). */
export const MAX_NAME_BYTES = 255;
/** A FILE_LIST entry's fixed part: {u16 nameLen, u8 type, u8 0, u32 mode, u64 size, i64 mtimeNs}. */
export const ENTRY_HEADER_BYTES = 24;
/** FILE_STAT's fixed part: {u32 type, u32 mode, u32 uid, u32 gid, u64 size, i64 mtimeNs, u32 targetLen}. */
const STAT_HEADER_BYTES = 36;

/**
 * What a guest file is.
 * @category Guest
 */
export type FileType = 'file' | 'directory' | 'symlink' | 'fifo' | 'socket' | 'char-device' | 'block-device' | 'unknown';

/** The wire's type codes (0 = unknown), in order. */
const FILE_TYPES: readonly FileType[] = ['unknown', 'file', 'directory', 'symlink', 'fifo', 'socket', 'char-device', 'block-device'];

/**
 * One entry of a guest directory, as {@link GuestFiles.list} gives it (lstat: a symlink is itself).
 * @category Guest
 */
export interface DirEntry {
  /**
   * The entry's name, never `.` or `..`, never with a `/`. Decoded as UTF-8: bytes that are not
   * UTF-8 read as U+FFFD.
   */
  name: string;
  type: FileType;
  /** Permission bits and setuid/setgid/sticky (`mode & 0o7777`). */
  mode: number;
  /** Size in bytes (a symlink's is its target's length). */
  size: number;
  /** Last modification, milliseconds since the epoch (fractional, as Node's `Stats.mtimeMs`). */
  mtimeMs: number;
}

/**
 * A guest file's status, as {@link GuestFiles.stat} gives it.
 * @category Guest
 */
export interface FileStat {
  type: FileType;
  /** Permission bits and setuid/setgid/sticky (`mode & 0o7777`). */
  mode: number;
  uid: number;
  gid: number;
  /** Size in bytes. */
  size: number;
  /** Last modification, milliseconds since the epoch (fractional). */
  mtimeMs: number;
  /** A symlink's target (when it could be read); absent for anything else. */
  target?: string;
}

/** A path as the agent takes it: `u32 length` + bytes, 1 to {@link MAX_PATH_BYTES}, no NUL. */
export function pathField(path: string, option = 'path'): Buffer {
  if (typeof path !== 'string') throw new InvalidOptionError(option, `expected a path string, got ${typeof path}`);
  const bytes = Buffer.from(path, 'utf8');
  if (bytes.length === 0) throw new InvalidOptionError(option, 'must not be empty');
  if (bytes.includes(0)) throw new InvalidOptionError(option, 'must not contain NUL bytes');
  if (bytes.length > MAX_PATH_BYTES) throw new InvalidOptionError(option, `${bytes.length} bytes, more than the ${MAX_PATH_BYTES} a guest path can have`);
  const field = Buffer.allocUnsafe(4 + bytes.length);
  field.writeUInt32LE(bytes.length, 0);
  bytes.copy(field, 4);
  return field;
}

/** A file or directory mode option: a whole number from 0 to 0o7777 (0: the op's default). */
export function modeField(option: string, value: unknown, fallback: number): number {
  if (value === undefined) return fallback;
  if (typeof value !== 'number' || !Number.isInteger(value) || value < 0 || value > 0o7777) {
    throw new InvalidOptionError(option, `expected a whole number from 0 to 0o7777, got ${typeof value === 'string' ? JSON.stringify(value) : String(value)}`);
  }
  return value;
}

/** `u32` fields, little-endian. */
export function u32Fields(...values: number[]): Buffer {
  const b = Buffer.alloc(4 * values.length);
  values.forEach((v, i) => b.writeUInt32LE(v >>> 0, 4 * i));
  return b;
}

function malformed(what: string): GuestRequestError {
  return new GuestRequestError(0, `the guest answered ${what}`);
}

function fileType(code: number, op: string): FileType {
  const t = FILE_TYPES[code];
  if (t === undefined) throw malformed(`${op} with file type ${code}, which is none of 0..7`);
  return t;
}

/** A u64 byte count the guest sent, which must be a safe integer. */
function safeSize(b: Buffer, at: number, op: string): number {
  const v = b.readBigUInt64LE(at);
  if (v > BigInt(Number.MAX_SAFE_INTEGER)) throw malformed(`${op} with a size of ${v} bytes, beyond what the host counts exactly`);
  return Number(v);
}

/** An i64 of nanoseconds since the epoch as fractional milliseconds. */
function msOfNs(b: Buffer, at: number): number {
  const ns = b.readBigInt64LE(at);
  return Number(ns / 1_000_000n) + Number(ns % 1_000_000n) / 1e6;
}

function mode(v: number, op: string): number {
  if (v > 0o7777) throw malformed(`${op} with mode 0o${v.toString(8)}, beyond 0o7777`);
  return v;
}

/**
 * Appends the entries of one FILE_LIST chunk to `into`: whole entries only, each name 1 to 255
 * bytes without `/` or NUL and neither `.` nor `..`. Returns how many it added.
 */
export function decodeEntries(chunk: Buffer, into: DirEntry[]): number {
  let at = 0;
  let added = 0;
  while (at < chunk.length) {
    if (chunk.length - at < ENTRY_HEADER_BYTES) throw malformed(`FILE_LIST with ${chunk.length - at} bytes left in a chunk, less than an entry's ${ENTRY_HEADER_BYTES}`);
    const nameLength = chunk.readUInt16LE(at);
    if (nameLength === 0 || nameLength > MAX_NAME_BYTES) throw malformed(`FILE_LIST with a name of ${nameLength} bytes (1 to ${MAX_NAME_BYTES})`);
    const nameAt = at + ENTRY_HEADER_BYTES;
    if (chunk.length - nameAt < nameLength) throw malformed(`FILE_LIST with a ${nameLength}-byte name that runs past its chunk`);
    const raw = chunk.subarray(nameAt, nameAt + nameLength);
    if (raw.includes(0x2f) || raw.includes(0)) throw malformed('FILE_LIST with a name holding "/" or NUL');
    const name = raw.toString('utf8');
    if (name === '.' || name === '..') throw malformed(`FILE_LIST with the entry ${JSON.stringify(name)}`);
    into.push({
      name,
      type: fileType(chunk[at + 2], 'FILE_LIST'),
      mode: mode(chunk.readUInt32LE(at + 4), 'FILE_LIST'),
      size: safeSize(chunk, at + 8, 'FILE_LIST'),
      mtimeMs: msOfNs(chunk, at + 16),
    });
    added++;
    at = nameAt + nameLength;
  }
  return added;
}

/** FILE_STAT's answer: its fixed part and exactly `targetLen` bytes of a symlink's target. */
export function decodeStat(r: Buffer): FileStat {
  if (r.length < STAT_HEADER_BYTES) throw malformed(`FILE_STAT with ${r.length} bytes, at least ${STAT_HEADER_BYTES} expected`);
  const targetLength = r.readUInt32LE(32);
  if (targetLength > MAX_PATH_BYTES || r.length !== STAT_HEADER_BYTES + targetLength) {
    throw malformed(`FILE_STAT with ${r.length} bytes for a ${targetLength}-byte symlink target`);
  }
  const type = fileType(r.readUInt32LE(0), 'FILE_STAT');
  if (targetLength > 0 && type !== 'symlink') throw malformed(`FILE_STAT with a symlink target for a ${type}`);
  const stat: FileStat = {
    type,
    mode: mode(r.readUInt32LE(4), 'FILE_STAT'),
    uid: r.readUInt32LE(8),
    gid: r.readUInt32LE(12),
    size: safeSize(r, 16, 'FILE_STAT'),
    mtimeMs: msOfNs(r, 24),
  };
  if (targetLength > 0) stat.target = r.toString('utf8', STAT_HEADER_BYTES);
  return stat;
}

/** The `{u64 count}` that ends FILE_READ, FILE_LIST, FILE_REMOVE and a write handle. */
export function decodeCount(r: Buffer, op: string): number {
  if (r.length !== 8) throw malformed(`${op} with ${r.length} bytes, 8 expected`);
  return safeSize(r, 0, op);
}
