// A page pool client process for the daemon's tests that connects with whatever credentials it is
// told: run as root, it takes the effective uid, gid and supplementary groups it is given for
// each connect (which is when the kernel records them for SO_PEERCRED and SO_PEERGROUPS), then
// takes root's back. Driven by JSON lines on stdin ({op, ...}), each answered by one JSON line.
import { closeSync, readSync, writeSync } from 'node:fs';
import { createInterface } from 'node:readline';
import { PoolOp } from '../src/daemon/pool-protocol';
import { PoolLink } from '../src/memory/pool-link';
import { encodeFrame, FrameDecoder, FrameType } from '../src/protocol/frame';
import { closeFd } from '../src/sys/libc';
import { connectUnixSocket, receiveWithFd } from '../src/sys/unix-socket';
import { keyOf, textPage, type Credentials } from './pool-daemon-run';
import { decodeAnswers, encodeOffer, encodePut, poolRequest } from './pool-wire';

const rootGroups = process.getgroups!();
const links = new Map<number, PoolLink>();
const sockets = new Map<number, number>();
let handles = 0;

/** Runs `f` (which must connect synchronously) with credentials `as`, then takes root's back. */
function as<T>(creds: Credentials, f: () => T): T {
  process.setgroups!(creds.groups);
  process.setegid!(creds.gid);
  process.seteuid!(creds.uid);
  try {
    return f();
  } finally {
    process.seteuid!(0);
    process.setegid!(0);
    process.setgroups!(rootGroups);
  }
}

/** The first frame that comes on `fd`, or undefined if none within `ms` (or the peer closed first). */
async function firstFrame(fd: number, ms: number) {
  const decoder = new FrameDecoder();
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    const got = receiveWithFd(fd);
    if (got?.fd !== undefined) closeFd(got.fd);
    if (got && got.data.length === 0) return undefined;
    const [f] = got ? decoder.push(got.data) : [];
    if (f) return f;
    await new Promise((r) => setTimeout(r, 5));
  }
  return undefined;
}

const link = (m: { [k: string]: unknown }) => {
  const l = links.get(m.client as number);
  if (!l) throw new Error(`no client ${String(m.client)}`);
  return l;
};

async function handle(m: { op: string; [k: string]: unknown }): Promise<object> {
  switch (m.op) {
    case 'hello': {
      const pending = as(m.as as Credentials, () => PoolLink.connect(m.socket as string, { scope: m.scope as string, name: m.name as string }, 5000));
      const l = await pending;
      links.set(++handles, l);
      return { client: handles, clientId: l.clientId };
    }
    case 'put': {
      const l = link(m);
      const p = await poolRequest(l, PoolOp.Put, encodePut([{ page: 0, bytes: textPage(m.text as string) }]), 5000);
      return { page: decodeAnswers(p, 1)[0].answer };
    }
    case 'offer': {
      const l = link(m);
      const p = await poolRequest(l, PoolOp.Offer, encodeOffer([{ page: 0, key: keyOf(textPage(m.text as string)) }]), 5000);
      return { answer: decodeAnswers(p, 1)[0].answer };
    }
    case 'read': {
      const b = Buffer.alloc(4096);
      readSync(link(m).poolFd, b, 0, 4096, (m.page as number) * 4096);
      return { text: b.subarray(0, b.indexOf(0) < 0 ? 4096 : b.indexOf(0)).toString('latin1') };
    }
    case 'close': {
      const l = link(m);
      l.close();
      closeSync(l.poolFd);
      links.delete(m.client as number);
      return {};
    }
    case 'status': {
      const fd = as(m.as as Credentials, () => connectUnixSocket(m.socket as string));
      try {
        writeSync(fd, encodeFrame({ type: FrameType.Request, id: 1, op: PoolOp.Status, payload: Buffer.alloc(0) }));
        const f = await firstFrame(fd, 5000);
        if (!f) throw new Error('no answer to Status');
        if (f.type === FrameType.Error) throw new Error(f.payload.toString());
        return { status: JSON.parse(f.payload.toString()) };
      } finally {
        closeFd(fd);
      }
    }
    case 'connect': {
      // A bare connection, held open: to fill the daemon's connection caps.
      const fd = as(m.as as Credentials, () => connectUnixSocket(m.socket as string));
      sockets.set(++handles, fd);
      return { conn: handles };
    }
    case 'refusal': {
      // What the daemon said on a bare connection within `ms`: its Error frame, or nothing.
      const f = await firstFrame(sockets.get(m.conn as number)!, m.ms as number);
      return { refusal: f?.type === FrameType.Error ? f.payload.toString() : undefined };
    }
    case 'disconnect': {
      closeFd(sockets.get(m.conn as number)!);
      sockets.delete(m.conn as number);
      return {};
    }
    default:
      throw new Error(`unknown op ${m.op}`);
  }
}

// One request at a time, in order: credentials are the process's, so connects must not interleave.
let chain = Promise.resolve();
const lines = createInterface({ input: process.stdin });
lines.on('line', (line) => {
  chain = chain.then(() =>
    handle(JSON.parse(line)).then(
      (r) => void process.stdout.write(`${JSON.stringify({ ok: true, ...r })}\n`),
      (e: Error) => void process.stdout.write(`${JSON.stringify({ ok: false, error: e.message })}\n`),
    ),
  );
});
lines.on('close', () => process.exit(0));
