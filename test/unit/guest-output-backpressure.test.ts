// Backpressure from a host consumer to the guest under stream credit, over the real parts between
// them: guest RAM (a real mapping), the virtio-console device behind its mmio transport, the agent
// client and the Linux client's streams. The guest's side (../flooding-guest.ts) is a driver that behaves as the
// agent under `yes` does. The 1 GiB floods are in ./guest-output-flood.test.ts.
// No KVM: the point is what the host takes and keeps, which these parts decide.
import { Readable } from 'node:stream';
import { VirtioConsole } from '../../src/backends/kvm/devices/virtio-console';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { GuestRequestError, TimeoutError } from '../../src';
import { STREAM_WINDOW_BYTES as WINDOW } from '../../src/protocol/stream-window';
import { FloodingGuest, FRAME_PAYLOAD } from '../flooding-guest';
import { DriverQueue, SIZE } from '../virtio-driver';

const VERSION_1 = 1n << 32n;
const KiB = 1024;
const MiB = 1024 * KiB;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const turn = () => new Promise((r) => setImmediate(r));

describe("guest output and the host's consumer: stream credit back to the guest", () => {
  it('a spawned command whose stdout is not read uses up its window and waits; the host keeps at most the window, takes every chain, and answers other requests meanwhile', async () => {
    const g = new FloodingGuest(0x0201, 1);
    try {
      const p = g.linux.spawn(['yes']);
      const before = process.memoryUsage().arrayBuffers;
      // The guest pushes as hard as it can for 300 turns of the event loop; nobody reads.
      for (let i = 0; i < 300; i++) {
        g.produce();
        await turn();
      }
      // It sent its window and no more: the host holds that much, and has taken every chain.
      expect(g.sentBytes).toBe(Math.floor(WINDOW / FRAME_PAYLOAD) * FRAME_PAYLOAD);
      expect(p.stdout.readableLength).toBe(g.sentBytes);
      expect(g.credit).toBeLessThan(FRAME_PAYLOAD);
      expect(g.creditWaits).toBeGreaterThan(200);
      expect(g.inFlight).toBe(0);
      expect(g.dev.transmitHeld).toBe(false);
      expect(g.grants).toBe(0);
      expect(process.memoryUsage().arrayBuffers - before).toBeLessThan(8 * MiB);
      // Another request of the same VM is answered at once: the channel is not held.
      const mem = g.linux.memInfo({ timeoutMs: 1000 });
      g.answer(2, 0x0220, Buffer.alloc(32));
      await expect(mem).resolves.toEqual({ totalBytes: 0, freeBytes: 0, availableBytes: 0, cachedBytes: 0 });

      // A slow consumer: 64 KiB every 5 ms. The flow goes on, in order, and the host's buffer
      // stays within the window however much the guest has to send.
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
      expect(maxBuffered).toBeLessThanOrEqual(WINDOW);
      expect(g.sentBytes - read).toBeLessThanOrEqual(WINDOW); // never more than a window ahead
      expect(letters).toMatch(/^[a-z]+$/);
      expect(g.warnings).toEqual([]);

      // Destroyed: what it held and all that comes is granted back, and the guest runs free again.
      p.stdout.destroy();
      await turn();
      const takenAtDestroy = g.taken;
      for (let i = 0; i < 20; i++) {
        g.produce();
        await turn();
      }
      expect(g.taken).toBeGreaterThan(takenAtDestroy + 100);
      expect(g.dev.transmitHeld).toBe(false);
    } finally {
      g.close();
    }
  });

  it('a stdout never read holds nothing once the command has ended', async () => {
    // 7 frames, then the 8th in the same buffer as the command's end: all within the window.
    const g = new FloodingGuest(0x0201, 1, 7 * FRAME_PAYLOAD);
    try {
      const p = g.linux.spawn(['yes']);
      for (let i = 0; i < 10; i++) {
        g.produce();
        await turn();
      }
      g.finish(Buffer.alloc(8), Buffer.alloc(FRAME_PAYLOAD, 'z'));
      await expect(p.exited).resolves.toEqual({ exitCode: 0, signal: null });
      expect(p.stdout.readableLength).toBe(8 * FRAME_PAYLOAD); // full, unread...
      expect(g.client.heldBytes(1, 1)).toBe(0); // ...and no window left open: no more comes for it
      expect(g.dev.transmitHeld).toBe(false);
    } finally {
      g.close();
    }
  });

  it('files.readStream: a file of any size costs the host its window; read at its pace it comes whole and checked', async () => {
    const total = 24 * MiB;
    const g = new FloodingGuest(0x0210, 1, total);
    try {
      const s = g.linux.files.readStream('/big');
      expect(s).toBeInstanceOf(Readable);
      for (let i = 0; i < 200; i++) {
        g.produce();
        await turn();
      }
      expect(s.readableLength).toBeLessThanOrEqual(WINDOW);
      expect(g.credit).toBeLessThan(FRAME_PAYLOAD); // the guest waits for credit, not for the ring
      expect(g.dev.transmitHeld).toBe(false);
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
      expect(maxBuffered).toBeLessThanOrEqual(WINDOW);
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

  it('a guest that sends beyond its credit fails the stream, said as a protocol warning; the host keeps no more than the window and drops what follows', async () => {
    const g = new FloodingGuest(0x0201, 1, Infinity, { honoursCredit: false });
    try {
      const p = g.linux.spawn(['yes']);
      const failed = p.exited.then(
        () => null,
        (e: Error) => e,
      );
      for (let i = 0; i < 100; i++) {
        g.produce();
        await turn();
      }
      const e = await failed;
      expect(e).toBeInstanceOf(GuestRequestError);
      expect(e!.message).toMatch(/sent 32752 bytes on stream 1 of request 1 \(op 0x201\) with \d+ bytes of credit left .*does not keep to stream credit/);
      expect(g.warnings.filter((w) => /beyond|credit left/.test(w))).toHaveLength(1);
      expect(g.sentBytes).toBeGreaterThan(8 * MiB); // it went on sending, and all of it was taken
      expect(g.inFlight).toBeLessThanOrEqual(SIZE);
      expect(g.dev.transmitHeld).toBe(false);
    } finally {
      g.close();
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
      dev.holdTransmit(true); // the machine paused meanwhile
      for (let i = 0; i < 3; i++) await turn();
      dev.notify(1); // a notification while held takes nothing either
      expect(received).toBe(8 * MiB);
      dev.holdTransmit(true); // paused twice: still held, and one release lets go
      dev.holdTransmit(false);
      for (let i = 0; i < 3; i++) await turn();
      expect(received).toBe(9 * MiB);
      expect(errors).toEqual([]);
    } finally {
      mem.unmap();
    }
  });
});
