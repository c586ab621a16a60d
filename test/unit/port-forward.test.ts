// vm.forward's relay over real loopback TCP, with a stand-in for the guest's `nc` process that
// behaves as the agent does for STDIN_WRITE: one write at a time per process (a second one while
// the first is pending is the agent's E_BUSY), each settling after a round trip. What the guest
// process sends on stdout goes back to the host's peer.
import { connect, type Socket } from 'node:net';
import { Readable } from 'node:stream';
import { randomBytes } from 'node:crypto';
import { forwardPort, STDIN_BATCH_BYTES } from '../../src/network/port-forward';
import type { Command, GuestProcess, SpawnOptions } from '../../src/guest/linux-client';

const KiB = 1024;
const MiB = 1024 * KiB;

/** A guest `nc` whose STDIN_WRITEs each take `roundTripMs`. */
class FakeNc {
  /** As the Linux client's output streams: chunks pushed as they come from the agent. */
  readonly stdout = new Readable({ read: () => {} });
  readonly writes: Buffer[] = [];
  readonly events: string[] = [];
  inFlight = 0;
  maxInFlight = 0;
  ended = 0;
  killed = 0;
  private exit!: () => void;
  readonly exited = new Promise<{ exitCode: number; signal: null }>((resolve) => (this.exit = () => resolve({ exitCode: 0, signal: null })));
  /** Resolves when stdin has been closed. */
  readonly stdinClosed: Promise<void>;
  private closed!: () => void;

  constructor(
    readonly argv: Command,
    private readonly roundTripMs: number,
  ) {
    this.stdinClosed = new Promise((r) => (this.closed = r));
  }

  write(data: Uint8Array): Promise<void> {
    if (this.inFlight > 0) return Promise.reject(new Error('a STDIN_WRITE is still pending (E_BUSY)'));
    if (this.ended) return Promise.reject(new Error('stdin is closed'));
    this.inFlight++;
    this.maxInFlight = Math.max(this.maxInFlight, this.inFlight);
    this.writes.push(Buffer.from(data));
    this.events.push('write');
    if (this.roundTripMs === Infinity) return new Promise(() => {}); // a guest that never reads
    return new Promise((resolve) =>
      setTimeout(() => {
        this.inFlight--;
        resolve();
      }, this.roundTripMs),
    );
  }

  end(): Promise<void> {
    this.ended++;
    this.events.push('end');
    this.closed();
    return Promise.resolve();
  }

  kill(): Promise<void> {
    this.killed++;
    return Promise.resolve();
  }

  /**
   * The guest server answers and closes: as the Linux client does, the output is pushed as it
   * arrives, ended, and then the exit status settles `exited`.
   */
  finish(answer: Buffer): void {
    if (answer.length) this.stdout.push(answer);
    this.stdout.push(null);
    this.exit();
  }
}

function spawner(roundTripMs: number) {
  const spawned: FakeNc[] = [];
  const spawn = (command: Command, _options: SpawnOptions): GuestProcess => {
    const p = new FakeNc(command, roundTripMs);
    spawned.push(p);
    return p as unknown as GuestProcess;
  };
  return { spawn, spawned };
}

/** Sends `data` in 16 KiB writes as fast as the socket takes them, then ends its side. */
function sendAll(s: Socket, data: Buffer): void {
  let off = 0;
  const more = (): void => {
    while (off < data.length) {
      const piece = data.subarray(off, off + 16 * KiB);
      off += piece.length;
      if (!s.write(piece)) {
        s.once('drain', more);
        return;
      }
    }
    s.end();
  };
  more();
}

