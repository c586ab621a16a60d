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

const fmt = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`;

/** Runs the steps on `vm`, printing one line per step through `print`. */
export async function runProbeScript(vm: Vm, steps: ProbeStep[], print: (line: string) => void): Promise<void> {
  for (const s of steps) {
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
        print(`wait: ${vm.name} was stopped after ${ms()}`);
        break;
      }
    }
  }
}

/** Resolves when the VM has ended (by `vm.stop()`, `pvisor stop`, a signal or a crash). */
function untilEnded(vm: Vm): Promise<{ error?: PvisorError }> {
  if (vm.state === 'stopped' || vm.state === 'crashed') return Promise.resolve({ error: vm.error });
  return new Promise((resolve) => vm.once('exit', ({ error }) => resolve({ error })));
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
