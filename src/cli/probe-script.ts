/**
 * `pvisor run --guest probe -- OPS`: the probe guest's "command" is a list of its operations,
 * separated by commas or `;`, e.g. `fill 64MiB random 42, digest, release, memory`.
 */
import { InvalidOptionError, VmStateError, type PvisorError } from '../errors';
import { PROBE_CONTENTS, isProbeContent, type ProbeContent } from '../guest/probe-content';
import { parseDurationMs, parseSize } from '../units';
import type { Vm } from '../vm';

/** One parsed operation. */
export type ProbeStep =
  | { op: 'fill'; sizeMiB: number; content: ProbeContent; seed: number }
  | { op: 'rewrite'; fraction: number; seed?: number }
  | { op: 'touch'; hotMiB: number; rounds: number }
  | { op: 'digest' }
  | { op: 'release'; offsetMiB?: number; sizeMiB?: number }
  | { op: 'idle' }
  | { op: 'memory' }
  | { op: 'pause' }
  | { op: 'suspend' }
  | { op: 'resume' }
  | { op: 'sleep'; ms: number }
  | { op: 'wait' };

const USAGE = `fill SIZE [${PROBE_CONTENTS.join('|')}] [SEED] | rewrite PERCENT% [SEED] | touch SIZE [ROUNDS] | digest | release [OFFSET SIZE] | idle | memory | pause | suspend | resume | sleep SECONDS[s|ms|m] | wait (last)`;

function mib(option: string, text: string | undefined): number {
  if (text === undefined) throw new InvalidOptionError(option, `missing size; steps are: ${USAGE}`);
  return parseSize(option, /^\d+$/.test(text) ? `${text}MiB` : text) / 2 ** 20;
}

function int(option: string, text: string | undefined, fallback: number): number {
  if (text === undefined) return fallback;
  if (!/^\d+$/.test(text)) throw new InvalidOptionError(option, `expected a whole number, got ${JSON.stringify(text)}`);
  return Number(text);
}

/** `sleep 30` is 30 s, as in the shell; `500ms`, `1.5s` and `2m` say their unit. */
function duration(text: string | undefined): number {
  return text === undefined ? 1000 : parseDurationMs('sleep', text);
}

/** Parses the words after `--` into steps. */
export function parseProbeScript(words: string[]): ProbeStep[] {
  const steps: ProbeStep[] = [];
  const groups = words.join(' ').split(/[,;]/).map((g) => g.trim().split(/\s+/).filter(Boolean)).filter((g) => g.length);
  for (const [op, ...args] of groups) {
    switch (op) {
      case 'fill': {
        const content = args[1] ?? 'repetitive';
        if (!isProbeContent(content)) throw new InvalidOptionError('fill', `content must be ${PROBE_CONTENTS.join(', ')}, got ${content}`);
        steps.push({ op, sizeMiB: mib('fill', args[0]), content, seed: int('seed', args[2], 1) });
        break;
      }
      case 'rewrite': {
        const m = /^(\d+(?:\.\d+)?)%$/.exec(args[0] ?? '');
        if (!m || Number(m[1]) > 100) throw new InvalidOptionError('rewrite', 'expected a percentage such as 25%');
        steps.push({ op, fraction: Number(m[1]) / 100, seed: args[1] === undefined ? undefined : int('seed', args[1], 0) });
        break;
      }
      case 'touch':
        steps.push({ op, hotMiB: mib('touch', args[0]), rounds: int('rounds', args[1], 1) });
        break;
      case 'release':
        steps.push(args.length ? { op, offsetMiB: mib('release', args[0]), sizeMiB: mib('release', args[1]) } : { op });
        break;
      case 'sleep':
        steps.push({ op, ms: duration(args[0]) });
        break;
      case 'wait':
        steps.push({ op });
        break;
      case 'digest':
      case 'idle':
      case 'memory':
      case 'pause':
      case 'suspend':
      case 'resume':
        steps.push({ op });
        break;
      default:
        throw new InvalidOptionError('probe step', `unknown step ${JSON.stringify(op)}; steps are: ${USAGE}`);
    }
  }
  if (!steps.length) throw new InvalidOptionError('probe steps', `nothing to run; steps are: ${USAGE}`);
  // After `wait` the VM has been stopped: a step behind it could never run.
  if (steps.slice(0, -1).some((s) => s.op === 'wait')) throw new InvalidOptionError('wait', 'must be the last step: it lasts until the VM is stopped');
  return steps;
}

