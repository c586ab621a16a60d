/**
 * The host side of the Linux guest agent's ops (docs/agent-protocol.md): run processes with
 * streamed output, stdin and signals; read and write files; guest memory figures.
 */
import { randomBytes } from 'node:crypto';
import { constants as osConstants } from 'node:os';
import { Readable } from 'node:stream';
import { GuestRequestError, InvalidOptionError, OutputLimitError, TimeoutError } from '../errors';
import type { AgentClient } from '../protocol/agent-client';
import { MAX_PAYLOAD_BYTES } from '../protocol/frame';
import { parseTimeoutMs } from '../units';

const enum LinuxOp {
  Exec = 0x0201,
  StdinWrite = 0x0202,
  StdinClose = 0x0203,
  Kill = 0x0204,
  FileRead = 0x0210,
  FileWrite = 0x0211,
  MemInfo = 0x0220,
  DropCaches = 0x0221,
  Shutdown = 0x0230,
  Restored = 0x0231,
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

const CHUNK_STDOUT = 1;
const CHUNK_STDERR = 2;
const CHUNK_STARTED = 4;
const EXEC_STDIN = 1;
const WRITE_APPEND = 1;
const WRITE_MKDIRS = 2;
/** Data per STDIN_WRITE / FILE_WRITE frame, well inside the 1 MiB payload limit. */
const DATA_PER_FRAME = 512 * 1024;
/**
 * How long a request the agent answers at once may take by default (a file frame, a kill, the
 * memory figures): the agent answers these in milliseconds, so a silent one is a broken one.
 */
const DEFAULT_REQUEST_TIMEOUT_MS = 30_000;
/** After a timeout's SIGKILL, how long exec waits for the process's end before it gives up on it. */
const KILL_GRACE_MS = 5_000;

/** Options of a request to the agent. */
export interface RequestTimeout {
  /**
   * Reject with a {@link TimeoutError} if the agent has not answered after this long (for a write
   * of a file or of stdin, per frame of 512 KiB; for a read, the whole file). A whole number of
   * milliseconds, 1 to 2^31-1. Default 30000.
   */
  timeoutMs?: number;
}

function requestTimeout(options: RequestTimeout | undefined): number {
  return options?.timeoutMs === undefined ? DEFAULT_REQUEST_TIMEOUT_MS : parseTimeoutMs('timeoutMs', options.timeoutMs);
}

/** A command: an argv array, or a string that `/bin/sh -c` runs. */
export type Command = string | readonly string[];

/** Options of {@link Vm.spawn}. */
export interface SpawnOptions {
  /** Variables added to (or overriding) the guest's base environment (PATH, HOME). */
  env?: Record<string, string>;
  /** Working directory in the guest. Default `/`. */
  cwd?: string;
  /** Keep stdin open for {@link GuestProcess.write}. Default false: stdin is /dev/null. */
  stdin?: boolean;
}

/** Options of {@link Vm.exec}. */
export interface ExecOptions {
  env?: Record<string, string>;
  cwd?: string;
  /** Bytes given to the command's stdin, which is then closed. */
  stdin?: string | Uint8Array;
  /**
   * Kill the command (SIGKILL) and reject with TimeoutError after this long (a whole number of
   * milliseconds, 1 to 2^31-1); if the guest does not report the end of the killed command within
   * 5 s more, reject anyway. Default: no limit.
   */
  timeoutMs?: number;
  /** Aborting kills the command (SIGKILL) and rejects with the signal's reason. */
  signal?: AbortSignal;
  /**
   * The most bytes of stdout, and of stderr, that are collected: beyond it the command is killed
   * (SIGKILL) and exec rejects with an {@link OutputLimitError}. A whole number of bytes, or
   * Infinity. Default 1 MiB, as Node's `child_process.exec`. For more, stream with
   * {@link Vm.spawn}.
   */
  maxBuffer?: number;
}

/** Default of {@link ExecOptions.maxBuffer}. */
const DEFAULT_MAX_BUFFER = 1024 * 1024;
/** Default of the `maxBytes` of {@link GuestFiles.read}. */
const DEFAULT_MAX_FILE_BYTES = 256 * 1024 * 1024;

/** A byte limit option: a whole number of bytes from 0, or Infinity. */
function byteLimit(option: string, value: unknown, fallback: number): number {
  if (value === undefined) return fallback;
  if (value === Infinity) return Infinity;
  if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < 0) {
    throw new InvalidOptionError(option, `expected a whole number of bytes or Infinity, got ${typeof value === 'string' ? JSON.stringify(value) : String(value)}`);
  }
  return value;
}

