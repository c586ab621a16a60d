/**
 * The client's end of a stream over a VM's control socket (see ./control-stream.ts and
 * docs/control-protocol.md, "Streams"): one connection, its request line, the JSON answer, then
 * frames. Output channels are Readables whose consumption is granted back to the server
 * ({@link StreamWindow}), input is sent only within the credit the server gave.
 */
import { createConnection, type Socket } from 'node:net';
import { Readable } from 'node:stream';
import { TakenReadable } from './taken-readable';
import { ControlProtocolError, ControlSocketError, TimeoutError, VmNotFoundError, type PvisorError } from './errors';
import { CONTROL_PROTOCOL_VERSION, errorFromPayload, type ControlRequest, type ControlResponse } from './control-socket';
import { MAX_STREAM_JSON_BYTES, STREAM_CHUNK_BYTES, STREAM_END_EVENT, StreamChannel, StreamRequestOp, u32 } from './control-stream';
import { encodeFrame, FrameDecoder, FrameType, type Frame } from './protocol/frame';
import { STREAM_WINDOW_BYTES, StreamWindow } from './protocol/stream-window';

/** The longest answer line taken before the frames. */
const MAX_ANSWER_LINE_BYTES = 64 * 1024;

/** One stream connection. */
export class ControlStream {
  private readonly decoder = new FrameDecoder();
  private readonly outputs = new Map<StreamChannel, { readable: Readable; window: StreamWindow; pushed: number; reported: number }>();
  private inputCredit = STREAM_WINDOW_BYTES;
  private creditWaiters: (() => void)[] = [];
  private nextId = 1;
  private readonly pending = new Map<number, { resolve: () => void; reject: (e: Error) => void }>();
  private ended: Error | undefined;
  private settleResult!: { resolve: (v: unknown) => void; reject: (e: Error) => void };
  /** The stream's result (the server's end event), or why it failed. */
  readonly result: Promise<unknown>;

  /** The answer to the request line; rejects with its typed error (the stream then is over). */
  readonly answered: Promise<ControlResponse & { ok: true }>;
  private readonly conn: Socket;
  private readonly what: string;
  private onFailure: (e: PvisorError) => void = () => {};
  /** Why the stream failed, once it has. */
  failure: PvisorError | undefined;

  /**
   * Connects to `path` and sends `request`; the answer must come within `timeoutMs`. `channels`
   * are the stream's output channels, whose Readables exist at once. With `errorOutputs`, a
   * failed stream destroys them with its error (a file read); without, it only closes them (a
   * process's outputs: why it failed is its `exited`).
   */
  constructor(
    path: string,
    id: string,
    request: ControlRequest,
    channels: StreamChannel[],
    timeoutMs: number,
    private readonly errorOutputs = false,
  ) {
    this.what = `${id} ${request.op}`;
    this.result = new Promise((resolve, reject) => (this.settleResult = { resolve, reject }));
    this.result.catch(() => {});
    for (const ch of channels) this.addOutput(ch);
    const conn = (this.conn = createConnection(path));
    let head = Buffer.alloc(0);
    let answered = false;
    let answer!: { resolve: (r: ControlResponse & { ok: true }) => void; reject: (e: PvisorError) => void };
    this.answered = new Promise((resolve, reject) => (answer = { resolve, reject }));
    this.answered.catch(() => {});
    const timer = setTimeout(() => this.destroy(new TimeoutError(`${id} did not answer ${request.op} on ${path} within ${timeoutMs} ms`)), timeoutMs);
    // Until the answer, a failure is the answer's; after it, the stream's.
    this.onFailure = (e) => {
      clearTimeout(timer);
      if (!answered) answer.reject(e);
    };
    conn.write(`${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, ...request })}\n`);
    const onHead = (chunk: Buffer) => {
      head = Buffer.concat([head, chunk]);
      const nl = head.indexOf(0x0a);
      if (nl < 0) {
        if (head.length > MAX_ANSWER_LINE_BYTES) this.destroy(new ControlSocketError(path, `answered ${request.op} with more than ${MAX_ANSWER_LINE_BYTES} bytes`));
        return;
      }
      conn.off('data', onHead);
      clearTimeout(timer);
      let r: (ControlResponse & { v?: unknown }) | null;
      try {
        r = JSON.parse(head.subarray(0, nl).toString('utf8')) as ControlResponse & { v?: unknown };
        if (typeof r !== 'object' || r === null || typeof r.ok !== 'boolean') throw new Error('no "ok" field');
      } catch (e) {
        return this.destroy(new ControlSocketError(path, `malformed answer: ${(e as Error).message}`));
      }
      if (r.v !== CONTROL_PROTOCOL_VERSION) {
        return this.destroy(new ControlProtocolError(r.v, `${path}: ${id} answered in control protocol version ${JSON.stringify(r.v)}; this pvisor speaks version ${CONTROL_PROTOCOL_VERSION}`));
      }
      if (!r.ok) return this.destroy(errorFromPayload(r.error));
      answered = true;
      answer.resolve(r);
      conn.on('data', (b: Buffer) => this.onData(b));
      const rest = head.subarray(nl + 1);
      if (rest.length) this.onData(rest);
    };
    conn.on('data', onHead);
    conn.on('error', (e: NodeJS.ErrnoException) => {
      if (e.code === 'ENOENT' || e.code === 'ECONNREFUSED') this.fail(new VmNotFoundError(id, `no VM named ${id} is running (${path})`));
      else this.fail(new ControlSocketError(path, e.message, { cause: e }));
    });
    conn.on('close', () => this.fail(new ControlSocketError(path, `${id} closed the ${request.op} stream before its end (the VM may have ended)`)));
  }

