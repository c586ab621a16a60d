/**
 * `pvisor run`: starts one VM (booted, or restored from a snapshot with `--from`), runs CMD in it
 * (probe steps on the probe guest), and answers its control socket meanwhile (./run-control.ts).
 */
import { constants as osConstants } from 'node:os';
import { formatMiB } from '../units';
import { Vm, type GuestKind } from '../vm';
import { ConsoleCopy } from './console-copy';
import { parseProbeScript, runProbeScript } from './probe-script';
import { parseRunArgs } from './run-args';
import { RunControl } from './run-control';
import { parseUsage } from './usage';

/** Runs `pvisor run ARGS`; resolves with the run's exit status. */
export async function cmdRun(argv: string[]): Promise<number> {
  const args = parseUsage('run', () => parseRunArgs(argv));
  const { source } = args;
  const machine = source.kind === 'boot' ? source : await readSnapshotMachine(source.dir);
  // Probe steps are checked before anything starts; for --from, the snapshot says the guest.
  const steps = machine.guest === 'probe' ? parseUsage('run', () => parseProbeScript(args.command)) : undefined;
  // Claim the id before booting, so that a taken id fails without starting anything.
  const control = await RunControl.open({ name: args.name, socketPath: args.socketPath, guest: machine.guest, memoryBytes: machine.memoryBytes, vcpus: machine.vcpus });
  try {
    process.stderr.write(`pvisor: VM ${control.id}, control socket ${control.socketPath}\n`);
    const t0 = performance.now();
    let vm: Vm;
    if (source.kind === 'boot') {
      process.stderr.write(`pvisor: starting a ${source.memoryText} ${source.guest} VM with ${source.vcpus} vCPU(s)...\n`);
      const { memoryBytes: memory, vcpus, guest, kernel, initrd, rootfs, network } = source;
      vm = await Vm.start({ name: control.id, memory, vcpus, guest, strategies: args.strategies, kernel, initrd, rootfs, network });
      if (vm.network.mode !== 'none') process.stderr.write(`pvisor: ${vm.name} network ${vm.network.mode}: guest ${vm.network.guestAddress ?? '(unconfigured)'} on ${vm.network.tap}\n`);
    } else {
      process.stderr.write(`pvisor: restoring a ${formatMiB(machine.memoryBytes)} ${machine.guest} VM with ${machine.vcpus} vCPU(s) from ${source.dir}${source.shared ? ", its RAM the snapshot's file shared copy-on-write" : ''}...\n`);
      vm = await Vm.restore(source.dir, { name: control.id, strategies: args.strategies });
    }
    control.attach(vm);
    try {
      for (const p of args.publish) {
        const f = await vm.forward(p.guestPort, { hostPort: p.hostPort });
        process.stderr.write(`pvisor: ${f.host}:${f.port} reaches the guest's port ${p.guestPort}\n`);
      }
      if (args.console) {
        const copy = new ConsoleCopy(process.stderr);
        vm.on('console', (line) => copy.line(line));
        vm.once('exit', () => copy.close());
      }
      vm.on('warning', (m) => process.stderr.write(`pvisor: warning: ${m}\n`));
      process.stderr.write(`pvisor: ${vm.name} ready in ${(performance.now() - t0).toFixed(0)} ms${source.kind === 'snapshot' ? ' (restored)' : ''}\n`);
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
      return await runCommand(vm, args.command, control);
    } finally {
      // The VM knows whether a writable rootfs is attached, which must get everything CMD wrote
      // (a clean shutdown); otherwise it is stopped at once.
      await vm[Symbol.asyncDispose]();
    }
  } finally {
    control.close();
  }
}

/**
 * The guest, memory and vCPUs of the VM a snapshot holds, read before restoring it: the guest
 * decides how CMD reads, and the control socket answers with them while the VM restores. A
 * damaged snapshot fails here, before the id is claimed; Vm.restore checks it again as it reads it.
 */
async function readSnapshotMachine(dir: string): Promise<{ guest: GuestKind; memoryBytes: number; vcpus: number }> {
  const { SnapshotReader } = await import('../snapshot/snapshot-dir');
  const snapshot = SnapshotReader.open(dir);
  snapshot.close();
  const { guest, memoryBytes, vcpus } = snapshot.state;
  return { guest, memoryBytes, vcpus };
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
