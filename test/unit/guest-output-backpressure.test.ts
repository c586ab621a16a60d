// Backpressure from a host consumer to the guest, over the real parts between them: guest RAM (a
// real mapping), the virtio-console device behind its mmio transport, the agent client and the
// Linux client's streams. The guest's side (../flooding-guest.ts) is a driver that behaves as the
// agent under `yes` does. The 1 GiB floods are in ./guest-output-flood.test.ts.
// No KVM: the point is what the host takes and keeps, which these parts decide.
import { Readable } from 'node:stream';
import { VirtioConsole } from '../../src/backends/kvm/devices/virtio-console';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { TimeoutError } from '../../src';
import { FloodingGuest, FRAME_PAYLOAD } from '../flooding-guest';
import { DriverQueue, SIZE } from '../virtio-driver';

const VERSION_1 = 1n << 32n;
const KiB = 1024;
const MiB = 1024 * KiB;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const turn = () => new Promise((r) => setImmediate(r));

describe("guest output and the host's consumer: backpressure to the guest", () => {
  it('a spawned command whose stdout is not read holds the transmit ring: the host keeps at most 1 MiB and one frame, the guest keeps the rest', async () => {
    const g = new FloodingGuest(0x0201, 1);
    try {
      const p = g.linux.spawn(['yes']);
      const before = process.memoryUsage().arrayBuffers;
      // The guest pushes as hard as it can for 300 turns of the event loop; nobody reads.
      for (let i = 0; i < 300; i++) {
        g.produce();
        await turn();
      }
      expect(g.dev.transmitHeldFor).toEqual(['consumer']);
      expect(g.client.flowHolders).toBe(1);
      expect(p.stdout.readableLength).toBeGreaterThanOrEqual(MiB);
      expect(p.stdout.readableLength).toBeLessThanOrEqual(MiB + FRAME_PAYLOAD);
      // The ring is full and stays so: the guest's writer is blocked, the host's memory flat.
      expect(g.inFlight).toBe(SIZE);
      const takenWhileHeld = g.taken;
      for (let i = 0; i < 50; i++) {
        g.produce();
        await turn();
      }
      expect(g.taken).toBe(takenWhileHeld);
      expect(process.memoryUsage().arrayBuffers - before).toBeLessThan(8 * MiB);

      // A slow consumer: 64 KiB every 5 ms. The flow goes on, in order, and the host's buffer
      // stays bounded however much the guest has to send.
      let read = 0;
      let maxBuffered = 0;
      let letters = '';
      for (let i = 0; i < 400; i++) {
        const chunk = p.stdout.read(64 * KiB) as Buffer | null;
        if (chunk) {
          read += chunk.length;
          if (i % 40 === 0) letters += String.fromCharCode(chunk[0]);
        }
        maxBuffered = Math.max(maxBuffered, p.stdout.readableLength);
        g.produce();
        await (i % 4 === 0 ? sleep(5) : turn());
      }
      expect(read).toBeGreaterThan(8 * MiB);
      expect(maxBuffered).toBeLessThanOrEqual(MiB + FRAME_PAYLOAD);
      expect(g.sentBytes).toBeGreaterThan(read); // the guest had more to give all along
      expect(letters).toMatch(/^[a-z]+$/);
      expect(g.warnings).toEqual([]);

      // Destroyed: the hold goes, what comes is dropped, and the guest runs free again.
      p.stdout.destroy();
      await turn();
      expect(g.client.flowHolders).toBe(0);
      const takenAtDestroy = g.taken;
      for (let i = 0; i < 20; i++) {
        g.produce();
        await turn();
      }
      expect(g.taken).toBeGreaterThan(takenAtDestroy + 100);
      expect(g.dev.transmitHeldFor).toEqual([]);
    } finally {
      g.close();
    }
  });

  it('a stdout never read does not hold the channel once the command has ended', async () => {
    // 32 frames stay under the 1 MiB; the 33rd fills it, in the same buffer as the command's end.
    const g = new FloodingGuest(0x0201, 1, 32 * FRAME_PAYLOAD);
    try {
      const p = g.linux.spawn(['yes']);
      for (let i = 0; i < 10; i++) {
        g.produce();
        await turn();
      }
      expect(g.client.flowHolders).toBe(0);
      g.finish(Buffer.alloc(8), Buffer.alloc(FRAME_PAYLOAD, 'z'));
      await expect(p.exited).resolves.toEqual({ exitCode: 0, signal: null });
      expect(p.stdout.readableLength).toBe(33 * FRAME_PAYLOAD); // full, unread...
      expect(g.client.flowHolders).toBe(0); // ...and holding nothing: no more comes for it
      expect(g.dev.transmitHeldFor).toEqual([]);
    } finally {
      g.close();
    }
  });

  it('files.readStream: a file of any size costs the host its 1 MiB buffer; read at its pace it comes whole and checked', async () => {
    const total = 24 * MiB;
    const g = new FloodingGuest(0x0210, 1, total);
    try {
      const s = g.linux.files.readStream('/big');
      expect(s).toBeInstanceOf(Readable);
      for (let i = 0; i < 200; i++) {
        g.produce();
        await turn();
      }
      expect(s.readableLength).toBeLessThanOrEqual(MiB + FRAME_PAYLOAD);
      expect(g.dev.transmitHeldFor).toEqual(['consumer']);
      let read = 0;
      let maxBuffered = 0;
      const ended = new Promise((r) => s.once('end', r));
      s.on('data', (c: Buffer) => {
        read += c.length;
        maxBuffered = Math.max(maxBuffered, s.readableLength);
        // A slow consumer: pauses after each chunk, for a turn.
        s.pause();
        setImmediate(() => s.resume());
      });
      while (g.sentBytes < total) {
        g.produce();
        await turn();
      }
      for (let i = 0; i < 50 && g.taken < g.sentCount; i++) {
        g.produce();
        await turn();
      }
      const answer = Buffer.alloc(8);
      answer.writeBigUInt64LE(BigInt(g.sentBytes));
      g.finish(answer);
      await ended;
      expect(read).toBe(g.sentBytes);
      expect(maxBuffered).toBeLessThanOrEqual(MiB + FRAME_PAYLOAD);
      expect(g.client.flowHolders).toBe(0);
    } finally {
      g.close();
    }
  });

  it('files.readStream: a guest that goes silent is a TimeoutError, a count that lies is a GuestRequestError', async () => {
    const g = new FloodingGuest(0x0210, 1, 64 * KiB);
    try {
      const s = g.linux.files.readStream('/f', { timeoutMs: 50 });
      const failed = new Promise<Error>((r) => s.once('error', r));
      s.resume();
      g.produce();
      await expect(failed).resolves.toBeInstanceOf(TimeoutError);
    } finally {
      g.close();
    }
    const h = new FloodingGuest(0x0210, 1, 64 * KiB);
    try {
      const s = h.linux.files.readStream('/f');
      const failed = new Promise<Error>((r) => s.once('error', r));
      s.resume();
      h.produce();
      await turn();
      const answer = Buffer.alloc(8);
      answer.writeBigUInt64LE(1n);
      h.finish(answer);
      expect((await failed).message).toMatch(/the guest said 1 bytes but sent \d+ for \/f/);
    } finally {
      h.close();
    }
  });
});

