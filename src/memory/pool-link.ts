/**
 * A VM process's connection to pvisor-daemon's page pool: the handshake that brings the pool's
 * memfd over (SCM_RIGHTS, which Node's `net` cannot receive, so the socket is connected and read
 * through libc until then and handed to `net` after), and requests answered in order, each
 * within a timeout. See ../daemon/pool-protocol.ts.
 */
import { writeSync } from 'node:fs';
import { connect, Socket } from 'node:net';
import { PoolUnavailableError } from '../errors';
import { encodeFrame, FRAME_HEADER_BYTES, FrameDecoder, FrameType, writeFrameHeader, type Frame } from '../protocol/frame';
import { closeFd } from '../sys/libc';
import { takeHandedPoolFd } from '../jail/handed-files';
import { connectUnixSocket, receiveWithFd } from '../sys/unix-socket';
import { decodeJson, decodeWelcome, POOL_PROTOCOL_VERSION, PoolOp, type PoolStatus } from '../daemon/pool-protocol';

/** A live connection to the pool. */
export class PoolLink {
  private readonly decoder = new FrameDecoder();
  private nextId = 1;
  private readonly waiting = new Map<number, { resolve: (p: Buffer) => void; reject: (e: Error) => void; timer: NodeJS.Timeout }>();
  private closedWith: Error | undefined;
  private readonly closeListeners: ((e: Error) => void)[] = [];

  private constructor(private readonly socket: Socket, readonly poolFd: number, readonly poolBytes: number, readonly clientId: number) {
    socket.on('data', (b: Buffer) => {
      try {
        for (const f of this.decoder.push(b)) this.settle(f);
      } catch (e) {
        this.end(new PoolUnavailableError(`the pool broke the protocol: ${(e as Error).message}`));
      }
    });
    socket.on('close', () => this.end(new PoolUnavailableError('the pool daemon closed the connection')));
    socket.on('error', (e) => this.end(new PoolUnavailableError(`the pool connection failed: ${e.message}`, { cause: e })));
  }

  /**
   * Connects to the daemon on `socketPath`, says who it is, and receives the pool's memfd
   * (the caller's to close). Rejects with {@link PoolUnavailableError} within `timeoutMs`.
   */
  static async connect(socketPath: string, hello: { scope: string; name: string }, timeoutMs: number): Promise<PoolLink> {
    let fd: number;
    try {
      // A jailed VMM was handed its launcher's connection (src/jail/handed-files.ts): the daemon
      // knows the user by it, not the jail's shared uid.
      fd = takeHandedPoolFd() ?? connectUnixSocket(socketPath);
    } catch (e) {
      throw new PoolUnavailableError(`cannot connect to the pool at ${socketPath}: ${(e as Error).message}`, { cause: e });
    }
    try {
      writeSync(fd, encodeFrame({ type: FrameType.Request, id: 0, op: PoolOp.Hello, payload: Buffer.from(JSON.stringify({ version: POOL_PROTOCOL_VERSION, ...hello })) }));
      const decoder = new FrameDecoder();
      let poolFd: number | undefined;
      const deadline = Date.now() + timeoutMs;
      for (;;) {
        const got = receiveWithFd(fd);
        if (got?.fd !== undefined) {
          if (poolFd !== undefined) closeFd(got.fd);
          else poolFd = got.fd;
        }
        if (got && got.data.length === 0) throw new PoolUnavailableError('the pool daemon closed the connection during the handshake');
        const frames = got ? decoder.push(got.data) : [];
        if (frames.length) {
          const f = frames[0];
          if (f.type === FrameType.Error) throw new PoolUnavailableError(`the pool refused: ${f.payload.toString('utf8')}`);
          const welcome = decodeWelcome(f.payload);
          if (poolFd === undefined) throw new PoolUnavailableError('the pool answered without its memory');
          const socket = new Socket({ fd, readable: true, writable: true });
          return new PoolLink(socket, poolFd, welcome.poolBytes, welcome.clientId);
        }
        if (Date.now() > deadline) throw new PoolUnavailableError(`the pool at ${socketPath} did not answer within ${timeoutMs} ms`);
        await new Promise((r) => setTimeout(r, 2));
      }
    } catch (e) {
      closeFd(fd);
      throw e instanceof PoolUnavailableError ? e : new PoolUnavailableError(`pool handshake failed: ${(e as Error).message}`, { cause: e });
    }
  }

