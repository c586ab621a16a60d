/**
 * The guest of a VM in another process, as a {@link VmHandle} reaches it over the VM's control
 * socket: processes ({@link RemoteProcess}, a {@link VmProcess}), files ({@link RemoteFiles}, a
 * {@link VmFiles}) and exec collected from a spawned process, with the options and errors the
 * same calls have on a {@link Vm}.
 * @module
 */
import { Writable, type Readable } from 'node:stream';
import { finished, pipeline } from 'node:stream/promises';
import { constants as osConstants } from 'node:os';
import { AbortError, abortError, InvalidOptionError, OutputLimitError, TimeoutError, type PvisorError } from './errors';
import { ControlStream } from './control-stream-client';
import { StreamChannel } from './control-stream';
import type { ControlRequest, ControlResponse } from './control-socket';
import type { DirEntry, FileStat } from './guest/file-wire';
import type {
  Command,
  ExecBufferOptions,
  ExecBufferResult,
  ExecOptions,
  ExecResult,
  ExitStatus,
  FilesCallOptions,
  ListOptions,
  MkdirOptions,
  ReadOptions,
  RemoveOptions,
  RequestTimeout,
  SpawnOptions,
  StatOptions,
  WriteOptions,
  VmFiles,
  VmProcess,
} from './guest/guest-types';
import { checkOptionKeys, optionKeys } from './option-keys';
import { parseTimeoutMs } from './units';
import { collectOutput } from './guest/exec-collect';
import { stdinWritable } from './guest/guest-process';

/** How {@link RemoteProcess} and {@link RemoteFiles} reach the VM: its socket, its id, a one-answer request. */
export interface RemoteVm {
  socketPath: string;
  id: string;
  /** One request and its answer, an error answer thrown as its typed error. */
  request(request: ControlRequest, timeoutMs: number): Promise<ControlResponse & { ok: true }>;
}

/** As a request in the VM's process: 30 s unless the call says. */
const DEFAULT_REQUEST_TIMEOUT_MS = 30_000;
/** What the round trip to the VM's process may add to a call's own timeout. */
const ROUND_TRIP_MS = 10_000;
/** Default of `maxBuffer` (as Vm.exec's) and of `maxBytes` (as files.read's). */
const DEFAULT_MAX_BUFFER = 1024 * 1024;
const DEFAULT_MAX_FILE_BYTES = 256 * 1024 * 1024;

const SPAWN_OPTION_KEYS = optionKeys<SpawnOptions>({ env: true, cwd: true, stdin: true, timeoutMs: true, signal: true, user: true, stdout: true, stderr: true });
const EXEC_OPTION_KEYS = optionKeys<ExecOptions | ExecBufferOptions>({ env: true, cwd: true, stdin: true, timeoutMs: true, signal: true, maxBuffer: true, encoding: true, onStdout: true, onStderr: true, user: true });

function timeoutOf(options: RequestTimeout | undefined): number {
  return options?.timeoutMs === undefined ? DEFAULT_REQUEST_TIMEOUT_MS : parseTimeoutMs('timeoutMs', options.timeoutMs);
}

function signalOf(value: unknown): AbortSignal | undefined {
  if (value === undefined || value instanceof AbortSignal) return value;
  throw new InvalidOptionError('signal', `expected an AbortSignal, got ${value === null ? 'null' : typeof value}`);
}

function signalNumber(signal: NodeJS.Signals | number): number {
  const n = typeof signal === 'number' ? signal : osConstants.signals[signal];
  if (!Number.isInteger(n) || n < 1 || n > 64) throw new InvalidOptionError('signal', `unknown signal ${String(signal)}`);
  return n;
}

/** A limit option: a whole number from 0, or Infinity. */
function limit(option: string, value: unknown, fallback: number): number {
  if (value === undefined) return fallback;
  if (value === Infinity) return Infinity;
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < 0) throw new InvalidOptionError(option, `expected a whole number or Infinity, got ${String(value)}`);
  return value;
}

/** What an exit status from the VM's process must look like. */
function exitStatus(v: unknown): ExitStatus {
  const r = v as Partial<ExitStatus> | null;
  const code = r?.exitCode;
  const signal = r?.signal;
  if (!r || !(code === null || Number.isSafeInteger(code)) || !(signal === null || (typeof signal === 'string' && signal.length < 16))) {
    throw new InvalidOptionError('exit status', `malformed exit status from the VM: ${JSON.stringify(v)?.slice(0, 100)}`);
  }
  return { exitCode: code as number | null, signal: signal as NodeJS.Signals | null };
}

