/**
 * The host end of the agent protocol: numbered requests with several outstanding at once,
 * responses matched by id, guest events delivered to a callback, and each request's output
 * streams under their own credit (./stream-window.ts).
 */
import { abortError, GuestRequestError, PvisorError, RequestTooLargeError, SnapshotError, TimeoutError, VmStateError } from '../errors';
import { arrayAt, base64Of, bytesAt, checkVersion, integerAt, objectAt } from '../persist/state-fields';
import { encodeFrame, FrameDecoder, FrameType, MAX_PAYLOAD_BYTES, type Frame } from './frame';
import { STREAM_WINDOW_BYTES, StreamWindow } from './stream-window';

/** Common ops (both guests). */
export const enum CommonOp {
  Hello = 0x0001,
  Ping = 0x0002,
  /** The op of a {@link FrameType.Credit} frame. */
  Credit = 0x0003,
}

/** HELLO's features word (`u32` at byte 32): bit 0, the agent sends its streams under credit. */
export const FEATURE_STREAM_CREDIT = 1;

/** The output streams of a request that flow under credit: chunk flags 1 (stdout, or a file's content) and 2 (stderr). */
export type OutputChannel = 1 | 2;
/** Chunk flags 4: an EXEC's STARTED (a u32 pid) or a FILE_WRITE_OPEN's OPENED (empty); not a stream. */
const CHUNK_STATUS = 4;
/** The longest status chunk: STARTED's pid. */
const MAX_STATUS_CHUNK_BYTES = 4;

interface Pending {
  op: number;
  /** See {@link RequestOptions.call}. */
  call: string | undefined;
  resolve(payload: Buffer): void;
  reject(error: Error): void;
  onChunk?: (flags: number, payload: Buffer) => void;
  onGiveUp?: () => void;
  /** See {@link RequestOptions.holdsChunks}. */
  holdsChunks: boolean;
  /** Credit of its stdout (or content) and stderr, made as the first chunk of each comes. */
  windows: [StreamWindow | undefined, StreamWindow | undefined];
  timer?: NodeJS.Timeout;
  /** Removes the abort listener (if any). */
  unlisten?: () => void;
}

/** Options of one request. */
export interface RequestOptions {
  /** Reject with {@link TimeoutError} after this long; default: no timeout. */
  timeoutMs?: number;
  /** Reject with an {@link AbortError} when this signal aborts (at once if it has already: nothing is sent). */
  signal?: AbortSignal;
  /** Receives the request's stream chunks (type 3) before its final frame. */
  onChunk?: (flags: number, payload: Buffer) => void;
  /**
   * Called once when the host gives the request up (its timeout, its signal, {@link AgentClient.giveUp})
   * while the guest still serves it: the caller tells the guest to stop (a FILE_CANCEL). The
   * request's later frames, its final one included, are then dropped without a word.
   */
  onGiveUp?: () => void;
  /**
   * The caller keeps the chunks `onChunk` is given until a consumer takes them, and says so with
   * {@link AgentClient.consumed} (or {@link AgentClient.discard}): the guest is granted more only
   * as they are taken. Default false: a chunk counts as taken once `onChunk` returns.
   */
  holdsChunks?: boolean;
  /**
   * The call this request serves, with its path or command (`files.read('/nope.txt')`): errors
   * name it instead of the op code, and keep the op code as a field.
   */
  call?: string;
}

/** A request in flight: its id names it in later requests (a process handle, for instance). */
export interface StartedRequest {
  id: number;
  /** The final response's payload, or the guest's error. */
  done: Promise<Buffer>;
}

/**
 * The version of {@link AgentChannelState} this code writes and reads. Version 1 was written
 * before stream credit: its guest's agent sends output without credit, which this client would
 * cut at a window, so it is refused with a SnapshotError saying so.
 */
export const AGENT_CHANNEL_STATE_VERSION = 2;

/**
 * The host end of the channel as a snapshot saves it. Requests in flight when the snapshot is
 * taken are the snapshotted VM's: their callers live in its process and get their answers there.
 * A VM restored from the snapshot runs a guest that may still answer them; its client knows them
 * by id, so such an answer is reported and dropped (never taken for a new request's, since ids
 * go on from `nextId`), and nobody waits on them. The bytes of a frame half received are kept, so
 * the decoder resumes mid-frame.
 */
