/**
 * pvisor-daemon's socket: accepts VM processes (PoolClient) and `pvisor-daemon status`, checks
 * each peer's credentials (SO_PEERCRED), hands the pool's memfd over with the answer to Hello
 * (SCM_RIGHTS), and answers Offer, Put, Settle and Status from the {@link PagePool}. A client that
 * breaks the protocol, sends more than it may, or stops reading is disconnected; other clients go
 * on.
 *
 * A client's references outlive its connection for as long as its process does: a VM maps the
 * pool pages it was granted until it says otherwise or ends, whether or not it is still
 * connected, and a slot given to new content while a VM still maps it would change that VM's
 * memory under it. So the references of a client that disconnects are kept until its process is
 * gone (checked by pid and start time, against pid reuse).
 */
import { chmodSync, chownSync, existsSync, lstatSync, readFileSync, unlinkSync } from 'node:fs';
import { connect, createServer, type Server, type Socket } from 'node:net';
import { pageHashesOf } from '../memory/uffd-server';
import { processResident } from '../memory-usage';
import { encodeFrame, FrameDecoder, FrameError, FrameType, type Frame } from '../protocol/frame';
import { peerCredentials, sendWithFd } from '../sys/unix-socket';
import { PagePool } from './page-pool';
import {
  ANSWER_FULL,
  ANSWER_NONE,
  ANSWER_SEND,
  checkName,
  decodeJson,
  decodeOffer,
  decodePut,
  decodeSettle,
  encodeAnswers,
  PAGE_BYTES,
  POOL_PROTOCOL_VERSION,
  PoolOp,
  PoolProtocolError,
  type PoolStatus,
} from './pool-protocol';

/** Options of {@link PoolServer.listen}. */
export interface PoolServerOptions {
  socketPath: string;
  /** Most bytes the pool holds. */
  poolBytes: number;
  /** A group whose members may connect too (the socket is then 0660 and of that group). */
  gid?: number;
}

/** A client stops reading: beyond this many unread answer bytes it is disconnected. */
const MAX_UNREAD_BYTES = 16 * 1024 * 1024;

/** How often the references of disconnected clients are checked against their processes. */
const ORPHAN_CHECK_MS = 2000;

interface Client {
  id: number;
  socket: Socket;
  pid: number;
  /** The process's start time (/proc/PID/stat), telling it from a later process of the same pid. */
  start: string | undefined;
  scope?: string;
  name?: string;
  /** Pool pages this client holds references to, with how many. */
  grants: Map<number, number>;
}

/** The daemon's server. */
export class PoolServer {
  private readonly clients = new Set<Client>();
  private nextClientId = 1;
  /** Disconnected clients whose processes may still map what they were granted. */
  private orphans: Client[] = [];
  private readonly orphanTimer: NodeJS.Timeout;

  private constructor(private readonly server: Server, private readonly pool: PagePool, private readonly options: PoolServerOptions) {
    this.orphanTimer = setInterval(() => this.reapOrphans(), ORPHAN_CHECK_MS);
    this.orphanTimer.unref();
  }

  /**
   * Creates the pool and listens on `socketPath` (0600, or 0660 with `gid`). A socket file left by
   * a daemon that is gone is replaced; a live daemon there is an error.
   */
  static async listen(options: PoolServerOptions): Promise<PoolServer> {
    await removeStaleSocket(options.socketPath);
    const pool = new PagePool(options.poolBytes);
    let self: PoolServer | undefined;
    const server = createServer({ allowHalfOpen: false }, (socket) => self!.accept(socket));
    self = new PoolServer(server, pool, options);
    try {
      await new Promise<void>((resolve, reject) => {
        server.once('error', reject);
        server.listen(options.socketPath, () => {
          server.off('error', reject);
          resolve();
        });
      });
      if (options.gid !== undefined) chownSync(options.socketPath, process.getuid!(), options.gid);
      chmodSync(options.socketPath, options.gid !== undefined ? 0o660 : 0o600);
    } catch (e) {
      server.close();
      pool.close();
      throw e;
    }
    return self;
  }

