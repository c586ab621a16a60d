// The virtio-mmio transport under random register writes in random orders, as a hostile driver
// makes them, in front of the real device models (console, balloon, blk over a real image), over
// real guest RAM. No KVM. After every access:
// - nothing is thrown by a read, a write or a notification;
// - a device is activated only with features it offered and VERSION_1, after FEATURES_OK was
//   accepted, once until the next reset, with queues whose sizes are powers of two within its
//   maximum and whose rings are aligned and inside guest RAM; it is notified only while active;
// - a reset (status 0) clears the status, the queues and the interrupt status, and resets an
//   active device;
// - the identification registers read as the spec says;
// - the transport's saved state, whatever registers the driver wrote, restores into a fresh
//   transport and saves back the same.
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { VirtioBalloon } from '../../src/backends/kvm/devices/virtio-balloon';
import { VirtioBlk } from '../../src/backends/kvm/devices/virtio-blk';
import { VirtioConsole } from '../../src/backends/kvm/devices/virtio-console';
import { MmioTransport, VIRTIO_F_VERSION_1, type DeviceSavedState, type TransportState, type VirtioDevice } from '../../src/backends/kvm/virtio/mmio-transport';
import { SnapshotError } from '../../src/errors';
import { VIRTQ_DESC_F_WRITE, type SplitQueue } from '../../src/backends/kvm/virtio/queue';
import { property, same, thrown } from '../fuzz-seed';
import { bufferAt, FuzzDriver, GuestImage, inFuzzRam, withFuzzRam, placeRings, Placer, scramble, WINDOWS } from '../fuzz-guest-ram';
import { ACK, DRIVER, DRIVER_OK, FEATURES_OK, NEEDS_RESET } from '../virtio-driver';

const FAILED = 128;
const Reg = {
  MagicValue: 0x000, Version: 0x004, DeviceId: 0x008, VendorId: 0x00c, DeviceFeatures: 0x010, DeviceFeaturesSel: 0x014,
  DriverFeatures: 0x020, DriverFeaturesSel: 0x024, QueueSel: 0x030, QueueNumMax: 0x034, QueueNum: 0x038, QueueReady: 0x044,
  QueueNotify: 0x050, InterruptStatus: 0x060, InterruptAck: 0x064, Status: 0x070, QueueDescLow: 0x080, QueueDescHigh: 0x084,
  QueueDriverLow: 0x090, QueueDriverHigh: 0x094, QueueDeviceLow: 0x0a0, QueueDeviceHigh: 0x0a4, ConfigGeneration: 0x0fc, Config: 0x100,
} as const;

/** What the transport did to the device, in order (the real device does the work). */
type Call = { kind: 'activate'; acked: bigint; queues: (SplitQueue | null)[]; status: number } | { kind: 'notify'; index: number; active: boolean } | { kind: 'reset' };

/** The real device, with a record of the calls the transport made on it. */
class Observed implements VirtioDevice {
  readonly calls: Call[] = [];
  active = false;
  transport: MmioTransport | undefined;
  saveState?: () => DeviceSavedState;
  restoreState?: (state: unknown, queues: (SplitQueue | null)[], acked: bigint, path: string) => void;

  constructor(readonly inner: VirtioDevice) {
    if (inner.saveState) this.saveState = () => inner.saveState!();
    if (inner.restoreState) {
      this.restoreState = (state, queues, acked, path) => {
        inner.restoreState!(state, queues, acked, path);
        this.active = true;
      };
    }
  }
  get deviceId(): number {
    return this.inner.deviceId;
  }
  get queueCount(): number {
    return this.inner.queueCount;
  }
  get features(): bigint {
    return this.inner.features;
  }
  maxQueueSize(i: number): number {
    return this.inner.maxQueueSize?.(i) ?? 256;
  }
  readConfig(off: number, len: number): number {
    return this.inner.readConfig(off, len);
  }
  activate(queues: (SplitQueue | null)[], acked: bigint): void {
    this.calls.push({ kind: 'activate', acked, queues, status: this.transport!.read(Reg.Status, 4) });
    this.inner.activate(queues, acked);
    this.active = true;
  }
  notify(index: number): void {
    this.calls.push({ kind: 'notify', index, active: this.active });
    this.inner.notify(index);
  }
  reset(): void {
    this.calls.push({ kind: 'reset' });
    this.active = false;
    this.inner.reset();
  }
}

