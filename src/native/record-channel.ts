/**
 * Node's end of a native helper's record socket (native-prebuilds/helpers/pv_record.h): a stream
 * of 16-byte records from a helper thread, read on the event loop (libuv can watch a socket, not
 * an eventfd or a userfaultfd, and a helper thread must not call into JavaScript).
 */
import { Socket } from 'node:net';

/** One record, as struct pv_record lays it out (little-endian). */
export interface NativeRecord {
  /** What happened, in the sending helper's own numbering. */
  kind: number;
  /** Which of the helper's things it is about (a vCPU, a queue, a source). */
  tag: number;
  /** 0, a positive errno, or a negative reason of the helper's own. */
  err: number;
  /** The number that goes with it; exact below 2^53 (offsets, counts, small return values). */
  value: number;
}

export const RECORD_BYTES = 16;
const TWO_POW_32 = 0x1_0000_0000;

/** Reads records from a helper's socket and hands each to a callback, in order. */
export class RecordChannel {
  private readonly socket: Socket;
  /** The start of a record split across two chunks: at most 15 bytes wait here. */
  private readonly carry = Buffer.alloc(RECORD_BYTES);
  private carried = 0;
  private destroyed = false;

  /**
   * Takes ownership of `fd` (Node's end of the socketpair): {@link destroy} closes it.
   * `writable`: records may also be sent to the helper ({@link send}).
   */
  constructor(fd: number, private readonly onRecord: (rec: NativeRecord) => void, options: { writable?: boolean; onClose?: () => void } = {}) {
    this.socket = new Socket({ fd, readable: true, writable: options.writable ?? false });
    if (options.onClose) this.socket.on('close', options.onClose);
    this.socket.on('data', (chunk: Buffer) => this.onData(chunk));
    // A read error means the helper is being torn down; its records are no longer wanted.
    this.socket.on('error', () => {});
  }

  private onData(chunk: Buffer): void {
    let off = 0;
    if (this.carried) {
      // Complete the split record from the new chunk: never concatenate whole chunks.
      const take = Math.min(RECORD_BYTES - this.carried, chunk.length);
      chunk.copy(this.carry, this.carried, 0, take);
      this.carried += take;
      off = take;
      if (this.carried < RECORD_BYTES) return;
      this.carried = 0;
      this.deliver(this.carry, 0);
    }
    for (; chunk.length - off >= RECORD_BYTES; off += RECORD_BYTES) this.deliver(chunk, off);
    if (off < chunk.length) this.carried = chunk.copy(this.carry, 0, off);
  }

  private deliver(buf: Buffer, off: number): void {
    if (this.destroyed) return;
    this.onRecord({
      kind: buf.readUInt16LE(off),
      tag: buf.readUInt16LE(off + 2),
      err: buf.readInt32LE(off + 4),
      // Two halves, not readBigUInt64LE: this runs once per vCPU exit.
      value: buf.readUInt32LE(off + 8) + buf.readUInt32LE(off + 12) * TWO_POW_32,
    });
  }

  /** Sends one record to the helper (a channel made `writable`); dropped once destroyed. */
  send(rec: NativeRecord): void {
    if (this.destroyed) return;
    const buf = Buffer.alloc(RECORD_BYTES);
    buf.writeUInt16LE(rec.kind, 0);
    buf.writeUInt16LE(rec.tag, 2);
    buf.writeInt32LE(rec.err, 4);
    buf.writeUInt32LE(rec.value % TWO_POW_32, 8);
    buf.writeUInt32LE(Math.floor(rec.value / TWO_POW_32), 12);
    this.socket.write(buf);
  }

  /**
   * Lets the process end while the socket is still open (a helper that lives as long as the
   * process, and only ever reports trouble).
   */
  unref(): void {
    this.socket.unref();
  }

  /** Stops delivering records and closes the socket. Idempotent. */
  destroy(): void {
    if (this.destroyed) return;
    this.destroyed = true;
    this.socket.destroy();
  }
}