/** How a process ended. */
export interface ExitStatus {
  /** Exit code, or null when a signal ended it. */
  exitCode: number | null;
  /** The signal that ended it, e.g. `SIGKILL`, or null. */
  signal: NodeJS.Signals | null;
}

/** What {@link Vm.exec} resolves to. */
export interface ExecResult extends ExitStatus {
  stdout: string;
  stderr: string;
}

/** Guest memory figures from /proc/meminfo, bytes. */
export interface GuestMemInfo {
  totalBytes: number;
  freeBytes: number;
  availableBytes: number;
  cachedBytes: number;
}

const signalNames = Object.fromEntries(Object.entries(osConstants.signals).map(([name, n]) => [n, name])) as Record<number, NodeJS.Signals>;

function str(s: string, what: string): Buffer {
  const bytes = Buffer.from(s, 'utf8');
  if (bytes.includes(0)) throw new InvalidOptionError(what, 'must not contain NUL bytes');
  const len = Buffer.alloc(4);
  len.writeUInt32LE(bytes.length, 0);
  return Buffer.concat([len, bytes]);
}

function u32s(...values: number[]): Buffer {
  const b = Buffer.alloc(4 * values.length);
  values.forEach((v, i) => b.writeUInt32LE(v >>> 0, 4 * i));
  return b;
}

/** `bytes` cut into frame-sized chunks; at least one, so that empty data is still sent once. */
function frameChunks(bytes: Buffer): Buffer[] {
  const chunks = [bytes.subarray(0, DATA_PER_FRAME)];
  for (let off = DATA_PER_FRAME; off < bytes.length; off += DATA_PER_FRAME) chunks.push(bytes.subarray(off, off + DATA_PER_FRAME));
  return chunks;
}

/**
 * Bytes a stream of guest output buffers for a consumer that does not read before it holds the
 * agent channel (see {@link AgentClient.holdFlow}): a command whose output nobody reads yet
 * neither blocks for its first megabyte nor grows the host beyond it.
 */
const STREAM_HIGH_WATER_BYTES = 1024 * 1024;

/**
 * A stream of one request's chunks whose full buffer holds the agent channel until its consumer
 * reads (or destroys it): backpressure all the way to the writer in the guest.
 */
function guestOutput(agent: AgentClient, onRead: () => void = () => {}): Readable {
  const s: Readable = new Readable({
    highWaterMark: STREAM_HIGH_WATER_BYTES,
    read: () => {
      agent.releaseFlow(s);
      onRead();
    },
  });
  s.once('close', () => agent.releaseFlow(s));
  return s;
}

/** Gives a {@link guestOutput} stream a chunk; false if it is full (it then holds the channel). */
function deliver(agent: AgentClient, s: Readable, chunk: Buffer): boolean {
  if (s.destroyed || s.readableEnded) return true; // destroyed by its consumer: dropped
  if (s.push(chunk)) return true;
  agent.holdFlow(s);
  return false;
}

/** No more chunks come for the stream: it ends once read, and holds nothing meanwhile. */
function endOutput(agent: AgentClient, s: Readable): void {
  if (!s.destroyed && !s.readableEnded) s.push(null);
  agent.releaseFlow(s);
}

function signalNumber(signal: NodeJS.Signals | number): number {
  const n = typeof signal === 'number' ? signal : osConstants.signals[signal];
  if (!Number.isInteger(n) || n < 1 || n > 64) throw new InvalidOptionError('signal', `unknown signal ${String(signal)}`);
  return n;
}

/** A process running in the guest. */
export class GuestProcess {
  /**
   * The command's standard output. Up to 1 MiB waits for a consumer; beyond it the host takes
   * nothing more from the guest until it is read (or destroyed): the command then blocks in
   * write(), and so, meanwhile, does every other answer of this VM's agent. Read it, pipe it, or
   * destroy it.
   */
  readonly stdout: Readable;
  /** The command's standard error; as {@link stdout}. */
  readonly stderr: Readable;
  /** The guest pid, once the program has started. */
  readonly pid: Promise<number>;
  /** Resolves when the process has ended and its output is complete; rejects if it never started. */
  readonly exited: Promise<ExitStatus>;
  private stdinQueue: Promise<unknown> = Promise.resolve();
  /** The EXEC's request id, which names the process in STDIN_WRITE, STDIN_CLOSE and KILL. */
  private readonly handle: number;

