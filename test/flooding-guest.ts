// The guest's side of the output floods in the unit suite: a driver over real guest RAM (a real
// mapping) and the real virtio-console device behind its mmio transport, feeding the real agent
// client and Linux client. It behaves as the agent under `yes` does: it says in its HELLO that it
// sends under stream credit, reads the host's CREDIT frames from its receive ring, and keeps the
// transmit ring full of 32 KiB frames of output for request 1 for as long as its credit lasts (a
// whole frame at a time: an agent may always send less than its credit). A hostile one
// (`honoursCredit: false`) sends regardless.
import { VirtioConsole } from '../src/backends/kvm/devices/virtio-console';
import { GuestMemory } from '../src/backends/kvm/guest-memory';
import { MmioTransport } from '../src/backends/kvm/virtio/mmio-transport';
import { LinuxGuest } from '../src/guest/linux-client';
import { AgentClient, CommonOp } from '../src/protocol/agent-client';
import { encodeFrame, FrameDecoder, FrameType } from '../src/protocol/frame';
import { STREAM_WINDOW_BYTES } from '../src/protocol/stream-window';
import { DriverQueue, driverUp, SIZE } from './virtio-driver';

const VERSION_1 = 1n << 32n;
const KiB = 1024;
const MiB = 1024 * KiB;
/** A frame per 32 KiB buffer, as the Linux port sends. */
export const FRAME_PAYLOAD = 32 * KiB - 16;
const RX_BASE = 0x40000;
const HELLO_GPA = 0x30000;

/** A Linux agent's HELLO that offers stream credit (features bit 0). */
export function creditHello(): Buffer {
  const payload = Buffer.alloc(36);
  payload.writeUInt32LE(1, 0);
  payload.writeUInt32LE(2, 4);
  payload.writeUInt32LE(1, 32);
  return encodeFrame({ type: FrameType.Event, id: 0, op: CommonOp.Hello, payload });
}

/** A guest whose agent answers request 1 with output chunks for as long as it is let. */
export class FloodingGuest {
  readonly mem = GuestMemory.map(16 * MiB);
  readonly dev: VirtioConsole;
  readonly transport: MmioTransport;
  readonly tx: DriverQueue;
  readonly rx: DriverQueue;
  readonly client: AgentClient;
  readonly linux: LinuxGuest;
  /** Chains the device has taken back from the transmit ring. */
  taken = 0;
  inFlight = 0;
  sentBytes = 0;
  sentCount = 0;
  /** Request 1's credit: what it may still send. */
  credit = STREAM_WINDOW_BYTES;
  /** Calls of produce() that had a free transmit buffer but not the credit for a frame. */
  creditWaits = 0;
  /** CREDIT frames it has read. */
  grants = 0;
  /** False: it sends whatever its credit (a hostile agent). */
  honoursCredit: boolean;
  warnings: string[] = [];
  private seq = 0;
  private rxOffered = 0;
  private readonly decoder = new FrameDecoder();
  /** The 26 frames it sends in turn, each chunk all one letter ("a\na\n..." to "z\nz\n..."). */
  private readonly frames: Buffer[];

  /** @param stopAfterBytes the output it has in all (it sends whole frames, so up to a frame more) */
  constructor(op: number, flags: number, private readonly stopAfterBytes = Infinity, options: { honoursCredit?: boolean } = {}) {
    this.honoursCredit = options.honoursCredit ?? true;
    this.frames = Array.from({ length: 26 }, (_, i) =>
      encodeFrame({ type: FrameType.StreamChunk, id: 1, op, flags, payload: Buffer.alloc(FRAME_PAYLOAD, `${String.fromCharCode(97 + i)}\n`) }),
    );
    this.op = op;
    this.flags = flags;
    this.dev = new VirtioConsole(this.mem, (b) => this.client.receive(b), () => {}, () => {}, (m) => this.warnings.push(m));
    this.transport = new MmioTransport(0xd0000000, this.dev, this.mem);
    this.rx = new DriverQueue(this.mem, 0x10000);
    this.tx = new DriverQueue(this.mem, 0x20000);
    driverUp(this.transport, VERSION_1, [this.rx.queue.config, this.tx.queue.config]);
    for (let i = 0; i < SIZE; i++) this.offerRx();
    this.client = new AgentClient((b) => this.dev.send(b), () => {}, (m) => this.warnings.push(m));
    this.linux = new LinuxGuest(this.client);
    // The agent's first frame, as after a boot.
    const hello = creditHello();
    this.mem.write(HELLO_GPA, hello);
    this.tx.offerChain([{ gpa: HELLO_GPA, len: hello.length }]);
    this.sentCount++;
    this.transport.write(0x050, 4, 1);
  }
  private readonly op: number;
  private readonly flags: number;

