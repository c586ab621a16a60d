// vm.forward's relay over real loopback TCP, with a stand-in for the guest's `nc` process that
// behaves as the agent does for STDIN_WRITE: one write at a time per process (a second one while
// the first is pending is the agent's E_BUSY), each settling after a round trip. What the guest
// process sends on stdout goes back to the host's peer.
import { connect, type Socket } from 'node:net';
import { Readable } from 'node:stream';
import { randomBytes } from 'node:crypto';
import { ConnectionBudget, forwardPort, STDIN_BATCH_BYTES } from '../../src/network/port-forward';
import { InvalidOptionError } from '../../src';
import type { GuestProcess } from '../../src/guest/guest-process';
import type { Command, SpawnOptions } from '../../src/guest/guest-types';

const KiB = 1024;
const MiB = 1024 * KiB;

/** A guest `nc` whose STDIN_WRITEs each take `roundTripMs`. */
class FakeNc {
  /** As the Linux client's output streams: chunks pushed as they come from the agent. */
  readonly stdout = new Readable({ read: () => {} });
  readonly stderr = new Readable({ read: () => {} });
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
    this.stderr.push(null);
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
      // Write until the peer's own socket holds what the relay would not take, and still holds
      // some 300 ms later: the kernel's receive buffer grows (tcp_rmem's max is 32 MiB on some
      // hosts) and takes a first 4 MiB whole. Up to 256 MiB, which a relay that buffered without
      // bound would take all of.
      for (let written = 0; written < 256 * MiB; ) {
        for (; written < 256 * MiB && s.writableLength < 4 * MiB; written += chunk.length) {
          s.write(chunk);
          await new Promise((r) => setImmediate(r));
        }
        await new Promise((r) => setTimeout(r, 300));
        if (s.writableLength > 0) break;
      }
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

  test('the guest process exits while its output still waits for a peer that reads late: the connection ends only after all of it', async () => {
    const { spawn, spawned } = spawner(1);
    const f = await forwardPort(spawn, 8004);
    const s = connect(f.port, f.host);
    try {
      await new Promise<void>((resolve, reject) => s.once('connect', () => resolve()).once('error', reject));
      s.pause();
      while (!spawned.length) await new Promise((r) => setTimeout(r, 5));
      const nc = spawned[0];
      // The guest server sends 32 MiB and closes: nc has written everything and exited, while
      // much of it still waits in the host's stream for the peer's socket to drain (loopback's
      // socket buffers take a few MiB of it first).
      const data = randomBytes(32 * MiB);
      for (let at = 0; at < data.length; at += 64 * KiB) nc.stdout.push(data.subarray(at, at + 64 * KiB));
      nc.finish(Buffer.alloc(0));
      await nc.exited;
      await new Promise((r) => setTimeout(r, 50));
      expect(nc.stdout.readableLength).toBeGreaterThan(0); // still waiting when the process had ended
      const got: Buffer[] = [];
      const ended = new Promise<void>((resolve) => s.on('end', () => resolve()));
      s.on('data', (d: Buffer) => got.push(d));
      s.resume();
      await ended;
      expect(Buffer.concat(got).length).toBe(data.length);
      expect(Buffer.concat(got).equals(data)).toBe(true);
    } finally {
      s.destroy();
      await f.close();
    }
  });

  /** A client that connects and says how its connection ended: 'end' (closed by the relay) or still 'open' after `waitMs`. */
  const probeConnection = (port: number, waitMs = 300) =>
    new Promise<{ socket: Socket; state: 'closed' | 'open'; bytes: number }>((resolve, reject) => {
      let bytes = 0;
      const socket = connect(port, '127.0.0.1');
      const timer = setTimeout(() => resolve({ socket, state: 'open', bytes }), waitMs);
      socket.on('data', (d: Buffer) => (bytes += d.length));
      socket.once('close', () => {
        clearTimeout(timer);
        resolve({ socket, state: 'closed', bytes });
      });
      socket.once('error', reject);
    });

  test('at most maxConnections per forward: one more is closed at once, before a byte or a guest process, and its slot comes back when one closes', async () => {
    const { spawn, spawned } = spawner(1);
    const refusals: string[] = [];
    const budget = new ConnectionBudget(256);
    const f = await forwardPort(spawn, 8005, { maxConnections: 2 }, { vmConnections: budget, onRefused: (m) => refusals.push(m) });
    const open: Socket[] = [];
    try {
      for (let i = 0; i < 2; i++) {
        const c = await probeConnection(f.port);
        expect(c.state).toBe('open');
        open.push(c.socket);
      }
      const third = await probeConnection(f.port);
      expect(third).toMatchObject({ state: 'closed', bytes: 0 });
      expect(spawned).toHaveLength(2);
      expect(f.connections()).toEqual({ open: 2, refused: 1 });
      expect(budget.inUse).toBe(2);
      expect(refusals).toHaveLength(1);
      expect(refusals[0]).toMatch(new RegExp(`forward 127\\.0\\.0\\.1:${f.port} to guest port 8005: a connection was closed at once, 2 connections of this forward are open \\(maxConnections\\)`));
      // One closes (its peer, then the guest's side): its slot is free again.
      open.shift()!.destroy();
      spawned[0].finish(Buffer.alloc(0));
      await new Promise((r) => setTimeout(r, 100));
      expect(budget.inUse).toBe(1);
      const again = await probeConnection(f.port);
      expect(again.state).toBe('open');
      open.push(again.socket);
      expect(spawned).toHaveLength(3);
    } finally {
      for (const s of open) s.destroy();
      await f.close();
    }
    await new Promise((r) => setTimeout(r, 100));
    expect(budget.inUse).toBe(0);
  });

  test("the VM's cap is shared by its forwards: past it, any forward closes a new connection at once", async () => {
    const { spawn, spawned } = spawner(1);
    const refusals: string[] = [];
    const limits = { vmConnections: new ConnectionBudget(3), onRefused: (m: string) => refusals.push(m) };
    const a = await forwardPort(spawn, 8006, {}, limits);
    const b = await forwardPort(spawn, 8007, {}, limits);
    const open: Socket[] = [];
    try {
      for (const port of [a.port, a.port, b.port]) {
        const c = await probeConnection(port);
        expect(c.state).toBe('open');
        open.push(c.socket);
      }
      for (const port of [a.port, b.port]) expect((await probeConnection(port)).state).toBe('closed');
      expect(spawned).toHaveLength(3);
      expect(refusals.map((m) => /the VM's forwards have 3 connections open/.test(m))).toEqual([true, true]);
      expect(a.connections()).toEqual({ open: 2, refused: 1 });
      expect(b.connections()).toEqual({ open: 1, refused: 1 });
    } finally {
      for (const s of open) s.destroy();
      await a.close();
      await b.close();
    }
  });

  test.each([0, -1, 1.5, 257, '4'])('maxConnections %p is refused before anything listens', async (bad) => {
    const { spawn } = spawner(1);
    await expect(forwardPort(spawn, 8008, { maxConnections: bad as number })).rejects.toThrow(InvalidOptionError);
  });
});