  /** @internal */
  constructor(
    private readonly agent: AgentClient,
    argvPayload: Buffer,
  ) {
    const stdout = (this.stdout = guestOutput(agent));
    const stderr = (this.stderr = guestOutput(agent));
    let started!: (pid: number) => void;
    let neverStarted!: (e: Error) => void;
    this.pid = new Promise((resolve, reject) => {
      started = resolve;
      neverStarted = reject;
    });
    // A command the guest refused never starts: `pid` rejects with `exited`'s reason.
    this.pid.catch(() => {});
    const req = agent.start(LinuxOp.Exec, argvPayload, {
      onChunk: (flags, payload) => {
        // A STARTED chunk too short for a pid is the guest's mistake: ignored, never a throw out
        // of the receive path (which would end the VM as a VMM error).
        if (flags === CHUNK_STARTED) {
          if (payload.length >= 4) started(payload.readUInt32LE(0));
        } else if (flags === CHUNK_STDOUT) deliver(agent, stdout, payload);
        else if (flags === CHUNK_STDERR) deliver(agent, stderr, payload);
      },
    });
    this.handle = req.id;
    this.exited = req.done.then(
      (r) => {
        endOutput(agent, stdout);
        endOutput(agent, stderr);
        // Ended without a STARTED chunk that held a pid: `pid` must settle all the same.
        neverStarted(new GuestRequestError(0, 'the guest ended the command without reporting its pid'));
        if (r.length < 8) throw new GuestRequestError(0, `the guest ended a command with a ${r.length}-byte status, 8 expected`);
        const code = r.readInt32LE(0);
        const sig = r.readInt32LE(4);
        return sig ? { exitCode: null, signal: signalNames[sig] ?? (`SIG${sig}` as NodeJS.Signals) } : { exitCode: code, signal: null };
      },
      (e: Error) => {
        // Closed without an error: a stream 'error' nobody listens to would throw in the host
        // process. Why the process ended is `exited`'s rejection.
        stdout.destroy();
        stderr.destroy();
        agent.releaseFlow(stdout);
        agent.releaseFlow(stderr);
        neverStarted(e);
        throw e;
      },
    );
    // A caller that only awaits `exited` must not see an unhandled rejection from `pid`.
    this.exited.catch(() => {});
  }

  /**
   * Writes to the process's stdin (spawned with `stdin: true`); resolves once it is in the pipe.
   * The timeout is per frame of 512 KiB (a process that does not read its stdin fills the pipe).
   */
  write(data: string | Uint8Array, options?: RequestTimeout): Promise<void> {
    const timeoutMs = requestTimeout(options);
    const bytes = typeof data === 'string' ? Buffer.from(data, 'utf8') : Buffer.from(data);
    const next = this.stdinQueue.then(async () => {
      for (const chunk of frameChunks(bytes)) await this.agent.request(LinuxOp.StdinWrite, Buffer.concat([u32s(this.handle), chunk]), { timeoutMs });
    });
    this.stdinQueue = next.catch(() => {});
    return next;
  }

  /** Closes stdin after everything written so far; the process then reads EOF. */
  end(options?: RequestTimeout): Promise<void> {
    const timeoutMs = requestTimeout(options);
    const next = this.stdinQueue.then(async () => {
      await this.agent.request(LinuxOp.StdinClose, u32s(this.handle), { timeoutMs });
    });
    this.stdinQueue = next.catch(() => {});
    return next;
  }

  /** Sends a signal to the process and everything it started (its process group). */
  async kill(signal: NodeJS.Signals | number = 'SIGTERM', options?: RequestTimeout): Promise<void> {
    await this.agent.request(LinuxOp.Kill, u32s(this.handle, signalNumber(signal)), { timeoutMs: requestTimeout(options) });
  }
}

/** Processes, files and memory figures of a Linux guest. */
export class LinuxGuest {
  /** Files in the guest. */
  readonly files: GuestFiles;

  /** @internal */
  constructor(private readonly agent: AgentClient) {
    this.files = new GuestFiles(agent);
  }

