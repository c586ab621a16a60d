/**
 * The host side of the Linux guest agent's ops (docs/agent-protocol.md): run processes with
 * streamed output, stdin and signals; read and write files; guest memory figures.
 */
import { randomBytes } from 'node:crypto';
import { Readable, Writable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { AbortError, abortError, GuestRequestError, InvalidOptionError, OutputLimitError, TimeoutError } from '../errors';
import { checkOptionKeys, optionKeys } from '../option-keys';
import type { AgentClient } from '../protocol/agent-client';
import { MAX_PAYLOAD_BYTES } from '../protocol/frame';
import { booleanOption, parseTimeoutMs } from '../units';
import { GuestOutput } from './guest-output';
import { DEFAULT_REQUEST_TIMEOUT_MS, CHUNK_STDOUT, frameChunks, requestTimeout } from './agent-requests';
import { GuestProcess } from './guest-process';
import type { Command, ExecBufferOptions, ExecBufferResult, ExecOptions, ExecResult, FilesCallOptions, GuestMemInfo, ListOptions, MkdirOptions, ReadOptions, RemoveOptions, RequestTimeout, SpawnOptions, StatOptions, VmFiles, WriteOptions } from './guest-types';
import { mergeEnvironment } from './environment';
import { userOption } from './guest-user';
import { GuestPtys } from './pty';
import { parseOutputMode } from './output-ring';
import { ProcessRegistry, type GuestProcessInfo } from './process-registry';
import { decodeCount, decodeEntries, decodeStat, FileOp, modeField, pathField, u32Fields as u32s, type DirEntry, type FileStat } from './file-wire';
import { collectOutput } from './exec-collect';

const enum LinuxOp {
  MemInfo = 0x0220,
  DropCaches = 0x0221,
  Shutdown = 0x0230,
  Restored = 0x0231,
  NetConfigure = 0x0232,
}

/** Host entropy sent with RESTORED: 512 bits, twice what the kernel's CRNG is keyed with. */
const RESTORED_ENTROPY_BYTES = 64;
/** The most processes the agent runs at once (its MAX_PROCS): a larger count is not the agent's. */
const MAX_GUEST_PROCESSES = 1024;

/** What the agent did when told its VM was restored (docs/agent-protocol.md, RESTORED). */
export interface RestoredReport {
  /** Processes started before the snapshot, now running detached (stdin closed, output dropped). */
  detachedProcesses: number;
  /** Requests of before the snapshot that the agent ended (a pending stdin write, an open file read). */
  endedRequests: number;
}

const EXEC_STDIN = 1;
/** EXEC's flags bit 1: the command runs on a new terminal (docs/agent-protocol.md, EXEC). */
const EXEC_PTY = 2;
const WRITE_APPEND = 1;
const WRITE_MKDIRS = 2;
/** The `signal` option: absent, or an AbortSignal. */
function abortSignal(value: unknown): AbortSignal | undefined {
  if (value === undefined || value instanceof AbortSignal) return value;
  throw new InvalidOptionError('signal', `expected an AbortSignal, got ${value === null ? 'null' : typeof value}`);
}

/** The timeout, signal and user of a files call, checked. */
function callLimits(agent: AgentClient, options: FilesCallOptions): { timeoutMs: number; signal: AbortSignal | undefined; user: string | undefined } {
  return { timeoutMs: requestTimeout(options), signal: abortSignal(options.signal), user: userOption(agent, options.user) };
}

const SPAWN_OPTION_KEYS = optionKeys<SpawnOptions>({ env: true, cwd: true, stdin: true, timeoutMs: true, signal: true, user: true, stdout: true, stderr: true });
const EXEC_OPTION_KEYS = optionKeys<ExecOptions | ExecBufferOptions>({ env: true, cwd: true, stdin: true, timeoutMs: true, signal: true, user: true, maxBuffer: true, encoding: true, onStdout: true, onStderr: true });

/** Default of {@link ExecOptions.maxBuffer}. */
const DEFAULT_MAX_BUFFER = 1024 * 1024;
/** Default of the `maxBytes` of {@link GuestFiles.read}. */
const DEFAULT_MAX_FILE_BYTES = 256 * 1024 * 1024;

/** A limit option: a whole number (of bytes, or `unit`) from 0, or Infinity. */
function byteLimit(option: string, value: unknown, fallback: number, unit = 'bytes'): number {
  if (value === undefined) return fallback;
  if (value === Infinity) return Infinity;
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < 0) {
    throw new InvalidOptionError(option, `expected a whole number of ${unit} or Infinity, got ${typeof value === 'string' ? JSON.stringify(value) : String(value)}`);
  }
  return value;
}

