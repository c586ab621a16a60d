/**
 * The host's end of `pvisor-workset` (native-prebuilds/linux-guest/workset.c): an application's
 * working set held by a process in the Linux guest, with the probe guest's content kinds, so that
 * the memory study runs on the guest users run and every digest is checked against the host's own
 * model of the working set (probe-content.ts), as the probe's are.
 */
import { GuestRequestError, InvalidOptionError } from '../errors';
import type { GuestProcess, SpawnOptions } from './linux-client';
import { expectedDigestHex, isProbeContent, PROBE_CONTENTS, rewritesPage, type ProbeContent, type ProbeWorkingSet } from './probe-content';
import type { FillOptions, ReleaseOptions, RewriteOptions, TouchOptions, ZeroOptions } from './probe-client';
import { pageMiBOption, u32Option } from '../units';

/** Where the shipped initramfs has the tool. */
export const WORKSET_PATH = '/bin/pvisor-workset';

/** How long one command may take by default: a fill of 64 MiB is well under a second natively, a minute in the nested harness. */
const DEFAULT_COMMAND_TIMEOUT_MS = 300_000;
/** An answer is one short line; a longer one is not the tool's. */
const MAX_ANSWER_BYTES = 4096;

/** A timed answer: the guest's own time for the work, ms (CLOCK_MONOTONIC in the guest). */
export interface WorkingSetTiming {
  guestMs: number;
}

/** A digest of the working set, computed in the guest, with the one the host expected. */
export interface WorkingSetDigest extends WorkingSetTiming {
  bytes: number;
  /** As the probe's: h2 then h1, 16 hex digits. */
  hex: string;
}

/** The guest's working set did not hold what the host put there. */
export class WorkingSetMismatchError extends Error {
  override readonly name = 'WorkingSetMismatchError';
}

/** Starts a process in the guest: `vm.spawn`. */
export type SpawnInGuest = (command: string[], options: SpawnOptions) => GuestProcess;

/**
 * One `pvisor-workset` process in a Linux guest and the host's model of what it holds. The
 * methods take the probe client's options, so code that drives a working set works on both
 * guests; `release` frees the working set in the guest (the program's munmap), which the guest
 * then reports free to the host like any freed memory.
 */
export class LinuxWorkingSet {
  private model: ProbeWorkingSet | undefined;
  private readonly lines: string[] = [];
  private partial = '';
  private waiting: ((line: string) => void) | undefined;
  private failure: Error | undefined;
  private queue: Promise<unknown> = Promise.resolve();
  private readonly expectedByModel = new Map<string, string>();

  private constructor(private readonly process: GuestProcess, private readonly timeoutMs: number) {
    process.stdout.setEncoding('utf8');
    process.stdout.on('data', (text: string) => this.take(text));
    process.stderr.resume();
    process.exited.then(
      (s) => this.fail(new GuestRequestError(0, `pvisor-workset ended (${s.signal ?? `exit ${s.exitCode}`})`)),
      (e: Error) => this.fail(e),
    );
  }

  /** Starts the tool in the guest (it holds nothing until {@link fill}). */
  static start(spawn: SpawnInGuest, options: { timeoutMs?: number } = {}): LinuxWorkingSet {
    return new LinuxWorkingSet(spawn([WORKSET_PATH], { stdin: true }), options.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS);
  }

  /** Fills the working set (replacing the previous one) and waits until the guest has written it. */
  async fill(options: FillOptions): Promise<{ bytes: number } & WorkingSetTiming> {
    const bytes = pageMiBOption('sizeMiB', options.sizeMiB);
    const seed = u32Option('seed', options.seed ?? 1);
    if (!isProbeContent(options.content)) throw new InvalidOptionError('content', `expected one of ${PROBE_CONTENTS.map((c) => JSON.stringify(c)).join(', ')}`);
    const a = await this.command(`fill ${bytes} ${options.content} ${seed}`, 'fill');
    this.model = { content: options.content, seed, sizeBytes: bytes, rewrites: [] };
    return { bytes: a.number('bytes'), guestMs: a.ms() };
  }

