// Saved state of the probe machine's devices (virtio-mmio transports with the console and the
// balloon, the UART, the RTC): taken from the real device models as a driver leaves them, through
// JSON, into fresh ones over the same guest RAM, which then carry on; malformed states are refused
// with SnapshotError naming the field, and leave the target untouched. No KVM.
import { SnapshotError } from '../../src';
import { CmosRtc } from '../../src/backends/kvm/devices/cmos-rtc';
import { Serial8250 } from '../../src/backends/kvm/devices/serial';
import { VirtioBalloon, VIRTIO_BALLOON_F_FREE_PAGE_REPORTING } from '../../src/backends/kvm/devices/virtio-balloon';
import { VirtioConsole } from '../../src/backends/kvm/devices/virtio-console';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { MmioTransport } from '../../src/backends/kvm/virtio/mmio-transport';
import { ACK, DRIVER, DRIVER_OK, driverUp as driverUpAt, DriverQueue as Ring, FEATURES_OK } from '../virtio-driver';

/** Brings a transport to DRIVER_OK with `features` and every queue at `rings`. */
function driverUp(t: MmioTransport, features: bigint, rings: Ring[]): void {
  driverUpAt(t, features, rings.map((r) => r.queue.config));
}

const VERSION_1 = 1n << 32n;
const json = <T>(v: T): T => JSON.parse(JSON.stringify(v));