  /** Receive buffers are offered in turn, so descriptor i is always buffer i. */
  private offerRx(): void {
    this.rx.offer(RX_BASE + 4 * KiB * (this.rxOffered++ % SIZE), 4 * KiB, true);
  }

  /** The agent reads what the host sent: CREDIT frames for request 1 add to its credit; requests are ignored. */
  private readRequests(): void {
    let reposted = 0;
    for (const [desc, len] of this.rx.used()) {
      for (const f of this.decoder.push(Buffer.from(this.mem.read(RX_BASE + 4 * KiB * desc, len)))) {
        if (f.type === FrameType.Credit && f.id === 1 && f.flags === this.flags && f.payload.length === 4) {
          this.credit += f.payload.readUInt32LE(0);
          this.grants++;
        }
      }
      this.offerRx();
      reposted++;
    }
    if (reposted) this.transport.write(0x050, 4, 0); // QueueNotify 0: buffers for the host's bytes
  }

  /** The agent's side: fills every free transmit buffer with a frame its credit allows, then notifies once. */
  produce(): void {
    this.readRequests();
    this.taken += this.tx.used().length;
    this.inFlight = this.sentCount - this.taken;
    let posted = 0;
    while (this.sentCount - this.taken < SIZE && this.sentBytes < this.stopAfterBytes) {
      if (this.honoursCredit && this.credit < FRAME_PAYLOAD) {
        this.creditWaits++;
        break;
      }
      const slot = this.sentCount % SIZE;
      const gpa = 0x100000 + slot * 32 * KiB;
      this.mem.write(gpa, this.frames[this.seq++ % 26]);
      this.tx.offerChain([{ gpa, len: 16 + FRAME_PAYLOAD }]);
      this.sentBytes += FRAME_PAYLOAD;
      this.credit -= FRAME_PAYLOAD;
      this.sentCount++;
      posted++;
    }
    if (posted) this.transport.write(0x050, 4, 1); // QueueNotify 1
  }

  /** The agent's final frame for request 1, after `last` (one more chunk) in the same buffer. */
  finish(payload: Buffer, last?: Buffer): void {
    this.taken += this.tx.used().length;
    const gpa = 0x100000 + (this.sentCount % SIZE) * 32 * KiB;
    const frames = [last && encodeFrame({ type: FrameType.StreamChunk, id: 1, op: this.op, flags: this.flags, payload: last }), encodeFrame({ type: FrameType.Response, id: 1, op: this.op, payload })];
    const bytes = Buffer.concat(frames.filter((f): f is Buffer => f !== undefined));
    this.mem.write(gpa, bytes);
    this.tx.offerChain([{ gpa, len: bytes.length }]);
    this.sentCount++;
    this.transport.write(0x050, 4, 1);
  }

  /** The agent answers request `id` (another than the flood's) with a response frame. */
  answer(id: number, op: number, payload: Buffer): void {
    this.taken += this.tx.used().length;
    const gpa = 0x100000 + (this.sentCount % SIZE) * 32 * KiB;
    const bytes = encodeFrame({ type: FrameType.Response, id, op, payload });
    this.mem.write(gpa, bytes);
    this.tx.offerChain([{ gpa, len: bytes.length }]);
    this.sentCount++;
    this.transport.write(0x050, 4, 1);
  }

  close(): void {
    this.client.close();
    this.mem.unmap();
  }
}
