/**
 * pvisor's frames, spoken by both guests (docs/probe-guest.md) and the page pool's daemon: a
 * 16-byte header (magic "PV", version, type, request id, op, flags, payload length) and a binary
 * payload. The C side is native-prebuilds/include/pv_frame.h, one header for the agent, the probe
 * and the daemon; test/unit/frame-vectors.test.ts checks the two against each other.
 */

/** Frame types. */
export const enum FrameType {
  Request = 1,
  Response = 2,
  StreamChunk = 3,
  Error = 4,
  Event = 5,
  /** Host to guest: a stream's consumer has read, the guest may send more (docs/agent-protocol.md, "Stream credit"); never answered. */
  Credit = 6,
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
/**
 * The version of the frame layout (header byte 2), not of a protocol carried in frames: the agent
 * protocol says its version in its HELLO event, the pool protocol in its Hello request.
 */
export const FRAME_VERSION = 1;
/** Largest payload either side accepts. */
export const MAX_PAYLOAD_BYTES = 1024 * 1024;
const MAGIC0 = 0x50; // 'P'
const MAGIC1 = 0x56; // 'V'

/** Encodes one frame. */
export function encodeFrame(f: Omit<Frame, 'flags'> & { flags?: number }): Buffer {
  const b = Buffer.allocUnsafe(FRAME_HEADER_BYTES + f.payload.length);
  writeFrameHeader(b, { ...f, length: f.payload.length });
  f.payload.copy(b, FRAME_HEADER_BYTES);
  return b;
}

/**
 * Writes a frame's header into the first {@link FRAME_HEADER_BYTES} of `b`, for a payload of
 * `length` bytes that the caller has put (or will put) right after it: a sender that builds its
 * payloads in one reusable buffer sends them without a copy.
 */
export function writeFrameHeader(b: Buffer, f: { type: FrameType; id: number; op: number; flags?: number; length: number }): void {
  if (f.length > MAX_PAYLOAD_BYTES) throw new RangeError(`payload of ${f.length} bytes exceeds ${MAX_PAYLOAD_BYTES}`);
  b[0] = MAGIC0;
  b[1] = MAGIC1;
  b[2] = FRAME_VERSION;
  b[3] = f.type;
  b.writeUInt32LE(f.id >>> 0, 4);
  b.writeUInt16LE(f.op, 8);
  b.writeUInt16LE(f.flags ?? 0, 10);
  b.writeUInt32LE(f.length, 12);
}

/** The byte stream does not hold valid frames: `reason` says which check of the header failed first. */
export class FrameError extends Error {
  constructor(readonly reason: 'magic' | 'version' | 'length', message: string) {
    super(message);
  }
}

/**
 * Reassembles frames from a byte stream that may split or join them anywhere. Linear in the bytes
 * pushed: each byte is copied once, into the header or into its frame's own payload buffer, as it
 * comes (a guest sending a 1 MiB frame a byte at a time must not cost a copy of the partial frame
 * per byte).
 */
export class FrameDecoder {
  private readonly headerBytes = Buffer.alloc(FRAME_HEADER_BYTES);
  private headerFill = 0;
  /** The frame being assembled once its header is in, with how much of its payload has come. */
  private frame: Frame | undefined;
  private payloadFill = 0;
  /** With `reusePayloads`: the one buffer every payload is assembled in. */
  private assembly: Buffer | undefined;

  /**
   * @param options.reusePayloads assemble every payload in one buffer, allocated once, and hand
   *   frames out only through {@link pushEach}, each valid until its callback returns. For a
   *   reader that handles each frame at once and keeps nothing of it (the page pool's daemon,
   *   which takes 1 MiB frames of pages as fast as VMs send them: a fresh buffer per frame grew it
   *   by tens of MiB of garbage that malloc kept).
   */
  constructor(private readonly options: { reusePayloads?: boolean } = {}) {}

  /**
   * The bytes of the frame being assembled, as they came: what a fresh decoder must be fed to
   * carry on where this one is (a snapshot of the channel).
   */
  pendingBytes(): Buffer {
    if (!this.frame) return Buffer.from(this.headerBytes.subarray(0, this.headerFill));
    // The header stays in headerBytes until the next frame's header starts to overwrite it.
    return Buffer.concat([this.headerBytes, this.frame.payload.subarray(0, this.payloadFill)]);
  }

  /** Adds bytes and returns every frame now complete. Throws {@link FrameError} on garbage. */
  push(bytes: Buffer): Frame[] {
    if (this.options.reusePayloads) throw new Error('a decoder that reuses its payload buffer hands frames out through pushEach');
    const frames: Frame[] = [];
    this.pushEach(bytes, (f) => frames.push(f));
    return frames;
  }

  /**
   * Adds bytes and calls `handle` with each frame as it completes, before assembling the next.
   * With `reusePayloads`, a frame's payload is valid only until `handle` returns. Throws
   * {@link FrameError} on garbage, and what `handle` throws (the rest of `bytes` is then dropped).
   */
  pushEach(bytes: Buffer, handle: (f: Frame) => void): void {
    let at = 0;
    while (at < bytes.length || (this.frame && this.payloadFill === this.frame.payload.length)) {
      if (!this.frame) {
        const n = Math.min(FRAME_HEADER_BYTES - this.headerFill, bytes.length - at);
        bytes.copy(this.headerBytes, this.headerFill, at, at + n);
        this.headerFill += n;
        at += n;
        if (this.headerFill < FRAME_HEADER_BYTES) break;
        this.headerFill = 0;
        this.frame = this.parseHeader(this.headerBytes);
        this.payloadFill = 0;
      }
      const f = this.frame;
      const n = Math.min(f.payload.length - this.payloadFill, bytes.length - at);
      bytes.copy(f.payload, this.payloadFill, at, at + n);
      this.payloadFill += n;
      at += n;
      if (this.payloadFill < f.payload.length) break;
      this.frame = undefined;
      handle(f);
    }
  }

  /** The header's frame, with a payload buffer of its length to fill. Lost framing throws. */
  private parseHeader(b: Buffer): Frame {
    if (b[0] !== MAGIC0 || b[1] !== MAGIC1) throw new FrameError('magic', 'bad frame magic');
    if (b[2] !== FRAME_VERSION) throw new FrameError('version', `unsupported protocol version ${b[2]}`);
    const length = b.readUInt32LE(12);
    if (length > MAX_PAYLOAD_BYTES) throw new FrameError('length', `payload length ${length} exceeds ${MAX_PAYLOAD_BYTES}`);
    const payload = this.options.reusePayloads ? (this.assembly ??= Buffer.allocUnsafe(MAX_PAYLOAD_BYTES)).subarray(0, length) : Buffer.allocUnsafe(length);
    return { type: b[3] as FrameType, id: b.readUInt32LE(4), op: b.readUInt16LE(8), flags: b.readUInt16LE(10), payload };
  }
}