  /** Starts a command and returns at once; output streams as it comes. */
  spawn(command: Command, options: SpawnOptions = {}): GuestProcess {
    const argv = typeof command === 'string' ? ['/bin/sh', '-c', command] : [...command];
    if (!argv.length || !argv[0]) throw new InvalidOptionError('command', 'empty command');
    const env = Object.entries(options.env ?? {}).map(([k, v]) => {
      if (!k || k.includes('=')) throw new InvalidOptionError('env', `bad variable name ${JSON.stringify(k)}`);
      return `${k}=${v}`;
    });
    const payload = Buffer.concat([
      u32s(options.stdin ? EXEC_STDIN : 0, argv.length, env.length, 0),
      str(options.cwd ?? '', 'cwd'),
      ...argv.map((a) => str(a, 'command')),
      ...env.map((e) => str(e, 'env')),
    ]);
    if (payload.length > MAX_PAYLOAD_BYTES) throw new InvalidOptionError('command', 'command line and environment exceed 1 MiB');
    return new GuestProcess(this.agent, payload);
  }

  /** Runs a command to its end and collects its output. */
  async exec(command: Command, options: ExecOptions = {}): Promise<ExecResult> {
    options.signal?.throwIfAborted();
    const timeoutMs = options.timeoutMs === undefined ? undefined : parseTimeoutMs('timeoutMs', options.timeoutMs);
    const maxBuffer = byteLimit('maxBuffer', options.maxBuffer, DEFAULT_MAX_BUFFER);
    let stop: Error | undefined;
    const p = this.spawn(command, { env: options.env, cwd: options.cwd, stdin: options.stdin !== undefined });
    const collected = { stdout: [] as Buffer[], stderr: [] as Buffer[] };
    const sizes = { stdout: 0, stderr: 0 };
    const collect = (name: 'stdout' | 'stderr') => (b: Buffer) => {
      if (stop) return; // killed already: nothing more is kept
      sizes[name] += b.length;
      if (sizes[name] > maxBuffer) {
        killFor(new OutputLimitError(maxBuffer, `command wrote more than ${maxBuffer} bytes to ${name} (maxBuffer); it was killed`));
        return;
      }
      collected[name].push(b);
    };
    if (options.stdin !== undefined) {
      p.write(options.stdin).then(() => p.end()).catch(() => {
        // The command may exit without reading its stdin (EPIPE): its exit status says enough.
      });
    }
    p.stdout.on('data', collect('stdout'));
    p.stderr.on('data', collect('stderr'));
    // A guest that does not report the killed command's end must not hold the caller forever.
    let gaveUp!: (e: Error) => void;
    const abandoned = new Promise<never>((_, reject) => (gaveUp = reject));
    let grace: NodeJS.Timeout | undefined;
    const killFor = (e: Error) => {
      if (stop) return;
      stop = e;
      p.kill('SIGKILL').catch(() => {});
      grace = setTimeout(() => gaveUp(stop!), KILL_GRACE_MS);
    };
    const timer = timeoutMs === undefined ? undefined : setTimeout(() => killFor(new TimeoutError(`command did not finish within ${timeoutMs} ms; it was killed`)), timeoutMs);
    const onAbort = () => killFor(options.signal!.reason instanceof Error ? options.signal!.reason : new Error('aborted'));
    options.signal?.addEventListener('abort', onAbort, { once: true });
    try {
      const status = await Promise.race([p.exited, abandoned]);
      if (stop) throw stop;
      return { ...status, stdout: Buffer.concat(collected.stdout).toString('utf8'), stderr: Buffer.concat(collected.stderr).toString('utf8') };
    } finally {
      if (timer) clearTimeout(timer);
      if (grace) clearTimeout(grace);
      options.signal?.removeEventListener('abort', onAbort);
    }
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
   * Drops the guest's clean page cache (and dentries/inodes); with IdleRelease the freed pages go
   * back to the host about 2 s later through free page reporting.
   */
  async dropCaches(options?: RequestTimeout): Promise<void> {
    await this.agent.request(LinuxOp.DropCaches, u32s(3), { timeoutMs: requestTimeout(options) });
  }
}

/** Reading and writing guest files. */
export class GuestFiles {
  /** @internal */
  constructor(private readonly agent: AgentClient) {}

