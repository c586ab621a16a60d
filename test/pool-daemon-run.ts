// The page pool's daemon as tests run it: `pvisor-daemon serve --memory-pool`, which becomes the
// native daemon (native-prebuilds/helpers/pool_daemon.c), on a fresh socket, with clients that
// speak its protocol over real sockets.
import { spawn, type ChildProcess } from 'node:child_process';
import { readFileSync, readSync } from 'node:fs';
import { connect, type Socket } from 'node:net';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { PoolOp, type PageKey } from '../src/daemon/pool-protocol';
import { pageHashesOf } from '../src/native/crc32c';
import { PoolLink } from '../src/memory/pool-link';
import { encodeFrame, FrameDecoder, FrameType, type Frame } from '../src/protocol/frame';
import { decodeAnswers, encodeOffer, encodePut, encodeSettle, poolRequest } from './pool-wire';

export const daemonMain = join(__dirname, '..', 'src', 'cli', 'daemon-main.js');

export interface Daemon {
  process: ChildProcess;
  socket: string;
  stderr: () => string;
  exited: Promise<number | null>;
}

/** `pvisor-daemon serve --memory-pool` on `socket`; resolves once it listens. */
export async function startDaemon(socket: string, maxPool: string, extra: string[] = []): Promise<Daemon> {
  const p = spawn(process.execPath, [daemonMain, 'serve', '--memory-pool', '--socket', socket, '--max-pool', maxPool, ...extra], { stdio: ['ignore', 'ignore', 'pipe'] });
  let err = '';
  const exited = new Promise<number | null>((resolve) => p.once('exit', (code) => resolve(code)));
  await new Promise<void>((resolve, reject) => {
    p.stderr!.on('data', (b: Buffer) => {
      err += b.toString();
      if (/page pool of up to/.test(err)) resolve();
    });
    void exited.then((code) => reject(new Error(`pvisor-daemon exited with ${code}: ${err}`)));
  });
  return { process: p, socket, stderr: () => err, exited };
}

export async function stopDaemon(d: Daemon): Promise<number | null> {
  d.process.kill('SIGTERM');
  return d.exited;
}

/** A process's resident memory from /proc/PID/smaps_rollup, in bytes. */
export function residentOf(pid: number): { rssBytes: number; pssBytes: number } {
  const text = readFileSync(`/proc/${pid}/smaps_rollup`, 'utf8');
  const kb = (field: string) => Number(new RegExp(`^${field}:\\s+(\\d+) kB`, 'm').exec(text)![1]) * 1024;
  return { rssBytes: kb('Rss'), pssBytes: kb('Pss') };
}

export const page = (fill: number) => Buffer.alloc(4096, fill);
/** A page that starts with `text`, zeros after. */
export const textPage = (text: string) => {
  const b = Buffer.alloc(4096);
  b.write(text);
  return b;
};
export function keyOf(bytes: Buffer): PageKey {
  const k = new BigUint64Array(1);
  pageHashesOf(bytes, k);
  return { lo: Number(k[0] & 0xffffffffn), hi: Number(k[0] >> 32n) };
}
export const hello = (socket: string, scope: string, name = scope) => PoolLink.connect(socket, { scope, name }, 5000);
const answers = (p: Buffer, max: number) => decodeAnswers(p, max).map((a) => a.answer);
export const offer = async (l: PoolLink, keys: PageKey[]) => answers(await poolRequest(l, PoolOp.Offer, encodeOffer(keys.map((key, i) => ({ page: i, key }))), 5000), keys.length);
export const put = async (l: PoolLink, pages: Buffer[]) => answers(await poolRequest(l, PoolOp.Put, encodePut(pages.map((bytes, i) => ({ page: i, bytes }))), 5000), pages.length);
export const settle = (l: PoolLink, drop: number[]) => poolRequest(l, PoolOp.Settle, encodeSettle([], drop), 5000);
export function readPoolPage(fd: number, p: number): Buffer {
  const b = Buffer.alloc(4096);
  readSync(fd, b, 0, 4096, p * 4096);
  return b;
}

export const request = (op: number, payload: Buffer, id = 1) => encodeFrame({ type: FrameType.Request, id, op, payload });

/** Sends `bytes` on a fresh connection; resolves with the frames that came back once the daemon closes it. */
export function exchange(socket: string, bytes: Buffer[], timeoutMs = 10_000): Promise<{ frames: Frame[]; closed: boolean }> {
  return new Promise((resolve) => {
    const decoder = new FrameDecoder();
    const frames: Frame[] = [];
    const s = connect(socket, () => {
      for (const b of bytes) s.write(b);
    });
    s.on('data', (b: Buffer) => {
      try {
        frames.push(...decoder.push(b));
      } catch {
        // Not frames: the test looks at what came before.
      }
    });
    s.on('error', () => {});
    const timer = setTimeout(() => {
      s.destroy();
      resolve({ frames, closed: false });
    }, timeoutMs);
    s.on('close', () => {
      clearTimeout(timer);
      resolve({ frames, closed: true });
    });
  });
}

/** A connection that is open once the daemon has accepted it (or refused it: then `refused` says why). */
export async function openConnection(socket: string): Promise<{ socket: Socket; refused: Promise<string | undefined> }> {
  const s = connect(socket);
  s.on('error', () => {});
  const decoder = new FrameDecoder();
  const refused = new Promise<string | undefined>((resolve) => {
    s.on('data', (b: Buffer) => {
      for (const f of decoder.push(b)) if (f.type === FrameType.Error) resolve(f.payload.toString());
    });
    s.on('close', () => resolve(undefined));
  });
  await new Promise((r) => s.once('connect', r));
  return { socket: s, refused };
}

export async function until(what: string, ok: () => Promise<boolean> | boolean, ms = 20_000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!(await ok())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** Credentials a {@link PeerAs} connects with: its effective uid and gid, and its supplementary groups. */
export interface Credentials {
  uid: number;
  gid: number;
  groups: number[];
}

/**
 * A second process (test/pool-peer-as.ts, run as root) that connects to the daemon with whatever
 * credentials it is told, one connection at a time: the kernel records them at connect.
 */
export class PeerAs {
  private readonly child = spawn(process.execPath, [join(__dirname, 'pool-peer-as.js')], { stdio: ['pipe', 'pipe', 'inherit'] });
  private readonly lines = createInterface({ input: this.child.stdout! })[Symbol.asyncIterator]();
  readonly pid = this.child.pid!;
  readonly exited = new Promise<void>((resolve) => this.child.once('exit', () => resolve()));

  async ask<T = Record<string, unknown>>(m: object): Promise<T & { ok: boolean; error?: string }> {
    this.child.stdin!.write(`${JSON.stringify(m)}\n`);
    const next = await this.lines.next();
    if (next.done) throw new Error('the peer process ended');
    return JSON.parse(next.value as string) as T & { ok: boolean; error?: string };
  }

  /** Says Hello as `as` in `scope`; resolves with its handle, or the daemon's refusal. */
  hello(socket: string, as: Credentials, scope: string, name = scope): Promise<{ ok: boolean; error?: string; client?: number; clientId?: number }> {
    return this.ask({ op: 'hello', socket, as, scope, name });
  }

  end(): Promise<void> {
    this.child.stdin!.end();
    return this.exited;
  }
}