describe('virtio-mmio transport under random register writes', () => {
  const env = withFuzzRam('pvisor-fuzz-mmio-');

  property('keeps the virtio state machine whatever the driver writes, and its saved state restores', 120, async (rng) => {
    const { mem, dir } = env;
    scramble(mem, rng);
    const placer = new Placer(rng);
    const path = join(dir, 'disk.img');
    writeFileSync(path, rng.bytes(8 * 512));
    const kind = rng.pick(['console', 'balloon', 'blk'] as const);
    const closers: (() => void)[] = [];
    const readOnly = rng.chance(0.5);
    const make = (): VirtioDevice => {
      if (kind === 'console') return new VirtioConsole(mem, () => {}, () => {}, () => {}, () => {});
      if (kind === 'balloon') return new VirtioBalloon((gpa, len) => mem.discard(gpa, len, 'backing'), () => {}, () => {});
      const blk = new VirtioBlk(mem, { path, readOnly }, () => {}, () => {});
      closers.push(() => blk.close());
      return blk;
    };
    const build = () => {
      const dev = new Observed(make());
      const t = new MmioTransport(0xd0000000, dev, mem, () => {}, () => {});
      dev.transport = t;
      return { dev, t };
    };
    let { dev, t } = build();
    // Rings the driver may point queues at: valid ones, and now and then anything.
    const rings = Array.from({ length: 6 }, () => placeRings(placer, rng, 2 ** rng.int(9), rng.chance(0.2)));
    const image = new GuestImage(mem);
    const offered = dev.features;
    const wordOf = (v: bigint, sel: number) => (sel > 1 ? 0 : Number((v >> BigInt(32 * sel)) & 0xffffffffn));
    let featuresSel = 0;
    let queueSel = 0;
    let checked = 0;

    const w = (off: number, value: number, len = 4) => {
      const e = thrown(() => t.write(off, len, value));
      if (e !== undefined) same({ write: off, value, e }, { write: off, value, e: undefined });
      if (len === 4 && off === Reg.DeviceFeaturesSel) featuresSel = value >>> 0;
      if (len === 4 && off === Reg.QueueSel) queueSel = value >>> 0;
    };
    const r = (off: number, len = 4): number => {
      let v = 0;
      const e = thrown(() => (v = t.read(off, len)));
      same({ read: off, e, integer: Number.isInteger(v) }, { read: off, e: undefined, integer: true });
      return v;
    };
    const randomValue = () => rng.weighted<number>([[3, rng.u32()], [2, rng.int(16)], [1, 0xffffffff], [1, 2 ** rng.int(32)]]);
    const someRing = () => rng.pick(rings);
    const address = () => rng.weighted<number>([[6, someRing().descGpa], [2, rng.pick(WINDOWS).start + rng.int(0x1000)], [1, rng.u32()], [1, 2 ** 32 + rng.u32()]]);

    for (let op = rng.between(20, 150); op > 0; op--) {
      const what = rng.weighted([
        [4, 'status'], [3, 'features'], [5, 'queue'], [3, 'notify'], [1, 'ack'], [2, 'any-write'], [2, 'any-read'], [1, 'driver-up'], [1, 'save-restore'], [2, 'post'],
      ] as const);
      switch (what) {
        case 'status': {
          const bits = rng.weighted([[1, 0], [5, rng.int(256)], [2, rng.u32()], [6, [ACK, ACK | DRIVER, ACK | DRIVER | FEATURES_OK, ACK | DRIVER | FEATURES_OK | DRIVER_OK, ACK | DRIVER | DRIVER_OK, FAILED, NEEDS_RESET][rng.int(7)]]]);
          const wasActive = dev.active;
          const before = dev.calls.length;
          w(Reg.Status, bits);
          if (bits === 0) {
            expect(r(Reg.Status)).toBe(0);
            expect(r(Reg.InterruptStatus)).toBe(0);
            for (let i = 0; i < dev.queueCount; i++) {
              w(Reg.QueueSel, i);
              expect(r(Reg.QueueReady)).toBe(0);
            }
            expect(dev.calls.slice(before).map((c) => c.kind)).toEqual(wasActive ? ['reset'] : []);
          }
          break;
        }
        case 'features':
          w(Reg.DriverFeaturesSel, rng.pick([0, 1, 1, rng.u32()]));
          w(Reg.DriverFeatures, rng.pick([wordOf(offered, 0), wordOf(offered, 1), rng.u32(), 0]));
          break;
        case 'queue': {
          w(Reg.QueueSel, rng.chance(0.9) ? rng.int(dev.queueCount) : randomValue());
          const ring = someRing();
          if (rng.chance(0.8)) w(Reg.QueueNum, rng.weighted<number>([[5, ring.size], [1, 2 ** rng.int(16)], [1, rng.int(1024)], [1, 0]]));
          const pick = (reg: number, gpa: number) => {
            w(reg, rng.chance(0.9) ? gpa % 2 ** 32 : address() % 2 ** 32);
            w(reg + 4, rng.chance(0.9) ? Math.floor(gpa / 2 ** 32) : rng.pick([0, 1, 2, rng.u32()]));
          };
          if (rng.chance(0.8)) pick(Reg.QueueDescLow, ring.descGpa);
          if (rng.chance(0.8)) pick(Reg.QueueDriverLow, ring.availGpa);
          if (rng.chance(0.8)) pick(Reg.QueueDeviceLow, ring.usedGpa);
          if (rng.chance(0.8)) w(Reg.QueueReady, rng.pick([1, 1, 0, 2]));
          break;
        }
        case 'notify':
          w(Reg.QueueNotify, rng.chance(0.8) ? rng.int(dev.queueCount) : randomValue());
          break;
        case 'ack':
          w(Reg.InterruptAck, randomValue());
          break;
        case 'any-write':
          w(rng.chance(0.8) ? 4 * rng.int(0x80) : rng.int(0x200), randomValue(), rng.pick([1, 2, 4, 8]));
          break;
        case 'any-read':
          r(rng.chance(0.8) ? 4 * rng.int(0x80) : rng.int(0x200), rng.pick([1, 2, 4, 8]));
          break;
        case 'driver-up': {
          // The whole sequence a good driver writes, queues at valid rings.
          w(Reg.Status, 0);
          w(Reg.Status, ACK | DRIVER);
          w(Reg.DriverFeaturesSel, 0);
          w(Reg.DriverFeatures, wordOf(offered, 0));
          w(Reg.DriverFeaturesSel, 1);
          w(Reg.DriverFeatures, wordOf(offered, 1));
          w(Reg.Status, ACK | DRIVER | FEATURES_OK);
          for (let i = 0; i < dev.queueCount; i++) {
            const ring = rings.find((x) => x.size <= dev.maxQueueSize(i) && x.descGpa % 16 === 0 && x.availGpa % 2 === 0 && x.usedGpa % 4 === 0);
            if (!ring || rng.chance(0.2)) continue;
            w(Reg.QueueSel, i);
            w(Reg.QueueNum, ring.size);
            for (const [reg, gpa] of [[Reg.QueueDescLow, ring.descGpa], [Reg.QueueDriverLow, ring.availGpa], [Reg.QueueDeviceLow, ring.usedGpa]]) {
              w(reg, gpa % 2 ** 32);
              w(reg + 4, Math.floor(gpa / 2 ** 32));
            }
            w(Reg.QueueReady, 1);
          }
          w(Reg.Status, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
          break;
        }
        case 'save-restore': {
          // A device that cannot be saved as it is (a writable disk) says so with a SnapshotError.
          let state!: TransportState;
          const refused = thrown(() => (state = JSON.parse(JSON.stringify(t.saveState()))));
          if (refused !== undefined && refused instanceof SnapshotError && dev.active) break;
          if (refused !== undefined) expect(refused).toBeUndefined();
          for (const close of closers.splice(0)) close();
          const next = build();
          const e = thrown(() => next.t.restoreState(state));
          if (e !== undefined) expect({ restore: state, e }).toEqual({ restore: state, e: undefined });
          expect(next.t.saveState()).toEqual(state);
          ({ dev, t } = next);
          checked = 0;
          featuresSel = state.deviceFeaturesSel;
          queueSel = state.queueSel;
          break;
        }
        case 'post': {
          // Chains on a random ring, as whatever queue the driver pointed at it; then a notification.
          const ring = someRing();
          if (ring.descGpa % 16 || ring.availGpa % 2 || ring.usedGpa % 4) break;
          const driver = new FuzzDriver(image, ring, image.u16(ring.availGpa + 2));
          for (let n = rng.int(4); n > 0; n--) {
            driver.offer(rng, Array.from({ length: rng.between(1, 3) }, () => ({ ...bufferAt(rng, rng.pick(placer.pools()), rng.size(4096)), flags: rng.chance(0.5) ? VIRTQ_DESC_F_WRITE : 0 })), rng.chance(0.1));
          }
          w(Reg.QueueNotify, rng.int(dev.queueCount));
          await new Promise((resolve) => setImmediate(resolve));
          break;
        }
      }

      // Identification and features read as the spec says, whatever was written.
      same(
        [r(Reg.MagicValue), r(Reg.Version), r(Reg.DeviceId), r(Reg.VendorId), r(Reg.DeviceFeatures), r(Reg.QueueNumMax), r(Reg.InterruptStatus) & ~3],
        [0x74726976, 2, dev.deviceId, 0x5056, wordOf(offered, featuresSel), queueSel < dev.queueCount ? dev.maxQueueSize(queueSel) : 0, 0],
      );

      // Every call the transport made on the device since the last look.
      for (const call of dev.calls.slice(checked)) {
        if (call.kind === 'activate') {
          same({ unoffered: call.acked & ~offered, version1: (call.acked & VIRTIO_F_VERSION_1) !== 0n, status: call.status & (FEATURES_OK | DRIVER_OK) }, { unoffered: 0n, version1: true, status: FEATURES_OK | DRIVER_OK });
          call.queues.forEach((q, i) => {
            if (!q) return;
            const { size, descGpa, availGpa, usedGpa } = q.config;
            const inRam = inFuzzRam(descGpa, 16 * size) && inFuzzRam(availGpa, 6 + 2 * size) && inFuzzRam(usedGpa, 6 + 8 * size);
            same({ queue: i, pow2: (size & (size - 1)) === 0, max: size <= dev.maxQueueSize(i), aligned: descGpa % 16 === 0 && availGpa % 2 === 0 && usedGpa % 4 === 0, inRam }, { queue: i, pow2: true, max: true, aligned: true, inRam: true });
          });
        } else if (call.kind === 'notify') same({ notifiedWhileActive: call.active }, { notifiedWhileActive: true });
      }
      // Activations alternate with resets: never twice without a reset between.
      const kinds = dev.calls.filter((c) => c.kind !== 'notify').map((c) => c.kind);
      for (let i = 1; i < kinds.length; i++) if (kinds[i] === kinds[i - 1]) expect(kinds.slice(0, i + 1)).toEqual('activate and reset in turn');
      checked = dev.calls.length;
    }
    t.write(Reg.Status, 4, 0);
    for (const close of closers) close();
  });
});
