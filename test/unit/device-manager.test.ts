// The device manager and the layout it uses: which devices a machine has, where each sits (slot,
// window, line), what the kernel is told, how each signals, and its saved state keyed by role and
// slot. Real device models, transports and guest memory; the VM fd is a recorder (no KVM here),
// and vhost a fake data path.
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { SnapshotError } from '../../src';
import { DeviceManager, QUEUES_PER_TAG, virtioStatesOf, type DeviceHost, type DeviceSignalling, type DeviceVm, type VirtioDeviceState } from '../../src/backends/kvm/device-manager';
import { VirtioLayout } from '../../src/backends/kvm/device-layout';
import type { NetDataPath } from '../../src/backends/kvm/devices/virtio-net';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { IoBus } from '../../src/backends/kvm/io-bus';
import type { MmioTransport } from '../../src/backends/kvm/virtio/mmio-transport';
import { driverUp, DriverQueue, DRIVER_OK } from '../virtio-driver';

const VERSION_1 = 1n << 32n;
const json = <T>(v: T): T => JSON.parse(JSON.stringify(v));
const MAGIC = 0x74726976;

describe('VirtioLayout', () => {
  it("puts each role at its slot's window with its line, in slot order whatever the order given, and tells the kernel in that order", () => {
    const layout = new VirtioLayout<string>([
      { role: 'net', slot: 3, irq: 10 },
      { role: 'console', slot: 0, irq: 5 },
      { role: 'blk', slot: 2, irq: 7 },
    ]);
    expect(layout.slots.map((s) => [s.role, s.base, s.irq])).toEqual([['console', 0xd0000000, 5], ['blk', 0xd0002000, 7], ['net', 0xd0003000, 10]]);
    expect(layout.slot('net')).toEqual({ role: 'net', slot: 3, irq: 10, base: 0xd0003000 });
    expect(layout.linuxCmdline()).toBe('virtio_mmio.device=512@0xd0000000:5 virtio_mmio.device=512@0xd0002000:7 virtio_mmio.device=512@0xd0003000:10');
    expect(() => layout.slot('balloon')).toThrow(/no virtio balloon/);
  });

  it('refuses a slot or a line taken twice, a role twice, a reserved line, and a slot past the probe doorbell', () => {
    const ok = { role: 'console', slot: 0, irq: 5 };
    expect(() => new VirtioLayout([ok, { role: 'balloon', slot: 0, irq: 6 }])).toThrow(/slot 0 is taken twice/);
    expect(() => new VirtioLayout([ok, { role: 'balloon', slot: 1, irq: 5 }])).toThrow(/irq 5 is taken twice/);
    expect(() => new VirtioLayout([ok, { role: 'console', slot: 1, irq: 6 }])).toThrow(/role console is taken twice/);
    for (const irq of [0, 2, 4, 8, 9, 24]) expect(() => new VirtioLayout([{ ...ok, irq }])).toThrow(/not a free ISA line/);
    expect(() => new VirtioLayout([{ ...ok, slot: 15 }])).toThrow(/not a slot from 0 to 14/);
    expect(new VirtioLayout([{ ...ok, slot: 14 }]).slots[0].base).toBe(0xd000e000); // the last window below 0xd000f000
  });
});

/** A data path that records what it is told (see test/unit/virtio-net.test.ts). */
class FakeVhost implements NetDataPath {
  calls: string[] = [];
  features(): bigint {
    return VERSION_1;
  }
  setFeatures(): void {}
  setMemTable(): void {}
  setVring(index: number, _m: GuestMemory, _r: unknown, base: number): void {
    this.calls.push(`vring ${index} base ${base}`);
  }
  setBackend(index: number, fd: number): void {
    this.calls.push(`backend ${index} ${fd}`);
  }
  vringBase(index: number): number {
    return 40 + index;
  }
  close(): void {
    this.calls.push('close');
  }
}