  private accept(socket: Socket): void {
    const fd = (socket as unknown as { _handle?: { fd?: number } })._handle?.fd;
    let peer: { pid: number; uid: number; gid: number };
    try {
      if (fd === undefined || fd < 0) throw new Error('no descriptor');
      peer = peerCredentials(fd);
    } catch {
      socket.destroy();
      return;
    }
    const client: Client = { id: this.nextClientId++, socket, pid: peer.pid, start: processStart(peer.pid), grants: new Map() };
    if (!this.allowed(peer)) {
      this.fail(client, 0, `uid ${peer.uid} may not use this pool`);
      return;
    }
    this.clients.add(client);
    // Each frame is handled as it completes and nothing of its payload is kept (Put copies the
    // pages into the pool): one assembly buffer serves every frame of this client.
    const decoder = new FrameDecoder({ reusePayloads: true });
    socket.on('data', (bytes: Buffer) => {
      try {
        decoder.pushEach(bytes, (f) => {
          if (!socket.destroyed) this.handle(client, f, fd!);
        });
      } catch (e) {
        // Whatever went wrong with this client ends this client, never the daemon and the others.
        const expected = e instanceof FrameError || e instanceof PoolProtocolError || e instanceof RangeError;
        if (!expected) process.stderr.write(`pvisor-daemon: client ${client.id} (pid ${client.pid}): ${(e as Error).stack ?? e}\n`);
        this.fail(client, 0, (e as Error).message);
      }
    });
    socket.on('close', () => this.drop(client));
    socket.on('error', () => {});
  }

  private allowed(peer: { uid: number; gid: number }): boolean {
    return peer.uid === 0 || peer.uid === process.getuid!() || (this.options.gid !== undefined && peer.gid === this.options.gid);
  }

  private handle(client: Client, f: Frame, fd: number): void {
    if (f.type !== FrameType.Request) throw new PoolProtocolError(`a frame of type ${f.type}, not a request`);
    const answer = (payload: Buffer) => {
      client.socket.write(encodeFrame({ type: FrameType.Response, id: f.id, op: f.op, payload }));
      if (client.socket.writableLength > MAX_UNREAD_BYTES) this.fail(client, f.id, 'the client does not read its answers');
    };
    if (f.op === PoolOp.Status) return answer(Buffer.from(JSON.stringify(this.status())));
    if (f.op === PoolOp.Hello) {
      if (client.scope !== undefined) throw new PoolProtocolError('a second Hello');
      const hello = decodeJson(f.payload, 4096, 'Hello');
      if (hello.version !== POOL_PROTOCOL_VERSION) throw new PoolProtocolError(`protocol version ${JSON.stringify(hello.version)}; this daemon speaks ${POOL_PROTOCOL_VERSION}`);
      const scope = checkName(hello.scope, 'Hello.scope');
      const name = checkName(hello.name, 'Hello.name');
      const scopeFd = this.pool.scopeFd(scope);
      client.scope = scope;
      client.name = name;
      const welcome = { version: POOL_PROTOCOL_VERSION, poolBytes: this.pool.pageCount * PAGE_BYTES, clientId: client.id };
      // The first bytes this daemon writes to the client: nothing queued in Node can overtake them.
      sendWithFd(fd, encodeFrame({ type: FrameType.Response, id: f.id, op: f.op, payload: Buffer.from(JSON.stringify(welcome)) }), scopeFd);
      return;
    }
    const scope = client.scope;
    if (scope === undefined) throw new PoolProtocolError(`op ${f.op} before Hello`);
    switch (f.op) {
      case PoolOp.Offer: {
        const answers = decodeOffer(f.payload).map(({ page, key }) => {
          const pooled = this.pool.lookup(scope, key)[0];
          if (pooled !== undefined) {
            this.pool.hold(scope, pooled);
            this.grant(client, pooled);
            return { page, answer: pooled };
          }
          return { page, answer: this.pool.offered(scope, key, client.id) ? ANSWER_SEND : ANSWER_NONE };
        });
        return answer(encodeAnswers(answers));
      }
      case PoolOp.Put: {
        const { pages, data } = decodePut(f.payload);
        const keys = new BigUint64Array(pages.length);
        // The keys are the daemon's own: a client cannot file a page under another content's key.
        pageHashesOf(data, keys);
        const answers = pages.map((page, i) => {
          const bytes = data.subarray(i * PAGE_BYTES, (i + 1) * PAGE_BYTES);
          const pooled = this.pool.put(scope, { lo: Number(keys[i] & 0xffffffffn), hi: Number(keys[i] >> 32n) }, bytes);
          if (pooled === undefined) return { page, answer: ANSWER_FULL };
          this.grant(client, pooled);
          return { page, answer: pooled };
        });
        return answer(encodeAnswers(answers));
      }
      case PoolOp.Settle: {
        const { drop } = decodeSettle(f.payload);
        for (const page of drop) {
          const n = client.grants.get(page);
          if (!n) throw new PoolProtocolError(`Settle drops pool page ${page}, which the client does not hold`);
          if (n === 1) client.grants.delete(page);
          else client.grants.set(page, n - 1);
          this.pool.release(scope, page);
        }
        return answer(Buffer.alloc(0));
      }
      default:
        throw new PoolProtocolError(`unknown op ${f.op}`);
    }
  }

