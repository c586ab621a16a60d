/**
 * A bench cell's process: `pvisor bench <mode> ...` started in the cell's cgroup (so that all it
 * allocates, from its first page, is charged to the cell), talking to the parent by lines of JSON
 * on stdin and stdout. The parent reads the group's figures from outside, so the reading costs
 * the cell nothing. Tables 1-2 run one such process per cell; Table 3 runs four, one per VM.
 */
import { spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { createInterface } from 'node:readline';
import { pvisorNodeEnv } from '../node-flags';
import { pvisorBenchArgv } from './bins';
import type { CellCgroup } from './cell-cgroup';

/** One message: a JSON object per line. */
export type CellMessage = Record<string, unknown>;

/** The parent's end of a cell process. */
export class CellProcess {
  private readonly lines: AsyncIterator<string>;
  private stderrText = '';
  /** Resolves with the exit status once the process has ended and its output is read. */
  readonly exited: Promise<number>;

  private constructor(
    private readonly child: ChildProcessWithoutNullStreams,
    /** Names the process in errors. */
    readonly label: string,
  ) {
    child.stderr.on('data', (d: Buffer) => (this.stderrText += d.toString()));
    this.exited = new Promise<number>((resolve) => child.on('close', (code) => resolve(code ?? 1)));
    this.lines = createInterface({ input: child.stdout })[Symbol.asyncIterator]();
  }

  /**
   * Starts `pvisor bench ...args` in `cgroup` (or, where no cgroup could be made, as a plain child,
   * whose figures the parent then reads from its pid alone).
   */
  static spawn(cgroup: CellCgroup | string, args: string[], label: string): CellProcess {
    const node = process.execPath;
    const argv = pvisorBenchArgv(args);
    const [cmd, full] = typeof cgroup === 'string' ? [node, argv] : cgroup.wrap(node, argv);
    return new CellProcess(spawn(cmd, full, { stdio: ['pipe', 'pipe', 'pipe'], env: pvisorNodeEnv() }), label);
  }

  /** The process's pid (of the node process itself: the cgroup wrapper execs it). */
  get pid(): number {
    return this.child.pid!;
  }

  /** What it wrote on stderr so far. */
  get stderr(): string {
    return this.stderrText;
  }

  /** Sends one line: a message, or a bare word such as `continue`. */
  send(message: CellMessage | string): void {
    this.child.stdin.write(`${typeof message === 'string' ? message : JSON.stringify(message)}\n`);
  }

  /** Closes its stdin: the cell has been told all it will be told. */
  endInput(): void {
    this.child.stdin.end();
  }

  /** Its messages, as they come, until it closes stdout. */
  async *messages(): AsyncGenerator<CellMessage> {
    for (;;) {
      const next = await this.lines.next();
      if (next.done) return;
      yield JSON.parse(next.value) as CellMessage;
    }
  }

  /** Its next message; a process that ended first is an error that carries its stderr. */
  async next(): Promise<CellMessage> {
    const next = await this.lines.next();
    if (next.done) throw new Error(`${this.label} ended (exit ${await this.exited}): ${this.stderrText.trim()}`);
    return JSON.parse(next.value) as CellMessage;
  }

  /** Ends it at once (a cell that failed, or one already done) and waits until it is gone. */
  async kill(): Promise<number> {
    this.child.kill('SIGKILL');
    return this.exited;
  }
}

/** The cell's end: messages to the parent on stdout, lines from it on stdin. */
export interface ParentLink {
  say(message: CellMessage): void;
  /** The parent's next line; undefined once it closed our stdin. */
  next(): Promise<string | undefined>;
}

/** The cell process's link to the parent that spawned it. */
export function parentLink(): ParentLink {
  const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
  return {
    say: (message) => process.stdout.write(`${JSON.stringify(message)}\n`),
    next: async () => {
      const r = await lines.next();
      return r.done ? undefined : r.value;
    },
  };
}
