// Streams under credit on the Linux guest, on real KVM (the nested harness on a kvm_pvm host), one
// VM for every case: a command's output nobody reads holds only that command (files.stat and exec
// answer within a second meanwhile, and the latency of an exec is measured against an exec with
// nothing held); vm.forward hands a peer all a guest process sent before it ends the connection;
// a forwarded peer that never reads holds only its own connection; a forward's connections are
// capped.
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { connect, type Socket } from 'node:net';
import { Vm } from '../../src';

const MiB = 2 ** 20;
const NESTED = process.env.PVISOR_NESTED === '1';
const SLOW = NESTED ? 10 : 1;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

/** How long `run` takes, in ms; a rejection is thrown with its time in the message. */
async function timed(run: () => Promise<unknown>): Promise<number> {
  const t0 = performance.now();
  try {
    await run();
  } catch (e) {
    (e as Error).message += ` (after ${(performance.now() - t0).toFixed(0)} ms)`;
    throw e;
  }
  return performance.now() - t0;
}

/** An HTTP response's head and body. */
function response(all: Buffer): { head: string; body: Buffer } {
  const at = all.indexOf('\r\n\r\n');
  return { head: all.subarray(0, Math.max(0, at)).toString('latin1'), body: at < 0 ? Buffer.alloc(0) : all.subarray(at + 4) };
}

/** An HTTP/1.0 GET through a forwarded port whose client reads nothing for `pauseMs`, then all. */
function getLate(port: number, path: string, pauseMs: number): Promise<{ head: string; body: Buffer }> {
  return new Promise((resolve, reject) => {
    const parts: Buffer[] = [];
    const s = connect(port, '127.0.0.1');
    s.on('data', (d: Buffer) => parts.push(d));
    s.on('end', () => resolve(response(Buffer.concat(parts))));
    s.on('error', reject);
    s.once('connect', () => {
      s.write(`GET ${path} HTTP/1.0\r\n\r\n`);
      s.pause();
      setTimeout(() => s.resume(), pauseMs);
    });
  });
}

/**
 * The same GET from a client that reads slowly through a small receive buffer (4 KiB, which Node
 * cannot set: a python3 client), so the host's socket to it fills within a few KiB instead of
 * the megabytes loopback buffers take, and what the guest sent waits on the host.
 */
const SLOW_CLIENT = `
import socket, sys, time
port, path, rate = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
s.connect(('127.0.0.1', port))
s.sendall(('GET %s HTTP/1.0\\r\\n\\r\\n' % path).encode())
while True:
    d = s.recv(4096)
    if not d:
        break
    sys.stdout.buffer.write(d)
    time.sleep(len(d) / rate)
`;
function getSlowly(port: number, path: string, bytesPerSecond: number): Promise<{ head: string; body: Buffer }> {
  return new Promise((resolve, reject) => {
    const parts: Buffer[] = [];
    const p = spawn('python3', ['-c', SLOW_CLIENT, String(port), path, String(bytesPerSecond)], { stdio: ['ignore', 'pipe', 'inherit'] });
    p.stdout.on('data', (d: Buffer) => parts.push(d));
    p.on('error', reject);
    p.on('close', (code) => (code === 0 ? resolve(response(Buffer.concat(parts))) : reject(new Error(`the python3 client exited with ${code}`))));
  });
}

/** Connects and says whether the relay closed the connection within `waitMs` (with no byte). */
function connection(port: number, waitMs: number): Promise<{ socket: Socket; closedAtOnce: boolean }> {
  return new Promise((resolve, reject) => {
    const socket = connect(port, '127.0.0.1');
    const timer = setTimeout(() => resolve({ socket, closedAtOnce: false }), waitMs);
    socket.once('close', () => {
      clearTimeout(timer);
      resolve({ socket, closedAtOnce: true });
    });
    socket.once('error', reject);
  });
}