function str(s: string, what: string): Buffer {
  const bytes = Buffer.from(s, 'utf8');
  if (bytes.includes(0)) throw new InvalidOptionError(what, 'must not contain NUL bytes');
  const len = Buffer.alloc(4);
  len.writeUInt32LE(bytes.length, 0);
  return Buffer.concat([len, bytes]);
}

/** Processes, files and memory figures of a Linux guest. */
export class LinuxGuest {
  /** Files in the guest. */
  readonly files: GuestFiles;
  /** Terminals in the guest. */
  readonly pty: GuestPtys;
  private readonly registry = new ProcessRegistry();

  /**
   * @internal
   * @param sandboxEnv the VM's {@link VmOptions.env}, checked: under every command's own.
   */
  constructor(
    private readonly agent: AgentClient,
    private readonly sandboxEnv: Readonly<Record<string, string>> = {},
  ) {
    this.files = new GuestFiles(agent);
    this.pty = new GuestPtys(agent, (method, command, options, terminal) => this.startProcess(method, command, options, terminal));
  }

  /**
   * Starts a command and returns at once; output streams as it comes. With `timeoutMs` or
   * `signal` the process is killed when either fires, and `exited` rejects with a
   * {@link TimeoutError} or an {@link AbortError}.
   */
  spawn(command: Command, options: SpawnOptions = {}): GuestProcess {
    checkOptionKeys('spawn', options, SPAWN_OPTION_KEYS);
    const p = this.startProcess('spawn', command, options);
    this.registry.add(p, typeof command === 'string' ? command : command.join(' '));
    return p;
  }

  /**
   * The processes started with {@link spawn} that this VM still has: every one running, and the
   * last 64 that ended with output kept (`{ keep }`).
   */
  processes(): GuestProcessInfo[] {
    return this.registry.list();
  }

  /** The spawned process of guest pid `pid` that {@link processes} lists, or undefined. */
  process(pid: number): GuestProcess | undefined {
    return this.registry.get(pid);
  }

  /**
   * {@link spawn} for `method` (spawn, exec, pty.create), which the process's errors name; with a
   * `terminal`, on a new terminal of that size (EXEC_PTY: its stdin, stdout and stderr).
   * @internal
   */
  startProcess(method: string, command: Command, options: SpawnOptions, terminal?: { cols: number; rows: number }): GuestProcess {
    const timeoutMs = options.timeoutMs === undefined ? undefined : parseTimeoutMs('timeoutMs', options.timeoutMs);
    const signal = abortSignal(options.signal);
    const user = userOption(this.agent, options.user);
    const outputModes = { stdout: parseOutputMode('stdout', options.stdout), stderr: parseOutputMode('stderr', options.stderr) };
    const argv = typeof command === 'string' ? ['/bin/sh', '-c', command] : [...command];
    if (!argv.length || !argv[0]) throw new InvalidOptionError('command', 'empty command');
    const env = Object.entries(mergeEnvironment(this.sandboxEnv, options.env)).map(([k, v]) => {
      if (!k || k.includes('=')) throw new InvalidOptionError('env', `bad variable name ${JSON.stringify(k)}`);
      return `${k}=${v}`;
    });
    const payload = Buffer.concat([
      u32s((options.stdin ? EXEC_STDIN : 0) | (terminal ? EXEC_PTY : 0), argv.length, env.length, terminal ? terminal.cols + terminal.rows * 0x10000 : 0),
      str(options.cwd ?? '', 'cwd'),
      ...argv.map((a) => str(a, 'command')),
      ...env.map((e) => str(e, 'env')),
    ]);
    if (payload.length > MAX_PAYLOAD_BYTES) throw new InvalidOptionError('command', 'command line and environment exceed 1 MiB');
    return new GuestProcess(this.agent, payload, { timeoutMs, signal }, { call: callText(method, typeof command === 'string' ? command : argv.join(' ')), argv0: typeof command === 'string' ? undefined : argv[0], stdin: options.stdin === true, user, ...outputModes });
  }

