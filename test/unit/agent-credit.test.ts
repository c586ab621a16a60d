// Stream credit end to end, without a VM: the real agent (agent.c, built here under ASan and
// UBSan, run on this host over a socketpair: ../host-agent.ts) serving the real AgentClient and
// LinuxGuest, real processes and files. One output stream is never read; every other stream and
// request goes on and completes whole within its timeout, and the host holds at most a window of
// the unread one. Skipped, saying so, without a C compiler.
import { randomBytes } from 'node:crypto';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { Readable } from 'node:stream';
import { STREAM_WINDOW_BYTES } from '../../src/protocol/stream-window';
import { property, type Rng } from '../fuzz-seed';
import { buildAgent, findCompiler, startHostAgent, type HostAgent } from '../host-agent';

const KiB = 1024;
const MiB = 1024 * KiB;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

const compiler = findCompiler();
if (!compiler) console.log('agent credit: SKIPPED, no C compiler found ($CC, gcc, clang or cc): the agent was not run on the host');
const describeWithCompiler = compiler ? describe : describe.skip;

/** Reads a stream to its end like a slow consumer: a random pause now and then. */
async function readSlowly(rng: Rng, s: Readable): Promise<Buffer> {
  const parts: Buffer[] = [];
  const pauses = rng.chance(0.5);
  for await (const chunk of s) {
    parts.push(chunk as Buffer);
    if (pauses && rng.chance(0.2)) await sleep(rng.int(5));
  }
  return Buffer.concat(parts);
}

/** `promise`, or a rejection naming `what` after `ms`: each operation's own deadline. */
function within<T>(what: string, ms: number, promise: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout;
  return Promise.race([
    promise.finally(() => clearTimeout(timer)),
    new Promise<T>((_, reject) => (timer = setTimeout(() => reject(new Error(`${what} did not complete within ${ms} ms`)), ms))),
  ]);
}

