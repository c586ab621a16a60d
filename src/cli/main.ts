#!/usr/bin/env node
/**
 * The `pvisor` command.
 */
import { constants as osConstants } from 'node:os';
import { parseArgs } from 'node:util';
import { InvalidOptionError, PvisorError, VmNotFoundError } from '../errors';
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

const HELP = `pvisor: KVM sandboxes that cost the host only the memory they use

Usage:
  pvisor run [--name ID] [--memory 512MiB] [--vcpus 2] [--guest linux|probe] [--console]
             [--vm-ram-dedup] [--vm-idle-release] [--vm-offload [--vm-offload-reload eager|lazy]]
             [--vm-ram-compression] [--vm-backing-dir DIR] [--kernel BZIMAGE] [--initrd CPIO]
             [--rootfs IMAGE [--rootfs-readonly]] -- CMD [ARGS...]
      Boots a fresh VM, runs CMD in it, prints its output, exits with its status, tears the VM down.
      The Linux guest (the default) needs hardware virtualisation; CMD is an argv, run without a
      shell. --kernel/--initrd boot your own instead of the shipped ones.
      --rootfs IMAGE: CMD runs in this root filesystem (an ext4 image with the tools CMD needs,
        e.g. made with mke2fs -t ext4 -d DIR IMAGE 256M), attached read-write as /dev/vda and
        shut down cleanly at the end, so what CMD wrote is in the image;
        --rootfs-readonly attaches it read-only (the image needs /dev and /proc and a clean
        journal: e2fsck -p IMAGE).
      --name ID: the VM's id for suspend/resume/stop/ps (default: 6 random hex digits); the run
        listens on ID.sock in $PVISOR_RUNTIME_DIR, $XDG_RUNTIME_DIR/pvisor, /run/pvisor (root) or
        /tmp/pvisor-$UID (--vm-socket PATH: there instead). SIGINT/SIGTERM stop the VM cleanly.
      --vm-ram-dedup: KSM merges identical guest pages (needs KSM running on the host).
      --vm-idle-release: the host drops pages the guest reports free.
      --vm-cold-ram-compression: while the VM runs, blocks unchanged for a while are compressed
        (lz4) into host memory and dropped; the guest's first touch brings them back.
        --vm-cold-after DURATION: how long unchanged (default 10s; 500ms, 30s, 2m).
      --vm-offload: suspend writes the VM's own guest RAM to a backing file and drops it as it
        becomes durable (the default; suspend returns at once, the memory follows).
      --vm-offload-reload: resume brings it all back and checks it first (eager, the default) or
        lets the guest run at once, each piece loaded on first touch and the rest in the
        background (lazy, through userfaultfd).
      --vm-ram-compression: the same with a zstd-compressed backing file (CompressedOffload).
      --vm-backing-dir DIR: where the backing file goes (default /var/tmp); a directory on
        tmpfs or ramfs is refused at suspend, since offloading into RAM frees nothing.
      With --guest probe, CMD is a list of probe steps, e.g.
        pvisor run --guest probe -- fill 64MiB random 42, digest, memory
      Steps: fill SIZE [repetitive|random|compressible] [SEED], rewrite PERCENT% [SEED], touch SIZE [ROUNDS],
             digest, release [OFFSET SIZE], idle, memory, pause, suspend, resume,
             sleep SECONDS (or 500ms, 2m), wait (last step: until pvisor stop ID or a signal)
  pvisor suspend ID [--vm-offload] [--vm-socket PATH] [--vm-job-id ID] [--vm-attempt-id A] [--json]
      Pauses the VM started by pvisor run --name ID; with --vm-offload its RAM goes to disk too.
  pvisor resume ID [--vm-load] [--vm-socket PATH] [--vm-job-id ID] [--vm-attempt-id A] [--json]
      Lets it run again; RAM that a suspend offloaded is loaded back and verified first.
  pvisor stop ID [--vm-socket PATH] [--json]
      Stops the VM; its run ends.
  pvisor ps [--json]
      Live VMs: id, state, guest RAM resident, memory, bytes on disk, pid.
  pvisor bench vmm [--runs N] [--json FILE]
      Start-to-ready time, exits per second against a native C loop, the VMM's memory per VM.
  pvisor bench linux [--runs 3] [--execs 20] [--restores 3] [--json FILE]
      The Linux guest: boot to agent ready, exec round trip, guest RAM once booted, and clones
      of a snapshot of the booted VM: restore to agent ready against a fresh boot.
  pvisor bench memory [--modes LIST] [--contents repetitive,random] [--backing-dir DIR] [--json FILE]
      The reference study's Tables 1 and 2: each cell a fresh 512 MiB VM in its own process and
      cgroup, resident (group PSS), guest RAM PSS, group memory, offload costs, the study beside.
      Modes cold-compression and cold-compression-mix (16 MiB hot, the rest cold) add a cold
      compression table: time to settle, store size, scanner CPU, faults/s against a native
      userfaultfd loop; --contents compressible is the study's distinct compressible pages.
  pvisor bench floors [--dir DIR] [--size 64MiB] [--runs 5] [--json FILE]
      The host's physical floors for the same bytes (C, no VM): copies into fresh memory and by
      UFFDIO_COPY, write + fdatasync, cold and warm reads back; DIR (default
      /var/tmp/pvisor-bench-floors) must be on a disk.
  pvisor bench soak [--cycles 1000] [--strategy LIST] [--vms 1] [--working-set 16MiB]
                    [--backing-dir DIR] [--json FILE]
      Suspend/resume cycles of 128 MiB probe VMs, each checked against the guest's digest, per
      strategy (none, idle-release, offload-eager, offload-lazy, compressed-offload) in a fresh
      process: cycles, failures, host RSS/PSS before and after, growth of the live JS heap
      (after a full collection), time per cycle (median, p99).
      --vms N runs N VMs in one process at once. Exits 1 if a cycle failed.
  pvisor help | --help
`;

