/**
 * Terminals in the Linux guest (`vm.pty.create`): a command on a pseudo-terminal the agent opens
 * (EXEC with its PTY flag: the terminal is the command's stdin, stdout, stderr and controlling
 * terminal), its output one stream under the same credit as a spawned process's stdout, so a
 * terminal nobody reads holds only itself; input through the process's stdin requests; RESIZE
 * sets its size, and the kernel tells its foreground programs (SIGWINCH).
 */
import { Writable, type Readable } from 'node:stream';
import { GuestFeatureError, InvalidOptionError } from '../errors';
import { checkOptionKeys, optionKeys } from '../option-keys';
import { FEATURE_PTY, type AgentClient } from '../protocol/agent-client';
import { u32Fields } from './file-wire';
import type { GuestProcess } from './guest-process';
import type { Command, ExitStatus, RequestTimeout, SpawnOptions } from './guest-types';

/** The agent's RESIZE op (docs/agent-protocol.md). */
const OP_RESIZE = 0x0205;
/** What a terminal's programs are told it is, unless the caller's env says otherwise. */
const DEFAULT_TERM = 'xterm-256color';
/** The agent answers RESIZE at once: a silent one is a broken one. */
const RESIZE_TIMEOUT_MS = 30_000;

/**
 * A terminal's size in character cells.
 * @category Guest
 */
export interface PtySize {
  /** Columns, 1 to 65535. */
  cols: number;
  /** Rows, 1 to 65535. */
  rows: number;
}

/**
 * Options of {@link GuestPtys.create}.
 * @category Guest
 */
export interface PtyCreateOptions extends PtySize {
  /** The command on the terminal: an argv array, or a string `/bin/sh -c` runs. Default `/bin/sh` (an interactive shell). */
  cmd?: Command;
  /** Variables over the guest's base environment and the VM's {@link VmOptions.env}; `TERM` is `xterm-256color` unless this env gives it. */
  env?: Record<string, string>;
  /** Working directory in the guest. Default `/`. */
  cwd?: string;
  /** The user the command runs as (as {@link SpawnOptions.user}); the terminal is given to it. Default root. */
  user?: string;
  /** Kill the command (SIGKILL) after this long, as {@link SpawnOptions.timeoutMs}. Default: no limit. */
  timeoutMs?: number;
  /** Aborting kills the command (SIGKILL), as {@link SpawnOptions.signal}. */
  signal?: AbortSignal;
}

const PTY_OPTION_KEYS = optionKeys<PtyCreateOptions>({ cols: true, rows: true, cmd: true, env: true, cwd: true, user: true, timeoutMs: true, signal: true });

/** A terminal dimension: a whole number 1 to 65535. */
function cells(option: string, value: unknown): number {
  if (typeof value !== 'number' || !Number.isInteger(value) || value < 1 || value > 0xffff) {
    throw new InvalidOptionError(option, `expected a whole number of cells from 1 to 65535, got ${typeof value === 'number' ? value : typeof value}`);
  }
  return value;
}

/**
 * A command running on a terminal in the guest.
 * @category Guest
 */
export class GuestPty {
  /**
   * What the terminal shows, as bytes (the command's output, with the terminal's echo of its
   * input and its line discipline's CR LF). Up to 256 KiB waits for a consumer; beyond it the
   * guest reads no more of the terminal until it is read (the command blocks in write(); every
   * other stream and request of this VM goes on). Read it or destroy it (what comes is then dropped).
   */
  readonly output: Readable;
  /**
   * The terminal's input as a stream (`pipeline(source, pty.input)`), each chunk through
   * {@link write}. Ending it sends nothing: a terminal has no end of input but what its line
   * discipline makes of Ctrl-D (`'\x04'`), and it closes with its command.
   */
  readonly input: Writable;
  /** The guest pid of the command, once it has started. */
  readonly pid: Promise<number>;
  /** How the command ended, once the terminal's output is complete; rejects as {@link GuestProcess.exited}. */
  readonly exited: Promise<ExitStatus>;

  /** @internal */
  constructor(
    private readonly agent: AgentClient,
    private readonly process: GuestProcess,
  ) {
    this.output = process.stdout;
    this.input = new Writable({
      write: (chunk: Buffer, _encoding, callback) => this.write(chunk).then(() => callback(), callback),
    });
    this.pid = process.pid;
    this.exited = process.exited;
  }

  /** Types into the terminal (keys as bytes: `'\r'` is Enter, `'\x03'` Ctrl-C); resolves once the guest has it. */
  write(data: string | Uint8Array, options?: RequestTimeout): Promise<void> {
    return this.process.write(data, options);
  }

  /** Gives the terminal a new size; its foreground programs get SIGWINCH and see it (`stty size`). */
  async resize(size: PtySize): Promise<void> {
    const cols = cells('cols', size?.cols);
    const rows = cells('rows', size?.rows);
    const payload = Buffer.concat([u32Fields(this.process.requestId), Buffer.from([cols & 0xff, cols >> 8, rows & 0xff, rows >> 8])]);
    await this.agent.request(OP_RESIZE, payload, { timeoutMs: RESIZE_TIMEOUT_MS, call: 'pty.resize' });
  }

  /**
   * Sends a signal to the command and everything it started (its process group). Default SIGHUP,
   * the signal of a terminal that hangs up, which an interactive shell does not ignore (SIGTERM it does).
   */
  kill(signal: NodeJS.Signals | number = 'SIGHUP', options?: RequestTimeout): Promise<void> {
    return this.process.kill(signal, options);
  }

  /** {@link exited}, as a call. */
  wait(): Promise<ExitStatus> {
    return this.exited;
  }
}

/**
 * The terminals of a Linux guest: `vm.pty.create(...)`.
 * @category Guest
 */
export class GuestPtys {
  /** @internal */
  constructor(
    private readonly agent: AgentClient,
    private readonly start: (method: string, command: Command, options: SpawnOptions, terminal: PtySize) => GuestProcess,
  ) {}

  /**
   * Starts `cmd` (default `/bin/sh`) on a new terminal of `cols` x `rows` and returns at once. An
   * agent that cannot open terminals (an initramfs built before this pvisor) throws a
   * {@link GuestFeatureError}; a command that cannot start rejects {@link GuestPty.exited}.
   */
  create(options: PtyCreateOptions): GuestPty {
    checkOptionKeys('pty.create', options, PTY_OPTION_KEYS);
    const size = { cols: cells('cols', options.cols), rows: cells('rows', options.rows) };
    if (!this.agent.hasFeature(FEATURE_PTY)) {
      throw new GuestFeatureError('pty', "pty.create: the guest agent cannot open terminals (its HELLO lacks the PTY feature): its initramfs was built before this pvisor's agent; rebuild it with this pvisor's agent (native-prebuilds/linux-guest/build-initramfs.sh)");
    }
    const process = this.start('pty.create', options.cmd ?? ['/bin/sh'], { env: { TERM: DEFAULT_TERM, ...options.env }, cwd: options.cwd, user: options.user, timeoutMs: options.timeoutMs, signal: options.signal, stdin: true }, size);
    return new GuestPty(this.agent, process);
  }
}
