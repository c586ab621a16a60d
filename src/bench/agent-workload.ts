/**
 * The agent workload: a Linux guest whose root filesystem (built by scripts/agent-rootfs.sh:
 * Debian bookworm with Debian's nodejs and node-typescript) runs a program shaped like an AI agent
 * (scripts/agent-workload/agent.js): it compiles a small TypeScript project through the compiler
 * API, keeps the result on its heap, says it is ready and idles, answering `status`, `work` and
 * `exit` on stdin with one JSON line each. The tests and `pvisor bench memory --guest linux` start
 * it the same way, through {@link AgentSession}.
 */
import { join } from 'node:path';
import type { GuestProcess } from '../guest/guest-process';
import { PACKAGE_ROOT } from '../native';
import type { Vm } from '../vm';

/** The agent program's command line in the image (cwd does not matter). */
export const AGENT_COMMAND: readonly string[] = ['node', '/opt/agent/agent.js'];

/** The script that builds the image, relative to the repository. */
export const AGENT_ROOTFS_SCRIPT = 'scripts/agent-rootfs.sh';

/**
 * Where scripts/agent-rootfs.sh puts the image when called without an argument:
 * `$PVISOR_AGENT_ROOTFS`, else `.cache/agent-rootfs/agent-rootfs.img` in the repository.
 */
export function agentRootfsImage(env: NodeJS.ProcessEnv = process.env): string {
  return env.PVISOR_AGENT_ROOTFS || join(PACKAGE_ROOT, '.cache', 'agent-rootfs', 'agent-rootfs.img');
}

/** A line of the agent program that is not what it prints, or an answer that never came. */
export class AgentWorkloadError extends Error {}

/** What the agent program's ready line says. */
export interface AgentReady {
  /** The project's own files it compiled. */
  files: number;
  /** Type check and emit, in the guest. */
  compileMs: number;
  /** V8's heap in use, and the process's RSS, when it said ready. */
  heapMiB: number;
  rssMiB: number;
  /** The whole line, for reports. */
  line: string;
}

