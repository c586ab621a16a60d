// Streams over the control socket (src/control-stream.ts, src/control-stream-client.ts), over real
// Unix sockets without KVM: the VM side is a session of plain Readables and a collecting input,
// which is all the stream code sees of a guest process or file. Includes hostile clients: one
// that never reads, one that grants without reading, one that sends beyond its credit or garbage.
import { mkdtempSync, rmSync } from 'node:fs';
import { createConnection, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { ControlServer, controlRequest, errorFromPayload, errorPayload, MAX_OPEN_STREAMS, parseRequest, type ControlHandler, type ControlStreamRequest } from '../../src/control-socket';
import { MAX_PENDING_STREAM_REQUESTS, MAX_UNSENT_STREAM_BYTES, serveStream, StreamChannel, type StreamSession } from '../../src/control-stream';
import { ControlStream } from '../../src/control-stream-client';
import { CommandNotFoundError, GuestRequestError, InvalidOptionError, OutputLimitError, PvisorError, TimeoutError } from '../../src/errors';
import { encodeFrame, FrameDecoder, FrameType } from '../../src/protocol/frame';
import { STREAM_WINDOW_BYTES } from '../../src/protocol/stream-window';

const KiB = 1024;
const MiB = 1024 * KiB;
const vm = { id: 'T', pid: process.pid, state: 'running' as const, guest: 'linux' as const, memoryBytes: 2 ** 26, vcpus: 1, labels: {} };
const status: ControlHandler = async () => ({ response: { ok: true, vm } });

/** A source of `totalBytes` bytes (byte i is i mod 251) that counts what it has produced. */
function source(totalBytes: number): Readable & { produced: number } {
  let produced = 0;
  const r = new Readable({
    highWaterMark: 16 * KiB,
    read(size) {
      if (produced >= totalBytes) return void this.push(null);
      const n = Math.min(size, 16 * KiB, totalBytes - produced);
      const b = Buffer.alloc(n);
      for (let i = 0; i < n; i++) b[i] = (produced + i) % 251;
      produced += n;
      this.push(b);
    },
  }) as Readable & { produced: number };
  Object.defineProperty(r, 'produced', { get: () => produced });
  return r;
}

function pattern(b: Buffer): boolean {
  for (let i = 0; i < b.length; i++) if (b[i] !== i % 251) return false;
  return true;
}

const settle = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe('control socket streams', () => {
  let dir: string;
  let server: ControlServer | undefined;
  let path: string;
  let sessions: { request: ControlStreamRequest; session: StreamSession; aborted: string[]; input: Buffer[] }[];
  /** What a test's session is made of. */
  let make: (request: ControlStreamRequest) => Omit<StreamSession, 'abort'>;

  beforeEach(async () => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-stream-'));
    path = join(dir, 'T.sock');
    sessions = [];
    server = await ControlServer.listen(path, 'T', status, (request, conn, leftover) => {
      const aborted: string[] = [];
      const session: StreamSession = { ...make(request), abort: (why) => aborted.push(why) };
      sessions.push({ request, session, aborted, input: [] });
      conn.write(`${JSON.stringify({ v: 1, ok: true, vm, pid: 42 })}\n`);
      serveStream(conn, leftover, session, errorPayload);
    });
  });
  afterEach(() => {
    server?.close();
    rmSync(dir, { recursive: true, force: true });
  });

  it('streams stdout and stderr to their end, and the result after them', async () => {
    const out = source(3 * MiB + 17);
    const err = source(100 * KiB);
    make = () => ({ outputs: { [StreamChannel.Stdout]: out, [StreamChannel.Stderr]: err }, result: Promise.resolve({ exitCode: 3, signal: null }) });
    const s = new ControlStream(path, 'T', { op: 'spawn', command: 'x', stdin: false }, [StreamChannel.Stdout, StreamChannel.Stderr], 5000);
    expect((await s.answered).pid).toBe(42);
    const read = async (r: Readable) => Buffer.concat(await r.toArray());
    const [o, e] = await Promise.all([read(s.output(StreamChannel.Stdout)), read(s.output(StreamChannel.Stderr))]);
    expect(o.length).toBe(3 * MiB + 17);
    expect(pattern(o)).toBe(true);
    expect(e.length).toBe(100 * KiB);
    expect(await s.result).toEqual({ exitCode: 3, signal: null });
  });

  it('a channel nobody reads holds only itself: the source stops a window ahead, the other channel and other requests go on', async () => {
    const out = source(16 * MiB);
    const err = source(2 * MiB);
    make = () => ({ outputs: { [StreamChannel.Stdout]: out, [StreamChannel.Stderr]: err }, result: new Promise(() => {}) });
    const s = new ControlStream(path, 'T', { op: 'spawn', command: 'x', stdin: false }, [StreamChannel.Stdout, StreamChannel.Stderr], 5000);
    await s.answered;
    // stderr is read to its end while stdout is never read.
    const e = Buffer.concat(await s.output(StreamChannel.Stderr).toArray());
    expect(e.length).toBe(2 * MiB);
    await settle(200);
    // What left the source: the client's window, and the source's own buffer (its high-water mark).
    expect(out.produced).toBeLessThanOrEqual(STREAM_WINDOW_BYTES + 32 * KiB);
    expect(s.output(StreamChannel.Stdout).readableLength).toBeLessThanOrEqual(STREAM_WINDOW_BYTES);
    // Another client is answered at once.
    const t0 = performance.now();
    expect((await controlRequest(path, 'T', { op: 'status' }, 2000)).ok).toBe(true);
    expect(performance.now() - t0).toBeLessThan(1000);
    // Reading it now takes it all, in order.
    const first = await new Promise<Buffer>((resolve) => s.output(StreamChannel.Stdout).once('data', resolve));
    expect(pattern(first)).toBe(true);
    s.destroy(new PvisorError('TEST', 'done'));
    await settle(100);
    expect(sessions[0].aborted).toEqual(['the client closed the connection']);
  });

  it('a raw client that grants credit but never reads the socket holds at most the unsent bound and the kernel buffers', async () => {
    const out = source(64 * MiB);
    make = () => ({ outputs: { [StreamChannel.Stdout]: out }, result: new Promise(() => {}) });
    const conn = await connect();
    conn.write(`${JSON.stringify({ v: 1, op: 'files.readStream', path: '/x' })}\n`);
    // 4 GiB of credit, never a byte read back.
    for (let i = 0; i < 1000; i++) conn.write(encodeFrame({ type: FrameType.Credit, id: 0, op: StreamChannel.Stdout, payload: u32(0xffffffff) }));
    conn.pause();
    await settle(500);
    const first = out.produced;
    await settle(500);
    // Stopped, not trickling: the server took nothing more once the socket was full.
    expect(out.produced).toBe(first);
    expect(first).toBeLessThan(8 * MiB);
    expect(first).toBeGreaterThan(MAX_UNSENT_STREAM_BYTES);
    // And others are answered.
    expect((await controlRequest(path, 'T', { op: 'status' }, 2000)).ok).toBe(true);
    conn.destroy();
  });

  it('input goes within its credit, in order, and its end after all of it', async () => {
    const taken: Buffer[] = [];
    let heldMax = 0;
    let held = 0;
    let ended = false;
    make = () => ({
      outputs: {},
      input: {
        // A slow writer: the client must wait for credit, never send beyond it.
        write: async (b) => {
          held += b.length;
          heldMax = Math.max(heldMax, held);
          await settle(2);
          held -= b.length;
          taken.push(b);
        },
        end: async () => void (ended = true),
      },
      result: new Promise((resolve) => setTimeout(() => resolve({ bytes: 1 }), 10)).then(async (v) => {
        while (!ended) await settle(5);
        return v;
      }),
    });
    const s = new ControlStream(path, 'T', { op: 'files.writeStream', path: '/f' }, [], 5000);
    const big = Buffer.alloc(2 * MiB + 3);
    for (let i = 0; i < big.length; i++) big[i] = i % 251;
    await s.write(big);
    await s.endInput();
    expect(ended).toBe(true);
    const all = Buffer.concat(taken);
    expect(all.length).toBe(big.length);
    expect(pattern(all)).toBe(true);
    expect(heldMax).toBeLessThanOrEqual(STREAM_WINDOW_BYTES);
    expect(await s.result).toEqual({ bytes: 1 });
  });

  it.each([
    ['input beyond its credit', () => [encodeFrame({ type: FrameType.StreamChunk, id: 0, op: StreamChannel.Input, payload: Buffer.alloc(STREAM_WINDOW_BYTES + 1) })], /beyond its credit/],
    ['data on an output channel', () => [encodeFrame({ type: FrameType.StreamChunk, id: 0, op: StreamChannel.Stdout, payload: Buffer.alloc(1) })], /channel 1/],
    ['credit for a channel that does not exist', () => [encodeFrame({ type: FrameType.Credit, id: 0, op: 7, payload: u32(1) })], /channel 7/],
    ['a short credit frame', () => [encodeFrame({ type: FrameType.Credit, id: 0, op: StreamChannel.Stdout, payload: Buffer.alloc(2) })], /2 bytes/],
    ['a signal out of range', () => [encodeFrame({ type: FrameType.Request, id: 1, op: 2, payload: u32(999) })], /signal 999/],
    ['too many requests', () => Array.from({ length: MAX_PENDING_STREAM_REQUESTS + 1 }, (_, i) => encodeFrame({ type: FrameType.Request, id: i + 1, op: 2, payload: u32(9) })), /requests waiting/],
    ['an unknown frame type', () => [encodeFrame({ type: 9 as FrameType, id: 0, op: 0, payload: Buffer.alloc(0) })], /type 9/],
    ['garbage', () => [Buffer.from('GET / HTTP/1.1\r\n\r\n')], /bad frames/],
  ])('a client that sends %s is cut off, told why, and its stream stopped', async (_what, frames, why) => {
    const out = source(1 * MiB);
    make = () => ({
      outputs: { [StreamChannel.Stdout]: out },
      input: { write: async () => {}, end: async () => {} },
      // Never answers: only the many-requests case gets past the limit.
      signal: () => new Promise(() => {}),
      result: new Promise(() => {}),
    });
    const conn = await connect();
    conn.write(`${JSON.stringify({ v: 1, op: 'spawn', command: 'x', stdin: true })}\n`);
    for (const f of frames()) conn.write(f);
    const got = await readAll(conn);
    const nl = got.indexOf(0x0a);
    expect(JSON.parse(got.subarray(0, nl).toString())).toMatchObject({ ok: true });
    const decoded = new FrameDecoder().push(got.subarray(nl + 1));
    const last = decoded[decoded.length - 1];
    expect(last.type).toBe(FrameType.Error);
    expect(JSON.parse(last.payload.toString())).toMatchObject({ code: 'PVISOR_CONTROL_PROTOCOL', message: expect.stringMatching(why) });
    expect(sessions[0].aborted).toEqual([expect.stringMatching(why)]);
  });

  it('a stream request must be the first of its connection', async () => {
    make = () => ({ outputs: {}, result: Promise.resolve(null) });
    const conn = await connect();
    conn.write(`${JSON.stringify({ v: 1, op: 'status' })}\n${JSON.stringify({ v: 1, op: 'watch' })}\n`);
    const lines = (await readAll(conn)).toString().trim().split('\n').map((l) => JSON.parse(l) as { ok: boolean; error?: { message: string } });
    expect(lines[0].ok).toBe(true);
    expect(lines[1]).toMatchObject({ ok: false, error: { message: expect.stringMatching(/watch must be the first request/) } });
    expect(sessions).toHaveLength(0);
  });

  it(`at most ${MAX_OPEN_STREAMS} streams are open at once; one more is refused, and taken once one has closed`, async () => {
    make = () => ({ outputs: {}, result: new Promise(() => {}) });
    const open: Socket[] = [];
    for (let i = 0; i < MAX_OPEN_STREAMS; i++) {
      const c = await connect();
      c.write(`${JSON.stringify({ v: 1, op: 'watch' })}\n`);
      open.push(c);
    }
    while (sessions.length < MAX_OPEN_STREAMS) await settle(10);
    const extra = await connect();
    extra.write(`${JSON.stringify({ v: 1, op: 'watch' })}\n`);
    expect(JSON.parse((await readAll(extra)).toString())).toMatchObject({ ok: false, error: { message: expect.stringMatching(/streams of this VM are open/) } });
    open.pop()!.destroy();
    await settle(100);
    const next = await connect();
    next.write(`${JSON.stringify({ v: 1, op: 'watch' })}\n`);
    while (sessions.length < MAX_OPEN_STREAMS + 1) await settle(10);
    for (const c of [...open, next]) c.destroy();
  });

  it('a failed stream ends with its typed error, the outputs closed', async () => {
    make = () => ({ outputs: { [StreamChannel.Stdout]: source(10) }, result: Promise.reject(new TimeoutError('command did not finish within 5 ms; it was killed')) });
    const s = new ControlStream(path, 'T', { op: 'spawn', command: 'x', stdin: false }, [StreamChannel.Stdout], 5000);
    await expect(s.result).rejects.toThrow(TimeoutError);
    expect(s.output(StreamChannel.Stdout).destroyed).toBe(true);
  });

  function connect(): Promise<Socket> {
    return new Promise((resolve, reject) => {
      const c = createConnection(path);
      c.once('connect', () => resolve(c));
      c.once('error', reject);
    });
  }
});

