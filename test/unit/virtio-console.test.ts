import { VirtioConsole } from '../../src/backends/kvm/devices/virtio-console';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { MmioTransport } from '../../src/backends/kvm/virtio/mmio-transport';
import { DriverQueue, driverUp, SIZE } from '../virtio-driver';

// The agent channel as Linux's virtio_console driver drives it with multiport: real guest memory,
// rings and buffers written the way the driver writes them. No KVM needed.
const MULTIPORT = 1n << 1n;
const VERSION_1 = 1n << 32n;

function control(id: number, event: number, value: number): Buffer {
  const b = Buffer.alloc(8);
  b.writeUInt32LE(id, 0);
  b.writeUInt16LE(event, 4);
  b.writeUInt16LE(value, 6);
  return b;
}

describe('virtio-console, multiport agent channel', () => {
  let mem: GuestMemory;
  let dev: VirtioConsole;
  let fromGuest: Buffer[];
  let interrupts: number;
  let errors: string[];
  let q: DriverQueue[];

  beforeEach(() => {
    mem = GuestMemory.map(1024 * 1024);
    fromGuest = [];
    interrupts = 0;
    errors = [];
    dev = new VirtioConsole(mem, (b) => fromGuest.push(b), () => {}, () => interrupts++, (m) => errors.push(m));
    q = [0, 1, 2, 3].map((i) => new DriverQueue(mem, 0x10000 * (i + 1)));
    expect(dev.features & MULTIPORT).toBe(MULTIPORT);
    expect(dev.readConfig(4, 4)).toBe(1); // max_nr_ports
    dev.activate(q.map((x) => x.queue), VERSION_1 | MULTIPORT);
  });
  afterEach(() => mem.unmap());

  /** The driver sends a control message and collects the device's answers. */
  function say(msg: Buffer): Buffer[] {
    for (let i = 0; i < 4; i++) q[2].offer(0x80000 + 0x100 * i, 64, true);
    mem.write(0x90000, msg);
    q[3].offer(0x90000, msg.length, false);
    dev.notify(3);
    expect(q[3].used()).toHaveLength(1);
    return q[2].used().map(([d, len]) => Buffer.from(mem.read(0x80000 + 0x100 * (d % 4), len)));
  }

  it('adds port 0, names it and opens the host side when the driver asks', () => {
    expect(say(control(0xffffffff, 0, 1))).toEqual([control(0, 1, 1)]); // DEVICE_READY -> DEVICE_ADD 0
    const answers = say(control(0, 3, 1)); // PORT_READY 0
    expect(answers[0].subarray(0, 8)).toEqual(control(0, 7, 1)); // PORT_NAME
    expect(answers[0].subarray(8).toString()).toBe('pvisor.agent');
    expect(answers[1]).toEqual(control(0, 6, 1)); // PORT_OPEN: the host is listening
    expect(errors).toEqual([]);
  });

  it('refuses a short control message and goes on', () => {
    mem.write(0x90000, Buffer.alloc(4));
    q[3].offer(0x90000, 4, false);
    dev.notify(3);
    expect(q[3].used()).toHaveLength(1);
    expect(errors.join()).toMatch(/control message of 4 bytes/);
    expect(say(control(0xffffffff, 0, 1))).toEqual([control(0, 1, 1)]);
  });

  it('carries bytes both ways and asks for receive notifications only while bytes wait', () => {
    mem.write(0xa0000, Buffer.from('from the guest'));
    q[1].offer(0xa0000, 14, false);
    dev.notify(1);
    expect(Buffer.concat(fromGuest).toString()).toBe('from the guest');

    dev.send(Buffer.from('x'.repeat(100)));
    expect(q[0].usedFlags).toBe(0); // waiting for a buffer: notify me
    q[0].offer(0xb0000, 64, true);
    dev.notify(0);
    expect(q[0].used()).toEqual([[0, 64]]);
    expect(q[0].usedFlags).toBe(0); // 36 bytes still wait
    q[0].offer(0xb1000, 64, true);
    dev.notify(0);
    expect(q[0].used()).toEqual([[1, 36]]);
    expect(q[0].usedFlags).toBe(1); // nothing waits: no notifications needed
    expect(mem.read(0xb0000, 64).toString() + mem.read(0xb1000, 36).toString()).toBe('x'.repeat(100));
  });

  it('raises no interrupt when the driver turned them off, and one when it wants them', () => {
    q[1].noInterrupt = true;
    q[1].offer(0xa0000, 1, false);
    dev.notify(1);
    expect(interrupts).toBe(0);
    q[1].noInterrupt = false;
    q[1].offer(0xa0000, 1, false);
    dev.notify(1);
    expect(interrupts).toBe(1);
  });

  it('answers held for a driver that asks again and again without taking them stay bounded (found by virtio-device-properties)', () => {
    mem.write(0x90000, control(0, 3, 1)); // PORT_READY: two answers each
    for (let i = 0; i < 200; i++) {
      q[3].offer(0x90000, 8, false);
      q[3].queue.renewBudget(); // a notification each, as through the transport
      dev.notify(3);
    }
    expect(dev.saveState().controlOutbox).toHaveLength(64);
    expect(errors.join('\n')).toMatch(/control answer 7 dropped: 64 wait already for the driver's buffers/);
  });

  it('a transmit chain whose descriptors all alias one large region is refused without a copy', () => {
    // 16 descriptors, each 512 KiB over the same bytes: 8 MiB claimed from 512 KiB of RAM.
    const before = process.memoryUsage().arrayBuffers;
    q[1].offerChain(Array.from({ length: SIZE }, () => ({ gpa: 0x80000, len: 512 * 1024 })));
    dev.notify(1);
    expect(fromGuest).toEqual([]);
    expect(errors.join()).toMatch(/transmit chain 0 carries 8388608 bytes, more than 1052672: refused/);
    expect(q[1].used()).toEqual([[0, 0]]);
    expect(process.memoryUsage().arrayBuffers - before).toBeLessThan(1024 * 1024);
    // The device goes on (at the next notification: the refused chain spent this turn's budget).
    mem.write(0xa0000, Buffer.from('next'));
    q[1].offer(0xa0000, 4, false);
    q[1].queue.renewBudget(); // as the transport does for each notification
    dev.notify(1);
    expect(Buffer.concat(fromGuest).toString()).toBe('next');
  });
});

describe('virtio-console, transmit work left for a later turn', () => {
  it('the rest of a flood, due in a later turn after guest RAM is unmapped (the VM stopped), is reported, never thrown into the event loop', async () => {
    const mem = GuestMemory.map(4 * 1024 * 1024);
    const errors: string[] = [];
    let received = 0;
    const dev = new VirtioConsole(mem, (b) => (received += b.length), () => {}, () => {}, (m) => errors.push(m));
    const tx = new DriverQueue(mem, 0x20000);
    dev.activate([new DriverQueue(mem, 0x10000).queue, tx.queue], VERSION_1);
    // Nine chains of 1 MiB (one descriptor each, well inside the queue's budget of 16): a turn
    // takes 8 MiB, the ninth is left for the next turn.
    for (let i = 0; i < 9; i++) tx.offerChain([{ gpa: 0x100000, len: 1024 * 1024 }]);
    dev.notify(1);
    expect(received).toBe(8 * 1024 * 1024);
    mem.unmap();
    await new Promise((r) => setImmediate(r));
    expect(received).toBe(8 * 1024 * 1024);
    expect(errors.join('\n')).toMatch(/guest RAM is no longer mapped/);
  });

  it('a turn that spends the byte budget and the queue budget at once still leaves the rest for the next turn (found by virtio-device-properties)', async () => {
    const mem = GuestMemory.map(4 * 1024 * 1024);
    try {
      let received = 0;
      const dev = new VirtioConsole(mem, (b) => (received += b.length), () => {}, () => {}, () => {});
      const t = new MmioTransport(0xd0000000, dev, mem);
      const rx = new DriverQueue(mem, 0x10000);
      const tx = new DriverQueue(mem, 0x20000);
      driverUp(t, VERSION_1, [rx.queue.config, tx.queue.config]);
      // Nine chains of two 512 KiB descriptors: eight make 8 MiB and 16 descriptors, both budgets.
      for (let i = 0; i < 9; i++) tx.offerChain([{ gpa: 0x100000, len: 512 * 1024 }, { gpa: 0x180000, len: 512 * 1024 }]);
      t.write(0x050, 4, 1); // QueueNotify 1
      expect(received).toBe(8 * 1024 * 1024);
      for (let turn = 0; turn < 3; turn++) await new Promise((r) => setImmediate(r));
      expect(received).toBe(9 * 1024 * 1024); // no second notification: the device went on by itself
    } finally {
      mem.unmap();
    }
  });
});