describe('device state of the probe machine', () => {
  let mem: GuestMemory;
  beforeEach(() => {
    mem = GuestMemory.map(1024 * 1024);
  });
  afterEach(() => mem.unmap());

  function consoleOn(received: Buffer[], errors: string[] = []) {
    const dev = new VirtioConsole(mem, (b) => received.push(b), () => {}, () => {}, (m) => errors.push(m));
    return { dev, t: new MmioTransport(0xd0000000, dev, mem, () => {}, (m) => errors.push(m)) };
  }

  it('the console carries on after a restore: bytes held for the guest arrive, its transmits reach the host', () => {
    const before: Buffer[] = [];
    const a = consoleOn(before);
    const rings = [0, 1].map((i) => new Ring(mem, 0x10000 * (i + 1)));
    driverUp(a.t, VERSION_1, rings); // the probe: no multiport, two queues
    rings[0].offer(0x40000, 8, true);
    a.dev.send(Buffer.from('0123456789abcdef')); // 8 bytes fit, 8 wait
    expect(rings[0].used()).toEqual([[0, 8]]);
    a.dev.hold(Buffer.from('HELD')); // sent while paused
    const state = json(a.t.saveState());
    expect(state.active?.queues.map((q) => q && q.nextUsed)).toEqual([1, 0, null, null]);

    const after: Buffer[] = [];
    const b = consoleOn(after);
    b.t.restoreState(state);
    expect(b.t.read(0x070, 4)).toBe(ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    rings[0].offer(0x50000, 64, true);
    b.t.write(0x050, 4, 0); // QueueNotify 0
    expect(rings[0].used()).toEqual([[1, 12]]);
    expect(mem.read(0x50000, 12).toString()).toBe('89abcdefHELD');
    mem.write(0x60000, Buffer.from('hello host'));
    rings[1].offer(0x60000, 10, false);
    b.t.write(0x050, 4, 1);
    expect(Buffer.concat(after).toString()).toBe('hello host');
    expect(before).toEqual([]);
  });

  it('the balloon keeps free page reporting across a restore, and refuses a device that does not offer it', () => {
    const reports: number[][] = [];
    const mk = (reporting: boolean) => new MmioTransport(0xd0001000, new VirtioBalloon((gpa, len) => reports.push([gpa, len]), () => {}, () => {}, reporting), mem);
    const rings = [0, 1, 2].map((i) => new Ring(mem, 0x10000 * (i + 4)));
    const a = mk(true);
    driverUp(a, VERSION_1 | VIRTIO_BALLOON_F_FREE_PAGE_REPORTING, rings);
    const state = json(a.saveState());
    const b = mk(true);
    b.restoreState(state);
    rings[2].offer(0x80000, 0x1000, false);
    b.write(0x050, 4, 2);
    expect(reports).toEqual([[0x80000, 0x1000]]);
    expect(() => mk(false).restoreState(state)).toThrow(/transport\.driverFeatures: 0x20 are features this device does not offer/);
  });

  it('a restored transport raises an interrupt still pending in its state once more, and none when none is', () => {
    let raised = 0;
    const mk = () => new MmioTransport(0xd0000000, new VirtioConsole(mem, () => {}, () => {}, () => {}, () => {}), mem, () => raised++);
    const a = mk();
    driverUp(a, VERSION_1, [0, 1].map((i) => new Ring(mem, 0x10000 * (i + 1))));
    const quiet = json(a.saveState());
    a.signalUsed(); // the guest has not acknowledged it yet
    const pending = json(a.saveState());
    raised = 0;
    const b = mk();
    b.restoreState(quiet);
    b.raisePendingInterrupt();
    expect(raised).toBe(0);
    const c = mk();
    c.restoreState(pending);
    c.raisePendingInterrupt();
    expect(raised).toBe(1);
    expect(c.read(0x060, 4)).toBe(1);
  });

  it('a transport the driver never activated restores its registers only', () => {
    const a = consoleOn([]);
    a.t.write(0x070, 4, ACK);
    a.t.write(0x030, 4, 1);
    const state = json(a.t.saveState());
    expect(state.active).toBeUndefined();
    const b = consoleOn([]);
    b.t.restoreState(state);
    expect(b.t.read(0x070, 4)).toBe(ACK);
    expect(b.t.saveState()).toEqual(state);
  });

  it('malformed transport states are SnapshotErrors naming the field, and the target is untouched', () => {
    const a = consoleOn([]);
    driverUp(a.t, VERSION_1, [0, 1].map((i) => new Ring(mem, 0x10000 * (i + 1))));
    const state = json(a.t.saveState());
    const bad = (f: (s: any) => void): unknown => {
      const c = json(state) as any;
      f(c);
      return c;
    };
    const cases: [unknown, RegExp][] = [
      [bad((s) => { s.version = 2; }), /transport\.version: this pvisor reads version 1/],
      [bad((s) => { s.deviceId = 5; }), /transport\.deviceId: the state is of virtio device 5, this transport drives 3/],
      [bad((s) => { s.queues.pop(); }), /transport\.queues: the state has 3 queues, this device 4/],
      [bad((s) => { s.queues[1].ready = 'yes'; }), /transport\.queues\[1\]\.ready: expected true or false/],
      [bad((s) => { s.driverFeatures = 12; }), /transport\.driverFeatures: expected a 64-bit value/],
      [bad((s) => { s.active.queues[0].size = 3; }), /transport\.active\.queues\[0\]\.size: a split queue's size is a power of 2/],
      [bad((s) => { s.active.queues[1].usedGpa = 0x7fffff00; }), /transport\.active\.queues\[1\]: virtqueue rings lie outside guest RAM/],
      // Found by snapshot-state-fuzz: larger than the device takes (and so a larger budget per turn).
      [bad((s) => { s.active.queues[0].size = 512; }), /transport\.active\.queues\[0\]\.size: 512, more than the 256 this device's queue takes/],
      [bad((s) => { s.active.device.outbox = '@@'; }), /transport\.active\.device\.outbox: expected base64 bytes/],
      [bad((s) => { s.active.device.version = 9; }), /transport\.active\.device\.version/],
      [bad((s) => { s.active.device.controlOutbox = ['AAAA']; }), /transport\.active\.device\.controlOutbox\.0: expected 8 to 4096 bytes, got 3/],
      [bad((s) => { s.status = 0; }), /transport\.status: an active device has DRIVER_OK set/],
    ];
    const target = consoleOn([]);
    const fresh = target.t.saveState();
    for (const [value, message] of cases) {
      expect(() => target.t.restoreState(value)).toThrow(SnapshotError);
      expect(() => target.t.restoreState(value)).toThrow(message);
      expect(target.t.saveState()).toEqual(fresh);
    }
  });

  it('the UART keeps its registers and the line being printed; the RTC its selected register', () => {
    const lines: string[] = [];
    const a = new Serial8250((l) => lines.push(l));
    a.write(3, 0x83); // DLAB
    a.write(0, 0x0c);
    a.write(3, 0x03);
    a.write(7, 0x5a);
    for (const c of Buffer.from('half a li')) a.write(0, c);
    const state = json(a.saveState());
    const b = new Serial8250((l) => lines.push(l));
    b.restoreState(state);
    for (const c of Buffer.from('ne\n')) b.write(0, c);
    expect(lines).toEqual(['half a line']);
    expect(b.read(7)).toBe(0x5a);
    expect(b.saveState()).toEqual({ ...state, line: '' });
    expect(() => b.restoreState({ ...state, lcr: 256 })).toThrow(/serial\.lcr: expected an integer in \[0, 255\], got number 256/);
    expect(() => b.restoreState({ ...state, version: 2 })).toThrow(SnapshotError);

    const rtc = new CmosRtc();
    rtc.write(0, 0x0b);
    const r2 = new CmosRtc();
    r2.restoreState(json(rtc.saveState()));
    expect(r2.read(1)).toBe(rtc.read(1));
    expect(() => r2.restoreState({ version: 1, index: 200 })).toThrow(/cmos\.index/);
  });
});