  /** Rewrites a fraction of the pages with new content (the probe's REWRITE). */
  async rewrite(options: RewriteOptions): Promise<{ pagesRewritten: number } & WorkingSetTiming> {
    if (!(options.fraction >= 0 && options.fraction <= 1)) throw new InvalidOptionError('fraction', 'expected a number from 0 to 1');
    const permille = Math.round(options.fraction * 1000);
    const seed = u32Option('seed', options.seed ?? ((this.model?.seed ?? 1) + 1) >>> 0);
    const a = await this.command(`rewrite ${permille} ${seed}`, 'rewrite');
    if (this.model && permille > 0) {
      this.model.rewrites.push({ permille, seed });
      // The model applies zeroed ranges after every rewrite, so the pages this rewrite gave
      // content again leave them.
      if (this.model.zeroed) this.model.zeroed = this.model.zeroed.flatMap((z) => runsNotRewritten(z, permille));
    }
    return { pagesRewritten: a.number('pages'), guestMs: a.ms() };
  }

  /** Reads every page of the first `hotMiB` `rounds` times. */
  async touch(options: TouchOptions): Promise<{ pagesTouched: number } & WorkingSetTiming> {
    const a = await this.command(`touch ${pageMiBOption('hotMiB', options.hotMiB)} ${u32Option('rounds', options.rounds ?? 1)}`, 'touch');
    return { pagesTouched: a.number('pages'), guestMs: a.ms() };
  }

  /** Writes zeros over a range; the pages stay the program's. */
  async zero(options: ZeroOptions): Promise<{ bytes: number } & WorkingSetTiming> {
    const offset = pageMiBOption('offsetMiB', options.offsetMiB);
    const length = pageMiBOption('sizeMiB', options.sizeMiB);
    const a = await this.command(`zero ${offset} ${length}`, 'zero');
    if (this.model && length > 0) (this.model.zeroed ??= []).push({ offset, length });
    return { bytes: a.number('bytes'), guestMs: a.ms() };
  }

  /** The digest the guest computes over its working set. */
  async digest(): Promise<WorkingSetDigest> {
    const a = await this.command('digest', 'digest');
    return { bytes: a.number('bytes'), hex: a.hex(), guestMs: a.ms() };
  }

  /** The digest the guest must report, from the host's model (16 hex digits). */
  expectedDigest(): string {
    const model = this.model ?? { content: 'repetitive' as ProbeContent, seed: 1, sizeBytes: 0, rewrites: [] };
    const key = JSON.stringify(model);
    let hex = this.expectedByModel.get(key);
    if (hex === undefined) this.expectedByModel.set(key, (hex = expectedDigestHex(model)));
    return hex;
  }

  /** Digests in the guest and throws a {@link WorkingSetMismatchError} unless it is the host model's. */
  async check(): Promise<WorkingSetDigest> {
    const d = await this.digest();
    const expected = this.expectedDigest();
    if (d.hex !== expected) throw new WorkingSetMismatchError(`the guest's working set digests to ${d.hex}, the host's model to ${expected}: its memory was not brought back as it was`);
    return d;
  }

  /**
   * Table 2's task in the guest: digest, write the working set to `path`, fsync, read it back and
   * compare, remove the file. Throws unless the digest is the host model's.
   */
  async task(path: string): Promise<WorkingSetDigest> {
    if (!/^\/[^\s]+$/.test(path)) throw new InvalidOptionError('path', 'expected an absolute guest path without spaces');
    const a = await this.command(`task ${path}`, 'task');
    const d = { bytes: a.number('bytes'), hex: a.hex(), guestMs: a.ms() };
    if (d.hex !== this.expectedDigest()) throw new WorkingSetMismatchError(`the task's digest ${d.hex} is not the host model's ${this.expectedDigest()}`);
    return d;
  }