  /** Runs a command to its end and collects its output. */
  exec(command: Command, options: ExecBufferOptions): Promise<ExecBufferResult>;
  exec(command: Command, options?: ExecOptions): Promise<ExecResult>;
  async exec(command: Command, options: ExecOptions | ExecBufferOptions = {}): Promise<ExecResult | ExecBufferResult> {
    checkOptionKeys('exec', options, EXEC_OPTION_KEYS);
    const maxBuffer = byteLimit('maxBuffer', options.maxBuffer, DEFAULT_MAX_BUFFER);
    const encoding: string = options.encoding ?? 'utf8';
    if (encoding !== 'utf8' && encoding !== 'buffer') throw new InvalidOptionError('encoding', `expected "utf8" or "buffer", got ${JSON.stringify(encoding)}`);
    // Each gets what the encoding says: a string (through a decoder, in collectOutput) or a Buffer.
    const listeners: Record<'stdout' | 'stderr', ((b: Buffer) => void) | undefined> = {
      stdout: callbackOption('onStdout', options.onStdout as ((b: Buffer) => void) | undefined),
      stderr: callbackOption('onStderr', options.onStderr as ((b: Buffer) => void) | undefined),
    };
    const p = this.startProcess('exec', command, { env: options.env, cwd: options.cwd, stdin: options.stdin !== undefined, timeoutMs: options.timeoutMs, signal: options.signal, user: options.user });
    return collectOutput(p, { maxBuffer, encoding, onStdout: listeners.stdout, onStderr: listeners.stderr, stdin: options.signal?.aborted ? undefined : options.stdin });
  }

  /** MemTotal, MemFree, MemAvailable and Cached of the guest's /proc/meminfo. */
  async memInfo(options?: RequestTimeout): Promise<GuestMemInfo> {
    const r = await this.agent.request(LinuxOp.MemInfo, Buffer.alloc(0), { timeoutMs: requestTimeout(options) });
    if (r.length < 32) throw new GuestRequestError(0, `the guest answered MEMINFO with ${r.length} bytes, 32 expected`);
    const kb = (i: number) => Number(r.readBigUInt64LE(8 * i)) * 1024;
    return { totalBytes: kb(0), freeBytes: kb(1), availableBytes: kb(2), cachedBytes: kb(3) };
  }

  /**
   * Asks the agent to end the guest cleanly (stop every process, remount a writable rootfs
   * read-only, reboot, which ends the VM). Resolves on the agent's answer, before the VM is gone.
   */
  async shutdown(): Promise<void> {
    await this.agent.request(LinuxOp.Shutdown, Buffer.alloc(0), { timeoutMs: DEFAULT_REQUEST_TIMEOUT_MS });
  }

  /**
   * Tells the agent of a VM just restored from a snapshot that it was: the guest's RNG is reseeded
   * with host entropy, its wall clock set to the host's, and what was in flight at the snapshot
   * detached. The answer is the restored channel's readiness (the agent's HELLO was sent before
   * the snapshot). Every value in it is checked: a guest that answers something else is not a
   * usable agent of this protocol.
   */
  async restored(options: { timeoutMs: number }): Promise<RestoredReport> {
    const head = Buffer.alloc(16);
    head.writeBigUInt64LE(BigInt(Date.now()) * 1_000_000n, 0);
    let r: Buffer;
    try {
      r = await this.agent.request(LinuxOp.Restored, Buffer.concat([head, randomBytes(RESTORED_ENTROPY_BYTES)]), { timeoutMs: options.timeoutMs });
    } catch (e) {
      if (e instanceof GuestRequestError && e.guestCode === 1) {
        throw new GuestRequestError(1, "the guest agent does not know RESTORED (op 0x0231): its initramfs was built before pvisor could restore Linux snapshots; rebuild it with this pvisor's agent");
      }
      throw e;
    }
    if (r.length !== 16) throw new GuestRequestError(0, `the guest answered RESTORED with ${r.length} bytes, 16 expected`);
    const [protocolVersion, guestKind, detachedProcesses, endedRequests] = [0, 4, 8, 12].map((at) => r.readUInt32LE(at));
    if (protocolVersion !== 1 || guestKind !== 2) {
      throw new GuestRequestError(0, `the guest answered RESTORED as protocol ${protocolVersion}, guest kind ${guestKind}; expected protocol 1, guest kind 2 (linux)`);
    }
    // A detached process ends at most a pending stdin write and a close; each open file read
    // holds one of the agent's file descriptors (PID 1 starts with a hard limit of 4096).
    if (detachedProcesses > MAX_GUEST_PROCESSES || endedRequests > 2 * MAX_GUEST_PROCESSES + 4096) {
      throw new GuestRequestError(0, `the guest answered RESTORED with ${detachedProcesses} detached processes and ${endedRequests} ended requests, more than its agent can have`);
    }
    return { detachedProcesses, endedRequests };
  }