describe('DeviceManager', () => {
  let mem: GuestMemory;
  let vmCalls: string[];
  let received: Buffer[];
  let errors: string[];
  let managers: DeviceManager[];
  let dir: string;
  const vm: DeviceVm = {
    irqLine: (irq, level) => void vmCalls.push(`line ${irq} ${level}`),
    irqfd: (_fd, gsi) => void vmCalls.push(`irqfd ${gsi}`),
    ioeventfd: (_fd, addr, _len, value) => void vmCalls.push(`ioeventfd 0x${addr.toString(16)} ${value}`),
  };
  beforeEach(() => {
    mem = GuestMemory.map(1024 * 1024);
    vmCalls = [];
    received = [];
    errors = [];
    managers = [];
    dir = mkdtempSync(join(tmpdir(), 'pvisor-devices-'));
  });
  afterEach(() => {
    for (const m of managers) {
      m.close((_what, work) => work());
      m.releaseEventFds((_what, work) => work());
    }
    mem.unmap();
    rmSync(dir, { recursive: true, force: true });
  });

  function host(): DeviceHost {
    return { memory: mem, onAgentData: (b) => received.push(b), onAgentDelivered: () => {}, onDeviceError: (m) => errors.push(m), goOnLater: () => {} };
  }
  function make(options: ConstructorParameters<typeof DeviceManager>[0] = {}, signalling: DeviceSignalling = 'polled', mmio = new IoBus('mmio')) {
    const m = new DeviceManager(options, host(), vm, signalling, mmio);
    managers.push(m);
    return { m, mmio };
  }
  /** A device's register window as the guest reaches it, through the MMIO bus. */
  function windowAt(mmio: IoBus, base: number): MmioTransport {
    const at = (o: number, l: number) => mmio.find(base + o, l)!;
    return { read: (o: number, l: number) => at(o, l).device.read(at(o, l).offset, l), write: (o: number, l: number, v: number) => void at(o, l).device.write(at(o, l).offset, l, v) } as unknown as MmioTransport;
  }
  function disk(): { path: string; readOnly: boolean } {
    const path = join(dir, 'disk.img');
    writeFileSync(path, Buffer.alloc(4096));
    return { path, readOnly: true };
  }
  const net = (vhost = new FakeVhost()) => ({ tap: { fd: 99, setOffload: () => {} }, openDataPath: () => vhost, mac: Buffer.from([2, 0x70, 0, 0, 0, 1]) });

  it('a probe machine has the console in slot 0 and the balloon in slot 1, polled: no interrupt, no eventfd', () => {
    const { m, mmio } = make();
    expect(m.layout.slots.map((s) => [s.role, s.slot, s.base, s.irq])).toEqual([['console', 0, 0xd0000000, 5], ['balloon', 1, 0xd0001000, 6]]);
    expect(windowAt(mmio, 0xd0000000).read(0, 4)).toBe(MAGIC);
    expect(windowAt(mmio, 0xd0000000).read(8, 4)).toBe(3); // virtio-console
    expect(windowAt(mmio, 0xd0001000).read(8, 4)).toBe(5); // virtio-balloon
    expect(mmio.find(0xd0002000, 4)).toBeUndefined();
    expect(m.get('blk')).toBeUndefined();
    const watched: number[] = [];
    m.watchNotifications((_fd, tag) => watched.push(tag));
    expect(watched).toEqual([]);
    expect(vmCalls).toEqual([]);
    expect(m.linuxCmdline()).toBe('virtio_mmio.device=512@0xd0000000:5 virtio_mmio.device=512@0xd0001000:6 pvisor.channel=/dev/vport0p0');
  });

  it('blk and net keep their slots and lines with or without the other; net gets its ioeventfds and irqfd whatever the signalling; close stops each once', () => {
    const vhost = new FakeVhost();
    const { m } = make({ net: net(vhost) }, { notify: 'exit', interrupt: 'irq-line' });
    expect(m.layout.slots.map((s) => [s.role, s.base, s.irq])).toEqual([['console', 0xd0000000, 5], ['balloon', 0xd0001000, 6], ['net', 0xd0003000, 10]]);
    expect(vmCalls).toEqual(['ioeventfd 0xd0003050 0', 'ioeventfd 0xd0003050 1', 'irqfd 10']);
    const both = make({ disk: disk(), net: net() }).m;
    expect(both.layout.slots.map((s) => [s.role, s.base, s.irq])).toEqual([['console', 0xd0000000, 5], ['balloon', 0xd0001000, 6], ['blk', 0xd0002000, 7], ['net', 0xd0003000, 10]]);
    expect(both.linuxCmdline()).toBe('virtio_mmio.device=512@0xd0000000:5 virtio_mmio.device=512@0xd0001000:6 virtio_mmio.device=512@0xd0002000:7 virtio_mmio.device=512@0xd0003000:10 pvisor.channel=/dev/vport0p0');
    expect(make({ disk: disk() }).m.layout.slot('blk').base).toBe(0xd0002000);
    const steps: string[] = [];
    m.close((what, work) => {
      steps.push(what);
      work();
    });
    expect(steps).toEqual(['virtio net close']);
    expect(vhost.calls).toEqual(['close']);
  });

  it("irq-line pulses the device's own line; irqfd gives each line an eventfd; ioeventfd notifications are tagged slot * 256 + queue", () => {
    const { m, mmio } = make({}, { notify: 'exit', interrupt: 'irq-line' });
    const rx = new DriverQueue(mem, 0x10000);
    driverUp(windowAt(mmio, 0xd0000000), VERSION_1, [rx.queue.config, new DriverQueue(mem, 0x20000).queue.config]);
    rx.offer(0x40000, 64, true);
    vmCalls.length = 0;
    m.get('console')!.send(Buffer.from('to the guest'));
    expect(rx.used()).toEqual([[0, 12]]);
    expect(vmCalls).toEqual(['line 5 1', 'line 5 0']);

    vmCalls = [];
    const fast = make({}, { notify: 'ioeventfd', interrupt: 'irqfd' }).m;
    expect(vmCalls).toEqual(['irqfd 5', 'irqfd 6']);
    const watched: number[] = [];
    fast.watchNotifications((_fd, tag) => watched.push(tag));
    const tags = [0, 1, 2, 3, QUEUES_PER_TAG, QUEUES_PER_TAG + 1, QUEUES_PER_TAG + 2];
    expect(watched).toEqual(tags); // console: 4 queues; balloon (slot 1): 3
    expect(fast.queueTags()).toEqual(tags);
    expect(vmCalls.slice(2)).toEqual([0, 1, 2, 3].map((q) => `ioeventfd 0xd0000050 ${q}`).concat([0, 1, 2].map((q) => `ioeventfd 0xd0001050 ${q}`)));
  });

  it('saves each device with its role and slot; a state listing them in another order restores into a fresh machine, which carries on', () => {
    const a = make();
    const rings = [new DriverQueue(mem, 0x10000), new DriverQueue(mem, 0x20000)];
    driverUp(windowAt(a.mmio, 0xd0000000), VERSION_1, rings.map((r) => r.queue.config));
    rings[0].offer(0x40000, 8, true);
    a.m.get('console')!.send(Buffer.from('0123456789abcdef')); // 8 fit, 8 wait
    expect(rings[0].used()).toEqual([[0, 8]]);
    const state: VirtioDeviceState[] = json(a.m.saveState());
    expect(state.map((d) => [d.role, d.slot, d.transport.deviceId])).toEqual([['console', 0, 3], ['balloon', 1, 5]]);

    const b = make();
    b.m.restoreState([...state].reverse(), 'devices.virtio');
    const console = windowAt(b.mmio, 0xd0000000);
    expect(console.read(0x070, 4) & DRIVER_OK).toBe(DRIVER_OK);
    rings[0].offer(0x50000, 64, true);
    console.write(0x050, 4, 0); // QueueNotify 0 through the bus
    expect(rings[0].used()).toEqual([[1, 8]]);
    expect(mem.read(0x50000, 8).toString()).toBe('89abcdef');
    expect(errors).toEqual([]);
  });

  it('a device missing from the state, one this machine lacks, a device in another slot, twice, or of no known role is a SnapshotError, and nothing is restored', () => {
    const a = make();
    driverUp(windowAt(a.mmio, 0xd0000000), VERSION_1, [new DriverQueue(mem, 0x10000).queue.config, new DriverQueue(mem, 0x20000).queue.config]);
    const state: VirtioDeviceState[] = json(a.m.saveState());
    const [console, balloon] = state;
    const cases: [unknown[], RegExp][] = [
      [[console], /devices\.virtio: the state has no virtio balloon, which this machine has/],
      [[console, balloon, { role: 'blk', slot: 2, transport: balloon.transport }], /devices\.virtio\[2\]: the state has a virtio blk, this machine none/],
      [[console, { ...balloon, slot: 2 }], /devices\.virtio\[1\]\.slot: the state has the virtio balloon in slot 2, this machine in 1/],
      [[console, balloon, console], /devices\.virtio\[2\]\.role: the state has the virtio console twice/],
      [[console, { ...balloon, role: 'vsock' }], /devices\.virtio\[1\]\.role: expected one of console, balloon, blk, net/],
      [[console, 'balloon'], /devices\.virtio\[1\]: expected an object/],
      [Array(17).fill(console), /at most 16 entries/],
    ];
    for (const [list, message] of cases) {
      const b = make();
      expect(() => b.m.restoreState(list, 'devices.virtio')).toThrow(SnapshotError);
      expect(() => b.m.restoreState(list, 'devices.virtio')).toThrow(message);
      expect(windowAt(b.mmio, 0xd0000000).read(0x070, 4)).toBe(0); // the console was not given its state
    }
  });

  it("net's own state goes with it: vhost's ring positions are saved and handed back as the rings' bases", () => {
    const src = new FakeVhost();
    const a = make({ net: net(src) }, { notify: 'exit', interrupt: 'irq-line' });
    const rings = [new DriverQueue(mem, 0x10000), new DriverQueue(mem, 0x20000)];
    driverUp(windowAt(a.mmio, 0xd0003000), VERSION_1, rings.map((r) => r.queue.config));
    expect(src.calls.slice(0, 2)).toEqual(['vring 0 base 0', 'vring 1 base 0']);
    a.m.pause(); // the TAP is detached: vhost's positions no longer move
    const state: VirtioDeviceState[] = json(a.m.saveState());
    expect(state.map((d) => d.role)).toEqual(['console', 'balloon', 'net']);
    expect(state[2].transport.active?.device).toEqual({ version: 1, mac: '027000000001', ringBases: [40, 41] });

    const dst = new FakeVhost();
    const b = make({ net: net(dst) }, { notify: 'exit', interrupt: 'irq-line' });
    b.m.pause();
    b.m.restoreState([state[2], state[0], state[1]], 'devices.virtio');
    expect(dst.calls).toEqual(['vring 0 base 40', 'vring 1 base 41']); // not attached while paused
    b.m.resume();
    expect(dst.calls.slice(2)).toEqual(['backend 0 99', 'backend 1 99']);
    expect(b.m.get('net')!.serving).toBe(true);
  });
});