  /**
   * Frees the working set in the guest (munmap); the guest's free page reporting then tells the
   * host. The `ReleaseOptions` of the probe are not taken: a program frees what it allocated.
   */
  async release(_options?: ReleaseOptions): Promise<{ bytes: number }> {
    const a = await this.command('free', 'free');
    this.model = undefined;
    return { bytes: a.number('bytes') };
  }

  /** Ends the tool (its memory goes back to the guest). */
  async close(): Promise<void> {
    if (this.failure) return;
    await this.process.write('exit\n').catch(() => {});
    await this.process.exited.catch(() => {});
  }

  private command(line: string, verb: string): Promise<Answer> {
    const run = this.queue.then(async () => {
      if (this.failure) throw this.failure;
      await this.process.write(`${line}\n`);
      const text = await this.nextLine();
      if (text.startsWith('error ')) throw new GuestRequestError(0, `pvisor-workset ${verb}: ${text.slice(6)}`);
      return new Answer(text, verb);
    });
    this.queue = run.catch(() => {});
    return run;
  }

  private nextLine(): Promise<string> {
    const line = this.lines.shift();
    if (line !== undefined) return Promise.resolve(line);
    if (this.failure) return Promise.reject(this.failure);
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiting = undefined;
        reject(new GuestRequestError(0, `pvisor-workset did not answer within ${this.timeoutMs} ms`));
      }, this.timeoutMs);
      this.waiting = (l) => {
        clearTimeout(timer);
        this.waiting = undefined;
        if (this.failure && l === '') reject(this.failure);
        else resolve(l);
      };
    });
  }

  private take(text: string): void {
    this.partial += text;
    if (this.partial.length > MAX_ANSWER_BYTES && !this.partial.includes('\n')) {
      this.fail(new GuestRequestError(0, `pvisor-workset wrote a line longer than ${MAX_ANSWER_BYTES} bytes`));
      this.process.kill('SIGKILL').catch(() => {});
      return;
    }
    let nl: number;
    while ((nl = this.partial.indexOf('\n')) >= 0) {
      const line = this.partial.slice(0, nl);
      this.partial = this.partial.slice(nl + 1);
      if (this.waiting) this.waiting(line);
      else this.lines.push(line);
    }
  }

  private fail(e: Error): void {
    if (this.failure) return;
    this.failure = e;
    this.waiting?.('');
  }
}

/** One `ok VERB key=value...` line. */
class Answer {
  private readonly fields = new Map<string, string>();

  constructor(line: string, verb: string) {
    const [ok, got, ...rest] = line.split(' ');
    if (ok !== 'ok' || got !== verb) throw new GuestRequestError(0, `pvisor-workset answered ${JSON.stringify(line.slice(0, 200))} to ${verb}`);
    for (const kv of rest) {
      const eq = kv.indexOf('=');
      if (eq > 0) this.fields.set(kv.slice(0, eq), kv.slice(eq + 1));
    }
  }

  number(key: string): number {
    const v = this.fields.get(key);
    if (v === undefined || !/^\d{1,16}$/.test(v)) throw new GuestRequestError(0, `pvisor-workset's answer has no number ${key}`);
    return Number(v);
  }

  hex(): string {
    const v = this.fields.get('hex');
    if (v === undefined || !/^[0-9a-f]{16}$/.test(v)) throw new GuestRequestError(0, "pvisor-workset's answer has no 16-digit hex digest");
    return v;
  }

  ms(): number {
    return this.number('ns') / 1e6;
  }
}

/** The page runs of `range` that a rewrite with `permille` leaves alone. */
function runsNotRewritten(range: { offset: number; length: number }, permille: number): { offset: number; length: number }[] {
  const out: { offset: number; length: number }[] = [];
  for (let at = range.offset; at < range.offset + range.length; at += 4096) {
    if (rewritesPage(at / 4096, permille)) continue;
    const last = out[out.length - 1];
    if (last && last.offset + last.length === at) last.length += 4096;
    else out.push({ offset: at, length: 4096 });
  }
  return out;
}

