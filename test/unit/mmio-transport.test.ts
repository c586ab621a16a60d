// The virtio-mmio transport enforces the device status state machine against a driver that does
// not follow it. Real guest memory, a device model that records what it is given. No KVM.
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { MmioTransport, VIRTIO_F_VERSION_1, type VirtioDevice } from '../../src/backends/kvm/virtio/mmio-transport';
import type { SplitQueue } from '../../src/backends/kvm/virtio/queue';
import { VirtioBalloon } from '../../src/backends/kvm/devices/virtio-balloon';
import { VirtioConsole } from '../../src/backends/kvm/devices/virtio-console';
import { DriverQueue, driverUp, SIZE } from '../virtio-driver';

const ACK = 1;
const DRIVER = 2;
const DRIVER_OK = 4;
const FEATURES_OK = 8;
const NEEDS_RESET = 64;

class Recorder implements VirtioDevice {
  readonly deviceId = 42;
  readonly queueCount = 1;
  readonly features = VIRTIO_F_VERSION_1;
  activated: (SplitQueue | null)[] | undefined;
  acked = 0n;
  readConfig(): number {
    return 0;
  }
  activate(queues: (SplitQueue | null)[], acked: bigint): void {
    this.activated = queues;
    this.acked = acked;
  }
  notify(): void {
    this.activated?.[0]?.popValid(() => {});
  }
  reset(): void {
    this.activated = undefined;
  }
}

