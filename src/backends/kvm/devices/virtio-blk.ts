/**
 * virtio-blk (device id 2): one disk backed by a file of the user's, one request queue. pvisor
 * uses it for the Linux guest's optional root filesystem.
 *
 * Everything in a request is the guest's and untrusted: the header may be short, the status byte
 * missing, the sector range past the end, the length not whole sectors. Such a request ends with
 * VIRTIO_BLK_S_IOERR (or no status at all when there is nowhere to put one) and the device goes
 * on; the image is never touched by it.
 *
 * File I/O is synchronous (fs.readSync / fs.writeSync at the notify, on the event loop), on
 * purpose:
 * - the request is finished before the vCPU that notified runs again, so completion order is the
 *   order the guest queued the requests, with no bookkeeping;
 * - nothing is ever in flight when the machine pauses (a strategy may then read or drop guest
 *   RAM) or stops (guest RAM is unmapped: an async completion would write into freed memory);
 * - the cost is the event loop waiting on the host's page cache (microseconds) or, on a miss,
 *   the disk; a rootfs is read mostly at boot and by the commands it runs.
 * Data moves straight between the file and guest RAM (readSync into a view of it), in pieces of
 * at most 1 MiB. Writes go to the host's page cache; FLUSH is offered, so the guest's fsync/sync
 * reach the disk as fdatasync.
 *
 * Since the event loop waits on each request, what a request and a turn may move is bounded, or
 * one notification of requests over aliased buffers would hold it for seconds: a request carries
 * at most seg_max x size_max bytes of data (the most the config space lets a driver send, see
 * {@link MAX_REQUEST_BYTES}; a larger one fails with IOERR, nothing moved), and the queue gives
 * the device chains naming at most {@link BYTES_PER_TURN} bytes a turn of the event loop (the rest
 * in later turns, as the queue's descriptor budget does).
 *
 * Snapshots: only a read-only disk can be saved (see {@link BlkState}); the same synchronous
 * handling means a saved queue never holds a request half done.
 */
import { createHash } from 'node:crypto';
import { closeSync, fdatasyncSync, fstatSync, openSync, readSync, writeSync, constants as fsConstants } from 'node:fs';
import { dupFd, tryLockFile } from '../../../sys/libc';
import { InvalidOptionError, SnapshotError } from '../../../errors';
import type { GuestMemory } from '../guest-memory';
import { booleanAt, checkVersion, integerAt, objectAt, stringAt } from '../../../persist/state-fields';
import { VIRTIO_F_VERSION_1, type VirtioDevice } from '../virtio/mmio-transport';
import type { Descriptor, SplitQueue } from '../virtio/queue';

// Feature bits and request layout from <linux/virtio_blk.h>.
/** VIRTIO_BLK_F_SIZE_MAX: config `size_max` bounds the bytes of one data buffer. */
export const VIRTIO_BLK_F_SIZE_MAX = 1n << 1n;
/** VIRTIO_BLK_F_SEG_MAX: config `seg_max` bounds the data buffers per request. */
export const VIRTIO_BLK_F_SEG_MAX = 1n << 2n;
/** VIRTIO_BLK_F_RO: the disk is read-only. */
export const VIRTIO_BLK_F_RO = 1n << 5n;
/** VIRTIO_BLK_F_FLUSH: the device has a write-back cache and takes FLUSH requests. */
export const VIRTIO_BLK_F_FLUSH = 1n << 9n;

export const VIRTIO_BLK_T_IN = 0;
export const VIRTIO_BLK_T_OUT = 1;
export const VIRTIO_BLK_T_FLUSH = 4;
export const VIRTIO_BLK_T_GET_ID = 8;

export const VIRTIO_BLK_S_OK = 0;
export const VIRTIO_BLK_S_IOERR = 1;
export const VIRTIO_BLK_S_UNSUPP = 2;

/** Sector size of the virtio-blk protocol, whatever the disk's own block size. */
export const SECTOR_BYTES = 512;
/** struct virtio_blk_outhdr: u32 type, u32 reserved, u64 sector. */
const HEADER_BYTES = 16;
/** GET_ID answers at most this many bytes (VIRTIO_BLK_ID_BYTES). */
const ID_BYTES = 20;
/**
 * seg_max: data buffers per request. Without indirect descriptors a request takes seg_max + 2
 * ring entries (header, data, status), so this keeps several requests in a 256-entry queue.
 */