  /**
   * Gives the guest's eth0 a configuration of its own, `ADDRESS/PREFIX,GATEWAY[,DNS]` as the
   * kernel command line's `pvisor.net=` does at boot: eth0 is taken down (dropping the routes and
   * neighbours it had), given the address, brought up with the default route, and the resolver
   * written (docs/agent-protocol.md, NET_CONFIGURE). For a clone restored from a snapshot.
   */
  async configureNetwork(spec: string, options: { timeoutMs: number }): Promise<void> {
    try {
      await this.agent.request(LinuxOp.NetConfigure, Buffer.from(spec), { timeoutMs: options.timeoutMs });
    } catch (e) {
      if (e instanceof GuestRequestError && e.guestCode === 1) {
        throw new GuestRequestError(1, "the guest agent does not know NET_CONFIGURE (op 0x0232): its initramfs was built before pvisor could restore networked snapshots; rebuild it with this pvisor's agent");
      }
      throw e;
    }
  }

  /**
   * Drops the guest's clean page cache (and dentries/inodes); with IdleRelease the freed pages go
   * back to the host about 2 s later through free page reporting.
   */
  async dropCaches(options?: RequestTimeout): Promise<void> {
    await this.agent.request(LinuxOp.DropCaches, u32s(3), { timeoutMs: requestTimeout(options) });
  }
}

/** Default of the `maxEntries` of {@link GuestFiles.list}. */
const DEFAULT_MAX_ENTRIES = 100_000;
/** How much a {@link GuestFiles.writeStream} buffers before its `write()` returns false. */
const WRITE_STREAM_HIGH_WATER_BYTES = 1024 * 1024;
/** The chunk that says a write handle's file is open (FILE_WRITE_OPEN). */
const CHUNK_OPENED = 4;

/** `promise`, or a {@link TimeoutError} saying `what` after `ms`. */
function within<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new TimeoutError(`${what} within ${ms} ms`)), ms)));
  return Promise.race([promise, late]).finally(() => clearTimeout(timer));
}

/**
 * Files in the guest: read, write (whole or streamed), list, stat, mkdir, remove, rename. Every
 * call takes `timeoutMs` and `signal` ({@link FilesCallOptions}); paths are 1 to 4095 bytes of
 * UTF-8 without NUL, relative ones relative to `/`.
 * @category Guest
 */
export class GuestFiles implements VmFiles {
  /** @internal */
  constructor(private readonly agent: AgentClient) {}

  /** Tells the agent to close what request `id` opened (its answer does not matter). */
  private cancel(id: number): void {
    this.agent.request(FileOp.Cancel, u32s(id), { timeoutMs: DEFAULT_REQUEST_TIMEOUT_MS }).catch(() => {});
  }

  /**
   * The whole content of a regular file (or what a FIFO's writers write until they close it). A
   * file larger than `maxBytes` rejects with an {@link OutputLimitError} and what came is dropped.
   * `timeoutMs` bounds the whole read; on it, on `signal` and on `maxBytes` the guest closes the file.
   */
  async read(path: string, options: ReadOptions = {}): Promise<Buffer> {
    const maxBytes = byteLimit('maxBytes', options.maxBytes, DEFAULT_MAX_FILE_BYTES);
    const { timeoutMs, signal, user } = callLimits(this.agent, options);
    const parts: Buffer[] = [];
    let size = 0;
    const req = this.agent.start(FileOp.Read, pathField(path), {
      call: callText('files.read', path), user,
      onChunk: (_f, p) => {
        size += p.length;
        if (size > maxBytes) {
          parts.length = 0;
          this.agent.giveUp(req.id, new OutputLimitError(maxBytes, `${path} is larger than ${maxBytes} bytes (maxBytes)`));
        } else parts.push(Buffer.from(p));
      },
      onGiveUp: () => this.cancel(req.id),
      timeoutMs,
      signal,
    });
    const total = decodeCount(await req.done, 'FILE_READ');
    const data = Buffer.concat(parts);
    if (total !== data.length) throw new GuestRequestError(0, `the guest said ${total} bytes but sent ${data.length} for ${path}`);
    return data;
  }