  /**
   * The whole content of a regular file. A file larger than `maxBytes` (a whole number of bytes or
   * Infinity; default 256 MiB) rejects with an {@link OutputLimitError} and what came is dropped.
   */
  async read(path: string, options: RequestTimeout & { maxBytes?: number } = {}): Promise<Buffer> {
    const maxBytes = byteLimit('maxBytes', options.maxBytes, DEFAULT_MAX_FILE_BYTES);
    const parts: Buffer[] = [];
    let size = 0;
    let tooLarge = false;
    const r = await this.agent.request(LinuxOp.FileRead, str(path, 'path'), {
      onChunk: (_f, p) => {
        size += p.length;
        if (size > maxBytes) tooLarge = true;
        if (tooLarge) parts.length = 0; // what came is dropped; the rest is counted, not kept
        else parts.push(Buffer.from(p));
      },
      timeoutMs: requestTimeout(options),
    });
    if (tooLarge) throw new OutputLimitError(maxBytes, `${path} is larger than ${maxBytes} bytes (maxBytes)`);
    if (r.length < 8) throw new GuestRequestError(0, `the guest answered FILE_READ with ${r.length} bytes, 8 expected`);
    const data = Buffer.concat(parts);
    const total = Number(r.readBigUInt64LE(0));
    if (total !== data.length) throw new GuestRequestError(0, `the guest said ${total} bytes but sent ${data.length} for ${path}`);
    return data;
  }

  /**
   * A regular file's content as a stream, with backpressure to the guest: while the stream's
   * buffer (1 MiB) is full the host takes nothing more from the guest, so a file of any size costs
   * the host no more than that (as for {@link GuestProcess.stdout}, every other answer of this VM's
   * agent waits meanwhile: consume or destroy the stream). It errors with the guest's
   * {@link GuestRequestError} (no such file, not a regular file), with a {@link TimeoutError} when
   * the guest sends nothing for `timeoutMs` while the stream wants more, and with a
   * GuestRequestError if the guest's count of bytes differs from what it sent.
   */
  readStream(path: string, options: RequestTimeout = {}): Readable {
    const timeoutMs = requestTimeout(options);
    const payload = str(path, 'path');
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
    const s = guestOutput(this.agent, arm);
    s.once('close', disarm);
    const finish = () => {
      done = true;
      disarm();
    };
    this.agent
      .request(LinuxOp.FileRead, payload, {
        onChunk: (_f, p) => {
          received += p.length;
          if (deliver(this.agent, s, p)) arm();
          else disarm();
        },
      })
      .then(
        (r) => {
          finish();
          if (r.length < 8) s.destroy(new GuestRequestError(0, `the guest answered FILE_READ with ${r.length} bytes, 8 expected`));
          else if (Number(r.readBigUInt64LE(0)) !== received) s.destroy(new GuestRequestError(0, `the guest said ${Number(r.readBigUInt64LE(0))} bytes but sent ${received} for ${path}`));
          else endOutput(this.agent, s);
          this.agent.releaseFlow(s);
        },
        (e: Error) => {
          finish();
          s.destroy(e);
          this.agent.releaseFlow(s);
        },
      );
    arm();
    return s;
  }

  /**
   * Creates or replaces a file with `data` (mode default 0644), creating missing parent
   * directories. Large files go in several frames, one at a time.
   */
  async write(path: string, data: string | Uint8Array, options: { mode?: number } & RequestTimeout = {}): Promise<void> {
    const timeoutMs = requestTimeout(options);
    const bytes = typeof data === 'string' ? Buffer.from(data, 'utf8') : Buffer.from(data);
    const p = str(path, 'path');
    // One frame in flight: a frame fits in the receive buffers the guest keeps posted, so the
    // device needs no notification per re-posted 4 KiB buffer. Sent all at once, 10 MiB took
    // 4.5-20 s in the nested harness (a notification and an interrupt per 4 KiB); one at a
    // time, 0.9-3.3 s.
    let i = 0;
    for (const chunk of frameChunks(bytes)) {
      const flags = WRITE_MKDIRS | (i++ > 0 ? WRITE_APPEND : 0);
      await this.agent.request(LinuxOp.FileWrite, Buffer.concat([u32s(flags, options.mode ?? 0o644), p, chunk]), { timeoutMs });
    }
  }
}
