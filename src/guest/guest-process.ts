/**
 * {@link GuestProcess}: a process running in the Linux guest, started by the agent's EXEC, with
 * its output streams under credit, its stdin, its signals and its end. Apart from linux-client.ts,
 * which starts it, so that the modules that only hold processes (the process registry, pty, exec's
 * collection, the port forward) reach it without importing what starts it.
 * @module
 */
import { constants as osConstants } from 'node:os';
import { Readable, Writable } from 'node:stream';
import { abortError, CommandNotFoundError, GuestRequestError, InvalidOptionError, TimeoutError } from '../errors';
import type { AgentClient } from '../protocol/agent-client';
import { CHUNK_STARTED, CHUNK_STDERR, CHUNK_STDOUT, frameChunks, requestTimeout } from './agent-requests';
import { u32Fields as u32s } from './file-wire';
import { GuestOutput } from './guest-output';
import type { ExitStatus, RequestTimeout, VmProcess } from './guest-types';
import { OutputRing, type OutputMode } from './output-ring';

/** The agent's requests about a process (docs/agent-protocol.md); the others are linux-client.ts's. */
const enum ProcessOp {
  Exec = 0x0201,
  StdinWrite = 0x0202,
  StdinClose = 0x0203,
  Kill = 0x0204,
}

/** After a timeout's SIGKILL, how long exec waits for the process's end before it gives up on it. */
const KILL_GRACE_MS = 5_000;

const signalNames = Object.fromEntries(Object.entries(osConstants.signals).map(([name, n]) => [n, name])) as Record<number, NodeJS.Signals>;

function signalNumber(signal: NodeJS.Signals | number): number {
  const n = typeof signal === 'number' ? signal : osConstants.signals[signal];
  if (!Number.isInteger(n) || n < 1 || n > 64) throw new InvalidOptionError('signal', `unknown signal ${String(signal)}`);
  return n;
}

/**
 * A process's standard input as a Writable over its own `write` and `end`, so that
 * `pipeline(source, p.stdin)` finishes once the guest has it all; for the local process and the
 * one behind a VM's control socket alike.
 */
export function stdinWritable(p: Pick<VmProcess, 'write' | 'end'>): Writable {
  return new Writable({
    write: (chunk: Buffer, _encoding, callback) => p.write(chunk).then(() => callback(), callback),
    final: (callback) => p.end().then(() => callback(), callback),
  });
}

/**
 * A process running in the guest.
 * @category Guest
 */
export class GuestProcess implements VmProcess {
  /**
   * The command's standard output. Up to 256 KiB (the stream's credit window) waits for a
   * consumer; beyond it the guest sends nothing more of it until it is read, and the command
   * blocks in write() meanwhile (every other stream and answer of this VM goes on). The process
   * ends ({@link exited}) only once its output has come, so read it, pipe it, or destroy it
   * (what comes is then dropped).
   */
  readonly stdout: Readable;
  /** The command's standard error; as {@link stdout}. */
  readonly stderr: Readable;
  /**
   * The command's standard input as a stream (spawned with `stdin: true`, else null): what is
   * written goes through {@link write}, `end()` closes it through {@link end}, so
   * `pipeline(source, p.stdin)` feeds the command and finishes once the guest has it all.
   * Made on first use: exec writes its stdin without one.
   */
  get stdin(): Writable | null {
    if (!this.stdinOpen) return null;
    this.stdinStream ??= stdinWritable(this);
    return this.stdinStream;
  }
  private stdinStream: Writable | undefined;
  private readonly stdinOpen: boolean;
  /** The guest pid, once the program has started. */
  readonly pid: Promise<number>;
  /** The kept tails of stdout and stderr (`{ keep }`), else undefined. */
  private readonly rings: [OutputRing | undefined, OutputRing | undefined];
  /** Resolves when the process has ended and its output is complete; rejects if it never started. */
  readonly exited: Promise<ExitStatus>;
  private stdinQueue: Promise<unknown> = Promise.resolve();
  /** The EXEC's request id, which names the process in STDIN_WRITE, STDIN_CLOSE and KILL. */
  private readonly handle: number;
  /** Why the host killed the process (its timeout, its signal, exec's maxBuffer): `exited` rejects with it. */
  private stoppedFor: Error | undefined;
  /** Rejects `exited` when the guest does not report the killed process's end in time. */
  private gaveUp!: (e: Error) => void;
  private grace: NodeJS.Timeout | undefined;