  /**
   * A regular file's content (or a FIFO's) as a stream, with backpressure to the guest: the guest
   * sends at most 256 KiB (the stream's credit window) beyond what the consumer has read, so a
   * file of any size costs the host no more than that, and a stream nobody reads holds only
   * itself (every other answer of this VM goes on). It errors with the guest's
   * {@link GuestRequestError} (no such file, not a regular file), with a {@link TimeoutError} when
   * the guest sends nothing for `timeoutMs` while the stream wants more, with an
   * {@link AbortError} on `signal`, and with a GuestRequestError if the guest's count of bytes
   * differs from what it sent. Destroying it before its end closes the file in the guest.
   */
  readStream(path: string, options: FilesCallOptions = {}): Readable {
    const { timeoutMs, signal, user } = callLimits(this.agent, options);
    const payload = pathField(path);
    if (signal?.aborted) return new Readable({ read() {} }).destroy(abortError(`reading ${path}`, signal)); // nothing sent
    let received = 0;
    let done = false;
    let timer: NodeJS.Timeout | undefined;
    const disarm = () => {
      if (timer) clearTimeout(timer);
      timer = undefined;
    };
    // Waiting on the guest: armed while the stream wants more, never while its consumer is full.
    const arm = () => {
      disarm();
      if (done || s.destroyed) return;
      timer = setTimeout(() => s.destroy(new TimeoutError(`the guest sent nothing of ${path} for ${timeoutMs} ms`)), timeoutMs);
    };
    const out = new GuestOutput(this.agent, CHUNK_STDOUT, arm);
    const s = out.readable;
    const onAbort = () => s.destroy(abortError(`reading ${path}`, signal!));
    const req = this.agent.start(FileOp.Read, payload, {
      call: callText('files.readStream', path), user,
      onChunk: (_f, p) => {
        received += p.length;
        if (out.deliver(p)) arm();
        else disarm();
      },
      onGiveUp: () => this.cancel(req.id),
      holdsChunks: true,
    });
    out.attach(req.id);
    s.once('close', () => {
      disarm();
      signal?.removeEventListener('abort', onAbort);
      // Destroyed before its end (by its consumer, a timeout, an abort): the guest closes the file.
      if (!done) this.agent.giveUp(req.id, new AbortError(`the stream of ${path} was destroyed`));
    });
    req.done.then(
      (r) => {
        done = true;
        disarm();
        try {
          const total = decodeCount(r, 'FILE_READ');
          if (total !== received) throw new GuestRequestError(0, `the guest said ${total} bytes but sent ${received} for ${path}`);
          out.end();
        } catch (e) {
          s.destroy(e as Error);
        }
      },
      (e: Error) => {
        done = true;
        disarm();
        s.destroy(e);
      },
    );
    signal?.addEventListener('abort', onAbort, { once: true });
    arm();
    return s;
  }

  /**
   * Creates or replaces a file (mode default 0o644), creating missing parent directories. Bytes
   * or a string go in frames of 512 KiB, one at a time (`timeoutMs` per frame); a stream or any
   * async iterable of chunks goes through {@link writeStream}, so it is never held whole. On
   * `signal` the write stops and what was written stays.
   */
  async write(path: string, data: string | Uint8Array | AsyncIterable<string | Uint8Array>, options: WriteOptions = {}): Promise<void> {
    if (typeof data !== 'string' && !(data instanceof Uint8Array)) {
      if (data === null || typeof data !== 'object' || typeof (data as AsyncIterable<unknown>)[Symbol.asyncIterator] !== 'function') {
        throw new InvalidOptionError('data', 'expected a string, bytes, a Readable or an async iterable of chunks');
      }
      await pipeline(data, this.writeStream(path, options));
      return;
    }
    const { timeoutMs, signal, user } = callLimits(this.agent, options);
    const mode = modeField('mode', options.mode, 0o644);
    const bytes = typeof data === 'string' ? Buffer.from(data, 'utf8') : Buffer.from(data.buffer, data.byteOffset, data.byteLength);
    const p = pathField(path);
    // One frame in flight: a frame fits in the receive buffers the guest keeps posted, so the
    // device needs no notification per re-posted 4 KiB buffer. Sent all at once, 10 MiB took
    // 4.5-20 s in the nested harness (a notification and an interrupt per 4 KiB); one at a
    // time, 0.9-3.3 s.
    let i = 0;
    for (const chunk of frameChunks(bytes)) {
      const flags = WRITE_MKDIRS | (i++ > 0 ? WRITE_APPEND : 0);
      await this.agent.request(FileOp.Write, Buffer.concat([u32s(flags, mode), p, chunk]), { timeoutMs, signal, call: callText('files.write', path), user });
    }
  }