describe('virtio-mmio transport, as a hostile driver drives it', () => {
  let mem: GuestMemory;
  let dev: Recorder;
  let t: MmioTransport;
  let errors: string[];
  let interrupts: number;
  beforeEach(() => {
    mem = GuestMemory.map(1024 * 1024);
    dev = new Recorder();
    errors = [];
    interrupts = 0;
    t = new MmioTransport(0xd0000000, dev, mem, () => interrupts++, (m) => errors.push(m));
  });
  afterEach(() => mem.unmap());

  const w = (reg: number, value: number) => t.write(reg, 4, value);
  function negotiate(): void {
    w(0x070, ACK | DRIVER);
    w(0x024, 1); // DriverFeaturesSel: the high word
    w(0x020, 1); // VERSION_1
    w(0x070, ACK | DRIVER | FEATURES_OK);
  }
  function queue(desc: number, avail: number, used: number): void {
    w(0x030, 0);
    w(0x038, 8);
    w(0x080, desc);
    w(0x090, avail);
    w(0x0a0, used);
    w(0x044, 1);
  }

  it('DRIVER_OK without FEATURES_OK: the device is not used and needs a reset', () => {
    w(0x070, ACK | DRIVER);
    queue(0x1000, 0x2000, 0x3000);
    w(0x070, ACK | DRIVER | DRIVER_OK);
    expect(dev.activated).toBeUndefined();
    expect(t.read(0x070, 4) & NEEDS_RESET).toBe(NEEDS_RESET);
    expect(errors.join()).toMatch(/DRIVER_OK without FEATURES_OK/);
  });

  it('features written after FEATURES_OK are ignored: the device runs with what was agreed', () => {
    negotiate();
    w(0x024, 0);
    w(0x020, 0xffffffff); // every low feature bit, after the fact
    queue(0x1000, 0x2000, 0x3000);
    w(0x070, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    expect(dev.activated).toHaveLength(1);
    expect(dev.acked).toBe(VIRTIO_F_VERSION_1);
    expect(errors.join()).toMatch(/rewrote its features after FEATURES_OK/);
  });

  it('a driver clears no status bit but by a reset: a live device keeps its features and DRIVER_OK, and stays restorable', () => {
    // What the probe's hostile mode (virtio-state, live-requeue) did from inside a guest: a status
    // write dropping FEATURES_OK re-opened feature negotiation on a live device, and one dropping
    // DRIVER_OK left a state that every restore of the VM's snapshots refused.
    const balloon = new MmioTransport(0xd0001000, new VirtioBalloon(() => {}, () => {}, () => {}), mem, () => {}, (m) => errors.push(m));
    const wb = (reg: number, value: number) => balloon.write(reg, 4, value);
    wb(0x070, ACK | DRIVER);
    wb(0x024, 1);
    wb(0x020, 1); // VERSION_1
    wb(0x070, ACK | DRIVER | FEATURES_OK);
    wb(0x070, ACK | DRIVER); // FEATURES_OK dropped, to negotiate again
    expect(balloon.read(0x070, 4)).toBe(ACK | DRIVER | FEATURES_OK);
    wb(0x024, 0);
    wb(0x020, 0xffffffff); // bits never offered, now refused as a rewrite after FEATURES_OK
    wb(0x070, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    expect(balloon.read(0x070, 4)).toBe(ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    wb(0x070, ACK); // a live device told it is not set up
    expect(balloon.read(0x070, 4)).toBe(ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    expect(errors.join()).toMatch(/cleared status bits 0x8 without a reset; ignored/);
    expect(errors.join()).toMatch(/cleared status bits 0xe without a reset; ignored/);
    const again = new MmioTransport(0xd0001000, new VirtioBalloon(() => {}, () => {}, () => {}), mem);
    again.restoreState(JSON.parse(JSON.stringify(balloon.saveState())));
    expect(again.read(0x070, 4)).toBe(ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    // A reset is the way back.
    wb(0x070, 0);
    expect(balloon.read(0x070, 4)).toBe(0);
  });

  it('unaligned rings are refused with DEVICE_NEEDS_RESET, not a RangeError', () => {
    negotiate();
    queue(0x1003, 0x2000, 0x3001);
    w(0x070, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    expect(dev.activated).toBeUndefined();
    expect(t.read(0x070, 4) & NEEDS_RESET).toBe(NEEDS_RESET);
    expect(errors.join()).toMatch(/rings are not aligned/);
  });

  it('a queue broken by an impossible available index sets DEVICE_NEEDS_RESET with a configuration interrupt', () => {
    negotiate();
    queue(0x1000, 0x2000, 0x3000);
    w(0x070, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    mem.writeU16(0x2000 + 2, 100); // 100 chains in a ring of 8
    w(0x050, 0); // QueueNotify
    expect(t.read(0x070, 4) & NEEDS_RESET).toBe(NEEDS_RESET);
    expect(t.read(0x060, 4) & 2).toBe(2); // InterruptStatus: configuration change
    expect(interrupts).toBe(1);
    expect(errors.join()).toMatch(/needs a reset: queue 0: available index 100/);
    // DEVICE_NEEDS_RESET is the device's: a status write without it does not clear it; a reset does.
    w(0x070, ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    expect(t.read(0x070, 4) & NEEDS_RESET).toBe(NEEDS_RESET);
    w(0x070, 0);
    expect(t.read(0x070, 4)).toBe(0);
  });

  // Both found by mmio-transport-properties: a guest could make its own VM's snapshot one that
  // restore refuses.
  it('the status keeps 8 bits, whatever the driver writes above them, and the saved state restores', () => {
    w(0x070, 0xffffff00 | ACK | DRIVER);
    expect(t.read(0x070, 4)).toBe(ACK | DRIVER);
    w(0x070, 0x80000000 | ACK | DRIVER | DRIVER_OK); // DRIVER_OK without FEATURES_OK: NEEDS_RESET is or-ed in
    expect(t.read(0x070, 4)).toBe(ACK | DRIVER | DRIVER_OK | NEEDS_RESET);
    const state = JSON.parse(JSON.stringify(t.saveState()));
    expect(() => new MmioTransport(0xd0000000, new Recorder(), mem).restoreState(state)).not.toThrow();
  });

  it('queue address registers hold any 64-bit value the driver writes, and the saved state restores', () => {
    w(0x030, 0);
    w(0x084, 0xffffffff); // QueueDescHigh: far beyond any guest RAM
    const state = JSON.parse(JSON.stringify(t.saveState()));
    const fresh = new MmioTransport(0xd0000000, new Recorder(), mem);
    expect(() => fresh.restoreState(state)).not.toThrow();
    expect(fresh.saveState()).toEqual(state);
  });
});

describe('virtio-mmio transport, device work left for a later turn', () => {
  it('a device that goes on in a later turn after guest RAM is unmapped (the VM stopped) reports it, and throws nothing into the event loop', async () => {
    const mem = GuestMemory.map(1024 * 1024);
    const errors: string[] = [];
    const tx = new DriverQueue(mem, 0x20000);
    // A guest that posts a transmit chain again as soon as the device takes one (a vCPU runs in
    // parallel): the device takes a ring's worth, then leaves the rest for a later turn.
    let posted = 0;
    const dev = new VirtioConsole(mem, () => {
      if (posted++ < 100) tx.offer(0x80000, 64, false);
    }, () => {}, () => {}, (m) => errors.push(m));
    const t = new MmioTransport(0xd0000000, dev, mem, () => {}, (m) => errors.push(m));
    driverUp(t, VIRTIO_F_VERSION_1, [new DriverQueue(mem, 0x10000).queue.config, tx.queue.config]);
    tx.offer(0x80000, 64, false);
    t.write(0x050, 4, 1); // QueueNotify 1
    expect(posted).toBe(SIZE);
    mem.unmap(); // the VM stops in this same turn
    await new Promise((r) => setImmediate(r));
    await new Promise((r) => setImmediate(r));
    expect(errors.join('\n')).toMatch(/guest RAM is no longer mapped/);
  });
});