describe('virtioStatesOf', () => {
  const t = { version: 1 };
  it('reads version 2 as it is, and version 1 (transports in build order) as console, balloon, then blk', () => {
    const v2 = [{ role: 'balloon', slot: 1, transport: t }];
    expect(virtioStatesOf({ version: 2, virtio: v2 }, 'devices', 2)).toEqual({ list: v2, path: 'devices.virtio' });
    expect(virtioStatesOf({ version: 1, transports: [t, t, t] }, 'devices', 2)).toEqual({
      list: [{ role: 'console', slot: 0, transport: t }, { role: 'balloon', slot: 1, transport: t }, { role: 'blk', slot: 2, transport: t }],
      path: 'devices.transports',
    });
  });

  it('refuses a version 1 list longer than its three devices, and a version it does not know', () => {
    expect(() => virtioStatesOf({ version: 1, transports: [t, t, t, t] }, 'devices', 2)).toThrow(/devices\.transports: at most 3 entries/);
    expect(() => virtioStatesOf({ version: 3, virtio: [] }, 'devices', 2)).toThrow(SnapshotError);
    expect(() => virtioStatesOf({ version: 3, virtio: [] }, 'devices', 2)).toThrow(/reads versions 1 and 2, the state says 3/);
    expect(() => virtioStatesOf({ version: 2 }, 'devices', 2)).toThrow(/devices\.virtio: expected an array/);
  });
});