const SEG_MAX = 126;
/**
 * size_max: bytes per data buffer, offered so that a request has a bound a driver knows: Linux's
 * virtio-blk hands seg_max and size_max to its block layer (blk_queue_max_segments,
 * blk_queue_max_segment_size in virtblk_probe), which splits every request to fit both, so no
 * request of a conforming driver carries more than {@link MAX_REQUEST_BYTES}. Linux sends at most
 * 1280 KiB a request by default (max_sectors_kb, BLK_DEF_MAX_SECTORS in 6.1) and, from a page
 * cache of 4 KiB pages that are seldom contiguous, mostly 4 KiB buffers (504 KiB with 126 of
 * them), so the bound costs it nothing; one who raises max_sectors_kb gets requests split at
 * about 2 MiB. Linux wants size_max at least a page.
 */
const SIZE_MAX = 16 * 1024;
/**
 * The most data one request may carry (seg_max x size_max, 2016 KiB). A request is served whole
 * at the notify, never across turns (see the file's comment), so this bounds what one request
 * holds the event loop for; a larger one breaks the limits the device offered and fails with
 * VIRTIO_BLK_S_IOERR before any byte moves.
 */
export const MAX_REQUEST_BYTES = SEG_MAX * SIZE_MAX;
/**
 * Bytes of chains (every buffer each names, an upper bound on what serving it moves) the device
 * takes in one turn of the event loop; the rest waits for later turns. With a request's bound, a
 * turn moves less than BYTES_PER_TURN + MAX_REQUEST_BYTES.
 */
export const BYTES_PER_TURN = 2 * 1024 * 1024;
/** Largest piece moved by one read or write call (a guest buffer may be much larger). */
const PIECE_BYTES = 1024 * 1024;

const REQUESTQ = 0;

/** The version of {@link BlkState} this code writes and reads. */
export const BLK_STATE_VERSION = 1;
/** How much of each end of the image {@link BlkState} fingerprints. */
const FINGERPRINT_BYTES = 1024 * 1024;
/** The longest image path a saved state may name (PATH_MAX). */
const MAX_PATH_CHARS = 4096;

/**
 * The disk's saved state: which image it is, so that a restore reattaches the same bytes. The
 * guest's page cache and its mounted filesystem's view are in guest RAM, so the image must be
 * exactly as it was: a restore refuses one of another path, size or read-only flag, one modified
 * since (its mtime moved), or one whose first or last MiB differs (a copy or a replacement that
 * kept the mtime). Only a read-only disk is saved: a writable image goes on changing under the
 * VM that keeps running, so it would not be the snapshot's. Nothing else is needed: requests are
 * served whole at the notify (see the file's comment), so the saved queue has none half done;
 * the next notification serves what the guest queued since.
 */
export interface BlkState {
  version: typeof BLK_STATE_VERSION;
  path: string;
  readOnly: true;
  sizeBytes: number;
  /** The image's modification time in nanoseconds, as a decimal string (beyond 2^53). */
  mtimeNs: string;
  /** SHA-256 of the first MiB (or of the whole image when smaller), hex. */
  headSha256: string;
  /** SHA-256 of the last MiB, hex. */
  tailSha256: string;
}

/** What identifies an image's bytes in a {@link BlkState}. */
type ImageIdentity = Pick<BlkState, 'sizeBytes' | 'mtimeNs' | 'headSha256' | 'tailSha256'>;

/** The disk a machine attaches. */
export interface DiskConfig {
  /** The image file: used as is, never truncated or grown. */
  path: string;
  /** Offer the disk read-only (VIRTIO_BLK_F_RO) and open the file O_RDONLY. */
  readOnly: boolean;
  /** GET_ID's answer (at most 20 bytes are sent). Default `pvisor-rootfs`. */
  serial?: string;
  /**
   * The image already open (by a jailed VMM's launcher, which may open what the VMM's uid may
   * not): the device uses duplicates of this fd instead of opening `path`, which is then only
   * its name in messages. The owner keeps it open as long as the device lives.
   */
  openFd?: number;
}