/**
 * Steps as text that {@link parseProbeScript} reads back as the same steps: how the steps a
 * hibernated run had left travel to the run that resumes it. Sizes in bytes, durations in ms.
 */
export function formatProbeScript(steps: readonly ProbeStep[]): string {
  const bytes = (mib: number) => `${Math.round(mib * 2 ** 20)}B`;
  return steps
    .map((s) => {
      switch (s.op) {
        case 'fill':
          return `fill ${bytes(s.sizeMiB)} ${s.content} ${s.seed}`;
        case 'rewrite':
          return `rewrite ${Number((s.fraction * 100).toPrecision(12))}%${s.seed === undefined ? '' : ` ${s.seed}`}`;
        case 'touch':
          return `touch ${bytes(s.hotMiB)} ${s.rounds}`;
        case 'release':
          return s.offsetMiB === undefined ? 'release' : `release ${bytes(s.offsetMiB)} ${bytes(s.sizeMiB!)}`;
        case 'sleep':
          return `sleep ${s.ms}ms`;
        default:
          return s.op;
      }
    })
    .join(', ');
}

/**
 * Where a run of steps is, so that a hibernation (../cli/run-control.ts) can stop it between
 * steps and say which are left. A step that talks to the guest is let finish first: its answer
 * comes to this process only. `wait` and `sleep` need nothing of the guest, and are cut short.
 */
export class ScriptCursor {
  private index = 0;
  private running = false;
  private startedMs = 0;
  private halted = false;
  private released: (() => void)[] = [];
  private idle: (() => void)[] = [];

  constructor(private readonly steps: readonly ProbeStep[]) {}

  /** Holds the steps that have not begun; the one under way runs on. */
  halt(): void {
    this.halted = true;
  }

  /** Lets the steps go on (the hibernation failed). */
  go(): void {
    this.halted = false;
    for (const r of this.released.splice(0)) r();
  }

  /** Resolves once no step talks to the guest (at once if none does). */
  outOfGuest(): Promise<void> {
    return this.inGuest ? new Promise((resolve) => this.idle.push(resolve)) : Promise.resolve();
  }

  /** The steps left: a sleep under way counts what remains of it; a guest step under way is done (its answer is lost). */
  remaining(now = performance.now()): ProbeStep[] {
    if (!this.running) return this.steps.slice(this.index);
    const current = this.steps[this.index];
    if (current.op === 'sleep') return [{ op: 'sleep', ms: Math.max(0, Math.round(current.ms - (now - this.startedMs))) }, ...this.steps.slice(this.index + 1)];
    if (current.op === 'wait') return this.steps.slice(this.index);
    return this.steps.slice(this.index + 1);
  }

  private get inGuest(): boolean {
    return this.running && this.steps[this.index].op !== 'sleep' && this.steps[this.index].op !== 'wait';
  }

  /** @internal The runner: step `index` is about to begin; waits while the steps are held, unless the VM ends. */
  async begin(index: number, vm: Vm): Promise<void> {
    while (this.halted) {
      let onExit: (() => void) | undefined;
      try {
        await new Promise<void>((resolve, reject) => {
          this.released.push(resolve);
          onExit = () => reject(new VmStateError(`${vm.name} ended before its steps were done`));
          if (vm.state === 'stopped' || vm.state === 'crashed') onExit();
          else vm.once('exit', onExit);
        });
      } finally {
        if (onExit) vm.off('exit', onExit);
      }
    }
    this.index = index;
    this.running = true;
    this.startedMs = performance.now();
  }

  /** @internal The runner: the step has ended (done or failed). */
  end(): void {
    this.running = false;
    this.index++;
    for (const r of this.idle.splice(0)) r();
  }
}

