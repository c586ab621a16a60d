/**
 * `pvisor run`: starts one VM, runs CMD in it (probe steps on the probe guest), and answers its
 * control socket meanwhile (./run-control.ts).
 */
import { constants as osConstants } from 'node:os';
import { parseArgs } from 'node:util';
import { InvalidOptionError } from '../errors';
import { ColdCompression } from '../memory/strategies/cold-compression';
import { IdleRelease } from '../memory/strategies/idle-release';
import { KsmAdvice } from '../memory/strategies/ksm-advice';
import { Offload } from '../memory/strategies/offload';
import type { MemoryStrategy } from '../memory/strategy';
import { CompressedOffload } from '../memory/strategies/compressed-offload';
import { parseDurationMs, parseSize } from '../units';
import { Vm, type GuestKind } from '../vm';
import { parseProbeScript, runProbeScript } from './probe-script';
import { RunControl } from './run-control';

/** Runs `pvisor run ARGS`; resolves with the run's exit status. */
export async function cmdRun(argv: string[]): Promise<number> {
  const dash = argv.indexOf('--');
  const own = dash >= 0 ? argv.slice(0, dash) : argv;
  const command = dash >= 0 ? argv.slice(dash + 1) : [];
  const { values } = parseArgs({
    args: own,
    options: {
      memory: { type: 'string', default: '512MiB' },
      vcpus: { type: 'string', default: '2' },
      guest: { type: 'string', default: 'linux' },
      console: { type: 'boolean', default: false },
      'vm-ram-dedup': { type: 'boolean', default: false },
      'vm-idle-release': { type: 'boolean', default: false },
      'vm-offload': { type: 'boolean', default: false },
      'vm-offload-reload': { type: 'string' },
      'vm-ram-compression': { type: 'boolean', default: false },
      'vm-backing-dir': { type: 'string' },
      'vm-cold-ram-compression': { type: 'boolean', default: false },
      'vm-cold-after': { type: 'string' },
      name: { type: 'string' },
      'vm-socket': { type: 'string' },
      kernel: { type: 'string' },
      initrd: { type: 'string' },
      rootfs: { type: 'string' },
      'rootfs-readonly': { type: 'boolean', default: false },
    },
    strict: true,
  });
  const coldAfter = values['vm-cold-after'];
  if (coldAfter !== undefined && !values['vm-cold-ram-compression']) throw new InvalidOptionError('--vm-cold-after', 'only goes with --vm-cold-ram-compression');
  if (values['rootfs-readonly'] && values.rootfs === undefined) throw new InvalidOptionError('--rootfs-readonly', 'only goes with --rootfs IMAGE');
  const reload = values['vm-offload-reload'];
  if (reload !== undefined && !values['vm-offload']) throw new InvalidOptionError('--vm-offload-reload', 'only goes with --vm-offload');
  if (reload !== undefined && reload !== 'eager' && reload !== 'lazy') throw new InvalidOptionError('--vm-offload-reload', `expected eager or lazy, got ${JSON.stringify(reload)}`);
  if (!command.length) throw new InvalidOptionError('command', 'nothing to run: give it after --, e.g. pvisor run -- uname -a');
  const vcpus = Number(values.vcpus);
  const guest = values.guest as GuestKind;
  const memory = parseSize('memory', values.memory);
  if (guest === 'probe' && (values.kernel !== undefined || values.initrd !== undefined)) throw new InvalidOptionError('--kernel', '--kernel and --initrd are for the Linux guest');
  if (guest === 'probe' && values.rootfs !== undefined) throw new InvalidOptionError('--rootfs', 'is for the Linux guest');
  const steps = guest === 'probe' ? parseProbeScript(command) : undefined;
  const strategies: MemoryStrategy[] = [];
  if (values['vm-ram-dedup']) strategies.push(new KsmAdvice());
  if (values['vm-idle-release']) strategies.push(new IdleRelease());
  const dir = values['vm-backing-dir'];
  if (values['vm-cold-ram-compression']) strategies.push(new ColdCompression({ coldAfterMs: coldAfter === undefined ? undefined : parseDurationMs('--vm-cold-after', coldAfter), dir }));
  if (values['vm-offload']) strategies.push(new Offload({ reload, dir }));
  if (values['vm-ram-compression']) strategies.push(new CompressedOffload({ dir }));
  // `pvisor suspend ID --vm-offload` must work on any VM, as in the reference CLI: Offload costs
  // nothing until a suspend, so it is composed unless another suspend-image strategy was chosen.
  if (!strategies.some((s) => s.exclusive.includes('suspend-image'))) strategies.push(new Offload({ dir }));
  // Claim the id before booting, so that a taken id fails without starting anything.
  const control = await RunControl.open({ name: values.name, socketPath: values['vm-socket'], guest, memoryBytes: memory, vcpus });
  try {
    process.stderr.write(`pvisor: VM ${control.id}, control socket ${control.socketPath}\n`);
    process.stderr.write(`pvisor: starting a ${values.memory} ${guest} VM with ${vcpus} vCPU(s)...\n`);
    const t0 = performance.now();
    const rootfs = values.rootfs === undefined ? undefined : { path: values.rootfs, readOnly: values['rootfs-readonly'] };
    const vm = await Vm.start({ name: control.id, memory, vcpus, guest, strategies, kernel: values.kernel, initrd: values.initrd, rootfs });
    control.attach(vm);
    try {
      if (values.console) vm.on('console', (line) => process.stderr.write(`[console] ${line}\n`));
      vm.on('warning', (m) => process.stderr.write(`pvisor: warning: ${m}\n`));
      process.stderr.write(`pvisor: ${vm.name} ready in ${(performance.now() - t0).toFixed(0)} ms\n`);
      if (steps) {
        try {
          await runProbeScript(vm, steps, (line) => process.stdout.write(`${line}\n`));
        } catch (e) {
          // Stopped from outside (pvisor stop, a signal) before the steps were done: not a failure of pvisor.
          if (!control.stopCause) throw e;
          process.stderr.write(`pvisor: ${vm.name} was stopped (${control.stopCause}) before its steps finished\n`);
          return control.stopExitCode;
        }
        return 0;
      }
      return await runCommand(vm, command, control);
    } finally {
      // A writable rootfs must get everything CMD wrote; otherwise there is nothing to save.
      if (rootfs && !rootfs.readOnly) await vm.shutdown();
      else vm.stop();
    }
  } finally {
    control.close();
  }
}

/**
 * Runs CMD in the Linux guest with its output streamed to ours; the exit status is CMD's, or
 * 128 + the signal that killed it, as a shell reports it.
 */
async function runCommand(vm: Vm, command: string[], control: RunControl): Promise<number> {
  const proc = vm.spawn(command);
  proc.stdout.pipe(process.stdout);
  proc.stderr.pipe(process.stderr);
  try {
    const status = await proc.exited;
    if (status.signal) return 128 + (osConstants.signals[status.signal] ?? 0);
    return status.exitCode ?? 1;
  } catch (e) {
    if (!control.stopCause) throw e;
    process.stderr.write(`pvisor: ${vm.name} was stopped (${control.stopCause}) before the command finished\n`);
    return control.stopExitCode;
  }
}