/** A request that fails: its status, and why (for the device-error hook), or no why for UNSUPP. */
class RequestFailure {
  constructor(readonly status: number, readonly why?: string) {}
}

/** A contiguous piece of guest memory in a request's data. */
interface Segment {
  gpa: number;
  len: number;
}

/** The virtio-blk device model. */
export class VirtioBlk implements VirtioDevice {
  readonly deviceId = 2;
  readonly queueCount = 1;
  readonly features: bigint;
  /** Capacity in 512-byte sectors, fixed when the device is made. */
  readonly capacitySectors: number;
  private readonly config = Buffer.alloc(24);
  private readonly serial: Buffer;
  private fd: number | null;
  private queue: SplitQueue | null = null;
  /** Only for a guest buffer that straddles two of GuestMemory's views (rare): made on first use. */
  private bounce: Buffer | undefined;

  /**
   * Opens the image (O_RDWR, or O_RDONLY for a read-only disk); a file that cannot be opened or
   * is not a non-empty regular file is an {@link InvalidOptionError} naming it.
   * @param onUsed the device returned requests used (raise the interrupt)
   * @param onError a malformed request from the guest (it failed; the device goes on)
   */
  constructor(
    private readonly mem: GuestMemory,
    private readonly disk: DiskConfig,
    private readonly onUsed: () => void,
    private readonly onError: (message: string) => void,
  ) {
    this.fd = this.open();
    try {
      const st = fstatSync(this.fd);
      if (!st.isFile()) throw new InvalidOptionError('rootfs', `${disk.path} is not a regular file`);
      this.capacitySectors = Math.floor(st.size / SECTOR_BYTES);
      if (this.capacitySectors === 0) throw new InvalidOptionError('rootfs', `${disk.path} is smaller than one 512-byte sector`);
    } catch (e) {
      this.close();
      throw e;
    }
    this.features = VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_SIZE_MAX | VIRTIO_BLK_F_SEG_MAX | VIRTIO_BLK_F_FLUSH | (disk.readOnly ? VIRTIO_BLK_F_RO : 0n);
    // struct virtio_blk_config: u64 capacity @0, u32 size_max @8, u32 seg_max @12.
    this.config.writeBigUInt64LE(BigInt(this.capacitySectors), 0);
    this.config.writeUInt32LE(SIZE_MAX, 8);
    this.config.writeUInt32LE(SEG_MAX, 12);
    this.serial = Buffer.from(disk.serial ?? 'pvisor-rootfs', 'utf8').subarray(0, ID_BYTES);
  }

  private open(): number {
    let fd: number;
    try {
      fd = this.disk.openFd !== undefined ? dupFd(this.disk.openFd) : openSync(this.disk.path, (this.disk.readOnly ? fsConstants.O_RDONLY : fsConstants.O_RDWR));
    } catch (e) {
      throw new InvalidOptionError('rootfs', `cannot open ${this.disk.path}${this.disk.readOnly ? '' : ' for reading and writing'}: ${(e as Error).message}`);
    }
    // Two guests mounting one ext4 image, one of them writing, corrupt it: a writer holds the
    // image alone, readers share it (flock, as other VMMs lock their images).
    if (!tryLockFile(fd, !this.disk.readOnly)) {
      closeSync(fd);
      throw new InvalidOptionError('rootfs', `${this.disk.path} is in use by another VM${this.disk.readOnly ? ' that writes to it' : ''} (it holds a lock on the file)`);
    }
    return fd;
  }

  readConfig(off: number, len: number): number {
    if (off < 0 || len < 1 || len > 4 || off + len > this.config.length) return 0;
    return this.config.readUIntLE(off, len);
  }

  activate(queues: (SplitQueue | null)[]): void {
    // After a reset the file was closed; a driver that comes back gets it reopened.
    this.fd ??= this.open();
    this.queue = queues[REQUESTQ];
  }

  /** The driver reset the device: no queue, and the file is closed until it activates again. */
  reset(): void {
    this.queue = null;
    this.close();
  }