describe('Linux guest: streams under credit', () => {
  let vm: Vm;
  const warnings: string[] = [];
  beforeAll(async () => {
    vm = await Vm.start({ memory: '256MiB', vcpus: 2, bootTimeoutMs: 180_000 });
    vm.on('warning', (m) => warnings.push(m));
    await vm.files.write('/tmp/www/blob', randomBytes(2 * MiB));
    await vm.files.write('/tmp/www/big', randomBytes(16 * MiB));
    expect((await vm.exec('httpd -p 127.0.0.1:8000 -h /tmp/www')).exitCode).toBe(0);
  }, 300_000);
  afterAll(() => vm?.stop());

  it('4 MiB nobody reads holds only its command: files.stat and exec each answer within 1 s meanwhile; an exec costs about what it costs with nothing held', async () => {
    // Warm up, then the latency of an exec with nothing held.
    for (let i = 0; i < 2; i++) await vm.exec('true');
    const free: number[] = [];
    for (let i = 0; i < 7; i++) free.push(await timed(() => vm.exec('true', { timeoutMs: 8000 * SLOW })));

    const unread = vm.spawn(['head', '-c', String(4 * MiB), '/dev/zero']);
    // Until the guest has sent its window and waits for credit (nothing more comes).
    let held = -1;
    for (let t = 0; t < 60 && unread.stdout.readableLength !== held; t++) {
      held = unread.stdout.readableLength;
      await sleep(500 * SLOW);
    }
    expect(held).toBeGreaterThan(0);
    expect(held).toBeLessThanOrEqual(256 * 1024);

    const statMs = await timed(async () => expect((await vm.files.stat('/etc/passwd', { timeoutMs: 8000 })).type).toBe('file'));
    const echoMs = await timed(async () => expect((await vm.exec('echo hi', { timeoutMs: 8000 })).stdout).toBe('hi\n'));
    const busy: number[] = [];
    for (let i = 0; i < 7; i++) busy.push(await timed(() => vm.exec('true', { timeoutMs: 8000 * SLOW })));
    console.log(
      `exec latency: nothing held ${median(free).toFixed(0)} ms (${free.map((x) => x.toFixed(0)).join(', ')}), ` +
        `4 MiB held unread ${median(busy).toFixed(0)} ms (${busy.map((x) => x.toFixed(0)).join(', ')}): ratio ${(median(busy) / median(free)).toFixed(2)}; ` +
        `files.stat ${statMs.toFixed(0)} ms, exec echo ${echoMs.toFixed(0)} ms; ${held} bytes held`,
    );
    expect(statMs).toBeLessThan(1000);
    expect(echoMs).toBeLessThan(1000);
    expect(unread.stdout.readableLength).toBe(held); // still held: the command waits in write()

    // Read at last, it all comes, and the command ends.
    let total = 0;
    unread.stdout.on('data', (b: Buffer) => (total += b.length));
    expect(await unread.exited).toEqual({ exitCode: 0, signal: null });
    expect(total).toBe(4 * MiB);
  }, 300_000);

  it('vm.forward: a 2 MiB file served by a guest process reaches a peer that reads late, or slowly, whole, then the connection ends', async () => {
    const f = await vm.forward(8000);
    try {
      const blob = await vm.files.read('/tmp/www/blob');
      // Slowly: the guest's server has sent all and nc has exited while much of it still waits
      // on the host for the peer.
      const ways = { now: () => getLate(f.port, '/blob', 0), late: () => getLate(f.port, '/blob', 3000 * SLOW), slowly: () => getSlowly(f.port, '/blob', 256 * 1024) };
      for (const [way, get] of Object.entries(ways)) {
        const { head, body } = await get();
        expect({ way, head: head.split('\r\n')[0], bytes: body.length }).toEqual({ way, head: expect.stringMatching(/^HTTP\/1\.[01] 200 OK/), bytes: 2 * MiB });
        expect(body.equals(blob)).toBe(true);
      }
    } finally {
      await f.close();
    }
  }, 300_000);

  it('a forwarded peer that never reads holds only its connection: exec answers meanwhile', async () => {
    const f = await vm.forward(8000);
    const s = connect(f.port, '127.0.0.1');
    try {
      await new Promise<void>((resolve, reject) => s.once('connect', () => resolve()).once('error', reject));
      s.write('GET /big HTTP/1.0\r\n\r\n');
      s.pause(); // never reads the 16 MiB
      await sleep(3000 * SLOW);
      const echoMs = await timed(async () => expect((await vm.exec('echo hi', { timeoutMs: 8000 })).stdout).toBe('hi\n'));
      console.log(`a forwarded peer that never reads: exec echo ${echoMs.toFixed(0)} ms`);
      expect(echoMs).toBeLessThan(1000 * (NESTED ? 2 : 1));
    } finally {
      s.destroy();
      await f.close();
    }
  }, 300_000);

  it('a forward with maxConnections 3: the 4th and 5th connections are closed at once, with no guest process, each said in a warning', async () => {
    const f = await vm.forward(8000, { maxConnections: 3 });
    const open: Socket[] = [];
    warnings.length = 0;
    try {
      for (let i = 0; i < 3; i++) {
        const c = await connection(f.port, 1000 * SLOW);
        expect(c.closedAtOnce).toBe(false);
        open.push(c.socket);
      }
      for (let i = 0; i < 2; i++) expect((await connection(f.port, 1000 * SLOW)).closedAtOnce).toBe(true);
      expect(f.connections()).toEqual({ open: 3, refused: 2 });
      const nc = (await vm.exec('ps')).stdout.split('\n').filter((l) => / nc 127\.0\.0\.1 8000$/.test(l));
      expect(nc).toHaveLength(3);
      expect(warnings.filter((w) => /a connection was closed at once, 3 connections of this forward are open \(maxConnections\)/.test(w))).toHaveLength(2);
    } finally {
      for (const s of open) s.destroy();
      await f.close();
    }
  }, 300_000);
});