const READY = /^ready compiled (\d{1,6}) files in (\d{1,9}) ms, heap (\d{1,6}\.\d) MiB, rss (\d{1,6}\.\d) MiB \(/;

/** Parses the agent program's first line; throws an {@link AgentWorkloadError} on anything else. */
export function parseAgentReady(line: string): AgentReady {
  const m = READY.exec(line);
  if (!m) throw new AgentWorkloadError(`the agent program's first line is not its ready line: ${JSON.stringify(line.slice(0, 200))}`);
  return { files: Number(m[1]), compileMs: Number(m[2]), heapMiB: Number(m[3]), rssMiB: Number(m[4]), line };
}

/** The agent program's answer to `status`. */
export interface AgentStatus {
  heapUsedBytes: number;
  heapTotalBytes: number;
  rssBytes: number;
  externalBytes: number;
  /** Timer ticks while it idled (one each 10 s). */
  ticks: number;
  uptimeMs: number;
}

const STATUS_FIELDS = ['heapUsedBytes', 'heapTotalBytes', 'rssBytes', 'externalBytes', 'ticks', 'uptimeMs'] as const;

/** Parses an answer to `status`; throws an {@link AgentWorkloadError} unless every figure is a whole number >= 0. */
export function parseAgentStatus(answer: Record<string, unknown>): AgentStatus {
  if (answer.status !== 'idle') throw new AgentWorkloadError(`not an answer to status: ${JSON.stringify(answer).slice(0, 200)}`);
  const out: Partial<AgentStatus> = {};
  for (const k of STATUS_FIELDS) {
    const v = answer[k];
    if (!Number.isSafeInteger(v) || (v as number) < 0) throw new AgentWorkloadError(`status: ${k} is ${JSON.stringify(v)}, not a whole number >= 0`);
    out[k] = v as number;
  }
  return out as AgentStatus;
}

// The program's lines are short; a guest that sends more without a newline is refused, not kept.
const MAX_LINE_BYTES = 64 * 1024;

/** The agent program running in a VM, with its stdin open for requests. */
export class AgentSession {
  private buffered = '';
  private readonly lines: string[] = [];
  private waiter: ((line: string | Error) => void) | undefined;
  private failure: Error | undefined;
  private queue: Promise<unknown> = Promise.resolve();

  private constructor(
    /** The agent program's process in the guest. */
    readonly process: GuestProcess,
    /** Its stderr so far (at most 64 KiB), for a failure's message. */
    private stderr: string[],
  ) {
    process.stdout.setEncoding('utf8');
    process.stdout.on('data', (chunk: string) => this.take(chunk));
    process.stdout.on('end', () => this.fail(new AgentWorkloadError(`the agent program ended its output${this.stderrTail()}`)));
    process.exited.then(
      (s) => this.fail(new AgentWorkloadError(`the agent program exited (${s.signal ?? `status ${s.exitCode}`})${this.stderrTail()}`)),
      (e: Error) => this.fail(e),
    );
  }

  /** What it said when ready. */
  ready!: AgentReady;

  /**
   * Starts {@link AGENT_COMMAND} in `vm` (booted with the agent rootfs) and waits for its ready line.
   * @param readyTimeoutMs how long it may take to load TypeScript and compile; in the nested
   *   harness the guest runs 10-50 times slower than on hardware.
   */
  static async start(vm: Vm, options: { readyTimeoutMs: number }): Promise<AgentSession> {
    const proc = vm.spawn([...AGENT_COMMAND], { stdin: true });
    const stderr: string[] = [];
    let stderrBytes = 0;
    proc.stderr.setEncoding('utf8');
    proc.stderr.on('data', (s: string) => {
      if (stderrBytes >= MAX_LINE_BYTES) return;
      stderrBytes += s.length;
      stderr.push(s);
    });
    const session = new AgentSession(proc, stderr);
    try {
      session.ready = parseAgentReady(await session.nextLine(options.readyTimeoutMs, 'its ready line'));
    } catch (e) {
      session.kill();
      throw e;
    }
    return session;
  }

  /** Sends one request and resolves with its JSON answer; requests are answered in order. */
  request(request: 'status' | 'work' | 'exit', options: { timeoutMs: number }): Promise<Record<string, unknown>> {
    const next = this.queue.then(async () => {
      await this.process.write(`${request}\n`);
      const line = await this.nextLine(options.timeoutMs, `the answer to ${request}`);
      let answer: unknown;
      try {
        answer = JSON.parse(line);
      } catch {
        throw new AgentWorkloadError(`the answer to ${request} is not JSON: ${JSON.stringify(line.slice(0, 200))}`);
      }
      if (typeof answer !== 'object' || answer === null || Array.isArray(answer)) throw new AgentWorkloadError(`the answer to ${request} is not a JSON object: ${line.slice(0, 200)}`);
      if ('error' in answer) throw new AgentWorkloadError(`the agent program refused ${request}: ${String((answer as { error: unknown }).error).slice(0, 200)}`);
      return answer as Record<string, unknown>;
    });
    this.queue = next.catch(() => {});
    return next;
  }

  /** Asks for `status`: the program's heap and RSS as it idles. */
  async status(options: { timeoutMs: number }): Promise<AgentStatus> {
    return parseAgentStatus(await this.request('status', options));
  }

  /** Kills the program (SIGKILL); the VM goes on. */
  kill(): void {
    this.process.kill('SIGKILL').catch(() => {});
  }

  private take(chunk: string): void {
    this.buffered += chunk;
    for (let nl = this.buffered.indexOf('\n'); nl >= 0; nl = this.buffered.indexOf('\n')) {
      this.push(this.buffered.slice(0, nl));
      this.buffered = this.buffered.slice(nl + 1);
    }
    if (this.buffered.length > MAX_LINE_BYTES) {
      this.fail(new AgentWorkloadError(`the agent program wrote more than ${MAX_LINE_BYTES} bytes without a newline`));
      this.buffered = '';
      this.kill();
    }
  }

  private push(line: string): void {
    const w = this.waiter;
    this.waiter = undefined;
    if (w) w(line);
    else if (this.lines.length < 1024) this.lines.push(line);
  }

  private fail(e: Error): void {
    this.failure ??= e;
    const w = this.waiter;
    this.waiter = undefined;
    w?.(e);
  }

  private nextLine(timeoutMs: number, what: string): Promise<string> {
    const queued = this.lines.shift();
    if (queued !== undefined) return Promise.resolve(queued);
    if (this.failure) return Promise.reject(this.failure);
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiter = undefined;
        reject(new AgentWorkloadError(`no ${what} within ${timeoutMs} ms${this.stderrTail()}`));
      }, timeoutMs);
      this.waiter = (line) => {
        clearTimeout(timer);
        if (line instanceof Error) reject(line);
        else resolve(line);
      };
    });
  }

  private stderrTail(): string {
    const text = this.stderr.join('').trim();
    return text ? `; its stderr: ${text.slice(-2000)}` : '';
  }
}