  private grant(client: Client, page: number): void {
    client.grants.set(page, (client.grants.get(page) ?? 0) + 1);
  }

  /** Sends an Error frame and disconnects; the close gives its references back. */
  private fail(client: Client, id: number, why: string): void {
    if (client.socket.destroyed) return;
    client.socket.end(encodeFrame({ type: FrameType.Error, id, op: 0, payload: Buffer.from(why.slice(0, 512)) }));
    client.socket.destroySoon?.();
    setTimeout(() => client.socket.destroy(), 1000).unref();
    this.drop(client);
  }

  private drop(client: Client): void {
    if (!this.clients.delete(client)) return;
    if (client.grants.size) this.orphans.push(client);
    this.reapOrphans();
  }

  /** Gives back the references of disconnected clients whose processes have ended. */
  private reapOrphans(): void {
    this.orphans = this.orphans.filter((c) => {
      if (c.start !== undefined && processStart(c.pid) === c.start) return true;
      for (const [page, n] of c.grants) for (let i = 0; i < n; i++) this.pool.release(c.scope!, page);
      c.grants.clear();
      return false;
    });
  }

  status(): PoolStatus {
    this.reapOrphans();
    const f = this.pool.figures();
    return {
      pid: process.pid,
      poolBytes: this.pool.pageCount * PAGE_BYTES,
      pagesUsed: f.pagesUsed,
      orphanedClients: this.orphans.length,
      references: f.references,
      clients: [...this.clients].filter((c) => c.scope !== undefined).map((c) => ({
        id: c.id,
        scope: c.scope!,
        name: c.name!,
        pid: c.pid,
        references: [...c.grants.values()].reduce((a, b) => a + b, 0),
      })),
      scopes: f.scopes,
      candidates: f.candidates,
      pssBytes: processResident().pssBytes,
    };
  }

  /** Stops listening, disconnects every client (their VMs keep the pages they map) and frees the pool. */
  close(): Promise<void> {
    clearInterval(this.orphanTimer);
    for (const c of this.clients) c.socket.destroy();
    return new Promise((resolve) => {
      this.server.close(() => {
        this.pool.close();
        resolve();
      });
    });
  }
}

/** Removes a socket file nobody listens on; refuses one a live daemon serves or any other file. */
async function removeStaleSocket(path: string): Promise<void> {
  if (!existsSync(path)) return;
  if (!lstatSync(path).isSocket()) throw new Error(`${path} exists and is not a socket`);
  const live = await new Promise<boolean>((resolve) => {
    const s = connect(path);
    s.once('connect', () => {
      s.destroy();
      resolve(true);
    });
    s.once('error', () => resolve(false));
  });
  if (live) throw new Error(`a daemon already serves ${path}`);
  unlinkSync(path);
}

/** The start time of process `pid` (field 22 of /proc/PID/stat), or undefined if it is gone. */
function processStart(pid: number): string | undefined {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2).split(' ')[19];
  } catch {
    return undefined;
  }
}