/** Exit status when pvisor itself fails (bad options, host unsupported, guest crash). */
const EXIT_PVISOR_ERROR = 125;
/** Exit status of suspend/resume/stop when no VM of that id is running. */
const EXIT_NO_SUCH_VM = 2;

async function cmdRun(argv: string[]): Promise<number> {
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

async function main(argv: string[]): Promise<number> {
  const [cmd, ...rest] = argv;
  switch (cmd) {
    case 'run':
      return cmdRun(rest);
    case 'suspend':
    case 'resume':
    case 'stop': {
      const { cmdControl } = await import('./control-commands');
      return cmdControl(cmd, rest);
    }
    case 'ps': {
      const { cmdPs } = await import('./control-commands');
      return cmdPs(rest);
    }
    case 'bench': {
      const { cmdBench } = await import('./bench');
      return cmdBench(rest);
    }
    case undefined:
    case 'help':
    case '--help':
    case '-h':
      process.stdout.write(HELP);
      return cmd === undefined ? 2 : 0;
    default:
      process.stderr.write(`pvisor: unknown command ${JSON.stringify(cmd)}\n\n${HELP}`);
      return 2;
  }
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (e: unknown) => {
    if (e instanceof VmNotFoundError) {
      process.stderr.write(`pvisor: ${e.message}\n`);
      process.exit(EXIT_NO_SUCH_VM);
    }
    if (e instanceof PvisorError) process.stderr.write(`pvisor: ${e.message}\n`);
    else if (e instanceof Error && 'code' in e && String(e.code).startsWith('ERR_PARSE_ARGS')) process.stderr.write(`pvisor: ${e.message}\n\n${HELP}`);
    else process.stderr.write(`pvisor: unexpected error: ${e instanceof Error ? e.stack : String(e)}\n`);
    process.exit(EXIT_PVISOR_ERROR);
  },
);