  /** @internal */
  constructor(
    private readonly agent: AgentClient,
    argvPayload: Buffer,
    limits: { timeoutMs?: number; signal?: AbortSignal } = {},
    what: { call?: string; argv0?: string; stdin?: boolean; user?: string; stdout?: OutputMode; stderr?: OutputMode } = {},
  ) {
    this.stdinOpen = what.stdin === true;
    const stdout = new GuestOutput(agent, CHUNK_STDOUT);
    const stderr = new GuestOutput(agent, CHUNK_STDERR);
    const modes = [what.stdout ?? 'pipe', what.stderr ?? 'pipe'] as const;
    this.rings = [undefined, undefined];
    const outputs = [stdout, stderr].map((o, i) => {
      const mode = modes[i];
      if (mode === 'pipe') return o.readable;
      // Drained as it comes: a destroyed stream grants back all that comes; a kept one takes it.
      if (mode === 'ignore') o.readable.destroy();
      else {
        const ring = (this.rings[i] = new OutputRing(mode.keep));
        o.readable.on('data', (b: Buffer) => ring.push(b));
        o.readable.on('error', () => {});
      }
      const empty = new Readable({ read() {} });
      empty.push(null);
      return empty;
    });
    this.stdout = outputs[0];
    this.stderr = outputs[1];
    let started!: (pid: number) => void;
    let neverStarted!: (e: Error) => void;
    this.pid = new Promise((resolve, reject) => {
      started = resolve;
      neverStarted = reject;
    });
    // A command the guest refused never starts: `pid` rejects with `exited`'s reason.
    this.pid.catch(() => {});
    const { signal, timeoutMs } = limits;
    const req = signal?.aborted ? { id: 0, done: Promise.reject(abortError('the command', signal)) } : agent.start(ProcessOp.Exec, argvPayload, {
      onChunk: (flags, payload) => {
        // A STARTED chunk too short for a pid is the guest's mistake: ignored, never a throw out
        // of the receive path (which would end the VM as a VMM error).
        if (flags === CHUNK_STARTED) {
          if (payload.length >= 4) started(payload.readUInt32LE(0));
        } else if (flags === CHUNK_STDOUT) stdout.deliver(payload);
        else if (flags === CHUNK_STDERR) stderr.deliver(payload);
      },
      holdsChunks: true,
      call: what.call,
      user: what.user,
    });
    this.handle = req.id;
    stdout.attach(req.id);
    stderr.attach(req.id);
    const ended = req.done.then(
      (r) => {
        stdout.end();
        stderr.end();
        // Ended without a STARTED chunk that held a pid: `pid` must settle all the same.
        neverStarted(new GuestRequestError(0, 'the guest ended the command without reporting its pid'));
        if (r.length < 8) throw new GuestRequestError(0, `the guest ended a command with a ${r.length}-byte status, 8 expected`);
        const code = r.readInt32LE(0);
        const sig = r.readInt32LE(4);
        return sig ? { exitCode: null, signal: signalNames[sig] ?? (`SIG${sig}` as NodeJS.Signals) } : { exitCode: code, signal: null };
      },
      (err: Error) => {
        // The agent's exec of a command it cannot find or run: its errno, then the command.
        const e = what.argv0 !== undefined && err instanceof GuestRequestError && (err.errno === 'ENOENT' || err.errno === 'EACCES') && err.message.endsWith(`: ${what.argv0}`) ? new CommandNotFoundError(what.argv0, err) : err;
        // Closed without an error: a stream 'error' nobody listens to would throw in the host
        // process. Why the process ended is `exited`'s rejection.
        this.stdout.destroy();
        this.stderr.destroy();
        neverStarted(e);
        throw e;
      },
    );
    // A guest that does not report the killed process's end must not hold the caller forever.
    const abandoned = new Promise<never>((_, reject) => (this.gaveUp = reject));
    const timer = timeoutMs === undefined ? undefined : setTimeout(() => this.stop(new TimeoutError(`command did not finish within ${timeoutMs} ms; it was killed`)), timeoutMs);
    const onAbort = () => this.stop(abortError('the command', signal!));
    if (req.id) signal?.addEventListener('abort', onAbort, { once: true });
    this.exited = Promise.race([ended, abandoned]).then(
      (status) => {
        if (this.stoppedFor) throw this.stoppedFor;
        return status;
      },
      (e: Error) => {
        throw this.stoppedFor ?? e;
      },
    );
    this.exited
      .finally(() => {
        if (timer) clearTimeout(timer);
        if (this.grace) clearTimeout(this.grace);
        signal?.removeEventListener('abort', onAbort);
      })
      // A caller that only awaits `exited` must not see an unhandled rejection from `pid`.
      .catch(() => {});
  }

