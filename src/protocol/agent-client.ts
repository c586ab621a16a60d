/**
 * The host end of the agent protocol: numbered requests with several outstanding at once,
 * responses matched by id, guest events delivered to a callback.
 */
import { abortError, GuestRequestError, PvisorError, RequestTooLargeError, SnapshotError, TimeoutError, VmStateError } from '../errors';
import { arrayAt, base64Of, bytesAt, checkVersion, integerAt, objectAt } from '../backends/kvm/state-fields';
import { encodeFrame, FrameDecoder, FrameType, MAX_PAYLOAD_BYTES, type Frame } from './frame';

/** Common ops (both guests). */
export const enum CommonOp {
  Hello = 0x0001,
  Ping = 0x0002,
}

interface Pending {
  op: number;
  resolve(payload: Buffer): void;
  reject(error: Error): void;
  onChunk?: (flags: number, payload: Buffer) => void;
  onGiveUp?: () => void;
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
}

/** A request in flight: its id names it in later requests (a process handle, for instance). */
export interface StartedRequest {
  id: number;
  /** The final response's payload, or the guest's error. */
  done: Promise<Buffer>;
}

/** The version of {@link AgentChannelState} this code writes and reads. */
export const AGENT_CHANNEL_STATE_VERSION = 1;

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

  /** Consumers whose buffers are full (see {@link holdFlow}). */
  private readonly flowHolds = new Set<object>();

  /**
   * @param onFlow told `true` when the first consumer holds the channel and `false` when the last
   *   one lets go: the owner stops (or starts again) taking what the guest transmits
   */
  constructor(
    private readonly send: (bytes: Buffer) => void,
    private readonly onEvent: (frame: Frame) => void,
    private readonly onProtocolError: (message: string) => void,
    private readonly onFlow: (held: boolean) => void = () => {},
  ) {}

  /**
   * A consumer of stream chunks (`holder`, e.g. a process's stdout) is full: nothing more is taken
   * from the guest until every holder has let go ({@link releaseFlow}). The whole channel waits,
   * answers to other requests included, so the guest's agent and the writer in the guest block
   * instead of the host buffering without end.
   */
  holdFlow(holder: object): void {
    if (this.closedWith || this.flowHolds.has(holder)) return;
    this.flowHolds.add(holder);
    if (this.flowHolds.size === 1) this.onFlow(true);
  }

  /** `holder` takes chunks again, or takes none any more (its request ended, it was destroyed). */
  releaseFlow(holder: object): void {
    if (this.flowHolds.delete(holder) && this.flowHolds.size === 0) this.onFlow(false);
  }

  /** How many consumers hold the channel now. */
  get flowHolders(): number {
    return this.flowHolds.size;
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
    };
  }

  /**
   * Takes a {@link saveState} value (unchecked, from a file) into this fresh client, before any
   * request. A malformed one is a {@link SnapshotError} naming the field, and nothing changes.
   */
  restoreState(value: unknown, path = 'agent'): void {
    if (this.pending.size > 0 || this.nextId !== 1) throw new SnapshotError(`${path}: the agent client has already been used`);
    const o = objectAt(value, path);
    checkVersion(o, path, AGENT_CHANNEL_STATE_VERSION);
    const nextId = integerAt(o, 'nextId', path, 1, 0xffffffff);
    const inFlight = arrayAt(o, 'inFlight', path, 65536).map((r, i) => {
      const e = objectAt(r, `${path}.inFlight[${i}]`);
      return [integerAt(e, 'id', `${path}.inFlight[${i}]`, 1, 0xffffffff), integerAt(e, 'op', `${path}.inFlight[${i}]`, 0, 0xffff)] as const;
    });
    const partial = bytesAt(o, 'partialFrame', path, { min: 0, max: 64 * 1024 * 1024 });
    const decoder = new FrameDecoder();
    try {
      decoder.push(partial);
    } catch (e) {
      throw new SnapshotError(`${path}.partialFrame: ${(e as Error).message}`);
    }
    this.nextId = nextId;
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
      p.onChunk?.(f.flags, f.payload);
      return;
    }
    // Whatever the final frame is, the request settles here, once.
    this.pending.delete(f.id);
    if (p.timer) clearTimeout(p.timer);
    p.unlisten?.();
    if (f.type === FrameType.Response) p.resolve(f.payload);
    else if (f.type === FrameType.Error) {
      const code = f.payload.length >= 4 ? f.payload.readUInt32LE(0) : 0;
      p.reject(new GuestRequestError(code, `guest refused op 0x${p.op.toString(16)}: ${errorText(f.payload)}`));
    } else {
      this.onProtocolError(`frame of type ${f.type} for request ${f.id}`);
      p.reject(new GuestRequestError(0, `the guest answered op 0x${p.op.toString(16)} with a frame of type ${f.type}, which is not an answer`));
    }
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
      const p: Pending = { op, resolve, reject, onChunk: options.onChunk, onGiveUp: options.onGiveUp };
      if (options.timeoutMs !== undefined) {
        p.timer = setTimeout(() => this.giveUp(id, new TimeoutError(`guest did not answer op 0x${op.toString(16)} within ${options.timeoutMs} ms`)), options.timeoutMs);
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
    this.flowHolds.clear();
    this.abandoned.clear();
    for (const [id, p] of this.pending) {
      if (p.timer) clearTimeout(p.timer);
      p.unlisten?.();
      p.reject(this.closedWith);
      this.pending.delete(id);
    }
  }
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