  /** The Readable of an output channel. */
  output(ch: StreamChannel): Readable {
    return this.outputs.get(ch)!.readable;
  }

  /** Sends `bytes` of input, waiting for credit as needed; resolves once all is sent. */
  async write(bytes: Buffer): Promise<void> {
    for (let at = 0; at < bytes.length; ) {
      if (this.ended) throw this.ended;
      if (this.inputCredit <= 0) {
        await new Promise<void>((resolve) => this.creditWaiters.push(resolve));
        continue;
      }
      const n = Math.min(this.inputCredit, STREAM_CHUNK_BYTES, bytes.length - at);
      this.inputCredit -= n;
      this.send({ type: FrameType.StreamChunk, id: 0, op: StreamChannel.Input, payload: bytes.subarray(at, at + n) });
      at += n;
    }
  }

  /** Ends the input (after what was written); resolves once the server has closed it. */
  endInput(): Promise<void> {
    return this.request(StreamRequestOp.EndInput, Buffer.alloc(0));
  }

  /** Sends a signal to what the stream runs. */
  signal(signal: number): Promise<void> {
    return this.request(StreamRequestOp.Signal, u32(signal));
  }

  /** Closes the connection: the server stops what the stream runs. */
  destroy(reason: PvisorError): void {
    this.fail(reason);
    this.conn.destroy();
  }