export interface AgentChannelState {
  version: typeof AGENT_CHANNEL_STATE_VERSION;
  nextId: number;
  inFlight: { id: number; op: number }[];
  /** Bytes of the frame being received, base64. */
  partialFrame: string;
  /** The features word of the agent's HELLO (0: none seen, or none offered, as the probe's). */
  agentFeatures: number;
}

/** Requests to, and events from, one guest agent. */
export class AgentClient {
  private readonly decoder = new FrameDecoder();
  private readonly pending = new Map<number, Pending>();
  private nextId = 1;
  private closedWith: Error | undefined;
  /** Requests given up with an `onGiveUp` (see {@link RequestOptions}), until their final frame. */
  private readonly abandoned = new Set<number>();
  /** Requests in flight when the snapshot this client was restored from was taken (id to op). */
  private readonly orphans = new Map<number, number>();
  private orphanCount = 0;
  /** The features word of the agent's HELLO. */
  private features = 0;
  /** Grants decided this turn, sent together: stream key ({@link streamKey}) to bytes. */
  private readonly dueGrants = new Map<number, number>();

  constructor(
    private readonly send: (bytes: Buffer) => void,
    private readonly onEvent: (frame: Frame) => void,
    private readonly onProtocolError: (message: string) => void,
    /** Told how each request ended, for a trace (the VM's logger); never for an unsent one's reason to differ. */
    private readonly onSettled?: (info: { op: number; call: string | undefined; ms: number; error?: Error }) => void,
  ) {}

  /**
   * Whether the agent said in its HELLO that it sends its streams under credit. Until it has, no
   * grant is sent (the probe guest, whose ops stream nothing, never says so); a stream is cut at
   * its first window all the same, so the host never holds more of it.
   */
  get speaksStreamCredit(): boolean {
    return (this.features & FEATURE_STREAM_CREDIT) !== 0;
  }

  /**
   * The consumer of request `id`'s output `channel` took `bytes` of it (a request started with
   * {@link RequestOptions.holdsChunks}), and may hold `windowBytes` at once (more than a window
   * only for a consumer that asks for more at once: see {@link StreamWindow.widen}): the guest is
   * granted more once that adds up (see {@link StreamWindow.takeGrant}). Nothing for a request
   * that has ended.
   */
  consumed(id: number, channel: OutputChannel, bytes: number, windowBytes = STREAM_WINDOW_BYTES): void {
    const p = this.pending.get(id);
    if (!p) return;
    const w = (p.windows[channel - 1] ??= new StreamWindow());
    w.widen(windowBytes);
    if (bytes > 0) w.consume(bytes);
    this.grant(id, channel, w);
  }

  /**
   * Request `id`'s output `channel` has no consumer any more (its stream was destroyed): what is
   * held and all that comes is dropped and granted back at once, so the writer in the guest runs
   * to its end instead of blocking for ever.
   */
  discard(id: number, channel: OutputChannel): void {
    const p = this.pending.get(id);
    if (!p) return;
    const w = (p.windows[channel - 1] ??= new StreamWindow());
    w.discard();
    this.grant(id, channel, w);
  }

  /** Bytes of request `id`'s output `channel` the host holds for its consumer (0 if none or ended). */
  heldBytes(id: number, channel: OutputChannel): number {
    return this.pending.get(id)?.windows[channel - 1]?.heldBytes ?? 0;
  }

  /** Queues what `w` grants now; every grant of this turn goes in one send. */
  private grant(id: number, channel: OutputChannel, w: StreamWindow): void {
    if (!this.speaksStreamCredit || this.closedWith) return;
    const bytes = w.takeGrant();
    if (!bytes) return;
    const key = streamKey(id, channel);
    const before = this.dueGrants.get(key);
    this.dueGrants.set(key, (before ?? 0) + bytes);
    if (this.dueGrants.size === 1 && before === undefined) queueMicrotask(() => this.sendGrants());
  }

  private sendGrants(): void {
    if (this.closedWith || !this.dueGrants.size) return;
    const frames: Buffer[] = [];
    for (const [key, bytes] of this.dueGrants) {
      const payload = Buffer.alloc(4);
      payload.writeUInt32LE(bytes, 0);
      frames.push(encodeFrame({ type: FrameType.Credit, id: Math.floor(key / 4), op: CommonOp.Credit, flags: key % 4, payload }));
    }
    this.dueGrants.clear();
    try {
      this.send(frames.length === 1 ? frames[0] : Buffer.concat(frames));
    } catch {
      // The VM is ending: its close() settles every request.
    }
  }