/**
 * A process in the guest of a VM of another process, streamed over its own control connection:
 * stdout and stderr under credit (one nobody reads holds only this process), stdin within the
 * credit the VM's process grants.
 */
export class RemoteProcess implements VmProcess {
  readonly stdout: Readable;
  readonly stderr: Readable;
  readonly pid: Promise<number>;
  readonly exited: Promise<ExitStatus>;
  private readonly stream: ControlStream;
  private stdinStream: Writable | undefined;
  private stdinQueue: Promise<unknown> = Promise.resolve();
  private stoppedFor: Error | undefined;

  /** @internal */
  constructor(vm: RemoteVm, command: Command, options: SpawnOptions = {}) {
    checkOptionKeys('spawn', options, SPAWN_OPTION_KEYS);
    const timeoutMs = options.timeoutMs === undefined ? undefined : parseTimeoutMs('timeoutMs', options.timeoutMs);
    const signal = signalOf(options.signal);
    if (typeof command !== 'string' && (!Array.isArray(command) || !command.length)) throw new InvalidOptionError('command', 'empty command');
    this.stdinOpen = options.stdin === true;
    const request: ControlRequest = {
      op: 'spawn',
      command: typeof command === 'string' ? command : [...command],
      stdin: this.stdinOpen,
      ...(options.env !== undefined && { env: options.env }),
      ...(options.cwd !== undefined && { cwd: options.cwd }),
      ...(timeoutMs !== undefined && { timeoutMs }),
      ...(options.user !== undefined && { user: options.user }),
      ...(options.stdout !== undefined && { stdout: options.stdout }),
      ...(options.stderr !== undefined && { stderr: options.stderr }),
    };
    this.stream = new ControlStream(vm.socketPath, vm.id, request, [StreamChannel.Stdout, StreamChannel.Stderr], DEFAULT_REQUEST_TIMEOUT_MS);
    if (signal?.aborted) this.stream.destroy(abortError('the command', signal));
    this.stdout = this.stream.output(StreamChannel.Stdout);
    this.stderr = this.stream.output(StreamChannel.Stderr);
    this.pid = this.stream.answered.then((r) => {
      if (!Number.isSafeInteger(r.pid)) throw new InvalidOptionError('pid', `the VM answered spawn without a pid`);
      return r.pid!;
    });
    this.pid.catch(() => {});
    const onAbort = () => this.stop(abortError('the command', signal!));
    signal?.addEventListener('abort', onAbort, { once: true });
    this.exited = this.stream.result.then(
      (v) => {
        if (this.stoppedFor) throw this.stoppedFor;
        return exitStatus(v);
      },
      (e: Error) => {
        throw this.stoppedFor ?? e;
      },
    );
    this.exited.finally(() => signal?.removeEventListener('abort', onAbort)).catch(() => {});
  }

  private readonly stdinOpen: boolean;

  get stdin(): Writable | null {
    if (!this.stdinOpen) return null;
    this.stdinStream ??= stdinWritable(this);
    return this.stdinStream;
  }

  /** Kills the process for `reason`, which `exited` rejects with. @internal */
  stop(reason: Error): void {
    if (this.stoppedFor) return;
    this.stoppedFor = reason;
    this.kill('SIGKILL').catch(() => this.stream.destroy(reason as PvisorError));
  }

  /** True once the host killed it for a reason of its own. @internal */
  get stopped(): boolean {
    return this.stoppedFor !== undefined;
  }

  write(data: string | Uint8Array, options?: RequestTimeout): Promise<void> {
    const timeoutMs = timeoutOf(options);
    const bytes = typeof data === 'string' ? Buffer.from(data, 'utf8') : Buffer.from(data);
    const next = this.stdinQueue.then(() => within(this.stream.write(bytes), timeoutMs, 'the guest did not take stdin'));
    this.stdinQueue = next.catch(() => {});
    return next;
  }

  end(options?: RequestTimeout): Promise<void> {
    const timeoutMs = timeoutOf(options);
    const next = this.stdinQueue.then(() => within(this.stream.endInput(), timeoutMs, 'the guest did not close stdin'));
    this.stdinQueue = next.catch(() => {});
    return next;
  }

  async kill(signal: NodeJS.Signals | number = 'SIGTERM', options?: RequestTimeout): Promise<void> {
    const n = signalNumber(signal);
    await within(this.stream.answered.then(() => this.stream.signal(n)), timeoutOf(options), 'the VM did not deliver the signal');
  }
}

/** The `user` of a call, as its request carries it (the VM's process checks it as its own call would). */
function userOf(options: { user?: string | undefined }): { user?: string } {
  if (options.user === undefined) return {};
  if (typeof options.user !== 'string') throw new InvalidOptionError('user', `expected a user name or "uid:gid", got ${typeof options.user}`);
  return { user: options.user };
}

