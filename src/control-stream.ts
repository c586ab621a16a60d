/**
 * Streams over a VM's control socket (docs/control-protocol.md, "Streams"): a spawned process's
 * stdout, stderr and stdin, a file read or written as it goes. A stream request is the first line
 * of its own connection; after its JSON answer, both sides speak pvisor's frames
 * ({@link FrameDecoder}, the codec of the agent and pool protocols) under stream credit
 * ({@link StreamWindow}), so one connection carries one stream's channels and nothing else:
 *
 * - `StreamChunk`, op = channel (0 input, 1 stdout or file content, 2 stderr): data, at most
 *   {@link STREAM_CHUNK_BYTES}, never more than the receiver has granted; an empty one from the
 *   server ends that output channel;
 * - `Credit`, op = channel, payload u32: the receiver took that many bytes more;
 * - `Request` id N, op 1 (end of input) or 2 (signal, payload u32), answered by a `Response` or
 *   an `Error` (JSON `{code, message}`) of id N;
 * - `Event` op 1 (end, JSON result) or an `Error` of id 0 (JSON error): the last frame; the
 *   server then closes the connection.
 *
 * The server side is the VM's process and its client an untrusted local peer: every frame is
 * checked, input beyond its credit ends the stream, output is sent only within the client's credit
 * and while fewer than {@link MAX_UNSENT_STREAM_BYTES} wait unsent in the socket, so a client
 * that never reads holds only its own stream's writer in the guest.
 * @module
 */
import type { Readable } from 'node:stream';
import type { Socket } from 'node:net';
import { encodeFrame, FrameDecoder, FrameError, FrameType, type Frame } from './protocol/frame';
import { STREAM_WINDOW_BYTES } from './protocol/stream-window';

/** Channels of a stream connection (the frame's op). */
export const enum StreamChannel {
  Input = 0,
  Stdout = 1,
  Stderr = 2,
}

/** Requests of a stream connection (the frame's op). */
export const enum StreamRequestOp {
  /** No more input: stdin is closed, the file is closed. */
  EndInput = 1,
  /** A signal to the process, payload u32. */
  Signal = 2,
}

/** The op of the `Event` that ends a stream. */
export const STREAM_END_EVENT = 1;

/** The most a data frame carries: a small frame keeps one stream from holding the socket long. */
export const STREAM_CHUNK_BYTES = 64 * 1024;
/**
 * What may wait unsent in one stream connection: beyond it the server takes no more output from
 * the guest until the socket drains, whatever credit the client gave (a client may grant without
 * reading the socket).
 */
export const MAX_UNSENT_STREAM_BYTES = 64 * 1024;
/** Requests of a stream connection that may wait for their answer at once; more ends it. */
export const MAX_PENDING_STREAM_REQUESTS = 8;
/** The largest JSON payload (an error, an end result) either side takes. */
export const MAX_STREAM_JSON_BYTES = 16 * 1024;

/** What the server streams for one request: built by the VM's process from the VM. */
export interface StreamSession {
  /** Output channels and their sources. */
  outputs: Partial<Record<StreamChannel.Stdout | StreamChannel.Stderr, Readable>>;
  /** Where input goes (stdin, a file), if the stream takes any; each write resolves once taken. */
  input?: { write(bytes: Buffer): Promise<void>; end(): Promise<void> };
  /** Sends a signal to what the stream runs (a process). */
  signal?(signal: number): Promise<void>;
  /** The stream's result: sent as its end once every output has ended. */
  result: Promise<unknown>;
  /** The client went away (or broke the protocol) before the end: stop what runs. */
  abort(reason: string): void;
}

/** An error as the stream protocol carries it. */
export type StreamErrorPayload = { code: string; message: string };

/**
 * Serves one stream connection whose request has been answered: `leftover` is what the client
 * sent after its request line. `errorPayload` turns a thrown error into what travels.
 */
export function serveStream(conn: Socket, leftover: Buffer, session: StreamSession, errorPayload: (e: unknown) => StreamErrorPayload): void {
  new StreamConnection(conn, session, errorPayload).start(leftover);
}

const json = (v: unknown) => Buffer.from(JSON.stringify(v ?? null));

/** One stream connection's state: its outputs under the client's credit, its input, its end. */
class StreamConnection {
  private readonly decoder = new FrameDecoder();
  /** Output channels and the bytes the client still grants each. */
  private readonly credit = new Map<StreamChannel, number>();
  private readonly ended = new Set<StreamChannel>();
  private readonly input: StreamInput | undefined;
  /** Requests waiting for their answer. */
  private pending = 0;
  private finished = false;
  private result: { ok: true; value: unknown } | { ok: false; error: unknown } | undefined;