describe('control stream requests', () => {
  it('parses the stream and files requests and refuses malformed ones with a typed error', () => {
    expect(parseRequest('{"v":1,"op":"spawn","command":["ls","-l"],"env":{"A":"1"},"cwd":"/tmp","stdin":true,"timeoutMs":500}')).toEqual({ op: 'spawn', command: ['ls', '-l'], env: { A: '1' }, cwd: '/tmp', stdin: true, timeoutMs: 500 });
    expect(parseRequest('{"v":1,"op":"spawn","command":"echo hi"}')).toEqual({ op: 'spawn', command: 'echo hi', stdin: false });
    expect(parseRequest('{"v":1,"op":"files","call":"stat","path":"/x","followSymlinks":true}')).toEqual({ op: 'files', call: 'stat', path: '/x', followSymlinks: true });
    expect(parseRequest('{"v":1,"op":"files","call":"rename","path":"/a","to":"/b"}')).toEqual({ op: 'files', call: 'rename', path: '/a', to: '/b' });
    expect(parseRequest('{"v":1,"op":"files.writeStream","path":"/f","mode":384}')).toEqual({ op: 'files.writeStream', path: '/f', mode: 384 });
    expect(parseRequest('{"v":1,"op":"watch","junk":1}')).toEqual({ op: 'watch' });
    for (const bad of [
      '{"v":1,"op":"spawn","command":[]}',
      '{"v":1,"op":"spawn","command":"x","env":{"A":1}}',
      '{"v":1,"op":"spawn","command":"x","env":["A=1"]}',
      '{"v":1,"op":"spawn","command":"x","stdin":"yes"}',
      '{"v":1,"op":"spawn","command":"x","cwd":7}',
      '{"v":1,"op":"spawn","command":"x","timeoutMs":1.5}',
      '{"v":1,"op":"spawn","command":"x","timeoutMs":1e12}',
      '{"v":1,"op":"files","call":"chmod","path":"/x"}',
      '{"v":1,"op":"files","call":"stat"}',
      `{"v":1,"op":"files","call":"stat","path":"${'a'.repeat(5000)}"}`,
      '{"v":1,"op":"files","call":"rename","path":"/a"}',
      '{"v":1,"op":"files","call":"mkdir","path":"/a","mode":"0755"}',
      '{"v":1,"op":"files.readStream","path":""}',
      '{"v":1,"op":"files.writeStream","path":"/f","mode":null}',
    ]) {
      expect(() => parseRequest(bad)).toThrow(InvalidOptionError);
    }
  });

  it('errors travel with their class and fields', () => {
    const guest = new GuestRequestError(2, "files.read('/nope'): ENOENT", { op: 0x210, call: "files.read('/nope')", errno: 'ENOENT' });
    const back = errorFromPayload(JSON.parse(JSON.stringify(errorPayload(guest))));
    expect(back).toBeInstanceOf(GuestRequestError);
    expect(back).toMatchObject({ message: guest.message, errno: 'ENOENT', call: "files.read('/nope')", op: 0x210, guestCode: 2 });
    const missing = errorFromPayload(JSON.parse(JSON.stringify(errorPayload(new CommandNotFoundError('nosuch', guest)))));
    expect(missing).toBeInstanceOf(CommandNotFoundError);
    expect(missing).toMatchObject({ command: 'nosuch', exitCode: 127, errno: 'ENOENT' });
    expect(errorFromPayload(errorPayload(new OutputLimitError(5, 'too much')))).toMatchObject({ limitBytes: 5, message: 'too much' });
    const option = errorFromPayload(errorPayload(new InvalidOptionError('cwd', 'bad')));
    expect(option).toBeInstanceOf(InvalidOptionError);
    expect(option).toMatchObject({ option: 'cwd', message: 'cwd: bad' });
    // Junk from a peer is bounded, never a throw.
    expect(errorFromPayload({ code: 'X'.repeat(1000), message: 'y'.repeat(10_000), guestCode: 'z' as unknown as number })).toBeInstanceOf(PvisorError);
    expect(errorFromPayload({ code: 'PVISOR_GUEST_REQUEST', message: 'm', guestCode: 1.5, call: 7 as unknown as string })).toMatchObject({ guestCode: 0, call: undefined });
  });
});

function u32(n: number): Buffer {
  const b = Buffer.alloc(4);
  b.writeUInt32LE(n >>> 0, 0);
  return b;
}

/** Everything the server sends until it closes the connection (at most 5 s). */
function readAll(conn: Socket): Promise<Buffer> {
  return new Promise((resolve) => {
    const parts: Buffer[] = [];
    const timer = setTimeout(() => (conn.destroy(), resolve(Buffer.concat(parts))), 5000);
    conn.on('data', (b: Buffer) => parts.push(b));
    conn.on('error', () => {});
    conn.on('close', () => {
      clearTimeout(timer);
      resolve(Buffer.concat(parts));
    });
  });
}
