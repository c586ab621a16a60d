// The driver's side of a split virtqueue, as a guest driver writes it: real guest memory, rings at
// `base` (descriptors), +0x400 (available) and +0x800 (used), 16 entries. For device-model tests.
import type { GuestMemory } from '../src/backends/kvm/guest-memory';
import type { MmioTransport } from '../src/backends/kvm/virtio/mmio-transport';
import { SplitQueue, type QueueConfig } from '../src/backends/kvm/virtio/queue';

// Device status bits (virtio 1.x, 2.1).
export const ACK = 1;
export const DRIVER = 2;
export const DRIVER_OK = 4;
export const FEATURES_OK = 8;
export const NEEDS_RESET = 64;

/**
 * Brings a transport to DRIVER_OK as a virtio 1 driver does: `features` acked, then queue `i` set
 * up at `queues[i]` (left not ready where null or absent).
 */
export function driverUp(t: MmioTransport, features: bigint, queues: readonly (QueueConfig | null)[]): void {
  const w = (reg: number, v: number) => t.write(reg, 4, v);
  const split = (reg: number, addr: number) => {
    w(reg, addr % 2 ** 32);
    w(reg + 4, Math.floor(addr / 2 ** 32));
  };
  w(0x070, ACK | DRIVER);
  w(0x024, 0);
  w(0x020, Number(features & 0xffffffffn));
  w(0x024, 1);
  w(0x020, Number(features >> 32n));
  w(0x070, ACK | DRIVER | FEATURES_OK);
  queues.forEach((q, i) => {
    if (!q) return;
    w(0x030, i);
    w(0x038, q.size);
    split(0x080, q.descGpa);
    split(0x090, q.availGpa);
    split(0x0a0, q.usedGpa);
    w(0x044, 1);
  });
  w(0x070, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
}

/** Entries of every test ring. */
export const SIZE = 16;

export class DriverQueue {
  private availIdx = 0;
  private seenUsed = 0;
  private nextDesc = 0;
  readonly queue: SplitQueue;
  constructor(private readonly mem: GuestMemory, readonly base: number) {
    this.queue = new SplitQueue(mem, { size: SIZE, descGpa: base, availGpa: base + 0x400, usedGpa: base + 0x800 });
  }
  /** Offers one buffer at `gpa` (device-writable if `writable`). */
  offer(gpa: number, len: number, writable: boolean): void {
    const d = this.nextDesc++ % SIZE;
    this.mem.writeU64(this.base + 16 * d, gpa);
    this.mem.writeU32(this.base + 16 * d + 8, len);
    this.mem.writeU16(this.base + 16 * d + 12, writable ? 2 : 0);
    this.mem.writeU16(this.base + 0x400 + 4 + 2 * (this.availIdx % SIZE), d);
    this.availIdx++;
    this.mem.writeU16(this.base + 0x400 + 2, this.availIdx);
  }
  /** Offers one chain of driver-readable buffers, chained with NEXT. */
  offerChain(buffers: { gpa: number; len: number }[]): void {
    const first = this.nextDesc % SIZE;
    buffers.forEach((b, k) => {
      const d = (first + k) % SIZE;
      this.mem.writeU64(this.base + 16 * d, b.gpa);
      this.mem.writeU32(this.base + 16 * d + 8, b.len);
      this.mem.writeU16(this.base + 16 * d + 12, k < buffers.length - 1 ? 1 : 0);
      this.mem.writeU16(this.base + 16 * d + 14, (d + 1) % SIZE);
    });
    this.nextDesc += buffers.length;
    this.mem.writeU16(this.base + 0x400 + 4 + 2 * (this.availIdx % SIZE), first);
    this.availIdx++;
    this.mem.writeU16(this.base + 0x400 + 2, this.availIdx);
  }
  /** Used elements since the last call: [descriptor, written length]. */
  used(): [number, number][] {
    const out: [number, number][] = [];
    const idx = this.mem.readU16(this.base + 0x800 + 2);
    while (this.seenUsed !== idx) {
      const e = this.base + 0x800 + 4 + 8 * (this.seenUsed % SIZE);
      out.push([this.mem.readU32(e), this.mem.readU32(e + 4)]);
      this.seenUsed = (this.seenUsed + 1) & 0xffff;
    }
    return out;
  }
  get usedFlags(): number {
    return this.mem.readU16(this.base + 0x800);
  }
  set noInterrupt(on: boolean) {
    this.mem.writeU16(this.base + 0x400, on ? 1 : 0);
  }
}

