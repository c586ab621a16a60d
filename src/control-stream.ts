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
  const decoder = new FrameDecoder();
  const credit = new Map<StreamChannel, number>();
  const ended = new Set<StreamChannel>();
  let inputCredit = STREAM_WINDOW_BYTES;
  let inputQueue: Buffer[] = [];
  let inputQueuedBytes = 0;
  let writing = false;
  let pending = 0;
  let finished = false;
  let result: { ok: true; value: unknown } | { ok: false; error: unknown } | undefined;

  const send = (f: Omit<Frame, 'flags'>) => {
    if (!conn.destroyed) conn.write(encodeFrame(f));
  };
  const json = (v: unknown) => Buffer.from(JSON.stringify(v ?? null));
  /** Ends the stream for a broken rule of the protocol: the client is told why, what runs stops. */
  const fail = (why: string) => {
    if (finished) return;
    finished = true;
    send({ type: FrameType.Error, id: 0, op: 0, payload: json({ code: 'PVISOR_CONTROL_PROTOCOL', message: `stream: ${why}` }) });
    conn.end();
    // The answer may not leave (a client that does not read): the connection goes anyway.
    setTimeout(() => conn.destroy(), 1000).unref();
    session.abort(why);
  };
  const finishIfDone = () => {
    if (finished || !result || pending > 0) return;
    for (const ch of Object.keys(session.outputs)) if (!ended.has(Number(ch))) return;
    finished = true;
    if (result.ok) send({ type: FrameType.Event, id: 0, op: STREAM_END_EVENT, payload: json(result.value) });
    else send({ type: FrameType.Error, id: 0, op: 0, payload: json(errorPayload(result.error)) });
    conn.end();
  };

  // Output: within the client's credit and while little waits unsent; the rest stays in the
  // source, whose own credit then holds its writer in the guest.
  const pump = (ch: StreamChannel, source: Readable) => {
    while (!conn.destroyed && conn.writableLength < MAX_UNSENT_STREAM_BYTES) {
      if (source.readableLength === 0) {
        // Asks for more, and lets an ended source say so ('end' comes from a read of nothing).
        source.read(0);
        break;
      }
      const n = Math.min(credit.get(ch)!, source.readableLength, STREAM_CHUNK_BYTES);
      if (n <= 0) break;
      const chunk = source.read(n) as Buffer | null;
      if (!chunk) break;
      credit.set(ch, credit.get(ch)! - chunk.length);
      send({ type: FrameType.StreamChunk, id: 0, op: ch, payload: chunk });
    }
  };
  const pumpAll = () => {
    for (const [ch, source] of Object.entries(session.outputs)) pump(Number(ch), source!);
  };
  for (const [key, source] of Object.entries(session.outputs)) {
    const ch = Number(key) as StreamChannel;
    credit.set(ch, STREAM_WINDOW_BYTES);
    source!.on('readable', () => pump(ch, source!));
    const end = () => {
      if (ended.has(ch)) return;
      ended.add(ch);
      finishIfDone();
    };
    source!.once('end', () => {
      // All of it was sent (a source ends only once read out): the client's channel ends here,
      // before the result (a process's stdout may end long before it exits).
      if (!finished) send({ type: FrameType.StreamChunk, id: 0, op: ch, payload: Buffer.alloc(0) });
      end();
    });
    source!.once('close', end);
    // Why it failed reaches the client through the result.
    source!.on('error', () => {});
  }
  conn.on('drain', pumpAll);

  session.result.then(
    (value) => ((result = { ok: true, value }), finishIfDone()),
    (error: unknown) => {
      result = { ok: false, error };
      // A failed stream's outputs carry nothing more worth waiting for.
      for (const ch of credit.keys()) ended.add(ch);
      finishIfDone();
    },
  );

  // Input: the client may send a window ahead of what was written; each write grants it back.
  let drainedWaiters: (() => void)[] = [];
  /** Resolves once every byte received so far has been written (or refused). */
  const inputDrained = () => new Promise<void>((resolve) => {
    if (!writing && !inputQueuedBytes) resolve();
    else drainedWaiters.push(resolve);
  });
  const pumpInput = () => {
    if (!writing && !inputQueuedBytes) {
      const waiters = drainedWaiters;
      drainedWaiters = [];
      for (const w of waiters) w();
    }
    if (writing || !inputQueuedBytes || !session.input) return;
    const data = inputQueue.length === 1 ? inputQueue[0] : Buffer.concat(inputQueue, inputQueuedBytes);
    inputQueue = [];
    inputQueuedBytes = 0;
    writing = true;
    const written = session.input.write(data).then(
      () => {
        writing = false;
        inputCredit += data.length;
        send({ type: FrameType.Credit, id: 0, op: StreamChannel.Input, payload: u32(data.length) });
        pumpInput();
      },
      (e: unknown) => {
        // The writer refused (a process gone, a file that failed): the result says why, and the
        // end of input, if asked, fails with it.
        writing = false;
        inputQueue = [];
        inputQueuedBytes = 0;
        inputFailure ??= e;
        pumpInput();
      },
    );
  };
  let inputFailure: unknown;
  const answer = (id: number, work: Promise<void>) => {
    work.then(
      () => send({ type: FrameType.Response, id, op: 0, payload: Buffer.alloc(0) }),
      (e: unknown) => send({ type: FrameType.Error, id, op: 0, payload: json(errorPayload(e)) }),
    ).finally(() => {
      pending--;
      // The end comes after the answers: an end of input is answered before the stream's end.
      finishIfDone();
    });
  };

  const onFrame = (f: Frame) => {
    if (finished) return;
    switch (f.type) {
      case FrameType.Credit: {
        if (!credit.has(f.op) || f.payload.length !== 4) return fail(`a credit frame for channel ${f.op} of ${f.payload.length} bytes`);
        // Bounded: what a client grants beyond reason is still sent only as the socket drains.
        credit.set(f.op, Math.min(credit.get(f.op)! + f.payload.readUInt32LE(0), 2 ** 40));
        const source = session.outputs[f.op as StreamChannel.Stdout];
        if (source) pump(f.op, source);
        return;
      }
      case FrameType.StreamChunk:
        if (f.op !== StreamChannel.Input || !session.input) return fail(`data on channel ${f.op}, which takes none`);
        if (f.payload.length > inputCredit) return fail(`${f.payload.length} bytes of input beyond its credit of ${inputCredit}`);
        inputCredit -= f.payload.length;
        inputQueue.push(f.payload);
        inputQueuedBytes += f.payload.length;
        pumpInput();
        return;
      case FrameType.Request:
        if (++pending > MAX_PENDING_STREAM_REQUESTS) return fail(`more than ${MAX_PENDING_STREAM_REQUESTS} requests waiting`);
        if (f.op === StreamRequestOp.EndInput && session.input && f.payload.length === 0) {
          const input = session.input;
          // After every write before it.
          const ending = inputDrained().then(() => (inputFailure === undefined ? input.end() : Promise.reject(inputFailure)));
          return answer(f.id, ending);
        }
        if (f.op === StreamRequestOp.Signal && session.signal && f.payload.length === 4) {
          const signal = f.payload.readUInt32LE(0);
          if (signal < 1 || signal > 64) return fail(`signal ${signal}`);
          return answer(f.id, session.signal(signal));
        }
        return fail(`request op ${f.op} with ${f.payload.length} bytes`);
      default:
        return fail(`a frame of type ${f.type}`);
    }
  };
  const onData = (bytes: Buffer) => {
    try {
      decoder.pushEach(bytes, onFrame);
    } catch (e) {
      fail(e instanceof FrameError ? `bad frames: ${e.message}` : String(e));
    }
  };
  conn.on('data', onData);
  conn.on('error', () => {});
  conn.once('close', () => {
    if (!finished) {
      finished = true;
      session.abort('the client closed the connection');
    }
  });
  if (leftover.length) onData(leftover);
  conn.resume();
  pumpAll();
}

/** A u32 payload. */
export function u32(n: number): Buffer {
  const b = Buffer.alloc(4);
  b.writeUInt32LE(n >>> 0, 0);
  return b;
}