  /** Feeds bytes received from the guest. */
  receive(bytes: Buffer): void {
    let frames: Frame[];
    try {
      frames = this.decoder.push(bytes);
    } catch (e) {
      this.onProtocolError((e as Error).message);
      return;
    }
    for (const f of frames) this.dispatch(f);
  }

  /** See {@link AgentChannelState}. */
  saveState(): AgentChannelState {
    return {
      version: AGENT_CHANNEL_STATE_VERSION,
      nextId: this.nextId,
      inFlight: [...this.pending].map(([id, p]) => ({ id, op: p.op })),
      partialFrame: base64Of(this.decoder.pendingBytes()),
      agentFeatures: this.features,
    };
  }

  /**
   * Takes a {@link saveState} value (unchecked, from a file) into this fresh client, before any
   * request. A malformed one is a {@link SnapshotError} naming the field, and nothing changes.
   */
  restoreState(value: unknown, path = 'agent'): void {
    if (this.pending.size > 0 || this.nextId !== 1) throw new SnapshotError(`${path}: the agent client has already been used`);
    const o = objectAt(value, path);
    if (o.version === 1) {
      throw new SnapshotError(
        `${path}.version: the snapshot was taken by an earlier pvisor (agent channel state version 1), whose guest agent sends its output without stream credit; ` +
          `this pvisor reads version ${AGENT_CHANNEL_STATE_VERSION} only: take the snapshot again with this pvisor (its guest booted from this pvisor's initramfs)`,
      );
    }
    checkVersion(o, path, AGENT_CHANNEL_STATE_VERSION);
    const nextId = integerAt(o, 'nextId', path, 1, 0xffffffff);
    const inFlight = arrayAt(o, 'inFlight', path, 65536).map((r, i) => {
      const e = objectAt(r, `${path}.inFlight[${i}]`);
      return [integerAt(e, 'id', `${path}.inFlight[${i}]`, 1, 0xffffffff), integerAt(e, 'op', `${path}.inFlight[${i}]`, 0, 0xffff)] as const;
    });
    const partial = bytesAt(o, 'partialFrame', path, { min: 0, max: 64 * 1024 * 1024 });
    const features = integerAt(o, 'agentFeatures', path, 0, 0xffffffff);
    const decoder = new FrameDecoder();
    try {
      decoder.push(partial);
    } catch (e) {
      throw new SnapshotError(`${path}.partialFrame: ${(e as Error).message}`);
    }
    this.nextId = nextId;
    this.features = features;
    for (const [id, op] of inFlight) this.orphans.set(id, op);
    this.orphanCount = this.orphans.size;
    this.decoder.push(partial);
  }

  /** How many requests were in flight in the snapshot this client was restored from (0 if none). */
  get inFlightAtSnapshot(): number {
    return this.orphanCount;
  }

