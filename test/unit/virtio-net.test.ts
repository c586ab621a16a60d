// virtio-net negotiates and hands the rings to vhost; packets never pass through it. A recording
// data path stands in for /dev/vhost-net; the transport and guest memory are real. No KVM.
import { SnapshotError } from '../../src';
import { createEventFd, closeFd } from '../../src/sys/libc';
import { readSync } from 'node:fs';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { MmioTransport, VIRTIO_F_VERSION_1 } from '../../src/backends/kvm/virtio/mmio-transport';
import type { QueueConfig } from '../../src/backends/kvm/virtio/queue';
import * as C from '../../src/sys/constants';
import {
  VirtioNet, offeredNetFeatures, tapOffloadsFor, vhostFeaturesFor, type NetDataPath,
  VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_CSUM, VIRTIO_RING_F_EVENT_IDX,
} from '../../src/backends/kvm/devices/virtio-net';
import { driverUp, NEEDS_RESET } from '../virtio-driver';

/** What vhost-net of Linux 6.1 reports: ring features, VERSION_1, its own header bit (27), LOG_ALL (26). */
const VHOST_FEATURES = VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MRG_RXBUF | (1n << 28n) | VIRTIO_RING_F_EVENT_IDX | (1n << 27n) | (1n << 26n) | (1n << 24n) | (1n << 30n);

class FakeVhost implements NetDataPath {
  calls: string[] = [];
  rings: { index: number; ring: QueueConfig; kick: number; call: number }[] = [];
  features(): bigint {
    return VHOST_FEATURES;
  }
  setFeatures(f: bigint): void {
    this.calls.push(`features 0x${f.toString(16)}`);
  }
  setMemTable(): void {
    this.calls.push('mem');
  }
  setVring(index: number, _mem: GuestMemory, ring: QueueConfig, base: number, kick: number, call: number): void {
    this.calls.push(`vring ${index} base ${base}`);
    this.rings.push({ index, ring, kick, call });
  }
  setBackend(index: number, fd: number): void {
    this.calls.push(`backend ${index} ${fd}`);
  }
  vringBase(index: number): number {
    return index === 0 ? 7 : 3;
  }
  close(): void {
    this.calls.push('close');
  }
}

const MAC = Buffer.from([0x02, 0x70, 1, 2, 3, 4]);
const RX: QueueConfig = { size: 16, descGpa: 0x1000, availGpa: 0x2000, usedGpa: 0x3000 };
const TX: QueueConfig = { size: 16, descGpa: 0x4000, availGpa: 0x5000, usedGpa: 0x6000 };