describe('virtio-console: transmit held while the machine is paused or stopped', () => {
  it("work a turn left for later waits while the machine holds the queue, and goes on when it lets go", async () => {
    const mem = GuestMemory.map(4 * MiB);
    try {
      let received = 0;
      const errors: string[] = [];
      const dev = new VirtioConsole(mem, (b) => (received += b.length), () => {}, () => {}, (m) => errors.push(m));
      const rx = new DriverQueue(mem, 0x10000);
      const tx = new DriverQueue(mem, 0x20000);
      dev.activate([rx.queue, tx.queue], VERSION_1);
      for (let i = 0; i < 9; i++) tx.offerChain([{ gpa: 0x100000, len: MiB }]);
      dev.notify(1);
      expect(received).toBe(8 * MiB); // a turn's worth; the ninth is left for the next turn
      dev.holdTransmit('machine', true); // the machine paused meanwhile
      for (let i = 0; i < 3; i++) await turn();
      dev.notify(1); // a notification while held takes nothing either
      expect(received).toBe(8 * MiB);
      dev.holdTransmit('consumer', true);
      dev.holdTransmit('machine', false); // resumed, but a consumer still holds it
      for (let i = 0; i < 3; i++) await turn();
      expect(received).toBe(8 * MiB);
      dev.holdTransmit('consumer', false);
      for (let i = 0; i < 3; i++) await turn();
      expect(received).toBe(9 * MiB);
      expect(errors).toEqual([]);
    } finally {
      mem.unmap();
    }
  });
});