  /** See {@link BlkState}; a writable disk is a {@link SnapshotError}. */
  saveState(): BlkState {
    if (!this.disk.readOnly) {
      throw new SnapshotError(`virtio-blk: ${this.disk.path} is attached read-write: its image goes on changing after the snapshot, so no clone could use it; attach it read-only to snapshot the VM`);
    }
    return { version: BLK_STATE_VERSION, path: this.disk.path, readOnly: true, ...this.identity() };
  }

  /**
   * Takes a {@link saveState} value (unchecked) in place of {@link activate}: this device must
   * have been made with the same image, read-only, and the image must be unchanged; otherwise a
   * {@link SnapshotError} says what differs, and nothing changes.
   */
  restoreState(value: unknown, queues: (SplitQueue | null)[], _acked: bigint, path: string): void {
    const o = objectAt(value, path);
    checkVersion(o, path, BLK_STATE_VERSION);
    const saved = {
      path: stringAt(o, 'path', path, MAX_PATH_CHARS),
      readOnly: booleanAt(o, 'readOnly', path),
      sizeBytes: integerAt(o, 'sizeBytes', path, SECTOR_BYTES, Number.MAX_SAFE_INTEGER),
      mtimeNs: stringAt(o, 'mtimeNs', path, 20, /^\d{1,20}$/),
      headSha256: stringAt(o, 'headSha256', path, 64, /^[0-9a-f]{64}$/),
      tailSha256: stringAt(o, 'tailSha256', path, 64, /^[0-9a-f]{64}$/),
    };
    if (!saved.readOnly) throw new SnapshotError(`${path}.readOnly: a saved disk is read-only, the state says it is writable`);
    if (saved.path !== this.disk.path) throw new SnapshotError(`${path}.path: the state is of ${saved.path}, this device has ${this.disk.path}`);
    if (!this.disk.readOnly) throw new SnapshotError(`${path}: the state's disk is read-only, this device has ${this.disk.path} read-write`);
    const now = this.identity();
    const what = now.sizeBytes !== saved.sizeBytes ? `is ${now.sizeBytes} bytes, was ${saved.sizeBytes}`
      : now.mtimeNs !== saved.mtimeNs ? `was modified after the snapshot (mtime ${now.mtimeNs} ns, was ${saved.mtimeNs})`
      : now.headSha256 !== saved.headSha256 ? 'differs in its first MiB'
      : now.tailSha256 !== saved.tailSha256 ? 'differs in its last MiB'
      : undefined;
    if (what) throw new SnapshotError(`${path}: the image ${this.disk.path} ${what}: it is not the disk the snapshot's guest had mounted`);
    this.queue = queues[REQUESTQ];
  }

  /** Size, mtime and fingerprints of the open image. */
  private identity(): ImageIdentity {
    const fd = this.fd;
    if (fd === null) throw new SnapshotError(`virtio-blk: ${this.disk.path} is closed (the driver reset the device)`);
    const st = fstatSync(fd, { bigint: true });
    const sizeBytes = Number(st.size);
    const sha = (offset: number) => {
      const length = Math.min(FINGERPRINT_BYTES, sizeBytes);
      const bytes = Buffer.alloc(length);
      for (let done = 0; done < length;) {
        const n = readSync(fd, bytes, done, length - done, offset + done);
        if (n <= 0) throw new SnapshotError(`virtio-blk: ${this.disk.path} ended at byte ${offset + done} of ${sizeBytes}`);
        done += n;
      }
      return createHash('sha256').update(bytes).digest('hex');
    };
    return { sizeBytes, mtimeNs: st.mtimeNs.toString(), headSha256: sha(0), tailSha256: sha(Math.max(0, sizeBytes - FINGERPRINT_BYTES)) };
  }

  /** Closes the image (the machine is stopping). Idempotent. */
  close(): void {
    if (this.fd === null) return;
    const fd = this.fd;
    this.fd = null;
    closeSync(fd);
  }

  notify(index: number): void {
    const q = this.queue;
    if (index !== REQUESTQ || !q) return;
    const usedBefore = q.usedIndex;
    let chain;
    while ((chain = q.popValid((message) => this.onError(`virtio-blk: ${message}`)))) {
      q.push(chain.head, this.serve(chain.head, chain.descriptors));
      q.spendBytes(total(chain.descriptors), BYTES_PER_TURN);
    }
    if (q.shouldInterrupt(usedBefore)) this.onUsed();
  }