  constructor(
    private readonly conn: Socket,
    private readonly session: StreamSession,
    private readonly errorPayload: (e: unknown) => StreamErrorPayload,
  ) {
    const { input } = session;
    if (input) this.input = new StreamInput(input, (n) => this.send({ type: FrameType.Credit, id: 0, op: StreamChannel.Input, payload: u32(n) }));
  }

  start(leftover: Buffer): void {
    for (const [key, source] of Object.entries(this.session.outputs)) this.wireOutput(Number(key) as StreamChannel, source!);
    this.conn.on('drain', () => this.pumpAll());
    this.session.result.then(
      (value) => ((this.result = { ok: true, value }), this.finishIfDone()),
      (error: unknown) => {
        this.result = { ok: false, error };
        // A failed stream's outputs carry nothing more worth waiting for.
        for (const ch of this.credit.keys()) this.ended.add(ch);
        this.finishIfDone();
      },
    );
    this.conn.on('data', (bytes: Buffer) => this.onData(bytes));
    this.conn.on('error', () => {});
    this.conn.once('close', () => {
      if (!this.finished) {
        this.finished = true;
        this.session.abort('the client closed the connection');
      }
    });
    if (leftover.length) this.onData(leftover);
    this.conn.resume();
    this.pumpAll();
  }

  private send(f: Omit<Frame, 'flags'>): void {
    if (!this.conn.destroyed) this.conn.write(encodeFrame(f));
  }

  /** Ends the stream for a broken rule of the protocol: the client is told why, what runs stops. */
  private fail(why: string): void {
    if (this.finished) return;
    this.finished = true;
    this.send({ type: FrameType.Error, id: 0, op: 0, payload: json({ code: 'PVISOR_CONTROL_PROTOCOL', message: `stream: ${why}` }) });
    this.conn.end();
    // The answer may not leave (a client that does not read): the connection goes anyway.
    setTimeout(() => this.conn.destroy(), 1000).unref();
    this.session.abort(why);
  }

  private finishIfDone(): void {
    const { result } = this;
    if (this.finished || !result || this.pending > 0) return;
    for (const ch of Object.keys(this.session.outputs)) if (!this.ended.has(Number(ch))) return;
    this.finished = true;
    if (result.ok) this.send({ type: FrameType.Event, id: 0, op: STREAM_END_EVENT, payload: json(result.value) });
    else this.send({ type: FrameType.Error, id: 0, op: 0, payload: json(this.errorPayload(result.error)) });
    this.conn.end();
  }

  private wireOutput(ch: StreamChannel, source: Readable): void {
    this.credit.set(ch, STREAM_WINDOW_BYTES);
    source.on('readable', () => this.pump(ch, source));
    const end = () => {
      if (this.ended.has(ch)) return;
      this.ended.add(ch);
      this.finishIfDone();
    };
    source.once('end', () => {
      // All of it was sent (a source ends only once read out): the client's channel ends here,
      // before the result (a process's stdout may end long before it exits).
      if (!this.finished) this.send({ type: FrameType.StreamChunk, id: 0, op: ch, payload: Buffer.alloc(0) });
      end();
    });
    source.once('close', end);
    // Why it failed reaches the client through the result.
    source.on('error', () => {});
  }

  /**
   * Output: within the client's credit and while little waits unsent; the rest stays in the
   * source, whose own credit then holds its writer in the guest.
   */
  private pump(ch: StreamChannel, source: Readable): void {
    while (!this.conn.destroyed && this.conn.writableLength < MAX_UNSENT_STREAM_BYTES) {
      if (source.readableLength === 0) {
        // Asks for more, and lets an ended source say so ('end' comes from a read of nothing).
        source.read(0);
        break;
      }
      const n = Math.min(this.credit.get(ch)!, source.readableLength, STREAM_CHUNK_BYTES);
      if (n <= 0) break;
      const chunk = source.read(n) as Buffer | null;
      if (!chunk) break;
      this.credit.set(ch, this.credit.get(ch)! - chunk.length);
      this.send({ type: FrameType.StreamChunk, id: 0, op: ch, payload: chunk });
    }
  }

  private pumpAll(): void {
    for (const [ch, source] of Object.entries(this.session.outputs)) this.pump(Number(ch), source!);
  }

  /** Answers request `id` once `work` settles; the stream's end waits for it. */
  private answer(id: number, work: Promise<void>): void {
    work.then(
      () => this.send({ type: FrameType.Response, id, op: 0, payload: Buffer.alloc(0) }),
      (e: unknown) => this.send({ type: FrameType.Error, id, op: 0, payload: json(this.errorPayload(e)) }),
    ).finally(() => {
      this.pending--;
      // The end comes after the answers: an end of input is answered before the stream's end.
      this.finishIfDone();
    });
  }