  /**
   * Kills the process (SIGKILL) for `reason`, which `exited` then rejects with (after the guest
   * reports the end, or 5 s without it). The first reason wins.
   * @internal
   */
  stop(reason: Error): void {
    if (this.stoppedFor) return;
    this.stoppedFor = reason;
    this.kill('SIGKILL').catch(() => {});
    this.grace = setTimeout(() => this.gaveUp(reason), KILL_GRACE_MS);
  }

  /** True once the host has killed the process for a reason of its own ({@link stop}). @internal */
  get stopped(): boolean {
    return this.stoppedFor !== undefined;
  }

  /**
   * Writes to the process's stdin (spawned with `stdin: true`); resolves once it is in the pipe.
   * The timeout is per frame of 512 KiB (a process that does not read its stdin fills the pipe).
   */
  write(data: string | Uint8Array, options?: RequestTimeout): Promise<void> {
    const timeoutMs = requestTimeout(options);
    const bytes = typeof data === 'string' ? Buffer.from(data, 'utf8') : Buffer.from(data);
    const next = this.stdinQueue.then(async () => {
      for (const chunk of frameChunks(bytes)) await this.agent.request(ProcessOp.StdinWrite, Buffer.concat([u32s(this.handle), chunk]), { timeoutMs });
    });
    this.stdinQueue = next.catch(() => {});
    return next;
  }

  /** Closes stdin after everything written so far; the process then reads EOF. */
  end(options?: RequestTimeout): Promise<void> {
    const timeoutMs = requestTimeout(options);
    const next = this.stdinQueue.then(async () => {
      await this.agent.request(ProcessOp.StdinClose, u32s(this.handle), { timeoutMs });
    });
    this.stdinQueue = next.catch(() => {});
    return next;
  }

  /**
   * The last bytes of stdout and stderr kept by `{ keep }` (oldest first; empty for a stream not
   * kept), with how many bytes each carried in all.
   */
  keptOutput(): { stdout: Buffer; stderr: Buffer; stdoutBytes: number; stderrBytes: number } {
    const [o, e] = this.rings;
    return { stdout: o?.kept() ?? Buffer.alloc(0), stderr: e?.kept() ?? Buffer.alloc(0), stdoutBytes: o?.totalBytes ?? 0, stderrBytes: e?.totalBytes ?? 0 };
  }

  /**
   * Follows the kept streams (`{ keep }`): each callback gets what was kept first, then every
   * chunk as it comes, until the returned function is called or the output ends. A stream not
   * kept gives nothing here (a `'pipe'` one belongs to {@link stdout} / {@link stderr}). A
   * callback that throws is removed; the process goes on.
   */
  output(listeners: { onStdout?: (chunk: Buffer) => void; onStderr?: (chunk: Buffer) => void }): () => void {
    const stops: (() => void)[] = [];
    const follow = (ring: OutputRing | undefined, listener: ((chunk: Buffer) => void) | undefined, name: string) => {
      if (!ring || listener === undefined) return;
      if (typeof listener !== 'function') throw new InvalidOptionError(name, `expected a function, got ${typeof listener}`);
      let stop = () => {};
      const safe = (chunk: Buffer) => {
        try {
          listener(chunk);
        } catch {
          stop();
        }
      };
      const kept = ring.kept();
      stop = ring.listen(safe);
      stops.push(stop);
      if (kept.length) safe(kept);
    };
    follow(this.rings[0], listeners.onStdout, 'onStdout');
    follow(this.rings[1], listeners.onStderr, 'onStderr');
    return () => stops.forEach((s) => s());
  }

  /** Whether stdout or stderr is kept (`{ keep }`). */
  get keepsOutput(): boolean {
    return this.rings[0] !== undefined || this.rings[1] !== undefined;
  }

  /** The EXEC's request id, which names the process in the agent's requests. @internal */
  get requestId(): number {
    return this.handle;
  }

  /** Sends a signal to the process and everything it started (its process group). */
  async kill(signal: NodeJS.Signals | number = 'SIGTERM', options?: RequestTimeout): Promise<void> {
    await this.agent.request(ProcessOp.Kill, u32s(this.handle, signalNumber(signal)), { timeoutMs: requestTimeout(options) });
  }
}