  private request(op: StreamRequestOp, payload: Buffer): Promise<void> {
    if (this.ended) return Promise.reject(this.ended);
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.send({ type: FrameType.Request, id, op, payload });
    });
  }

  private send(f: Omit<Frame, 'flags'>): void {
    if (!this.conn.destroyed) this.conn.write(encodeFrame(f));
  }

  private addOutput(ch: StreamChannel): void {
    const window = new StreamWindow();
    const state = { readable: undefined as unknown as Readable, window, pushed: 0, reported: 0 };
    const grant = () => {
      const taken = state.pushed - state.readable.readableLength;
      window.consume(taken - state.reported);
      state.reported = taken;
      const g = window.takeGrant();
      if (g > 0) this.send({ type: FrameType.Credit, id: 0, op: ch, payload: u32(g) });
    };
    state.readable = new TakenReadable({ highWaterMark: STREAM_WINDOW_BYTES, read: grant }, grant);
    state.readable.once('close', () => {
      // Nobody reads it any more: what comes counts as taken, so the process is not held.
      window.discard();
      const g = window.takeGrant();
      if (g > 0) this.send({ type: FrameType.Credit, id: 0, op: ch, payload: u32(g) });
    });
    this.outputs.set(ch, state);
  }

  private onData(bytes: Buffer): void {
    try {
      this.decoder.pushEach(bytes, (f) => this.onFrame(f));
    } catch (e) {
      this.destroy(new ControlSocketError(this.what, `bad frames from the VM: ${(e as Error).message}`));
    }
  }

  private onFrame(f: Frame): void {
    switch (f.type) {
      case FrameType.StreamChunk: {
        const out = this.outputs.get(f.op);
        if (out && f.payload.length === 0) {
          // The channel's end: all it had has come.
          if (!out.readable.destroyed && !out.readable.readableEnded) out.readable.push(null);
          return;
        }
        if (!out || !out.window.receive(f.payload.length)) throw new Error(`data on channel ${f.op} beyond its credit`);
        if (out.readable.destroyed) {
          const g = out.window.takeGrant();
          if (g > 0) this.send({ type: FrameType.Credit, id: 0, op: f.op, payload: u32(g) });
          return;
        }
        out.pushed += f.payload.length;
        out.readable.push(f.payload);
        return;
      }
      case FrameType.Credit:
        if (f.op !== StreamChannel.Input || f.payload.length !== 4) throw new Error(`credit for channel ${f.op}`);
        this.inputCredit = Math.min(this.inputCredit + f.payload.readUInt32LE(0), STREAM_WINDOW_BYTES);
        for (const w of this.creditWaiters.splice(0)) w();
        return;
      case FrameType.Response:
      case FrameType.Error: {
        if (f.id === 0 && f.type === FrameType.Error) return this.fail(errorFromPayload(parseError(f.payload)));
        const p = this.pending.get(f.id);
        if (!p) throw new Error(`an answer to request ${f.id}, which is not waiting`);
        this.pending.delete(f.id);
        if (f.type === FrameType.Response) p.resolve();
        else p.reject(errorFromPayload(parseError(f.payload)));
        return;
      }
      case FrameType.Event:
        if (f.op !== STREAM_END_EVENT || f.payload.length > MAX_STREAM_JSON_BYTES) throw new Error(`event ${f.op}`);
        this.finish(JSON.parse(f.payload.toString('utf8')) as unknown);
        return;
      default:
        throw new Error(`a frame of type ${f.type}`);
    }
  }

  private finish(value: unknown): void {
    if (this.ended) return;
    this.ended = new ControlSocketError(this.what, 'the stream has ended');
    for (const { readable } of this.outputs.values()) if (!readable.destroyed && !readable.readableEnded) readable.push(null);
    this.settleResult.resolve(value);
    this.settleAll(this.ended);
  }

  private fail(e: PvisorError): void {
    if (this.ended) return;
    this.ended = e;
    this.failure = e;
    this.onFailure(e);
    // Without errorOutputs, closed without an error event: why is the result's rejection.
    for (const { readable } of this.outputs.values()) readable.destroy(this.errorOutputs ? e : undefined);
    this.settleResult.reject(e);
    this.settleAll(e);
  }

  private settleAll(e: Error): void {
    for (const p of this.pending.values()) p.reject(e);
    this.pending.clear();
    for (const w of this.creditWaiters.splice(0)) w();
  }
}

/** An error payload from the server, checked: a code and a message, both strings. */
function parseError(payload: Buffer): { code: string; message: string } & Record<string, unknown> {
  if (payload.length > MAX_STREAM_JSON_BYTES) throw new Error(`an error of ${payload.length} bytes`);
  const e = JSON.parse(payload.toString('utf8')) as Record<string, unknown> | null;
  if (!e || typeof e.code !== 'string' || typeof e.message !== 'string') throw new Error('an error without code and message');
  return e as { code: string; message: string };
}