  /** Serves one request; returns the bytes written into its writable buffers (status included). */
  private serve(head: number, descriptors: Descriptor[]): number {
    // Layout (virtio 1.x, 5.2.6): driver-readable buffers (header, then OUT data), then
    // device-writable ones (IN data or the id), the last byte of the last one being the status.
    // Buffer boundaries carry no meaning, so the request is handled as two byte streams.
    const firstWritable = descriptors.findIndex((d) => d.writable);
    const readable = firstWritable < 0 ? descriptors : descriptors.slice(0, firstWritable);
    const writable = firstWritable < 0 ? [] : descriptors.slice(firstWritable);
    const writableBytes = total(writable);
    if (writableBytes === 0 || writable.some((d) => !d.writable)) {
      // No status byte the guest will look at: the request can only be returned, unanswered.
      this.onError(`virtio-blk: request ${head} has ${writableBytes === 0 ? 'no device-writable status byte' : 'a driver-readable buffer after a device-writable one'}`);
      return 0;
    }
    const status = segmentsOf(writable, writableBytes - 1, 1)[0];
    const inData = segmentsOf(writable, 0, writableBytes - 1);
    try {
      const written = this.execute(readable, inData, writableBytes - 1);
      this.mem.write(status.gpa, Buffer.of(VIRTIO_BLK_S_OK));
      return written + 1;
    } catch (e) {
      // A host I/O error (EIO, ENOSPC) fails this request like a bad one: the guest sees IOERR.
      const failure = e instanceof RequestFailure ? e : new RequestFailure(VIRTIO_BLK_S_IOERR, `${this.disk.path}: ${(e as Error).message}`);
      if (failure.why) this.onError(`virtio-blk: request ${head}: ${failure.why}`);
      this.mem.write(status.gpa, Buffer.of(failure.status));
      return 1;
    }
  }

  /** Runs the request; returns the data bytes written to the guest; throws RequestFailure. */
  private execute(readable: Descriptor[], inData: Segment[], inBytes: number): number {
    const readableBytes = total(readable);
    if (readableBytes < HEADER_BYTES) throw new RequestFailure(VIRTIO_BLK_S_IOERR, `header of ${readableBytes} bytes, not ${HEADER_BYTES}`);
    const header = this.gather(segmentsOf(readable, 0, HEADER_BYTES), HEADER_BYTES);
    const type = header.readUInt32LE(0);
    const sector = header.readBigUInt64LE(8);
    const outData = segmentsOf(readable, HEADER_BYTES, readableBytes - HEADER_BYTES);
    const outBytes = readableBytes - HEADER_BYTES;
    const fd = this.fd;
    if (fd === null) throw new RequestFailure(VIRTIO_BLK_S_IOERR, 'the image is closed');
    switch (type) {
      case VIRTIO_BLK_T_IN: {
        const offset = this.checkRange(sector, inBytes);
        if (outBytes) throw new RequestFailure(VIRTIO_BLK_S_IOERR, `read request carries ${outBytes} bytes of data`);
        this.readToGuest(fd, inData, offset);
        return inBytes;
      }
      case VIRTIO_BLK_T_OUT: {
        if (this.disk.readOnly) throw new RequestFailure(VIRTIO_BLK_S_IOERR, 'write to a read-only disk');
        const offset = this.checkRange(sector, outBytes);
        if (inBytes) throw new RequestFailure(VIRTIO_BLK_S_IOERR, `write request offers ${inBytes} writable data bytes`);
        this.writeFromGuest(fd, outData, offset);
        return 0;
      }
      case VIRTIO_BLK_T_FLUSH:
        if (!this.disk.readOnly) fdatasyncSync(fd);
        return 0;
      case VIRTIO_BLK_T_GET_ID: {
        // The id is NUL-padded to 20 bytes; a shorter buffer gets what fits.
        const id = Buffer.alloc(Math.min(ID_BYTES, inBytes));
        this.serial.copy(id);
        this.scatter(inData, id);
        return id.length;
      }
      default:
        throw new RequestFailure(VIRTIO_BLK_S_UNSUPP);
    }
  }