  /**
   * Sends a request built in place: `frame`'s payload (after its {@link FRAME_HEADER_BYTES}
   * header, which this writes) holds `bytes` bytes. A merge pass sends hundreds of near-1 MiB
   * requests and builds them all in one frame of its own (see ./pass-scratch.ts): allocated anew,
   * they grew a VM process by tens of MiB that malloc kept after they were freed. One request at a
   * time: the frame is free again once its answer has come.
   */
  requestBuilt(op: PoolOp, frame: Buffer, bytes: number, timeoutMs: number): Promise<Buffer> {
    if (this.closedWith) return Promise.reject(this.closedWith);
    if (this.waiting.size) return Promise.reject(new Error('a built request is sent while another is waiting'));
    const id = this.nextId++;
    writeFrameHeader(frame, { type: FrameType.Request, id, op, length: bytes });
    return this.send(id, op, frame.subarray(0, FRAME_HEADER_BYTES + bytes), timeoutMs);
  }

  private send(id: number, op: PoolOp, frame: Buffer, timeoutMs: number): Promise<Buffer> {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => this.end(new PoolUnavailableError(`the pool did not answer op ${op} within ${timeoutMs} ms`)), timeoutMs);
      this.waiting.set(id, { resolve, reject, timer });
      this.socket.write(frame);
    });
  }

  private settle(f: Frame): void {
    const w = this.waiting.get(f.id);
    if (!w) throw new Error(`an answer to request ${f.id}, which is not waiting`);
    this.waiting.delete(f.id);
    clearTimeout(w.timer);
    if (f.type === FrameType.Response) w.resolve(f.payload);
    else {
      const e = new PoolUnavailableError(`the pool refused: ${f.payload.toString('utf8').slice(0, 512)}`);
      w.reject(e);
      this.end(e);
    }
  }

  /** Called once when the link ends, with why. */
  onClose(listener: (e: Error) => void): void {
    if (this.closedWith) listener(this.closedWith);
    else this.closeListeners.push(listener);
  }

  get closed(): boolean {
    return this.closedWith !== undefined;
  }

  private end(e: Error): void {
    if (this.closedWith) return;
    this.closedWith = e;
    this.socket.destroy();
    for (const w of this.waiting.values()) {
      clearTimeout(w.timer);
      w.reject(e);
    }
    this.waiting.clear();
    for (const l of this.closeListeners) l(e);
  }

  /** Ends the link (the daemon gives this client's references back); the memfd stays the caller's. */
  close(): void {
    this.end(new PoolUnavailableError('the link was closed'));
  }
}

/** Asks the daemon at `socketPath` for its figures. */
export function poolStatus(socketPath: string, timeoutMs: number): Promise<PoolStatus> {
  return new Promise((resolve, reject) => {
    const socket = connect(socketPath);
    const decoder = new FrameDecoder();
    const timer = setTimeout(() => {
      socket.destroy();
      reject(new PoolUnavailableError(`the pool at ${socketPath} did not answer within ${timeoutMs} ms`));
    }, timeoutMs);
    socket.on('connect', () => socket.write(encodeFrame({ type: FrameType.Request, id: 1, op: PoolOp.Status, payload: Buffer.alloc(0) })));
    socket.on('data', (b: Buffer) => {
      try {
        const [f] = decoder.push(b);
        if (!f) return;
        clearTimeout(timer);
        socket.destroy();
        resolve(decodeJson(f.payload, 1 << 20, 'Status') as unknown as PoolStatus);
      } catch (e) {
        clearTimeout(timer);
        socket.destroy();
        reject(new PoolUnavailableError(`the pool's status: ${(e as Error).message}`));
      }
    });
    socket.on('error', (e) => {
      clearTimeout(timer);
      reject(new PoolUnavailableError(`cannot reach the pool at ${socketPath}: ${e.message}`, { cause: e }));
    });
  });
}
