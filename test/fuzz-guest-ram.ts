/**
 * A fuzzing guest driver over real guest RAM (GuestMemory, no KVM): it places virtqueue rings
 * where a hostile driver may (unaligned, across the 1 GiB seam between GuestMemory's views, at
 * the edges of the MMIO hole), writes descriptor chains into them, and keeps a model of what the
 * guest RAM it uses must hold afterwards, so a test can say that a device wrote nothing but what
 * it was allowed to.
 *
 * The driver only ever names bytes inside a few windows of guest RAM (or bytes that are not RAM
 * at all); the model holds a copy of every window.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GuestMemory, HIGH_RAM_START, MMIO_HOLE_START } from '../src/backends/kvm/guest-memory';
import { PAGE_SIZE } from '../src/sys/constants';
import { VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE, type Descriptor, type QueueConfig } from '../src/backends/kvm/virtio/queue';
import type { Rng } from './fuzz-seed';

/** Where GuestMemory's 1 GiB views meet: a field across it cannot go through one view. */
export const VIEW_SEAM = 2 ** 30;
/** Guest RAM of the fuzzers: both regions, low RAM up to the MMIO hole and 1 MiB above 4 GiB. */
export const FUZZ_RAM_BYTES = MMIO_HOLE_START + 2 ** 20;
/** The guest-physical address where that RAM ends. */
export const FUZZ_RAM_END = HIGH_RAM_START + (FUZZ_RAM_BYTES - MMIO_HOLE_START);

/** A range of guest-physical addresses [start, end). */
export interface Range {
  start: number;
  end: number;
}

/** The parts of guest RAM the driver uses: every ring and buffer lies inside one of them. */
export const WINDOWS: readonly Range[] = [
  { start: 0x100000, end: 0x140000 }, // low RAM
  { start: VIEW_SEAM - 0x20000, end: VIEW_SEAM + 0x20000 }, // across the first view seam
  { start: MMIO_HOLE_START - 0x20000, end: MMIO_HOLE_START }, // the end of low RAM, at the hole
  { start: HIGH_RAM_START, end: HIGH_RAM_START + 0x20000 }, // the start of high RAM
];
/** Bytes at the end of every window that nothing is placed in: they must never change. */
const MARGIN = PAGE_SIZE;

/** Maps the fuzzers' guest RAM: 3 GiB and more, NORESERVE, so only the windows cost memory. */
export function mapFuzzRam(): GuestMemory {
  return GuestMemory.map(FUZZ_RAM_BYTES);
}

/**
 * For a test file: the fuzzers' guest RAM and a temporary directory (for image files), made
 * before its tests (read them in a test, not before) and removed after them.
 */
export function withFuzzRam(dirPrefix: string): { mem: GuestMemory; dir: string } {
  const env = {} as { mem: GuestMemory; dir: string };
  beforeAll(() => {
    env.mem = mapFuzzRam();
    env.dir = mkdtempSync(join(tmpdir(), dirPrefix));
  });
  afterAll(() => {
    env.mem?.unmap();
    if (env.dir) rmSync(env.dir, { recursive: true, force: true });
  });
  return env;
}

/** Whether [gpa, gpa+len) is guest RAM of {@link FUZZ_RAM_BYTES}, worked out independently of GuestMemory. */
export function inFuzzRam(gpa: number, len: number): boolean {
  const end = gpa + len;
  return (gpa >= 0 && end <= MMIO_HOLE_START) || (gpa >= HIGH_RAM_START && end <= FUZZ_RAM_END);
}

/** Fills every window of guest RAM with random bytes: a test then sees any byte a device changes. */
export function scramble(mem: GuestMemory, rng: Rng): void {
  for (const w of WINDOWS) mem.write(w.start, rng.bytes(w.end - w.start));
}

/**
 * What the windows of guest RAM must hold: a copy taken from guest RAM, changed by the driver
 * (through {@link poke}, which writes both) and by the test's model of the device.
 */
export class GuestImage {
  private readonly copies: Buffer[];

  constructor(readonly mem: GuestMemory) {
    this.copies = WINDOWS.map((w) => Buffer.from(mem.read(w.start, w.end - w.start)));
  }