describe('forwardPort', () => {
  test('host to guest: every byte in order, one write in flight, gathered into writes no larger than a frame, stdin closed after the last', async () => {
    const { spawn, spawned } = spawner(15);
    const f = await forwardPort(spawn, 8000);
    try {
      const data = randomBytes(3 * MiB);
      const answer = Buffer.from('done\n');
      const got: Buffer[] = [];
      const closed = new Promise<void>((resolve, reject) => {
        const s = connect(f.port, f.host, () => sendAll(s, data));
        s.on('data', (d: Buffer) => got.push(d)).on('close', () => resolve()).on('error', reject);
      });
      while (!spawned.length) await new Promise((r) => setTimeout(r, 5));
      const nc = spawned[0];
      expect(nc.argv).toEqual(['nc', '127.0.0.1', '8000']);
      await nc.stdinClosed;
      nc.finish(answer);
      await closed;

      expect(Buffer.concat(nc.writes).equals(data)).toBe(true);
      expect(nc.maxInFlight).toBe(1);
      expect(nc.ended).toBe(1);
      expect(nc.events[nc.events.length - 1]).toBe('end');
      expect(nc.events.filter((e) => e === 'end')).toHaveLength(1);
      // A socket read is at most 64 KiB: what waits while one write is in flight may pass the
      // batch size by one read, never more.
      for (const w of nc.writes) expect(w.length).toBeLessThanOrEqual(STDIN_BATCH_BYTES + 64 * KiB);
      // What arrived during a 15 ms round trip went in one write rather than one per socket read.
      expect(Math.max(...nc.writes.map((w) => w.length))).toBeGreaterThan(64 * KiB);
      expect(Buffer.concat(got).equals(answer)).toBe(true);
    } finally {
      await f.close();
    }
  });

  test('an empty connection closes the guest stdin once, with no write', async () => {
    const { spawn, spawned } = spawner(1);
    const f = await forwardPort(spawn, 8001);
    try {
      const closed = new Promise<void>((resolve, reject) => {
        const s = connect(f.port, f.host, () => s.end());
        s.resume().on('close', () => resolve()).on('error', reject);
      });
      while (!spawned.length) await new Promise((r) => setTimeout(r, 5));
      await spawned[0].stdinClosed;
      spawned[0].finish(Buffer.alloc(0));
      await closed;
      expect(spawned[0].writes).toHaveLength(0);
      expect(spawned[0].ended).toBe(1);
    } finally {
      await f.close();
    }
  });

  test('a guest that never takes its stdin holds one write; the host peer is paused, not buffered without bound', async () => {
    const { spawn, spawned } = spawner(Infinity);
    const f = await forwardPort(spawn, 8002);
    const s = connect(f.port, f.host);
    try {
      await new Promise<void>((resolve, reject) => s.once('connect', () => resolve()).once('error', reject));
      const chunk = Buffer.alloc(64 * KiB);
      // Write until the peer's own socket buffer holds what the relay would not take.
      for (let i = 0; i < 512 && s.writableLength < 4 * MiB; i++) {
        s.write(chunk);
        await new Promise((r) => setImmediate(r));
      }
      await new Promise((r) => setTimeout(r, 300));
      const nc = spawned[0];
      expect(nc.writes).toHaveLength(1);
      expect(nc.maxInFlight).toBe(1);
      // What left the peer's socket: the relay's batch and the kernel's buffers, never all of it.
      expect(s.writableLength).toBeGreaterThan(0);
    } finally {
      s.destroy();
      await f.close();
    }
  });

  test('guest to host: a peer that does not read pauses the guest stream, which then stops taking output; all of it arrives once the peer reads', async () => {
    const { spawn, spawned } = spawner(1);
    const f = await forwardPort(spawn, 8003);
    const s = connect(f.port, f.host);
    try {
      await new Promise<void>((resolve, reject) => s.once('connect', () => resolve()).once('error', reject));
      s.pause(); // a peer that does not read
      while (!spawned.length) await new Promise((r) => setTimeout(r, 5));
      const nc = spawned[0];
      // The guest pushes as the Linux client's stream does, until the stream says it is full
      // (push() false: then the VMM would stop taking the guest's transmit queue).
      const data = randomBytes(64 * MiB);
      let pushed = 0;
      for (let idle = 0; pushed < data.length && idle < 20; ) {
        if (nc.stdout.push(data.subarray(pushed, pushed + 64 * KiB))) {
          pushed += 64 * KiB;
          idle = 0;
        } else {
          pushed += 64 * KiB;
          idle++;
          await new Promise((r) => setTimeout(r, 20)); // the relay gets every chance to drain it
        }
        await new Promise((r) => setImmediate(r));
      }
      // What left the guest: the peer's socket buffers, the kernel's and the stream's own, not 64 MiB.
      expect(pushed).toBeLessThan(16 * MiB);
      const got: Buffer[] = [];
      const all = new Promise<void>((resolve) => s.on('end', () => resolve()));
      s.on('data', (d: Buffer) => got.push(d));
      s.resume();
      // The peer reads again: the rest goes through as the stream drains.
      while (pushed < data.length) {
        const ok = nc.stdout.push(data.subarray(pushed, pushed + 64 * KiB));
        pushed += 64 * KiB;
        if (!ok) await new Promise((r) => setTimeout(r, 5));
      }
      nc.finish(Buffer.alloc(0));
      await all;
      expect(Buffer.concat(got).equals(data)).toBe(true);
    } finally {
      s.destroy();
      await f.close();
    }
  });
});
