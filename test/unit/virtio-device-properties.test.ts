// The virtio device models (console, balloon, blk over a real image file) behind the real
// virtio-mmio transport, driven by a fuzzing guest driver over real guest RAM: rings at random
// aligned places (across the 1 GiB view seam, in high RAM), random starting indices (through a
// saved state), chains that loop, alias one buffer many times, leave RAM or run out of the ring.
// No KVM. What each device did is checked against a model of the device replayed over the chains
// it returned used, in order:
// - nothing but typed queue errors: no notification throws;
// - at most one ring of chains per notification and per turn of the event loop; a transmit chain
//   carries at most 1 MiB + 4 KiB, a turn at most 8 MiB more (chains are counted by a spy that
//   calls the real SplitQueue.pop through);
// - host memory allocated by a notification is at most twice what it hands on, plus 2 MiB;
// - guest RAM changes only where the model says (used rings, the device-writable buffers of
//   well-formed requests), the disk image only by a well-formed write request;
// - every chain the driver made available is taken (no notification is lost).
// A second property per device lets buffers overlap the rings themselves, where no model can say
// what must happen, and checks only the bounds, that nothing throws and that nothing outside the
// windows the driver named changes.
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { VirtioBalloon, VIRTIO_BALLOON_F_FREE_PAGE_REPORTING } from '../../src/backends/kvm/devices/virtio-balloon';
import {
  SECTOR_BYTES, VirtioBlk, VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
} from '../../src/backends/kvm/devices/virtio-blk';
import { VirtioConsole } from '../../src/backends/kvm/devices/virtio-console';
import type { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { MmioTransport, VIRTIO_F_VERSION_1, type VirtioDevice } from '../../src/backends/kvm/virtio/mmio-transport';
import { SplitQueue, VIRTQ_DESC_F_WRITE, type Descriptor, type QueueConfig } from '../../src/backends/kvm/virtio/queue';
import { SnapshotError } from '../../src/errors';
import { PAGE_SIZE } from '../../src/sys/constants';
import { property, thrown, type Rng } from '../fuzz-seed';
import { bufferAt, FuzzDriver, GuestImage, withFuzzRam, modelChain, modelUsed, placeRings, Placer, scramble, u16le, type Buf, type ModelChain, type Range } from '../fuzz-guest-ram';
import { driverUp, NEEDS_RESET } from '../virtio-driver';

const TRANSPORT_BASE = 0xd0000000;
const QUEUE_NOTIFY = 0x050;
const STATUS = 0x070;
const VIRTIO_CONSOLE_F_MULTIPORT = 1n << 1n;

/** The stated bounds (issue 10, item 1): what one transmit chain, and one turn, may carry. */
const MAX_CHAIN_BYTES = 1024 * 1024 + 4096;
const MAX_TURN_BYTES = 8 * 1024 * 1024 + MAX_CHAIN_BYTES;
/** Host bytes a notification may allocate beyond twice what it hands on (blk's 1 MiB bounce buffer, slack). */
const ALLOCATION_SLACK = 2 * 1024 * 1024;

/** One queue of a device under test, and how far the model has followed it. */
interface RigQueue {
  index: number;
  config: QueueConfig;
  driver: FuzzDriver;
  /** The next available entry and used entry the model has not yet accounted for. */
  availFrom: number;
  usedFrom: number;
  /** Whether the driver notified the queue since it last made chains available. */
  notified: boolean;
}

/** A device behind its transport, with the driver's queues and the model of guest RAM. */
interface Rig<D extends VirtioDevice> {
  dev: D;
  t: MmioTransport;
  image: GuestImage;
  queues: RigQueue[];
  errors: string[];
  /** Bytes the device handed on (the console's transmitted data), for the allocation bound. */
  handedOn: () => number;
}

const sum = (ds: readonly { len: number }[]) => ds.reduce((n, d) => n + d.len, 0);

/**
 * Sets a device up behind a fresh transport, as its driver would or, if the device can save and
 * restore, from a saved state with random available and used indices (as a snapshot restores it).
 */
function bringUp<D extends VirtioDevice>(mem: GuestMemory, rng: Rng, make: () => D, features: bigint, configs: (QueueConfig | null)[], handedOn: () => number = () => 0): Rig<D> {
  const errors: string[] = [];
  const indices = configs.map(() => ({ nextAvail: 0, nextUsed: 0 }));
  let dev: D;
  let t: MmioTransport;
  let scratch: D | undefined = make();
  let state: { active: { queues: ({ nextAvail: number; nextUsed: number } | null)[] } } | undefined;
  if (scratch.saveState && scratch.restoreState && rng.chance(0.6)) {
    const s = new MmioTransport(TRANSPORT_BASE, scratch, mem);
    driverUp(s, features, configs);
    // A device that cannot be saved as it is (a writable disk) is set up by its driver instead.
    const refused = thrown(() => (state = JSON.parse(JSON.stringify(s.saveState()))));
    if (refused !== undefined && !(refused instanceof SnapshotError)) throw refused;
    (scratch as { close?: () => void }).close?.(); // a disk's image lock
    scratch = undefined; // driven already
  }
  if (state) {
    state.active.queues.forEach((q, i) => {
      if (!q) return;
      const near = rng.chance(0.3) ? 0xffff - rng.int(8) : rng.int(0x10000); // near the 16-bit wrap, or anywhere
      indices[i] = { nextAvail: near, nextUsed: rng.chance(0.5) ? near : rng.int(0x10000) };
      Object.assign(q, indices[i]);
    });
    dev = make();
    t = new MmioTransport(TRANSPORT_BASE, dev, mem, () => {}, (m) => errors.push(m));
    t.restoreState(state);
  } else {
    dev = scratch ?? make();
    t = new MmioTransport(TRANSPORT_BASE, dev, mem, () => {}, (m) => errors.push(m));
    driverUp(t, features, configs);
  }
  expect(t.read(STATUS, 4) & NEEDS_RESET).toBe(0);
  const image = new GuestImage(mem);
  const queues = configs.flatMap((config, index) => {
    if (!config) return [];
    const { nextAvail, nextUsed } = indices[index];
    const driver = new FuzzDriver(image, config, nextAvail);
    driver.setAvailIdx(nextAvail);
    image.poke(config.usedGpa + 2, u16le(nextUsed)); // as the driver (or the snapshot's RAM) left it
    return [{ index, config, driver, availFrom: nextAvail, usedFrom: nextUsed, notified: true }];
  });
  return { dev, t, image, queues, errors, handedOn };
}

/** Rings for each queue (null where `sizes` has none): aligned, anywhere in the windows. */
function ringsFor(placer: Placer, rng: Rng, sizes: (number | null)[]): (QueueConfig | null)[] {
  return sizes.map((size) => (size === null ? null : placeRings(placer, rng, size)));
}

/** A power of two up to `max`, skewed to the small. */
function queueSize(rng: Rng, max: number): number {
  return 2 ** rng.int(Math.log2(max) + 1);
}

/** The driver makes a chain available on `q` (see {@link FuzzDriver.offer}). */
function offer(q: RigQueue, rng: Rng, bufs: Buf[], corrupt: boolean): void {
  q.notified = false;
  q.driver.offer(rng, bufs, corrupt);
}

function usedIndexIn(mem: GuestMemory, q: RigQueue): number {
  return mem.read(q.config.usedGpa + 2, 2).readUInt16LE(0);
}

/**
 * Available entries each queue took, by its descriptor table's address: counted at SplitQueue.pop
 * (the real one, called through), since a guest's buffers may overwrite the used index.
 */
const takes = new Map<number, number>();
function takenFrom(q: RigQueue): number {
  return takes.get(q.config.descGpa) ?? 0;
}
beforeAll(() => {
  const pop = SplitQueue.prototype.pop;
  const count = (queue: SplitQueue) => takes.set(queue.config.descGpa, (takes.get(queue.config.descGpa) ?? 0) + 1);
  jest.spyOn(SplitQueue.prototype, 'pop').mockImplementation(function (this: SplitQueue) {
    let chain;
    try {
      chain = pop.call(this);
    } catch (e) {
      count(this); // a malformed chain is taken too
      throw e;
    }
    if (chain) count(this);
    return chain;
  });
});
afterAll(() => jest.restoreAllMocks());

/**
 * Notifies queue `q` through the transport's register and checks the bounds of that one
 * notification: nothing thrown, at most one ring of chains taken, host memory allocated at
 * most twice what the device handed on plus slack.
 */
function notify<D extends VirtioDevice>(rig: Rig<D>, q: RigQueue): void {
  const takenBefore = takenFrom(q);
  const handedBefore = rig.handedOn();
  const allocatedBefore = process.memoryUsage().arrayBuffers;
  q.notified = true;
  const e = thrown(() => rig.t.write(QUEUE_NOTIFY, 4, q.index));
  const allocated = process.memoryUsage().arrayBuffers - allocatedBefore;
  if (e !== undefined) expect(e).toBeUndefined();
  const taken = takenFrom(q) - takenBefore;
  const handed = rig.handedOn() - handedBefore;
  if (taken > q.config.size) expect({ taken }).toEqual({ taken: `at most ${q.config.size}` });
  if (allocated > 2 * handed + ALLOCATION_SLACK) expect({ allocated }).toEqual({ allocated: `at most ${2 * handed + ALLOCATION_SLACK}` });
  if (handed > MAX_TURN_BYTES) expect({ handed }).toEqual({ handed: `at most ${MAX_TURN_BYTES}` });
}

/**
 * Lets the device finish in later turns of the event loop what its budget left (it must go on by
 * itself), checking each turn's bounds, until nothing moves for two turns or `maxTurns` pass.
 * The default bound is a ring's worth of turns and more: a guest that posts a chain of a ring's
 * worth of descriptors again each time the device takes one (the console's reposts, up to three
 * rings of them) is served about two chains a turn, as the descriptor budget wants.
 */
async function settle<D extends VirtioDevice>(rig: Rig<D>, maxTurns = 2000): Promise<void> {
  for (let turn = 0, quiet = 0; turn < maxTurns && quiet < 2; turn++) {
    const before = rig.queues.map(takenFrom);
    const handedBefore = rig.handedOn();
    await new Promise((resolve) => setImmediate(resolve));
    const moved = rig.queues.map((q, i) => takenFrom(q) - before[i]);
    // Two budgets may fall into one measured turn (the device's immediate and ours interleave).
    rig.queues.forEach((q, i) => {
      if (moved[i] > 2 * q.config.size) expect({ queue: q.index, moved: moved[i] }).toEqual({ queue: q.index, moved: `at most ${2 * q.config.size}` });
    });
    const handed = rig.handedOn() - handedBefore;
    if (handed > 2 * MAX_TURN_BYTES) expect({ handed }).toEqual({ handed: `at most ${2 * MAX_TURN_BYTES}` });
    quiet = moved.some((n) => n > 0) ? 0 : quiet + 1;
  }
}

/**
 * The chains the device took from `q` since the model last looked, in order, each with the used
 * element it returned (none for an available entry whose head is out of the ring: it is dropped).
 * `serve` is the model of the device: it applies the request to the model and returns the length
 * the device must have written. Checks that every chain made available was taken, unless the
 * queue broke or `mayWait` (a receive queue waits for bytes to send).
 */
function follow<D extends VirtioDevice>(rig: Rig<D>, q: RigQueue, serve: (chain: ModelChain & { kind: 'chain' | 'bad-chain' }) => number, mayWait = () => false): void {
  const mem = rig.image.mem;
  const usedTo = usedIndexIn(mem, q);
  while (q.usedFrom !== usedTo) {
    if (q.availFrom === q.driver.availIdx) throw new Error(`queue ${q.index}: the device returned more chains than were made available`);
    const chain = modelChain(rig.image, q.config, q.availFrom, q.driver.takePosted(q.availFrom));
    q.availFrom = (q.availFrom + 1) & 0xffff;
    if (chain.kind === 'bad-head') continue;
    const expected = [chain.head, serve(chain)];
    // A used element is still in the ring unless the device has gone round it since.
    if (((usedTo - q.usedFrom) & 0xffff) <= q.config.size) {
      const e = q.config.usedGpa + 4 + 8 * (q.usedFrom % q.config.size);
      const actual = [mem.read(e, 4).readUInt32LE(0), mem.read(e + 4, 4).readUInt32LE(0)];
      if (actual[0] !== expected[0] || actual[1] !== expected[1]) expect({ queue: q.index, used: actual }).toEqual({ queue: q.index, used: expected });
    }
    modelUsed(rig.image, q.config, q.usedFrom, chain.head, expected[1]);
    q.usedFrom = (q.usedFrom + 1) & 0xffff;
  }
  const broken = (rig.t.read(STATUS, 4) & NEEDS_RESET) !== 0;
  // What is left must be entries the device drops (heads out of the ring), unless it may wait:
  // the queue broke, was not notified, or (a receive queue) has nothing to send.
  if (!broken && q.notified && !mayWait()) {
    for (let i = q.availFrom; i !== q.driver.availIdx; i = (i + 1) & 0xffff) {
      const left = modelChain(rig.image, q.config, i, q.driver.takePosted(i));
      if (left.kind !== 'bad-head') expect({ queue: q.index, notTaken: i }).toEqual({ queue: q.index, notTaken: 'none' });
    }
    q.availFrom = q.driver.availIdx;
  }
}

function checkGuestRam<D extends VirtioDevice>(rig: Rig<D>, ignore: Range[] = []): void {
  const diff = rig.image.firstDifference(ignore);
  if (diff !== undefined) expect({ diff }).toEqual({ diff: undefined });
}

/** Bytes [start, start+len) of the byte stream the descriptors make, from the model. */
function gather(image: GuestImage, ds: readonly Descriptor[], start: number, len: number): Buffer {
  const out = Buffer.alloc(len);
  let pos = 0;
  for (const d of ds) {
    const from = Math.max(start, pos);
    const to = Math.min(start + len, pos + d.len);
    if (to > from) image.read(d.gpa + from - pos, to - from).copy(out, from - start);
    pos += d.len;
  }
  return out;
}

/** Writes `data` at byte `start` of the stream the descriptors make, into the model, in order. */
function scatter(image: GuestImage, ds: readonly Descriptor[], start: number, data: Buffer): void {
  let pos = 0;
  for (const d of ds) {
    const from = Math.max(start, pos);
    const to = Math.min(start + data.length, pos + d.len);
    if (to > from) image.write(d.gpa + from - pos, data.subarray(from - start, to - start));
    pos += d.len;
  }
}

/** A random chain's buffers in `pool`: `n` of them, each `flags`, sometimes all over one buffer (aliases). */
function someBufs(rng: Rng, pool: Range, n: number, flags: () => number, maxLen: number): Buf[] {
  if (rng.chance(0.1)) {
    const b = bufferAt(rng, pool, rng.size(maxLen));
    return Array.from({ length: n }, () => ({ ...b, flags: flags() }));
  }
  return Array.from({ length: n }, () => ({ ...bufferAt(rng, pool, rng.size(maxLen)), flags: flags() }));
}

/** Windows' pools split in two halves, so that what one queue writes is never what another reads. */
function halves(pools: Range[]): [Range[], Range[]] {
  const mid = (r: Range) => r.start + Math.floor((r.end - r.start) / 2);
  return [pools.map((r) => ({ start: r.start, end: mid(r) })), pools.map((r) => ({ start: mid(r), end: r.end }))];
}

describe('virtio devices behind the mmio transport, under a fuzzing driver', () => {
  const env = withFuzzRam('pvisor-fuzz-blk-');

  property('console: transmits exactly the bytes of well-formed chains, fills receive buffers in order, within its bounds', 50, async (rng) => {
    const { mem } = env;
    scramble(mem, rng);
    const placer = new Placer(rng);
    const multiport = rng.chance(0.5);
    // Now and then a flood: more than a turn's 8 MiB of transmit chains at their largest.
    const flood = rng.chance(0.1);
    const configs = ringsFor(placer, rng, [queueSize(rng, 256), flood ? 256 : queueSize(rng, 256), multiport ? queueSize(rng, 16) : null, multiport ? queueSize(rng, 16) : null]);
    const received: Buffer[] = [];
    let receivedBytes = 0;
    /** A guest that posts a chain again each time the device takes one (a vCPU runs in parallel). */
    let reposts = 0;
    let repost = () => {};
    const rig = bringUp(mem, rng, () => new VirtioConsole(mem, (b) => {
      received.push(b); // the device's own copy (guest RAM changes under a view)
      receivedBytes += b.length;
      if (reposts > 0 && reposts--) repost();
    }, () => {}, () => {}, () => {}), VIRTIO_F_VERSION_1 | (multiport ? VIRTIO_CONSOLE_F_MULTIPORT : 0n), configs, () => receivedBytes);
    const [rx, tx] = rig.queues;
    const [txPools, rxPools] = halves(placer.pools());
    const sent: Buffer[] = [];
    let sentTaken = 0;
    const expectedReceived: Buffer[] = [];
    const stream = () => Buffer.concat(sent);

    for (let round = rng.between(1, 4); round > 0; round--) {
      // Transmit chains: readable buffers (writable ones the device must ignore), some far larger than allowed.
      for (let n = rng.int(Math.min(tx.config.size, 24) + 1); n > 0; n--) {
        const len = rng.chance(0.1) ? tx.config.size : rng.between(1, 4);
        offer(tx, rng, someBufs(rng, rng.pick(txPools), len, () => (rng.chance(0.2) ? VIRTQ_DESC_F_WRITE : 0), rng.chance(0.2) ? 128 * 1024 : 4096), rng.chance(0.05));
      }
      if (flood && round === 1) {
        // Chains of 1 MiB (16 descriptors over one 64 KiB buffer) and a little more: at the limit
        // (1 MiB + 4 KiB) or just beyond it.
        const b = bufferAt(rng, rng.pick(txPools.filter((p) => p.end - p.start >= 64 * 1024)), 64 * 1024);
        for (let n = rng.between(9, 15); n > 0; n--) {
          const extra = rng.pick([0, 4096, 4097, 64 * 1024]);
          offer(tx, rng, [...Array.from({ length: 16 }, () => ({ ...b, flags: 0 })), { gpa: b.gpa, len: extra, flags: 0 }], false);
        }
      }
      // Receive chains: writable buffers (readable ones the device must skip).
      for (let n = rng.int(Math.min(rx.config.size, 24) + 1); n > 0; n--) {
        offer(rx, rng, someBufs(rng, rng.pick(rxPools), rng.between(1, 3), () => (rng.chance(0.85) ? VIRTQ_DESC_F_WRITE : 0), 2048), rng.chance(0.05));
      }
      if (rng.chance(0.7)) {
        const bytes = rng.bytes(rng.size(64 * 1024));
        sent.push(bytes);
        const before = receivedBytes;
        expect(thrown(() => rig.dev.send(bytes))).toBeUndefined();
        expect(receivedBytes).toBe(before);
      }
      if (rng.chance(0.2)) {
        // One descriptor, posted again and again while the device takes: beyond a ring's worth in
        // one notification, so the device must stop at its budget and go on by itself.
        const d = rng.int(tx.config.size);
        const b = bufferAt(rng, rng.pick(txPools), rng.size(512));
        tx.driver.desc(d, b.gpa, b.len, 0, 0);
        reposts = rng.between(tx.config.size, 3 * tx.config.size);
        repost = () => tx.driver.post(d);
        tx.driver.post(d);
        tx.notified = false;
      }
      for (const q of rng.shuffle([rx, tx])) if (rng.chance(0.8)) notify(rig, q);
      await settle(rig);

      follow(rig, tx, (chain) => {
        if (chain.kind === 'bad-chain') return 0;
        const readable = chain.descriptors.filter((d) => !d.writable && d.len > 0);
        if (sum(readable) <= MAX_CHAIN_BYTES) expectedReceived.push(gather(rig.image, readable, 0, sum(readable)));
        return 0;
      });
      const all = stream();
      follow(rig, rx, (chain) => {
        if (chain.kind === 'bad-chain') return 0;
        let written = 0;
        for (const d of chain.descriptors) {
          if (!d.writable) continue;
          const n = Math.min(d.len, all.length - sentTaken);
          rig.image.write(d.gpa, all.subarray(sentTaken, sentTaken + n));
          sentTaken += n;
          written += n;
        }
        return written;
      }, () => sentTaken === all.length);
      // used.flags of the receive queue: notifications wanted while bytes wait (0) or not (1).
      const flags = mem.read(rx.config.usedGpa, 2).readUInt16LE(0);
      expect(flags === 0 || flags === 1).toBe(true);
      rig.image.write(rx.config.usedGpa, u16le(flags));
      checkGuestRam(rig);
      expect(received.length).toBe(expectedReceived.length);
      const same = received.every((b, i) => b.equals(expectedReceived[i]));
      if (!same) expect(received.map((b) => b.toString('hex'))).toEqual(expectedReceived.map((b) => b.toString('hex')));
      for (const b of received) expect(b.length).toBeLessThanOrEqual(MAX_CHAIN_BYTES);
    }
    rig.t.write(STATUS, 4, 0);
  });

  property('console control queue: answers waiting for the driver stay bounded however it asks, and the state restores', 30, async (rng) => {
    const { mem } = env;
    scramble(mem, rng);
    const placer = new Placer(rng);
    const configs = ringsFor(placer, rng, [queueSize(rng, 256), queueSize(rng, 256), queueSize(rng, 16), queueSize(rng, 16)]);
    const make = () => new VirtioConsole(mem, () => {}, () => {}, () => {}, () => {});
    const rig = bringUp(mem, rng, make, VIRTIO_F_VERSION_1 | VIRTIO_CONSOLE_F_MULTIPORT, configs);
    const [, , controlRx, controlTx] = rig.queues;
    const pool = rng.pick(placer.pools());
    // struct virtio_console_control: DEVICE_READY, PORT_READY and PORT_OPEN with the values that
    // get answers, or anything.
    const message = () => {
      const m = Buffer.alloc(8);
      m.writeUInt32LE(rng.chance(0.8) ? 0 : rng.u32(), 0);
      m.writeUInt16LE(rng.pick([0, 3, 6, rng.int(0x10000)]), 4);
      m.writeUInt16LE(rng.chance(0.8) ? 1 : rng.int(0x10000), 6);
      return m;
    };
    for (let round = rng.between(20, 200); round > 0; round--) {
      for (let n = rng.int(controlTx.config.size + 1); n > 0; n--) {
        const b = bufferAt(rng, pool, rng.pick([8, 8, 8, 4, 16]));
        if (b.gpa >= pool.start && b.gpa + 8 <= pool.end) rig.image.poke(b.gpa, message());
        offer(controlTx, rng, [{ ...b, flags: 0 }], false);
      }
      // The driver takes answers now and then, or never.
      if (rng.chance(0.05)) for (let n = rng.int(3); n > 0; n--) offer(controlRx, rng, [{ ...bufferAt(rng, pool, 64), flags: VIRTQ_DESC_F_WRITE }], false);
      notify(rig, controlTx);
      if (rng.chance(0.1)) notify(rig, controlRx);
    }
    const state = JSON.parse(JSON.stringify(rig.t.saveState()));
    const waiting = state.active.device.controlOutbox.length;
    if (waiting > 64) expect({ waiting }).toEqual({ waiting: 'at most 64' });
    const e = thrown(() => new MmioTransport(TRANSPORT_BASE, make(), mem).restoreState(state));
    if (e !== undefined) expect(e).toBeUndefined();
    rig.t.write(STATUS, 4, 0);
  });

  property('balloon: drops exactly the whole pages of well-formed reports, and nothing else', 60, async (rng) => {
    const { mem } = env;
    scramble(mem, rng);
    const placer = new Placer(rng);
    const configs = ringsFor(placer, rng, [null, null, queueSize(rng, 256)]);
    const rig = bringUp(mem, rng, () => new VirtioBalloon((gpa, len) => mem.discard(gpa, len, 'backing'), () => {}, () => {}), VIRTIO_F_VERSION_1 | VIRTIO_BALLOON_F_FREE_PAGE_REPORTING, configs);
    const [reporting] = rig.queues;
    const pools = placer.pools();
    for (let round = rng.between(1, 3); round > 0; round--) {
      for (let n = rng.int(Math.min(reporting.config.size, 24) + 1); n > 0; n--) {
        const bufs = Array.from({ length: rng.between(1, 3) }, () => {
          const aligned = rng.chance(0.8);
          const b = bufferAt(rng, rng.pick(pools), aligned ? PAGE_SIZE * rng.between(0, 4) : rng.size(3 * PAGE_SIZE), aligned ? PAGE_SIZE : 1);
          return { ...b, flags: rng.chance(0.7) ? VIRTQ_DESC_F_WRITE : 0 };
        });
        offer(reporting, rng, bufs, rng.chance(0.05));
      }
      if (rng.chance(0.9)) notify(rig, reporting);
      await settle(rig);
      follow(rig, reporting, (chain) => {
        if (chain.kind === 'bad-chain') return 0;
        // Whole pages read back as zero; anything else is refused and left as it was.
        for (const d of chain.descriptors) if (d.gpa % PAGE_SIZE === 0 && d.len % PAGE_SIZE === 0) rig.image.write(d.gpa, Buffer.alloc(d.len));
        return 0;
      });
      checkGuestRam(rig);
    }
    rig.t.write(STATUS, 4, 0);
  });

  property('blk: answers every request as the protocol says; the image changes only by well-formed writes', 60, async (rng) => {
    const { mem, dir } = env;
    scramble(mem, rng);
    const placer = new Placer(rng);
    const sectors = rng.between(1, 64);
    const path = join(dir, 'disk.img');
    const disk = rng.bytes(sectors * SECTOR_BYTES);
    writeFileSync(path, disk);
    const readOnly = rng.chance(0.3);
    const serial = rng.pick(['pvisor-rootfs', 'a serial longer than twenty bytes', 'é'.repeat(15), '']);
    const configs = ringsFor(placer, rng, [queueSize(rng, 256)]);
    const devices: VirtioBlk[] = [];
    const rig = bringUp(mem, rng, () => {
      const d = new VirtioBlk(mem, { path, readOnly, serial }, () => {}, () => {});
      devices.push(d);
      return d;
    }, VIRTIO_F_VERSION_1, configs);
    try {
      const [requests] = rig.queues;
      const pools = placer.pools();
      const id = Buffer.from(serial, 'utf8').subarray(0, 20);
      for (let round = rng.between(1, 3); round > 0; round--) {
        for (let n = rng.int(Math.min(requests.config.size, 16) + 1); n > 0; n--) offer(requests, rng, blkRequest(rng, rig.image, rng.pick(pools), sectors), rng.chance(0.05));
        if (rng.chance(0.9)) notify(rig, requests);
        await settle(rig);
        follow(rig, requests, (chain) => (chain.kind === 'bad-chain' ? 0 : serveBlk(rig.image, disk, chain.descriptors, readOnly, id)));
        checkGuestRam(rig);
        const file = readFileSync(path);
        if (!file.equals(disk)) {
          const at = file.findIndex((b, i) => b !== disk[i]);
          expect({ imageByte: at, value: file[at] }).toEqual({ imageByte: at, value: disk[at] });
        }
      }
    } finally {
      rig.t.write(STATUS, 4, 0);
      for (const d of devices) d.close();
    }
  });

  property('any device, its buffers over its own rings: nothing thrown, bounded turns, nothing written outside what the driver named, nothing after a reset', 45, async (rng) => {
    const { mem, dir } = env;
    scramble(mem, rng);
    const placer = new Placer(rng);
    const path = join(dir, 'hostile.img');
    writeFileSync(path, rng.bytes(rng.between(1, 64) * SECTOR_BYTES));
    const kind = rng.pick(['console', 'balloon', 'blk'] as const);
    let handed = 0;
    const rig: Rig<VirtioDevice> = kind === 'console'
      ? bringUp<VirtioDevice>(mem, rng, () => new VirtioConsole(mem, (b) => (handed += b.length), () => {}, () => {}, () => {}), VIRTIO_F_VERSION_1 | VIRTIO_CONSOLE_F_MULTIPORT,
        ringsFor(placer, rng, [queueSize(rng, 256), queueSize(rng, 256), queueSize(rng, 16), queueSize(rng, 16)]), () => handed)
      : kind === 'balloon'
        ? bringUp<VirtioDevice>(mem, rng, () => new VirtioBalloon((gpa, len) => mem.discard(gpa, len, 'backing'), () => {}, () => {}), VIRTIO_F_VERSION_1 | VIRTIO_BALLOON_F_FREE_PAGE_REPORTING, ringsFor(placer, rng, [null, null, queueSize(rng, 256)]))
        : bringUp<VirtioDevice>(mem, rng, () => new VirtioBlk(mem, { path, readOnly: false }, () => {}, () => {}), VIRTIO_F_VERSION_1, ringsFor(placer, rng, [queueSize(rng, 256)]));
    // Buffers anywhere in what the driver placed: over descriptor tables, available and used rings.
    const named = placer.named();
    try {
      for (let round = rng.between(1, 4); round > 0; round--) {
        for (const q of rig.queues) {
          for (let n = rng.int(Math.min(q.config.size, 16) + 1); n > 0; n--) {
            const area = rng.pick(named);
            const bufs = kind === 'blk'
              ? blkRequest(rng, rig.image, area, 64)
              : someBufs(rng, area, rng.between(1, 4), () => (rng.chance(0.7) ? VIRTQ_DESC_F_WRITE : 0), rng.chance(0.1) ? 64 * 1024 : 4096);
            offer(q, rng, bufs, rng.chance(0.1));
          }
        }
        if (rig.dev instanceof VirtioConsole && rng.chance(0.7)) {
          const bytes = rng.bytes(rng.size(256 * 1024));
          expect(thrown(() => (rig.dev as VirtioConsole).send(bytes))).toBeUndefined();
        }
        for (const q of rng.shuffle([...rig.queues])) if (rng.chance(0.8)) notify(rig, q);
        await settle(rig, 50);
        checkGuestRam(rig, named);
      }
      // After a reset the device touches nothing, whatever it had left for later turns.
      rig.t.write(STATUS, 4, 0);
      const after = new GuestImage(mem);
      for (let turn = 0; turn < 3; turn++) await new Promise((resolve) => setImmediate(resolve));
      const diff = after.firstDifference();
      if (diff !== undefined) expect({ afterReset: diff }).toEqual({ afterReset: undefined });
    } finally {
      rig.t.write(STATUS, 4, 0);
      (rig.dev as { close?: () => void }).close?.();
    }
  });
});

/** A random virtio-blk request in `pool`: header (often valid), data, status byte, each sometimes wrong. */
function blkRequest(rng: Rng, image: GuestImage, pool: Range, sectors: number): Buf[] {
  const type = rng.weighted<number>([[3, VIRTIO_BLK_T_IN], [3, VIRTIO_BLK_T_OUT], [1, VIRTIO_BLK_T_FLUSH], [1, VIRTIO_BLK_T_GET_ID], [1, rng.u32()]]);
  const sector = rng.weighted<bigint>([[6, BigInt(rng.int(sectors + 1))], [1, BigInt(sectors - rng.int(3))], [1, 2n ** 64n - BigInt(rng.between(1, 4))], [1, 2n ** 63n]]);
  const header = Buffer.alloc(16);
  header.writeUInt32LE(type, 0);
  header.writeUInt32LE(rng.chance(0.9) ? 0 : rng.u32(), 4);
  header.writeBigUInt64LE(sector & (2n ** 64n - 1n), 8);
  const h = bufferAt(rng, pool, rng.chance(0.9) ? 16 : rng.int(32));
  if (h.len > 0 && h.gpa >= pool.start && h.gpa + h.len <= pool.end) image.poke(h.gpa, header.subarray(0, Math.min(16, h.len)));
  const bufs: Buf[] = [];
  // The header, now and then split in two, now and then marked device-writable.
  const headerFlags = rng.chance(0.05) ? VIRTQ_DESC_F_WRITE : 0;
  if (h.len >= 2 && rng.chance(0.2)) {
    const cut = rng.between(1, h.len - 1);
    bufs.push({ gpa: h.gpa, len: cut, flags: headerFlags }, { gpa: h.gpa + cut, len: h.len - cut, flags: headerFlags });
  } else bufs.push({ ...h, flags: headerFlags });
  const dataWritable = type === VIRTIO_BLK_T_IN || type === VIRTIO_BLK_T_GET_ID;
  for (let n = rng.weighted([[2, 0], [5, 1], [2, 2], [1, 3]]); n > 0; n--) {
    const len = rng.chance(0.8) ? SECTOR_BYTES * rng.int(9) : rng.size(4096);
    bufs.push({ ...bufferAt(rng, pool, len), flags: dataWritable !== rng.chance(0.1) ? VIRTQ_DESC_F_WRITE : 0 });
  }
  // The status byte: one writable byte, or more, or none, or readable.
  const status = rng.weighted([[8, 'byte'], [1, 'wide'], [1, 'none'], [1, 'readable']] as const);
  if (status !== 'none') bufs.push({ ...bufferAt(rng, pool, status === 'wide' ? rng.between(2, 64) : 1), flags: status === 'readable' ? 0 : VIRTQ_DESC_F_WRITE });
  return bufs;
}

/**
 * The virtio-blk protocol (virtio 1.x, 5.2.6) over the model: readable buffers then writable
 * ones, the last writable byte the status. Applies the request to the model of guest RAM and of
 * the disk; returns the bytes the device must report written.
 */
function serveBlk(image: GuestImage, disk: Buffer, ds: Descriptor[], readOnly: boolean, id: Buffer): number {
  const first = ds.findIndex((d) => d.writable);
  const readable = first < 0 ? ds : ds.slice(0, first);
  const writable = first < 0 ? [] : ds.slice(first);
  const writableBytes = sum(writable);
  if (writableBytes === 0 || writable.some((d) => !d.writable)) return 0; // nowhere to put a status
  const inBytes = writableBytes - 1;
  const readableBytes = sum(readable);
  const capacity = BigInt(disk.length / SECTOR_BYTES);
  const result = (() => {
    if (readableBytes < 16) return { status: VIRTIO_BLK_S_IOERR, written: 0 };
    const header = gather(image, readable, 0, 16);
    const type = header.readUInt32LE(0);
    const sector = header.readBigUInt64LE(8);
    const outBytes = readableBytes - 16;
    const inDisk = (len: number) => len % SECTOR_BYTES === 0 && sector + BigInt(len / SECTOR_BYTES) <= capacity;
    const offset = Number(sector) * SECTOR_BYTES;
    switch (type) {
      case VIRTIO_BLK_T_IN:
        if (!inDisk(inBytes) || outBytes) return { status: VIRTIO_BLK_S_IOERR, written: 0 };
        scatter(image, writable, 0, disk.subarray(offset, offset + inBytes));
        return { status: VIRTIO_BLK_S_OK, written: inBytes };
      case VIRTIO_BLK_T_OUT:
        if (readOnly || !inDisk(outBytes) || inBytes) return { status: VIRTIO_BLK_S_IOERR, written: 0 };
        gather(image, readable, 16, outBytes).copy(disk, offset);
        return { status: VIRTIO_BLK_S_OK, written: 0 };
      case VIRTIO_BLK_T_FLUSH:
        return { status: VIRTIO_BLK_S_OK, written: 0 };
      case VIRTIO_BLK_T_GET_ID: {
        const answer = Buffer.alloc(Math.min(20, inBytes));
        id.copy(answer);
        scatter(image, writable, 0, answer);
        return { status: VIRTIO_BLK_S_OK, written: answer.length };
      }
      default:
        return { status: VIRTIO_BLK_S_UNSUPP, written: 0 };
    }
  })();
  scatter(image, writable, writableBytes - 1, Buffer.of(result.status));
  return result.status === VIRTIO_BLK_S_OK ? result.written + 1 : 1;
}