  private locate(gpa: number, len: number): [Buffer, number] {
    const i = WINDOWS.findIndex((w) => gpa >= w.start && gpa + len <= w.end);
    if (i < 0) throw new Error(`test bug: 0x${gpa.toString(16)}+${len} is not inside one window`);
    return [this.copies[i], gpa - WINDOWS[i].start];
  }

  read(gpa: number, len: number): Buffer {
    const [b, off] = this.locate(gpa, len);
    return b.subarray(off, off + len);
  }

  write(gpa: number, data: Uint8Array): void {
    const [b, off] = this.locate(gpa, data.length);
    b.set(data, off);
  }

  /** A driver's store: into guest RAM and into the model. */
  poke(gpa: number, data: Uint8Array): void {
    this.mem.write(gpa, data);
    this.write(gpa, data);
  }

  u16(gpa: number): number {
    return this.read(gpa, 2).readUInt16LE(0);
  }

  /**
   * Where guest RAM first differs from the model, or undefined. Bytes inside `ignore` are not
   * compared (what the test cannot predict).
   */
  firstDifference(ignore: readonly Range[] = []): string | undefined {
    for (const [i, w] of WINDOWS.entries()) {
      const actual = this.mem.read(w.start, w.end - w.start);
      const model = this.copies[i];
      if (actual.equals(model)) continue;
      for (const r of outside(w, ignore)) {
        const a = actual.subarray(r.start - w.start, r.end - w.start);
        const m = model.subarray(r.start - w.start, r.end - w.start);
        if (a.equals(m)) continue;
        const off = a.findIndex((b, k) => b !== m[k]);
        return `guest byte 0x${(r.start + off).toString(16)} is 0x${a[off].toString(16)}, expected 0x${m[off].toString(16)}`;
      }
    }
    return undefined;
  }
}

/** The parts of `w` outside every range of `ignore`. */
function outside(w: Range, ignore: readonly Range[]): Range[] {
  const cuts = ignore.filter((r) => r.end > w.start && r.start < w.end).sort((a, b) => a.start - b.start);
  const out: Range[] = [];
  let at = w.start;
  for (const r of cuts) {
    if (r.start > at) out.push({ start: at, end: r.start });
    at = Math.max(at, r.end);
  }
  if (at < w.end) out.push({ start: at, end: w.end });
  return out;
}

export function u16le(v: number): Buffer {
  const b = Buffer.alloc(2);
  b.writeUInt16LE(v & 0xffff, 0);
  return b;
}

export function u32le(v: number): Buffer {
  const b = Buffer.alloc(4);
  b.writeUInt32LE(v >>> 0, 0);
  return b;
}

/**
 * Hands out space in the windows, rings first, then buffers from what is left (the pool). Every
 * window keeps an unused margin at its end and, now and then, a region is put across the seam.
 */
export class Placer {
  private readonly cursors: number[];
  private readonly firsts: number[];
  private seamTried = false;

  constructor(private readonly rng: Rng) {
    this.cursors = WINDOWS.map((w) => w.start + rng.int(PAGE_SIZE));
    this.firsts = [...this.cursors];
  }

  /** `len` bytes at an address that is a multiple of `align` plus `skew`, in a window with room. */
  take(len: number, align: number, skew = 0): number {
    const order = this.rng.shuffle([...WINDOWS.keys()]);
    if (!this.seamTried && this.rng.chance(0.4)) {
      // Across the seam: the region starts up to its length before it.
      this.seamTried = true;
      this.cursors[1] = Math.max(this.cursors[1], VIEW_SEAM - this.rng.int(len + 1));
      order.unshift(1);
    }
    for (const i of order) {
      let at = this.cursors[i] + this.rng.int(64);
      at = Math.ceil((at - skew) / align) * align + skew;
      if (at + len <= WINDOWS[i].end - MARGIN - PAGE_SIZE * 4) {
        this.cursors[i] = at + len;
        return at;
      }
    }
    throw new Error(`test bug: no window has room for ${len} bytes`);
  }

  /** The space left in every window, for buffers. */
  pools(): Range[] {
    return WINDOWS.map((w, i) => ({ start: this.cursors[i], end: w.end - MARGIN }));
  }