describeWithCompiler("stream credit with the real agent on the host", () => {
  let built: ReturnType<typeof buildAgent>;
  let work: string;
  let agent: HostAgent | undefined;
  beforeAll(() => {
    built = buildAgent(compiler!);
    work = mkdtempSync(join(tmpdir(), 'pvisor-credit-'));
  }, 120_000);
  afterEach(async () => {
    await agent?.stop();
    agent = undefined;
  });
  afterAll(() => {
    built?.remove();
    rmSync(work, { recursive: true, force: true });
  });

  property('one stream never read holds only itself: every other stream and request completes whole within its timeout, the host holding at most a window of it', 4, async (rng, run) => {
    // One agent per run, ended with it (afterEach ends the one of a run that failed).
    agent = await startHostAgent(built.bin);
    const { linux, client } = agent;
    const dir = join(work, `run-${run}`);
    mkdirSync(join(dir, 'many'), { recursive: true });
    const files = Array.from({ length: rng.between(2, 4) }, (_, i) => {
      const data = rng.bytes(rng.size(2 * MiB));
      const path = join(dir, `f${i}`);
      writeFileSync(path, data);
      return { path, data };
    });
    const entries = rng.between(0, 3000);
    for (let i = 0; i < entries; i++) writeFileSync(join(dir, 'many', `entry-${i}-${'x'.repeat(rng.int(200))}`), '');
    const big = join(dir, 'big');
    writeFileSync(big, randomBytes(4 * MiB));

    // The stream nobody reads: a command's stdout or stderr, or a file read as a stream.
    const kind = rng.pick(['stdout', 'stderr', 'readStream'] as const);
    const unreadProcess = kind === 'readStream' ? undefined : linux.spawn(kind === 'stdout' ? ['cat', big] : ['sh', '-c', `cat ${big} >&2`]);
    const unread = unreadProcess ? (kind === 'stdout' ? unreadProcess.stdout : unreadProcess.stderr) : linux.files.readStream(big);
    if (unreadProcess) (kind === 'stdout' ? unreadProcess.stderr : unreadProcess.stdout).resume();
    // Until it has used up its window.
    for (let t = 0; unread.readableLength < STREAM_WINDOW_BYTES - 64 * KiB && t < 500; t++) await sleep(10);

    const TIMEOUT_MS = 20_000;
    const ops: Promise<void>[] = [];
    for (let n = rng.between(3, 7); n > 0; n--) {
      const f = rng.pick(files);
      const which = rng.int(6);
      const op = async (): Promise<void> => {
        if (which === 0) {
          const r = await linux.exec(['base64', f.path], { timeoutMs: TIMEOUT_MS, maxBuffer: Infinity });
          expect(r.exitCode).toBe(0);
          expect(Buffer.from(r.stdout.replace(/\n/g, ''), 'base64').equals(f.data)).toBe(true);
        } else if (which === 1) {
          const p = linux.spawn(rng.chance(0.5) ? ['cat', f.path] : ['sh', '-c', `cat ${f.path} >&2`], { timeoutMs: TIMEOUT_MS });
          const [out, err] = await Promise.all([readSlowly(rng, p.stdout), readSlowly(rng, p.stderr)]);
          expect(Buffer.concat([out, err]).equals(f.data)).toBe(true);
          expect(await p.exited).toEqual({ exitCode: 0, signal: null });
        } else if (which === 2) {
          expect((await linux.files.read(f.path, { timeoutMs: TIMEOUT_MS })).equals(f.data)).toBe(true);
        } else if (which === 3) {
          expect((await readSlowly(rng, linux.files.readStream(f.path, { timeoutMs: TIMEOUT_MS }))).equals(f.data)).toBe(true);
        } else if (which === 4) {
          expect(await linux.files.list(join(dir, 'many'), { timeoutMs: TIMEOUT_MS })).toHaveLength(entries);
        } else {
          expect((await linux.files.stat(f.path, { timeoutMs: TIMEOUT_MS })).size).toBe(f.data.length);
        }
      };
      ops.push(within(`operation ${which} on ${f.data.length} bytes`, TIMEOUT_MS, sleep(rng.int(50)).then(op)));
    }
    // A request that is answered at once by the agent keeps that latency meanwhile.
    const t0 = performance.now();
    await within('a stat while the stream is held', 2000, linux.files.stat(big, { timeoutMs: 2000 }));
    const statMs = performance.now() - t0;
    await Promise.all(ops);

    // The unread stream got its window, no more; the writer waits in the guest (here: its pipe).
    expect(unread.readableLength).toBeLessThanOrEqual(STREAM_WINDOW_BYTES);
    expect(unread.readableLength).toBeGreaterThan(STREAM_WINDOW_BYTES / 2);
    expect(agent.warnings).toEqual([]);
    // Destroyed, its writer runs to its end: what comes is granted back and dropped.
    const closed = new Promise((r) => unread.once('close', r));
    unread.destroy();
    await closed;
    if (unreadProcess) expect(await within('the unread command', TIMEOUT_MS, unreadProcess.exited)).toEqual({ exitCode: 0, signal: null });
    expect(client.heldBytes(1, 1)).toBe(0);
    expect(statMs).toBeLessThan(2000);
    await agent.stop();
    agent = undefined;
  }, 180_000);

  it('read(size) of more than a window widens the window to it: 1 MiB reads of a 3 MiB stdout each get their megabyte', async () => {
    agent = await startHostAgent(built.bin);
    const p = agent.linux.spawn(['head', '-c', String(3 * MiB), '/dev/zero']);
    const sizes = await new Promise<number[]>((resolve) => {
      const got: number[] = [];
      p.stdout.on('readable', () => {
        for (let chunk; (chunk = p.stdout.read(MiB) as Buffer | null) !== null; ) got.push(chunk.length);
        if (got.length === 3) resolve(got);
      });
    });
    expect(sizes).toEqual([MiB, MiB, MiB]);
    p.stdout.resume();
    expect(await p.exited).toEqual({ exitCode: 0, signal: null });
    expect(agent.warnings).toEqual([]);
  }, 60_000);

  it('a listing, a read and a command each complete under a window smaller than their size, in order and whole', async () => {
    agent = await startHostAgent(built.bin);
    const dir = join(work, 'whole');
    mkdirSync(join(dir, 'many'), { recursive: true });
    for (let i = 0; i < 5000; i++) writeFileSync(join(dir, 'many', `n${i}-${'y'.repeat(100)}`), '');
    const data = randomBytes(3 * MiB);
    writeFileSync(join(dir, 'f'), data);
    // 5000 entries of ~130 bytes: about 2.5 windows of listing.
    expect(await agent.linux.files.list(join(dir, 'many'))).toHaveLength(5000);
    expect((await agent.linux.files.read(join(dir, 'f'))).equals(data)).toBe(true);
    const r = await agent.linux.exec(['sh', '-c', `cat ${join(dir, 'f')} | od -An -tx1 -v | tr -d ' \\n' | head -c 64`]);
    expect(r.stdout).toBe(data.subarray(0, 32).toString('hex'));
    expect(agent.warnings).toEqual([]);
  }, 60_000);
});