/** `promise`, or a {@link TimeoutError} saying `what` after `ms`. */
function within<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new TimeoutError(`${what} within ${ms} ms`)), ms)));
  return Promise.race([promise, late]).finally(() => clearTimeout(timer));
}

/** Runs a command in a VM of another process and collects its output, as {@link Vm.exec} does. */
export async function remoteExec(vm: RemoteVm, command: Command, options: ExecOptions | ExecBufferOptions = {}): Promise<ExecResult | ExecBufferResult> {
  checkOptionKeys('exec', options, EXEC_OPTION_KEYS);
  const maxBuffer = limit('maxBuffer', options.maxBuffer, DEFAULT_MAX_BUFFER);
  const encoding: string = options.encoding ?? 'utf8';
  if (encoding !== 'utf8' && encoding !== 'buffer') throw new InvalidOptionError('encoding', `expected "utf8" or "buffer", got ${JSON.stringify(encoding)}`);
  for (const k of ['onStdout', 'onStderr'] as const) if (options[k] !== undefined && typeof options[k] !== 'function') throw new InvalidOptionError(k, `expected a function, got ${typeof options[k]}`);
  const p = new RemoteProcess(vm, command, { env: options.env, cwd: options.cwd, stdin: options.stdin !== undefined, timeoutMs: options.timeoutMs, signal: options.signal, user: options.user });
  return collectOutput(p, { maxBuffer, encoding, onStdout: options.onStdout, onStderr: options.onStderr, stdin: options.stdin });
}

/** Files of the guest of a VM of another process, over its control socket. */
export class RemoteFiles implements VmFiles {
  /** @internal */
  constructor(private readonly vm: RemoteVm) {}

  async read(path: string, options: ReadOptions = {}): Promise<Buffer> {
    const maxBytes = limit('maxBytes', options.maxBytes, DEFAULT_MAX_FILE_BYTES);
    const s = this.readStream(path, { ...(options.timeoutMs !== undefined && { timeoutMs: options.timeoutMs }), ...(options.signal && { signal: options.signal }), ...userOf(options) });
    const parts: Buffer[] = [];
    let size = 0;
    for await (const chunk of s as AsyncIterable<Buffer>) {
      size += chunk.length;
      if (size > maxBytes) {
        s.destroy();
        throw new OutputLimitError(maxBytes, `${path} is larger than ${maxBytes} bytes (maxBytes)`);
      }
      parts.push(chunk);
    }
    return Buffer.concat(parts);
  }

  readStream(path: string, options: FilesCallOptions = {}): Readable {
    const timeoutMs = options.timeoutMs === undefined ? undefined : parseTimeoutMs('timeoutMs', options.timeoutMs);
    const signal = signalOf(options.signal);
    const stream = new ControlStream(this.vm.socketPath, this.vm.id, { op: 'files.readStream', path, ...(timeoutMs !== undefined && { timeoutMs }), ...userOf(options) }, [StreamChannel.Stdout], (timeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS) + ROUND_TRIP_MS, true);
    const s = stream.output(StreamChannel.Stdout);
    const onAbort = () => stream.destroy(abortError(`reading ${path}`, signal!));
    if (signal?.aborted) onAbort();
    signal?.addEventListener('abort', onAbort, { once: true });
    s.once('close', () => {
      signal?.removeEventListener('abort', onAbort);
      // Destroyed by its consumer before its end: the VM's process closes the file.
      if (!s.readableEnded) stream.destroy(new AbortError(`the stream of ${path} was destroyed`));
    });
    return s;
  }

  async write(path: string, data: string | Uint8Array | AsyncIterable<string | Uint8Array>, options: WriteOptions = {}): Promise<void> {
    if (typeof data === 'string' || data instanceof Uint8Array) {
      const w = this.writeStream(path, options);
      w.end(typeof data === 'string' ? Buffer.from(data, 'utf8') : Buffer.from(data.buffer, data.byteOffset, data.byteLength));
      await finished(w);
      return;
    }
    if (data === null || typeof data !== 'object' || typeof (data as AsyncIterable<unknown>)[Symbol.asyncIterator] !== 'function') {
      throw new InvalidOptionError('data', 'expected a string, bytes, a Readable or an async iterable of chunks');
    }
    await pipeline(data, this.writeStream(path, options));
  }