  /** Everything placed in a window so far and its pool: beyond it, a window's bytes are never named. */
  named(): Range[] {
    return WINDOWS.map((w, i) => ({ start: this.firsts[i], end: w.end - MARGIN }));
  }
}

/**
 * Rings for a queue of `size` entries. Aligned as the split ring asks (descriptors 16, available
 * 2, used 4 bytes), or, if `misalign`, each ring may be off by a few bytes.
 */
export function placeRings(placer: Placer, rng: Rng, size: number, misalign = false): QueueConfig {
  const skew = (align: number) => (misalign && rng.chance(0.5) ? rng.between(1, align - 1 || 1) : 0);
  const descGpa = placer.take(16 * size, 16, skew(16));
  const availGpa = placer.take(6 + 2 * size, 2, skew(2));
  const usedGpa = placer.take(6 + 8 * size, 4, skew(4));
  return { size, descGpa, availGpa, usedGpa };
}

/** A buffer of a chain as the driver describes it. */
export interface Buf {
  gpa: number;
  len: number;
  flags: number;
}

/**
 * A buffer's place: mostly inside `pool`, sometimes where no buffer may be (past the end of RAM,
 * across the MMIO hole, at addresses beyond 2^53, lengths up to 2^32-1).
 */
export function bufferAt(rng: Rng, pool: Range, len: number, alignTo = 1): { gpa: number; len: number } {
  const r = rng.int(40);
  if (r === 0) return { gpa: FUZZ_RAM_END - rng.int(16), len: rng.between(17, 4096) };
  if (r === 1) return { gpa: MMIO_HOLE_START - rng.between(1, 64), len: rng.between(65, 8192) };
  if (r === 2) return { gpa: rng.pick([2 ** 53, 2 ** 62, 2 ** 64 - 4096, HIGH_RAM_START - 4096]), len: rng.int(4097) };
  if (r === 3) {
    // From inside the pool to past the end of its RAM region, by up to 2^32-1 bytes.
    const regionEnd = pool.start < MMIO_HOLE_START ? MMIO_HOLE_START : FUZZ_RAM_END;
    return { gpa: pool.start, len: rng.chance(0.5) ? 0xffffffff : regionEnd - pool.start + rng.between(1, PAGE_SIZE) };
  }
  const room = pool.end - pool.start;
  const n = Math.min(len, room);
  const start = Math.ceil(pool.start / alignTo) * alignTo;
  const slots = Math.floor((pool.end - n - start) / alignTo);
  return { gpa: slots > 0 ? start + alignTo * rng.int(slots + 1) : pool.start, len: slots > 0 ? n : 0 };
}

/** The driver's side of one queue over real guest RAM, every store also made in the model. */
export class FuzzDriver {
  private nextDesc = 0;
  /**
   * The head posted at each available index not yet followed: a driver that posts while the
   * device takes reuses ring slots before a test looks back at them.
   */
  private readonly posted = new Map<number, number>();

  constructor(private readonly image: GuestImage, readonly config: QueueConfig, public availIdx: number) {}

  /** Writes descriptor `i`. */
  desc(i: number, gpa: number, len: number, flags: number, next: number): void {
    const d = Buffer.alloc(16);
    d.writeBigUInt64LE(BigInt(gpa) & 0xffffffffffffffffn, 0);
    d.writeUInt32LE(len >>> 0, 8);
    d.writeUInt16LE(flags & 0xffff, 12);
    d.writeUInt16LE(next & 0xffff, 14);
    this.image.poke(this.config.descGpa + 16 * i, d);
  }

  /** Makes `head` available (next entry of the available ring, then the index). */
  post(head: number): void {
    const { availGpa, size } = this.config;
    this.image.poke(availGpa + 4 + 2 * (this.availIdx % size), u16le(head));
    this.posted.set(this.availIdx, head);
    this.availIdx = (this.availIdx + 1) & 0xffff;
    this.image.poke(availGpa + 2, u16le(this.availIdx));
  }

  /** The head posted at available index `idx` (forgotten once asked for), if this driver posted it. */
  takePosted(idx: number): number | undefined {
    const head = this.posted.get(idx);
    this.posted.delete(idx);
    return head;
  }

