// The guest's side of the output floods in the unit suite: a driver over real guest RAM (a real
// mapping) and the real virtio-console device behind its mmio transport, feeding the real agent
// client and Linux client. It behaves as the agent under `yes` does: it keeps the transmit ring
// full of 32 KiB frames of output for request 1 for as long as the device takes them.
import { VirtioConsole } from '../src/backends/kvm/devices/virtio-console';
import { GuestMemory } from '../src/backends/kvm/guest-memory';
import { MmioTransport } from '../src/backends/kvm/virtio/mmio-transport';
import { LinuxGuest } from '../src/guest/linux-client';
import { AgentClient } from '../src/protocol/agent-client';
import { encodeFrame, FrameType } from '../src/protocol/frame';
import { DriverQueue, driverUp, SIZE } from './virtio-driver';

const VERSION_1 = 1n << 32n;
const KiB = 1024;
const MiB = 1024 * KiB;
/** A frame per 32 KiB buffer, as the Linux port sends. */
export const FRAME_PAYLOAD = 32 * KiB - 16;

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
  warnings: string[] = [];
  private seq = 0;
  /** The 26 frames it sends in turn, each chunk all one letter ("a\na\n..." to "z\nz\n..."). */
  private readonly frames: Buffer[];

  /** @param stopAfterBytes the output it has in all (it sends whole frames, so up to a frame more) */
  constructor(op: number, flags: number, private readonly stopAfterBytes = Infinity) {
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
    for (let i = 0; i < SIZE; i++) this.rx.offer(0x40000 + 4 * KiB * i, 4 * KiB, true); // requests land here, unread
    this.client = new AgentClient((b) => this.dev.send(b), () => {}, (m) => this.warnings.push(m), (held) => this.dev.holdTransmit('consumer', held));
    this.linux = new LinuxGuest(this.client);
  }
  private readonly op: number;
  private readonly flags: number;

  /** The agent's side: fills every free transmit buffer with a frame, then notifies once. */
  produce(): void {
    this.taken += this.tx.used().length;
    this.inFlight = this.sentCount - this.taken;
    let posted = 0;
    while (this.sentCount - this.taken < SIZE && this.sentBytes < this.stopAfterBytes) {
      const slot = this.sentCount % SIZE;
      const gpa = 0x100000 + slot * 32 * KiB;
      this.mem.write(gpa, this.frames[this.seq++ % 26]);
      this.tx.offerChain([{ gpa, len: 16 + FRAME_PAYLOAD }]);
      this.sentBytes += FRAME_PAYLOAD;
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

  close(): void {
    this.client.close();
    this.mem.unmap();
  }
}