  writeStream(path: string, options: WriteOptions = {}): Writable {
    const timeoutMs = options.timeoutMs === undefined ? undefined : parseTimeoutMs('timeoutMs', options.timeoutMs);
    const signal = signalOf(options.signal);
    if (options.mode !== undefined && typeof options.mode !== 'number') throw new InvalidOptionError('mode', `expected a number, got ${typeof options.mode}`);
    const stream = new ControlStream(
      this.vm.socketPath,
      this.vm.id,
      { op: 'files.writeStream', path, ...(options.mode !== undefined && { mode: options.mode }), ...(timeoutMs !== undefined && { timeoutMs }), ...userOf(options) },
      [],
      (timeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS) + ROUND_TRIP_MS,
    );
    let ended = false;
    const onAbort = () => w.destroy(abortError(`writing ${path}`, signal!));
    const w: Writable = new Writable({
      highWaterMark: 1024 * 1024,
      write: (chunk: Buffer, _e, cb) => {
        // A write the VM refused (the file could not be opened) fails with the stream's reason.
        stream.answered.then(() => stream.write(chunk)).then(() => cb(), (e: Error) => cb(stream.failure ?? e));
      },
      final: (cb) => {
        stream.answered
          .then(() => stream.endInput())
          .then(() => stream.result)
          .then(
            () => ((ended = true), cb()),
            (e: Error) => cb(stream.failure ?? e),
          );
      },
      destroy: (error, cb) => {
        signal?.removeEventListener('abort', onAbort);
        if (!ended) stream.destroy((error as PvisorError | null) ?? new AbortError(`the write stream of ${path} was destroyed`));
        cb(error);
      },
    });
    if (signal?.aborted) onAbort();
    else signal?.addEventListener('abort', onAbort, { once: true });
    return w;
  }

  async list(path: string, options: ListOptions = {}): Promise<DirEntry[]> {
    const { timeoutMs, signal } = options;
    const maxEntries = options.maxEntries === Infinity ? undefined : options.maxEntries;
    const r = await this.call({ op: 'files', call: 'list', path, ...(maxEntries !== undefined && { maxEntries }), ...(timeoutMs !== undefined && { timeoutMs }), ...userOf(options) }, timeoutMs, signal);
    if (!Array.isArray(r.entries)) throw new InvalidOptionError('entries', 'the VM answered a listing without entries');
    return r.entries;
  }

  async stat(path: string, options: StatOptions = {}): Promise<FileStat> {
    const { timeoutMs, signal, followSymlinks } = options;
    const r = await this.call({ op: 'files', call: 'stat', path, ...(followSymlinks !== undefined && { followSymlinks }), ...(timeoutMs !== undefined && { timeoutMs }), ...userOf(options) }, timeoutMs, signal);
    if (!r.stat || typeof r.stat !== 'object') throw new InvalidOptionError('stat', 'the VM answered a stat without one');
    return r.stat;
  }

  async mkdir(path: string, options: MkdirOptions = {}): Promise<void> {
    const { timeoutMs, signal, recursive, mode } = options;
    await this.call({ op: 'files', call: 'mkdir', path, ...(recursive !== undefined && { recursive }), ...(mode !== undefined && { mode }), ...(timeoutMs !== undefined && { timeoutMs }), ...userOf(options) }, timeoutMs, signal);
  }

  async remove(path: string, options: RemoveOptions = {}): Promise<void> {
    const { timeoutMs, signal, recursive } = options;
    await this.call({ op: 'files', call: 'remove', path, ...(recursive !== undefined && { recursive }), ...(timeoutMs !== undefined && { timeoutMs }), ...userOf(options) }, timeoutMs, signal);
  }

  async rename(from: string, to: string, options: FilesCallOptions = {}): Promise<void> {
    const { timeoutMs, signal } = options;
    await this.call({ op: 'files', call: 'rename', path: from, to, ...(timeoutMs !== undefined && { timeoutMs }), ...userOf(options) }, timeoutMs, signal);
  }

  /**
   * One files request. Its options are checked in the VM's process, as a call there would check
   * them; an aborted `signal` rejects here at once (what was sent may have been done, as on a Vm).
   */
  private async call(request: ControlRequest, timeoutMs: number | undefined, signalOption: unknown): Promise<ControlResponse & { ok: true }> {
    const signal = signalOf(signalOption);
    if (signal?.aborted) throw abortError('the files call', signal);
    const answer = this.vm.request(request, (typeof timeoutMs === 'number' ? timeoutMs : DEFAULT_REQUEST_TIMEOUT_MS) + ROUND_TRIP_MS);
    if (!signal) return answer;
    let onAbort!: () => void;
    const aborted = new Promise<never>((_, reject) => (onAbort = () => reject(abortError('the files call', signal))));
    signal.addEventListener('abort', onAbort, { once: true });
    return Promise.race([answer, aborted]).finally(() => signal.removeEventListener('abort', onAbort));
  }
}