  private onData(bytes: Buffer): void {
    try {
      this.decoder.pushEach(bytes, (f) => this.onFrame(f));
    } catch (e) {
      this.fail(e instanceof FrameError ? `bad frames: ${e.message}` : String(e));
    }
  }

  private onFrame(f: Frame): void {
    if (this.finished) return;
    switch (f.type) {
      case FrameType.Credit: {
        if (!this.credit.has(f.op) || f.payload.length !== 4) return this.fail(`a credit frame for channel ${f.op} of ${f.payload.length} bytes`);
        // Bounded: what a client grants beyond reason is still sent only as the socket drains.
        this.credit.set(f.op, Math.min(this.credit.get(f.op)! + f.payload.readUInt32LE(0), 2 ** 40));
        const source = this.session.outputs[f.op as StreamChannel.Stdout];
        if (source) this.pump(f.op, source);
        return;
      }
      case FrameType.StreamChunk: {
        if (f.op !== StreamChannel.Input || !this.input) return this.fail(`data on channel ${f.op}, which takes none`);
        const refused = this.input.take(f.payload);
        if (refused) this.fail(refused);
        return;
      }
      case FrameType.Request:
        if (++this.pending > MAX_PENDING_STREAM_REQUESTS) return this.fail(`more than ${MAX_PENDING_STREAM_REQUESTS} requests waiting`);
        if (f.op === StreamRequestOp.EndInput && this.input && f.payload.length === 0) return this.answer(f.id, this.input.end());
        if (f.op === StreamRequestOp.Signal && this.session.signal && f.payload.length === 4) {
          const signal = f.payload.readUInt32LE(0);
          if (signal < 1 || signal > 64) return this.fail(`signal ${signal}`);
          return this.answer(f.id, this.session.signal(signal));
        }
        return this.fail(`request op ${f.op} with ${f.payload.length} bytes`);
      default:
        return this.fail(`a frame of type ${f.type}`);
    }
  }
}

/**
 * A stream's input: the client may send a window ahead of what was written; each write grants
 * it back (`grant`). Writes go one at a time, in order; the end comes after every write before it.
 */
class StreamInput {
  private credit = STREAM_WINDOW_BYTES;
  private queue: Buffer[] = [];
  private queuedBytes = 0;
  private writing = false;
  private failure: unknown;
  private drainedWaiters: (() => void)[] = [];

  constructor(
    private readonly sink: NonNullable<StreamSession['input']>,
    private readonly grant: (bytes: number) => void,
  ) {}

  /** Queues bytes the client sent; returns why they break its credit, if they do. */
  take(bytes: Buffer): string | undefined {
    if (bytes.length > this.credit) return `${bytes.length} bytes of input beyond its credit of ${this.credit}`;
    this.credit -= bytes.length;
    this.queue.push(bytes);
    this.queuedBytes += bytes.length;
    this.pump();
    return undefined;
  }

  /** Ends the input after every write before it; fails with what a write failed with. */
  end(): Promise<void> {
    return this.drained().then(() => (this.failure === undefined ? this.sink.end() : Promise.reject(this.failure)));
  }

  /** Resolves once every byte received so far has been written (or refused). */
  private drained(): Promise<void> {
    return new Promise<void>((resolve) => {
      if (!this.writing && !this.queuedBytes) resolve();
      else this.drainedWaiters.push(resolve);
    });
  }

  private pump(): void {
    if (!this.writing && !this.queuedBytes) {
      const waiters = this.drainedWaiters;
      this.drainedWaiters = [];
      for (const w of waiters) w();
    }
    if (this.writing || !this.queuedBytes) return;
    const data = this.queue.length === 1 ? this.queue[0] : Buffer.concat(this.queue, this.queuedBytes);
    this.queue = [];
    this.queuedBytes = 0;
    this.writing = true;
    this.sink.write(data).then(
      () => {
        this.writing = false;
        this.credit += data.length;
        this.grant(data.length);
        this.pump();
      },
      (e: unknown) => {
        // The writer refused (a process gone, a file that failed): the result says why, and the
        // end of input, if asked, fails with it.
        this.writing = false;
        this.queue = [];
        this.queuedBytes = 0;
        this.failure ??= e;
        this.pump();
      },
    );
  }
}

/** A u32 payload. */
export function u32(n: number): Buffer {
  const b = Buffer.alloc(4);
  b.writeUInt32LE(n >>> 0, 0);
  return b;
}
