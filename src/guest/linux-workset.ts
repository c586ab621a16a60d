/**
 * The host's end of `pvisor-workset` (native-prebuilds/linux-guest/workset.c): an application's
 * working set held by a process in the Linux guest, with the probe guest's content kinds, so that
 * the memory study runs on the guest users run and every digest is checked against the host's own
 * model of the working set (probe-content.ts), as the probe's are.
 */
import { GuestRequestError, InvalidOptionError } from '../errors';
import type { GuestProcess } from './guest-process';
import type { ExecOptions, ExecResult, SpawnOptions } from './guest-types';
import { expectedDigestHex, isProbeContent, PROBE_CONTENTS, rewritesPage, type ProbeContent, type ProbeWorkingSet } from './probe-content';
import type { FillOptions, ReleaseOptions, RewriteOptions, TouchOptions, ZeroOptions } from './probe-client';
import { pageMiBOption, u32Option } from '../units';

/** Where the shipped initramfs has the tool. */
export const WORKSET_PATH = '/bin/pvisor-workset';
/** Where the holder listens by default (the guest's /run, a tmpfs). */
const DEFAULT_SOCKET = '/run/pvisor-workset.sock';

/** How long one command may take by default: a fill of 64 MiB is well under a second natively, a minute in the nested harness. */
const DEFAULT_COMMAND_TIMEOUT_MS = 300_000;

/** A timed answer: the guest's own time for the work, ms (CLOCK_MONOTONIC in the guest). */
export interface WorkingSetTiming {
  guestMs: number;
}

/** A digest of the working set, computed in the guest. */
export interface WorkingSetDigest extends WorkingSetTiming {
  bytes: number;
  /** As the probe's: h2 then h1, 16 hex digits. */
  hex: string;
}

/** The guest's working set did not hold what the host put there. */
export class WorkingSetMismatchError extends Error {
  override readonly name = 'WorkingSetMismatchError';
}

/** What the working set needs of a Linux VM: {@link Vm.spawn} and {@link Vm.exec}. */
export interface WorkingSetGuest {
  spawn(command: string[], options: SpawnOptions): GuestProcess;
  exec(command: string[], options: ExecOptions): Promise<ExecResult>;
}

/**
 * A `pvisor-workset` holder in a Linux guest and the host's model of what it holds. The methods
 * take the probe client's options, so code that drives a working set works on both guests;
 * `release` frees the working set in the guest (the program's munmap), which the guest then
 * reports free to the host like any freed memory. The holder outlives snapshots: a VM restored
 * from one gets its own {@link attach}ed client with a copy of the model ({@link model}).
 */
export class LinuxWorkingSet {
  private readonly expectedByModel = new Map<string, string>();

  private constructor(
    private readonly guest: WorkingSetGuest,
    /** The holder's socket in the guest. */
    readonly socket: string,
    private current: ProbeWorkingSet | undefined,
    private readonly timeoutMs: number,
  ) {}