  private dispatch(f: Frame): void {
    if (f.type === FrameType.Event) {
      // HELLO: `u32 protocolVersion, u32 guestKind, u64 ramBytes, u64 wsBase, u64 wsLimit[, u32 features]`.
      if (f.op === CommonOp.Hello) this.features = f.payload.length >= 36 ? f.payload.readUInt32LE(32) : 0;
      this.onEvent(f);
      return;
    }
    const p = this.pending.get(f.id);
    if (!p && this.abandoned.has(f.id)) {
      if (f.type !== FrameType.StreamChunk) this.abandoned.delete(f.id);
      return;
    }
    const orphanOp = p ? undefined : this.orphans.get(f.id);
    if (orphanOp !== undefined) {
      // Failed, not lost silently: its caller was in the snapshotted VM (see AgentChannelState).
      if (f.type === FrameType.StreamChunk) return;
      this.orphans.delete(f.id);
      this.onProtocolError(`request ${f.id} (op 0x${orphanOp.toString(16)}) was in flight when the snapshot was taken; its answer after the restore has no caller and was dropped`);
      return;
    }
    if (!p) {
      if (f.type === FrameType.Error) this.onProtocolError(`guest error for request ${f.id}: ${errorText(f.payload)}`);
      return;
    }
    if (f.type === FrameType.StreamChunk) {
      this.takeChunk(f, p);
      return;
    }
    // Whatever the final frame is, the request settles here, once.
    this.pending.delete(f.id);
    if (p.timer) clearTimeout(p.timer);
    p.unlisten?.();
    if (f.type === FrameType.Response) p.resolve(f.payload);
    else if (f.type === FrameType.Error) {
      const code = f.payload.length >= 4 ? f.payload.readUInt32LE(0) : 0;
      const text = errorText(f.payload);
      // An OS error's text starts with its errno name (the agent's send_os_error).
      const errno = /^(E[A-Z0-9]{1,15}): /.exec(text)?.[1];
      p.reject(new GuestRequestError(code, p.call ? `${p.call}: ${text}` : `guest refused op 0x${p.op.toString(16)}: ${text}`, { op: p.op, call: p.call, errno }));
    } else {
      this.onProtocolError(`frame of type ${f.type} for request ${f.id}`);
      p.reject(new GuestRequestError(0, `the guest answered op 0x${p.op.toString(16)} with a frame of type ${f.type}, which is not an answer`));
    }
  }

  /**
   * A stream chunk of a request in flight: an output chunk is counted against its stream's credit
   * (beyond it, the guest broke the protocol: the request fails, and nothing of the chunk is kept);
   * a status chunk (STARTED, OPENED) is passed on; any other is dropped with a warning.
   */
  private takeChunk(f: Frame, p: Pending): void {
    const channel = f.flags;
    if (channel === 1 || channel === 2) {
      const w = (p.windows[channel - 1] ??= new StreamWindow());
      if (!w.receive(f.payload.length)) {
        const message = `the guest sent ${f.payload.length} bytes on stream ${channel} of request ${f.id} (op 0x${p.op.toString(16)}) with ${w.credit} bytes of credit left (a window is ${STREAM_WINDOW_BYTES})`;
        this.onProtocolError(message);
        this.giveUp(f.id, new GuestRequestError(0, `${message}: the guest's agent does not keep to stream credit`));
        return;
      }
      p.onChunk?.(channel, f.payload);
      if (!p.holdsChunks) w.consume(f.payload.length);
      // (a discarded stream has taken it too)
      if (this.pending.get(f.id) === p) this.grant(f.id, channel, w);
      return;
    }
    if (channel === CHUNK_STATUS && f.payload.length <= MAX_STATUS_CHUNK_BYTES) {
      p.onChunk?.(channel, f.payload);
      return;
    }
    this.onProtocolError(`stream chunk with flags ${channel} and ${f.payload.length} bytes for request ${f.id} (op 0x${p.op.toString(16)}): dropped`);
  }

  /** Sends a request and resolves with the response payload. */
  request(op: number, payload: Buffer = Buffer.alloc(0), options: RequestOptions = {}): Promise<Buffer> {
    return this.start(op, payload, options).done;
  }