  /** The byte offset of [sector, sector + len/512) after checking it lies inside the disk. */
  private checkRange(sector: bigint, len: number): number {
    if (len > MAX_REQUEST_BYTES) throw new RequestFailure(VIRTIO_BLK_S_IOERR, `${len} bytes of data, more than the ${MAX_REQUEST_BYTES} a request may carry (seg_max x size_max)`);
    if (len % SECTOR_BYTES !== 0) throw new RequestFailure(VIRTIO_BLK_S_IOERR, `data length ${len} is not a multiple of ${SECTOR_BYTES}`);
    if (sector + BigInt(len / SECTOR_BYTES) > BigInt(this.capacitySectors)) {
      throw new RequestFailure(VIRTIO_BLK_S_IOERR, `sectors ${sector}+${len / SECTOR_BYTES} lie beyond the disk's ${this.capacitySectors}`);
    }
    return Number(sector) * SECTOR_BYTES;
  }

  /** File bytes from `offset` on into the guest's buffers, read straight into guest RAM. */
  private readToGuest(fd: number, segments: Segment[], offset: number): void {
    let at = offset;
    for (const piece of pieces(segments)) {
      const view = this.guestView(piece);
      const target = view ?? (this.bounce ??= Buffer.allocUnsafe(PIECE_BYTES)).subarray(0, piece.len);
      for (let done = 0; done < piece.len;) {
        const n = readSync(fd, target, done, piece.len - done, at + done);
        if (n <= 0) throw new RequestFailure(VIRTIO_BLK_S_IOERR, `${this.disk.path} ended at byte ${at + done}, inside the disk (was it truncated?)`);
        done += n;
      }
      if (!view) this.mem.write(piece.gpa, target);
      at += piece.len;
    }
  }

  /** The guest's buffers into the file from `offset` on. */
  private writeFromGuest(fd: number, segments: Segment[], offset: number): void {
    let at = offset;
    for (const piece of pieces(segments)) {
      const data = this.mem.read(piece.gpa, piece.len); // a view, or a copy across two views
      for (let done = 0; done < piece.len;) {
        const n = writeSync(fd, data, done, piece.len - done, at + done);
        if (n <= 0) throw new RequestFailure(VIRTIO_BLK_S_IOERR, `${this.disk.path}: a write made no progress at byte ${at + done}`);
        done += n;
      }
      at += piece.len;
    }
  }

  /** A zero-copy view of guest RAM for a piece, or undefined where it straddles two views. */
  private guestView(piece: Segment): Buffer | undefined {
    const off = this.mem.hostOffset(piece.gpa, piece.len);
    if (off < 0) return undefined; // not RAM: mem.write will refuse it (the queue checked already)
    try {
      return this.mem.hostView(off, piece.len);
    } catch {
      return undefined;
    }
  }

  private gather(segments: Segment[], len: number): Buffer {
    const out = Buffer.alloc(len);
    let at = 0;
    for (const s of segments) {
      this.mem.read(s.gpa, s.len).copy(out, at);
      at += s.len;
    }
    return out;
  }

  private scatter(segments: Segment[], data: Buffer): void {
    let at = 0;
    for (const s of segments) {
      if (at >= data.length) break;
      const n = Math.min(s.len, data.length - at);
      this.mem.write(s.gpa, data.subarray(at, at + n));
      at += n;
    }
  }
}

/** Segments cut into pieces of at most PIECE_BYTES, so no single call moves a huge buffer. */
function* pieces(segments: Segment[]): Generator<Segment> {
  for (const s of segments) {
    for (let done = 0; done < s.len; done += PIECE_BYTES) yield { gpa: s.gpa + done, len: Math.min(PIECE_BYTES, s.len - done) };
  }
}

function total(descriptors: Descriptor[]): number {
  return descriptors.reduce((sum, d) => sum + d.len, 0);
}

/** The guest memory behind bytes [start, start+len) of the stream the descriptors make. */
function segmentsOf(descriptors: Descriptor[], start: number, len: number): Segment[] {
  const out: Segment[] = [];
  let pos = 0;
  const end = start + len;
  for (const d of descriptors) {
    const from = Math.max(start, pos);
    const to = Math.min(end, pos + d.len);
    if (to > from) out.push({ gpa: d.gpa + (from - pos), len: to - from });
    pos += d.len;
    if (pos >= end) break;
  }
  return out;
}