describe('virtio-net over vhost', () => {
  let mem: GuestMemory;
  let vhost: FakeVhost;
  let net: VirtioNet;
  let t: MmioTransport;
  let offloads: number[];
  let errors: string[];
  let fds: number[];
  beforeEach(() => {
    mem = GuestMemory.map(1024 * 1024);
    vhost = new FakeVhost();
    offloads = [];
    errors = [];
    net = new VirtioNet(mem, { fd: 77, setOffload: (f) => offloads.push(f) }, vhost, MAC, (m) => errors.push(m));
    fds = [createEventFd(), createEventFd(), createEventFd()];
    net.bindKernelSignals([fds[0], fds[1]], fds[2]);
    t = new MmioTransport(0xd0003000, net, mem, () => {}, (m) => errors.push(m));
  });
  afterEach(() => {
    mem.unmap();
    fds.forEach(closeFd);
  });

  it('offers only ring features vhost implements, plus the MAC and the offloads the TAP carries out', () => {
    const offered = offeredNetFeatures(VHOST_FEATURES);
    expect(offered & (1n << 27n)).toBe(0n); // vhost's own header bit is not the guest's business
    expect(offered & (1n << 26n)).toBe(0n);
    expect(offered & VIRTIO_NET_F_MAC).toBe(VIRTIO_NET_F_MAC);
    expect(offered & VIRTIO_NET_F_CSUM).toBe(VIRTIO_NET_F_CSUM);
    expect(offeredNetFeatures(VIRTIO_F_VERSION_1) & VIRTIO_NET_F_MRG_RXBUF).toBe(0n);
    expect(() => offeredNetFeatures(VIRTIO_NET_F_MRG_RXBUF)).toThrow(/VERSION_1/);
  });

  it('tells vhost only the ring features acked, and the TAP only the offloads the guest takes', () => {
    const acked = VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MAC | VIRTIO_NET_F_MRG_RXBUF | VIRTIO_NET_F_CSUM | VIRTIO_NET_F_GUEST_CSUM;
    expect(vhostFeaturesFor(acked, VHOST_FEATURES)).toBe(VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MRG_RXBUF);
    expect(tapOffloadsFor(acked)).toBe(C.TUN_F_CSUM);
    expect(tapOffloadsFor(acked | VIRTIO_NET_F_GUEST_TSO4)).toBe(C.TUN_F_CSUM | C.TUN_F_TSO4);
    // TSO without checksum offload would hand the guest packets it cannot take.
    expect(tapOffloadsFor(VIRTIO_F_VERSION_1 | VIRTIO_NET_F_GUEST_TSO4)).toBe(0);
  });

  it('shows the MAC in its config space', () => {
    expect(t.read(0x100, 4)).toBe(0x02 | (0x70 << 8) | (1 << 16) | (2 << 24));
    expect(t.read(0x104, 2)).toBe(3 | (4 << 8));
    expect(t.read(0x106, 2)).toBe(0); // status: not offered
  });

  it('at DRIVER_OK hands vhost the features, guest RAM and both rings with their eventfds, then attaches the TAP', () => {
    const acked = VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MAC | VIRTIO_RING_F_EVENT_IDX;
    driverUp(t, acked, [RX, TX]);
    expect(errors).toEqual([]);
    expect(vhost.calls).toEqual([`features 0x${(VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX).toString(16)}`, 'mem', 'vring 0 base 0', 'vring 1 base 0', 'backend 0 77', 'backend 1 77']);
    expect(vhost.rings.map((r) => [r.ring, r.kick, r.call])).toEqual([[RX, fds[0], fds[2]], [TX, fds[1], fds[2]]]);
    expect(offloads).toEqual([0]);
    expect(net.serving).toBe(true);
    // Notifications the guest gave before the TAP was attached are looked at: both kicks fired.
    const b = Buffer.alloc(8);
    expect(readSync(fds[0], b)).toBe(8);
    expect(readSync(fds[1], b)).toBe(8);
  });

  it('reports used buffers in InterruptStatus always: vhost interrupts through an irqfd the transport never sees', () => {
    driverUp(t, VIRTIO_F_VERSION_1, [RX, TX]);
    expect(t.read(0x060, 4) & 1).toBe(1);
    t.write(0x064, 4, 1); // acknowledged: the next interrupt may be vhost's again
    expect(t.read(0x060, 4) & 1).toBe(1);
  });

  it('detaches the TAP while paused and attaches it again at resume; a pause before DRIVER_OK holds the attach', () => {
    net.pause();
    driverUp(t, VIRTIO_F_VERSION_1, [RX, TX]);
    expect(net.serving).toBe(false);
    expect(vhost.calls.filter((c) => c.startsWith('backend'))).toEqual([]);
    net.resume();
    expect(net.serving).toBe(true);
    net.pause();
    expect(vhost.calls.filter((c) => c.startsWith('backend'))).toEqual(['backend 0 77', 'backend 1 77', 'backend 0 -1', 'backend 1 -1']);
  });

  it('a driver that readies one queue gets DEVICE_NEEDS_RESET, and vhost is never given a ring', () => {
    driverUp(t, VIRTIO_F_VERSION_1, [RX, null]);
    expect(t.read(0x070, 4) & NEEDS_RESET).toBe(NEEDS_RESET);
    expect(vhost.calls).toEqual([]);
    expect(errors.join('\n')).toMatch(/both its receive and transmit queues/);
  });

  it('a reset detaches the TAP; close stops vhost', () => {
    driverUp(t, VIRTIO_F_VERSION_1, [RX, TX]);
    t.write(0x070, 4, 0);
    expect(net.serving).toBe(false);
    net.close();
    expect(vhost.calls.slice(-3)).toEqual(['backend 0 -1', 'backend 1 -1', 'close']);
  });

  it("saves the MAC and vhost's ring positions only while detached; a restore gives vhost the rings at those bases and, at its first attach, raises the interrupt once", () => {
    driverUp(t, VIRTIO_F_VERSION_1, [RX, TX]);
    expect(() => t.saveState()).toThrow(/still attached/);
    net.pause();
    const state = JSON.parse(JSON.stringify(t.saveState()));
    expect(state.active.device).toEqual({ version: 1, mac: '027001020304', ringBases: [7, 3] });

    const v2 = new FakeVhost();
    const n2 = new VirtioNet(mem, { fd: 78, setOffload: () => {} }, v2, MAC, () => {});
    const fds2 = [createEventFd(), createEventFd(), createEventFd()];
    n2.bindKernelSignals([fds2[0], fds2[1]], fds2[2]);
    try {
      n2.pause();
      new MmioTransport(0xd0003000, n2, mem).restoreState(state);
      expect(v2.calls.filter((c) => c.startsWith('vring'))).toEqual(['vring 0 base 7', 'vring 1 base 3']);
      expect(n2.serving).toBe(false);
      n2.resume();
      expect(n2.serving).toBe(true);
      const counter = Buffer.alloc(8);
      expect(readSync(fds2[2], counter)).toBe(8); // the interrupt owed
      expect(counter.readBigUInt64LE(0)).toBe(1n);
      n2.pause();
      n2.resume(); // not again
      expect(() => readSync(fds2[2], counter)).toThrow(/EAGAIN/);
    } finally {
      fds2.forEach(closeFd);
    }
  });

  it('refuses a state of another MAC, or with a ring position out of range, before vhost is told anything', () => {
    driverUp(t, VIRTIO_F_VERSION_1, [RX, TX]);
    net.pause();
    const state = JSON.parse(JSON.stringify(t.saveState()));
    for (const [device, message] of [
      [{ ...state.active.device, mac: '027001020305' }, /mac: the saved guest has MAC 027001020305, this device 027001020304/],
      [{ ...state.active.device, ringBases: [7, 65536] }, /ringBases\[1\]: expected an integer in \[0, 65535\]/],
      [{ ...state.active.device, ringBases: [7] }, /ringBases: expected 2 entries/],
      [{ ...state.active.device, version: 2 }, /version/],
    ] as const) {
      const v2 = new FakeVhost();
      const n2 = new VirtioNet(mem, { fd: 78, setOffload: () => {} }, v2, MAC, () => {});
      n2.bindKernelSignals([fds[0], fds[1]], fds[2]);
      const bad = { ...state, active: { ...state.active, device } };
      expect(() => new MmioTransport(0xd0003000, n2, mem).restoreState(bad)).toThrow(SnapshotError);
      expect(() => new MmioTransport(0xd0003000, n2, mem).restoreState(bad)).toThrow(message);
      expect(v2.calls).toEqual([]);
    }
  });
});