  /**
   * A stream that writes a file as data comes (created or truncated, mode default 0o644, missing
   * parents created): frames of up to 512 KiB, each sent once the guest has taken the one before,
   * so neither side holds the whole file; `write()` returns false once 1 MiB waits. It finishes
   * (`'finish'`, or `pipeline` resolving) once the guest has closed the file and confirmed every
   * byte. Errors: the guest's {@link GuestRequestError} (cannot open, disk full), a
   * {@link TimeoutError} when the guest does not take a frame (or open or close the file) within
   * `timeoutMs`, an {@link AbortError} on `signal`. An error or `destroy()` closes the file in the
   * guest; what was written stays.
   */
  writeStream(path: string, options: WriteOptions = {}): Writable {
    const { timeoutMs, signal, user } = callLimits(this.agent, options);
    const mode = modeField('mode', options.mode, 0o644);
    const payload = Buffer.concat([u32s(WRITE_MKDIRS, mode), pathField(path)]);
    if (signal?.aborted) return new Writable({ write: (_c, _e, cb) => cb() }).destroy(abortError(`writing ${path}`, signal)); // nothing sent
    let sent = 0;
    let closed = false;
    let opened!: () => void;
    const open = new Promise<void>((resolve) => (opened = resolve));
    const handle = this.agent.start(FileOp.WriteOpen, payload, {
      call: callText('files.writeStream', path), user,
      onChunk: (flags) => {
        if (flags === CHUNK_OPENED) opened();
      },
      onGiveUp: () => this.cancel(handle.id),
    });
    handle.done.catch(() => {}); // its reason reaches the stream through `ready` or `final`
    // The file is open, or why it is not (the guest refused, or said nothing in time).
    const ready = within(Promise.race([open, handle.done.then(() => Promise.reject(new GuestRequestError(0, `the guest ended the write of ${path} before opening it`)))]), timeoutMs, `the guest did not open ${path}`);
    ready.catch(() => {});
    // A data or close request given up (its timeout) gives the handle up: the guest closes the
    // file, and ends that request too, quietly.
    const giveUpHandle = () => this.agent.giveUp(handle.id, new AbortError(`the write of ${path} was given up`));
    const send = async (bytes: Buffer) => {
      await ready;
      for (const part of frameChunks(bytes)) {
        if (!part.length) continue;
        await this.agent.request(FileOp.WriteData, Buffer.concat([u32s(handle.id), part]), { timeoutMs, onGiveUp: giveUpHandle });
        sent += part.length;
      }
    };
    const onAbort = () => w.destroy(abortError(`writing ${path}`, signal!));
    const w: Writable = new Writable({
      highWaterMark: WRITE_STREAM_HIGH_WATER_BYTES,
      decodeStrings: true,
      writev: (chunks, cb) => {
        send(Buffer.concat(chunks.map((c) => c.chunk as Buffer))).then(() => cb(), cb);
      },
      final: (cb) => {
        (async () => {
          await ready;
          await this.agent.request(FileOp.WriteClose, u32s(handle.id), { timeoutMs, onGiveUp: giveUpHandle });
          closed = true;
          const total = decodeCount(await within(handle.done, timeoutMs, `the guest did not end the write of ${path}`), 'FILE_WRITE_OPEN');
          if (total !== sent) throw new GuestRequestError(0, `the guest said ${total} bytes of ${path} written, ${sent} were sent`);
        })().then(() => cb(), cb);
      },
      destroy: (error, cb) => {
        signal?.removeEventListener('abort', onAbort);
        // Before the close went through, the guest closes the file and ends the handle.
        if (!closed) this.agent.giveUp(handle.id, error ?? new AbortError(`the write stream of ${path} was destroyed`));
        cb(error);
      },
    });
    signal?.addEventListener('abort', onAbort, { once: true });
    return w;
  }

