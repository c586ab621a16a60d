/**
 * pvisor's agent protocol v1 framing, spoken by both guests (docs/probe-guest.md): a 16-byte
 * header (magic "PV", version, type, request id, op, flags, payload length) and a binary payload.
 */

/** Frame types. */
export const enum FrameType {
  Request = 1,
  Response = 2,
  StreamChunk = 3,
  Error = 4,
  Event = 5,
}

/** One decoded frame. */
export interface Frame {
  type: FrameType;
  id: number;
  op: number;
  flags: number;
  payload: Buffer;
}

export const FRAME_HEADER_BYTES = 16;
export const PROTOCOL_VERSION = 1;
/** Largest payload either side accepts. */
export const MAX_PAYLOAD_BYTES = 1024 * 1024;
const MAGIC0 = 0x50; // 'P'
const MAGIC1 = 0x56; // 'V'

/** Encodes one frame. */
export function encodeFrame(f: Omit<Frame, 'flags'> & { flags?: number }): Buffer {
  if (f.payload.length > MAX_PAYLOAD_BYTES) throw new RangeError(`payload of ${f.payload.length} bytes exceeds ${MAX_PAYLOAD_BYTES}`);
  const b = Buffer.allocUnsafe(FRAME_HEADER_BYTES + f.payload.length);
  b[0] = MAGIC0;
  b[1] = MAGIC1;
  b[2] = PROTOCOL_VERSION;
  b[3] = f.type;
  b.writeUInt32LE(f.id >>> 0, 4);
  b.writeUInt16LE(f.op, 8);
  b.writeUInt16LE(f.flags ?? 0, 10);
  b.writeUInt32LE(f.payload.length, 12);
  f.payload.copy(b, FRAME_HEADER_BYTES);
  return b;
}

/** The byte stream does not hold valid frames (bad magic, version or length). */
export class FrameError extends Error {}

/** Reassembles frames from a byte stream that may split or join them anywhere. */
export class FrameDecoder {
  private buf: Buffer = Buffer.alloc(0);

  /** Adds bytes and returns every frame now complete. Throws {@link FrameError} on garbage. */
  push(bytes: Buffer): Frame[] {
    this.buf = this.buf.length ? Buffer.concat([this.buf, bytes]) : bytes;
    const frames: Frame[] = [];
    let off = 0;
    while (this.buf.length - off >= FRAME_HEADER_BYTES) {
      const b = this.buf;
      if (b[off] !== MAGIC0 || b[off + 1] !== MAGIC1) {
        this.buf = Buffer.alloc(0);
        throw new FrameError('bad frame magic');
      }
      if (b[off + 2] !== PROTOCOL_VERSION) {
        this.buf = Buffer.alloc(0);
        throw new FrameError(`unsupported protocol version ${b[off + 2]}`);
      }
      const len = b.readUInt32LE(off + 12);
      if (len > MAX_PAYLOAD_BYTES) {
        this.buf = Buffer.alloc(0);
        throw new FrameError(`payload length ${len} exceeds ${MAX_PAYLOAD_BYTES}`);
      }
      if (b.length - off < FRAME_HEADER_BYTES + len) break;
      frames.push({
        type: b[off + 3] as FrameType,
        id: b.readUInt32LE(off + 4),
        op: b.readUInt16LE(off + 8),
        flags: b.readUInt16LE(off + 10),
        payload: Buffer.from(b.subarray(off + FRAME_HEADER_BYTES, off + FRAME_HEADER_BYTES + len)),
      });
      off += FRAME_HEADER_BYTES + len;
    }
    this.buf = off === this.buf.length ? Buffer.alloc(0) : this.buf.subarray(off);
    return frames;
  }
}