  /** Starts a holder in the guest (it holds nothing until {@link fill}) and waits until it serves. */
  static async start(guest: WorkingSetGuest, options: { socket?: string; timeoutMs?: number } = {}): Promise<LinuxWorkingSet> {
    const socket = options.socket ?? DEFAULT_SOCKET;
    const timeoutMs = options.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS;
    const holder = guest.spawn([WORKSET_PATH, 'serve', socket], {});
    holder.stderr.resume();
    let said = '';
    await new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => reject(new GuestRequestError(0, `pvisor-workset did not start serving within ${timeoutMs} ms`)), timeoutMs);
      holder.stdout.on('data', (d: Buffer) => {
        said += d.toString('latin1');
        if (said.includes('ok serve\n')) {
          clearTimeout(timer);
          resolve();
        } else if (said.length > 64) {
          clearTimeout(timer);
          reject(new GuestRequestError(0, `pvisor-workset said ${JSON.stringify(said.slice(0, 64))} when starting`));
        }
      });
      holder.exited.then(
        (st) => reject(new GuestRequestError(0, `pvisor-workset ended as it started (${st.signal ?? `exit ${st.exitCode}`})`)),
        (e: Error) => reject(e),
      );
    });
    // Nothing more comes on its output; what might is read and dropped.
    holder.stdout.resume();
    return new LinuxWorkingSet(guest, socket, undefined, timeoutMs);
  }

  /** A client of a holder that already runs in `guest` (a restored VM's), whose memory `model` describes. */
  static attach(guest: WorkingSetGuest, model: ProbeWorkingSet | undefined, options: { socket?: string; timeoutMs?: number } = {}): LinuxWorkingSet {
    return new LinuxWorkingSet(guest, options.socket ?? DEFAULT_SOCKET, model && structuredClone(model), options.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS);
  }

  /** The host's model of the working set (a copy), or undefined when it holds nothing. */
  get model(): ProbeWorkingSet | undefined {
    return this.current && structuredClone(this.current);
  }

  /** Fills the working set (replacing the previous one) and waits until the guest has written it. */
  async fill(options: FillOptions): Promise<{ bytes: number } & WorkingSetTiming> {
    const bytes = pageMiBOption('sizeMiB', options.sizeMiB);
    const seed = u32Option('seed', options.seed ?? 1);
    if (!isProbeContent(options.content)) throw new InvalidOptionError('content', `expected one of ${PROBE_CONTENTS.map((c) => JSON.stringify(c)).join(', ')}`);
    const a = await this.command(['fill', bytes, options.content, seed]);
    this.current = { content: options.content, seed, sizeBytes: bytes, rewrites: [] };
    return { bytes: a.number('bytes'), guestMs: a.ms() };
  }

  /** Rewrites a fraction of the pages with new content (the probe's REWRITE). */
  async rewrite(options: RewriteOptions): Promise<{ pagesRewritten: number } & WorkingSetTiming> {
    if (!(options.fraction >= 0 && options.fraction <= 1)) throw new InvalidOptionError('fraction', 'expected a number from 0 to 1');
    const permille = Math.round(options.fraction * 1000);
    const seed = u32Option('seed', options.seed ?? ((this.current?.seed ?? 1) + 1) >>> 0);
    const a = await this.command(['rewrite', permille, seed]);
    if (this.current && permille > 0) {
      this.current.rewrites.push({ permille, seed });
      // The model applies zeroed ranges after every rewrite, so the pages this rewrite gave
      // content again leave them.
      if (this.current.zeroed) this.current.zeroed = this.current.zeroed.flatMap((z) => runsNotRewritten(z, permille));
    }
    return { pagesRewritten: a.number('pages'), guestMs: a.ms() };
  }

  /** Reads every page of the first `hotMiB` `rounds` times. */
  async touch(options: TouchOptions): Promise<{ pagesTouched: number } & WorkingSetTiming> {
    const a = await this.command(['touch', pageMiBOption('hotMiB', options.hotMiB), u32Option('rounds', options.rounds ?? 1)]);
    return { pagesTouched: a.number('pages'), guestMs: a.ms() };
  }

  /** Writes zeros over a range; the pages stay the program's. */
  async zero(options: ZeroOptions): Promise<{ bytes: number } & WorkingSetTiming> {
    const offset = pageMiBOption('offsetMiB', options.offsetMiB);
    const length = pageMiBOption('sizeMiB', options.sizeMiB);
    const a = await this.command(['zero', offset, length]);
    this.zeroed(offset, length);
    return { bytes: a.number('bytes'), guestMs: a.ms() };
  }

  /** The digest the guest computes over its working set. */
  async digest(): Promise<WorkingSetDigest> {
    const a = await this.command(['digest']);
    return { bytes: a.number('bytes'), hex: a.hex(), guestMs: a.ms() };
  }

  /** The digest the guest must report, from the host's model (16 hex digits). */
  expectedDigest(): string {
    const model = this.current ?? { content: 'repetitive' as ProbeContent, seed: 1, sizeBytes: 0, rewrites: [] };
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
   * Frees the working set in the guest, or a range of it (which then reads as zeros), as a
   * program's free does; the guest's free page reporting then tells the host.
   */
  async release(options: ReleaseOptions = {}): Promise<{ bytes: number }> {
    if (options.offsetMiB === undefined && options.sizeMiB === undefined) {
      const a = await this.command(['free']);
      this.current = undefined;
      return { bytes: a.number('bytes') };
    }
    const offset = pageMiBOption('offsetMiB', options.offsetMiB ?? 0);
    const length = options.sizeMiB === undefined ? (this.current?.sizeBytes ?? 0) - offset : pageMiBOption('sizeMiB', options.sizeMiB);
    const a = await this.command(['free', offset, Math.max(0, length)]);
    this.zeroed(offset, length);
    return { bytes: a.number('bytes') };
  }

  /** Ends the holder (its memory goes back to the guest). */
  async close(): Promise<void> {
    await this.command(['exit']).catch(() => {});
  }

  private zeroed(offset: number, length: number): void {
    if (this.current && length > 0) (this.current.zeroed ??= []).push({ offset, length });
  }

  private async command(words: (string | number)[]): Promise<Answer> {
    const verb = String(words[0]);
    const r = await this.guest.exec([WORKSET_PATH, this.socket, ...words.map(String)], { timeoutMs: this.timeoutMs });
    const line = r.stdout.split('\n')[0];
    if (line.startsWith('error ')) throw new GuestRequestError(0, `pvisor-workset ${verb}: ${line.slice(6)}`);
    if (r.exitCode !== 0) throw new GuestRequestError(0, `pvisor-workset ${verb} ended ${r.signal ?? `with exit ${r.exitCode}`}: ${JSON.stringify((line || r.stderr).slice(0, 200))}`);
    return new Answer(line, verb);
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