const fmt = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`;

/**
 * Runs the steps on `vm`, printing one line per step through `print`; `cursor` follows them (for
 * a hibernation), and is made for these very steps.
 */
export async function runProbeScript(vm: Vm, steps: ProbeStep[], print: (line: string) => void, cursor?: ScriptCursor): Promise<void> {
  for (const [i, s] of steps.entries()) {
    await cursor?.begin(i, vm);
    try {
      await runStep(vm, s, print);
    } finally {
      cursor?.end();
    }
  }
}

async function runStep(vm: Vm, s: ProbeStep, print: (line: string) => void): Promise<void> {
  const t0 = performance.now();
  const ms = () => `${(performance.now() - t0).toFixed(1)} ms`;
  switch (s.op) {
    case 'fill': {
      const r = await vm.probe.fill(s);
      print(`fill: ${fmt(r.bytes)} ${s.content} (seed ${s.seed}) in ${ms()}`);
      break;
    }
    case 'rewrite': {
      const r = await vm.probe.rewrite(s);
      print(`rewrite: ${r.pagesRewritten} pages in ${ms()}`);
      break;
    }
    case 'touch': {
      const r = await vm.probe.touch(s);
      print(`touch: ${r.pagesTouched} page reads in ${ms()}`);
      break;
    }
    case 'digest': {
      const d = await vm.probe.digest();
      print(`digest: ${d.hex} over ${fmt(d.bytes)} in ${ms()}`);
      break;
    }
    case 'release': {
      const r = await vm.probe.release(s);
      print(`release: ${fmt(r.bytesReported)} reported free in ${ms()}`);
      break;
    }
    case 'idle':
      await vm.probe.idle();
      print('idle: the guest is parked until the next request');
      break;
    case 'memory': {
      const u = vm.memoryUsage();
      print(`memory: guest RAM PSS ${fmt(u.guestRamPssBytes)} of ${fmt(u.capacityBytes)}; process PSS ${fmt(u.processPssBytes)} (${u.vmsInProcess} VM)`);
      // A clone's resident RAM is partly the snapshot file's page cache, shared by every clone,
      // and partly its own copies of what it wrote: the second part is what the clone costs.
      if (u.guestRamSharedBytes > 0 || u.strategies.some((st) => st.strategy === 'shared-snapshot')) {
        print(`  guest RAM resident: ${fmt(u.guestRamSharedBytes)} shared (the snapshot's RAM file), ${fmt(u.guestRamPrivateBytes)} private`);
      }
      for (const st of u.strategies) {
        const figures = Object.entries(st.figures).map(([k, v]) => `${k} ${v}`).join(', ');
        print(`  ${st.strategy}: ${figures}${st.notes.map((n) => `; note: ${n}`).join('')}`);
      }
      break;
    }
    case 'pause':
      await vm.pause();
      print(`pause: vCPUs stopped in ${ms()}`);
      break;
    case 'suspend':
      await vm.suspend();
      print(`suspend: vCPUs stopped and memory strategies under way in ${ms()}`);
      await vm.memoryReleased();
      print(`suspend: memory released after ${ms()}`);
      break;
    case 'resume':
      await vm.resume();
      print(`resume: running in ${ms()}`);
      break;
    case 'sleep':
      await sleepWhileAlive(vm, s.ms);
      print(`sleep: ${s.ms} ms`);
      break;
    case 'wait': {
      const end = await untilEnded(vm);
      if (end.error) throw end.error;
      // Not stopped: it goes on in the process that resumes it, which waits in its turn.
      if (end.hibernatedTo !== undefined) throw new VmStateError(`${vm.name} hibernated during wait`);
      print(`wait: ${vm.name} was stopped after ${ms()}`);
      break;
    }
  }
}

/** Resolves when the VM has ended (by `vm.stop()`, `pvisor stop`, a signal or a crash). */
function untilEnded(vm: Vm): Promise<{ error?: PvisorError; hibernatedTo?: string }> {
  if (vm.state === 'stopped' || vm.state === 'crashed') return Promise.resolve({ error: vm.error });
  return new Promise((resolve) => vm.once('exit', ({ error, hibernatedTo }) => resolve({ error, hibernatedTo })));
}

/**
 * Sleeps `ms`, but ends at once with an error if the VM ends meanwhile, so that a run stopped from
 * outside does not sit out its sleep. (Steps that talk to the guest need nothing of the kind: while
 * the VM is paused or suspended from outside their requests are held until it resumes, and a stop
 * fails them.)
 */
async function sleepWhileAlive(vm: Vm, ms: number): Promise<void> {
  let timer: NodeJS.Timeout | undefined;
  let onExit: (() => void) | undefined;
  try {
    await new Promise<void>((resolve, reject) => {
      timer = setTimeout(resolve, ms);
      onExit = () => reject(new VmStateError(`${vm.name} stopped during sleep`));
      if (vm.state === 'stopped' || vm.state === 'crashed') onExit();
      else vm.once('exit', onExit);
    });
  } finally {
    clearTimeout(timer);
    if (onExit) vm.off('exit', onExit);
  }
}