  /**
   * Sends a request and returns its id at once, with a promise of its final frame. The promise
   * settles exactly once: with the final frame, the timeout, {@link close}, or at once when the
   * request cannot be sent (a payload over one frame's {@link MAX_PAYLOAD_BYTES} is a
   * {@link RequestTooLargeError}, and nothing is sent).
   */
  start(op: number, payload: Buffer = Buffer.alloc(0), options: RequestOptions = {}): StartedRequest {
    if (this.closedWith) return { id: this.nextId, done: Promise.reject(this.closedWith) };
    if (options.signal?.aborted) return { id: this.nextId, done: Promise.reject(abortError(`op 0x${op.toString(16)}`, options.signal)) };
    if (payload.length > MAX_PAYLOAD_BYTES) {
      const e = new RequestTooLargeError(payload.length, MAX_PAYLOAD_BYTES, `a request of op 0x${op.toString(16)} with ${payload.length} bytes exceeds the ${MAX_PAYLOAD_BYTES} bytes one frame carries; nothing was sent`);
      return { id: this.nextId, done: Promise.reject(e) };
    }
    const id = this.takeId();
    const frame = encodeFrame({ type: FrameType.Request, id, op, payload });
    const done = new Promise<Buffer>((resolve, reject) => {
      const p: Pending = { op, call: options.call, resolve, reject, onChunk: options.onChunk, onGiveUp: options.onGiveUp, holdsChunks: options.holdsChunks ?? false, windows: [undefined, undefined] };
      if (options.timeoutMs !== undefined) {
        p.timer = setTimeout(() => this.giveUp(id, new TimeoutError(`guest did not answer ${options.call ? `${options.call} (op 0x${op.toString(16)})` : `op 0x${op.toString(16)}`} within ${options.timeoutMs} ms`)), options.timeoutMs);
      }
      const signal = options.signal;
      if (signal) {
        const onAbort = () => this.giveUp(id, abortError(`op 0x${op.toString(16)}`, signal));
        signal.addEventListener('abort', onAbort, { once: true });
        p.unlisten = () => signal.removeEventListener('abort', onAbort);
      }
      this.pending.set(id, p);
      try {
        this.send(frame);
      } catch (e) {
        // Never sent: it settles now, and leaves no entry for a later frame, timer or close.
        this.pending.delete(id);
        if (p.timer) clearTimeout(p.timer);
        p.unlisten?.();
        reject(e instanceof PvisorError ? e : new VmStateError(`op 0x${op.toString(16)} could not be sent to the guest: ${(e as Error).message}`));
      }
    });
    if (this.onSettled) {
      const settled = this.onSettled;
      const t0 = performance.now();
      const ms = () => Math.round((performance.now() - t0) * 1000) / 1000;
      done.then(
        () => settled({ op, call: options.call, ms: ms() }),
        (error: Error) => settled({ op, call: options.call, ms: ms(), error }),
      );
    }
    return { id, done };
  }

  /**
   * Settles request `id` now with `reason`, if it is still waiting: the host stops waiting for it
   * (a timeout, an abort, a consumer that has had enough). With an `onGiveUp` the request's later
   * frames are dropped quietly and `onGiveUp` runs; without, a late final frame is reported as any
   * answer to nothing is.
   */
  giveUp(id: number, reason: Error): void {
    const p = this.pending.get(id);
    if (!p) return;
    this.pending.delete(id);
    if (p.timer) clearTimeout(p.timer);
    p.unlisten?.();
    if (p.onGiveUp) this.abandoned.add(id);
    p.reject(reason);
    p.onGiveUp?.();
  }

  /**
   * The next request id that names nothing in flight: after 2^32 - 1 requests ids wrap, and a
   * request still pending (a long-running process) or one of a restored snapshot's keeps its id;
   * a new request under it would take its answer, and the first would never settle.
   */
  private takeId(): number {
    for (;;) {
      const id = this.nextId;
      this.nextId = id >= 0xffffffff ? 1 : id + 1;
      if (!this.pending.has(id) && !this.orphans.has(id) && !this.abandoned.has(id)) return id;
    }
  }

  /** Fails every outstanding and future request with `error`. */
  close(error: Error = new VmStateError('the VM has stopped')): void {
    this.closedWith ??= error;
    this.dueGrants.clear();
    this.abandoned.clear();
    for (const [id, p] of this.pending) {
      if (p.timer) clearTimeout(p.timer);
      p.unlisten?.();
      p.reject(this.closedWith);
      this.pending.delete(id);
    }
  }
}

/** A number naming one output stream of one request (ids are below 2^32, so it stays exact). */
function streamKey(id: number, channel: OutputChannel): number {
  return id * 4 + channel;
}

/** Most characters of an error frame's text that go into a host warning or error. */
const MAX_ERROR_TEXT = 1000;

/**
 * An error frame's text as the host shows it: the guest wrote it, so control characters (terminal
 * escapes, line breaks that forge log lines) become `?`, and it is cut, with its length said.
 */
function errorText(payload: Buffer): string {
  if (payload.length <= 4) return 'no reason given';
  const bytes = payload.length - 4;
  // eslint-disable-next-line no-control-regex
  const text = payload.subarray(4, 4 + 4 * MAX_ERROR_TEXT).toString('utf8').replace(/[\x00-\x1f\x7f]/g, '?');
  return text.length > MAX_ERROR_TEXT || bytes > 4 * MAX_ERROR_TEXT ? `${text.slice(0, MAX_ERROR_TEXT)}... (${bytes} bytes)` : text;
}