  /**
   * The entries of a directory (not `.` and `..`), in the guest's order, each as lstat sees it.
   * The guest sends them in chunks as it reads the directory; more than `maxEntries` rejects with
   * an {@link OutputLimitError}. `timeoutMs` bounds the whole listing; on it, on `signal` and on
   * `maxEntries` the guest closes the directory. Not a directory: the guest's
   * {@link GuestRequestError} (`ENOTDIR`).
   */
  async list(path: string, options: ListOptions = {}): Promise<DirEntry[]> {
    const { timeoutMs, signal, user } = callLimits(this.agent, options);
    const maxEntries = byteLimit('maxEntries', options.maxEntries, DEFAULT_MAX_ENTRIES, 'entries');
    const entries: DirEntry[] = [];
    const req = this.agent.start(FileOp.List, pathField(path), {
      call: callText('files.list', path), user,
      onChunk: (_f, p) => {
        try {
          decodeEntries(p, entries);
          if (entries.length > maxEntries) throw new OutputLimitError(maxEntries, `${path} has more than ${maxEntries} entries (maxEntries)`);
        } catch (e) {
          entries.length = 0;
          this.agent.giveUp(req.id, e as Error);
        }
      },
      onGiveUp: () => this.cancel(req.id),
      timeoutMs,
      signal,
    });
    const count = decodeCount(await req.done, 'FILE_LIST');
    if (count !== entries.length) throw new GuestRequestError(0, `the guest said ${count} entries but sent ${entries.length} for ${path}`);
    return entries;
  }

  /** A file's type, mode, owner, size and mtime; a symlink's own unless `followSymlinks`, with its target. */
  async stat(path: string, options: StatOptions = {}): Promise<FileStat> {
    const { timeoutMs, signal, user } = callLimits(this.agent, options);
    const follow = booleanOption('followSymlinks', options.followSymlinks, false);
    return decodeStat(await this.agent.request(FileOp.Stat, Buffer.concat([u32s(follow ? 1 : 0), pathField(path)]), { timeoutMs, signal, call: callText('files.stat', path), user }));
  }

  /** Creates a directory (mode default 0o755, set exactly); an existing one is `EEXIST` unless `recursive`. */
  async mkdir(path: string, options: MkdirOptions = {}): Promise<void> {
    const { timeoutMs, signal, user } = callLimits(this.agent, options);
    const recursive = booleanOption('recursive', options.recursive, false);
    const mode = modeField('mode', options.mode, 0o755);
    await this.agent.request(FileOp.Mkdir, Buffer.concat([u32s(recursive ? 1 : 0, mode), pathField(path)]), { timeoutMs, signal, call: callText('files.mkdir', path), user });
  }

  /** Removes a file, a symlink or an empty directory; with `recursive`, a whole tree. */
  async remove(path: string, options: RemoveOptions = {}): Promise<void> {
    const { timeoutMs, signal, user } = callLimits(this.agent, options);
    const recursive = booleanOption('recursive', options.recursive, false);
    decodeCount(await this.agent.request(FileOp.Remove, Buffer.concat([u32s(recursive ? 1 : 0), pathField(path)]), { timeoutMs, signal, call: callText('files.remove', path), user }), 'FILE_REMOVE');
  }

  /** Renames (moves) `from` to `to` within the guest's filesystem, replacing `to` as rename(2) does. */
  async rename(from: string, to: string, options: FilesCallOptions = {}): Promise<void> {
    const { timeoutMs, signal, user } = callLimits(this.agent, options);
    await this.agent.request(FileOp.Rename, Buffer.concat([pathField(from, 'from'), pathField(to, 'to')]), { timeoutMs, signal, call: callText('files.rename', from, to), user });
  }
}

/**
 * How an error names the call that failed: `files.read('/nope.txt')`, `exec('ls -l')`. Arguments
 * are the guest's paths and commands: quoted, control characters shown as `?`, each cut at 200
 * characters so that a message stays a line.
 */
function callText(method: string, ...args: string[]): string {
  // eslint-disable-next-line no-control-regex
  const quote = (a: string) => `'${(a.length > 200 ? `${a.slice(0, 200)}...` : a).replace(/[\\']/g, '\\$&').replace(/[\x00-\x1f\x7f]/g, '?')}'`;
  return `${method}(${args.map(quote).join(', ')})`;
}

/** An optional callback option: undefined or a function, else an {@link InvalidOptionError}. */
function callbackOption<T extends (...args: never[]) => unknown>(option: string, value: T | undefined): T | undefined {
  if (value !== undefined && typeof value !== 'function') throw new InvalidOptionError(option, `expected a function, got ${typeof value}`);
  return value;
}