  /** Sets the available index to anything (a driver that lies about what it posted). */
  setAvailIdx(idx: number): void {
    this.availIdx = idx & 0xffff;
    this.image.poke(this.config.availGpa + 2, u16le(this.availIdx));
  }

  /** Sets avail.flags (bit 0: no interrupts wanted). */
  setAvailFlags(flags: number): void {
    this.image.poke(this.config.availGpa, u16le(flags));
  }

  /**
   * Writes `bufs` as one chain in descriptors taken in turn from the table and posts it; with
   * `corrupt`, one descriptor's flags or next index is replaced by a random one (loops, indices
   * out of range, indirect tables). Returns the head.
   */
  offer(rng: Rng, bufs: Buf[], corrupt = false): number {
    const { size } = this.config;
    const ids = bufs.map(() => this.nextDesc++ % size);
    bufs.forEach((b, k) => {
      const last = k === bufs.length - 1;
      this.desc(ids[k], b.gpa, b.len, (b.flags & ~VIRTQ_DESC_F_NEXT) | (last ? 0 : VIRTQ_DESC_F_NEXT), last ? rng.int(0x10000) : ids[k + 1]);
    });
    if (corrupt && bufs.length) {
      const k = rng.int(bufs.length);
      const b = bufs[k];
      this.desc(ids[k], b.gpa, b.len, rng.pick([VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_INDIRECT, rng.int(0x10000), b.flags | VIRTQ_DESC_F_NEXT]), rng.pick([ids[0], ids[k], size, rng.int(0x10000)]));
    }
    const head = bufs.length ? ids[0] : rng.int(size);
    this.post(rng.chance(0.03) ? rng.pick([size, 0xffff, rng.int(0x10000)]) : head);
    return head;
  }
}

/** One entry of the available ring as the split ring's rules make it (virtio 1.x, 2.7.5-2.7.7). */
export type ModelChain =
  | { kind: 'bad-head'; head: number; walked: 0 }
  | { kind: 'bad-chain'; head: number; walked: number }
  | { kind: 'chain'; head: number; walked: number; descriptors: Descriptor[] };

/**
 * The chain at available entry `availIdx` (whose head is `posted`, when the driver remembers it),
 * read from the model: the reference the device's queue is checked against. A chain is bad when
 * it has more descriptors than the ring, an indirect descriptor, a buffer outside guest RAM or a
 * next index outside the ring. `walked` is how many descriptors were read to find out (what the
 * queue's budget per turn counts).
 */

export function modelChain(image: GuestImage, config: QueueConfig, availIdx: number, posted?: number): ModelChain {
  const { size, descGpa, availGpa } = config;
  const head = posted ?? image.u16(availGpa + 4 + 2 * (availIdx % size));
  if (head >= size) return { kind: 'bad-head', head, walked: 0 };
  const descriptors: Descriptor[] = [];
  for (let i = head; ;) {
    if (descriptors.length >= size) return { kind: 'bad-chain', head, walked: descriptors.length };
    const d = image.read(descGpa + 16 * i, 16);
    const walked = descriptors.length + 1;
    const gpa = Number(d.readBigUInt64LE(0));
    const len = d.readUInt32LE(8);
    const flags = d.readUInt16LE(12);
    if (flags & VIRTQ_DESC_F_INDIRECT || !inFuzzRam(gpa, len)) return { kind: 'bad-chain', head, walked };
    descriptors.push({ gpa, len, writable: (flags & VIRTQ_DESC_F_WRITE) !== 0 });
    if (!(flags & VIRTQ_DESC_F_NEXT)) return { kind: 'chain', head, walked, descriptors };
    i = d.readUInt16LE(14);
    if (i >= size) return { kind: 'bad-chain', head, walked };
  }
}

/** Writes used element `usedIdx` and the used index into the model, as the device must have. */
export function modelUsed(image: GuestImage, config: QueueConfig, usedIdx: number, head: number, len: number): void {
  const e = config.usedGpa + 4 + 8 * (usedIdx % config.size);
  image.write(e, u32le(head));
  image.write(e + 4, u32le(len));
  image.write(config.usedGpa + 2, u16le(usedIdx + 1));
}
