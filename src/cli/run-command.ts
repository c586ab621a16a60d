/**
 * `pvisor run`: starts one VM (booted, or restored from a snapshot with `--from`), runs CMD in it
 * (probe steps on the probe guest), and answers its control socket meanwhile (./run-control.ts).
 * The same run goes on in a new process when `pvisor resume` continues a hibernated VM
 * (./resume-hibernated.ts).
 */
import { rmSync, statSync } from 'node:fs';
import { constants as osConstants } from 'node:os';
import { InvalidOptionError, type PvisorError } from '../errors';
import { checkKvmHost, requireKernelModeGuests, type KvmHostInfo } from '../backends/kvm/host-check';
import { formatMiB } from '../units';
import { Vm } from '../vm';
import type { GuestKind } from '../vm-types';
import { ConsoleCopy } from './console-copy';
import { parseProbeScript, runProbeScript, ScriptCursor, type ProbeStep } from './probe-script';
import { parseRunArgs, type RunArgs } from './run-args';
import { isStoreUrl } from '../store/store-url';
import type { FetchedSnapshot } from '../store/download';
import type { StoreOptions } from '../store/store-options';
import { RunControl } from './run-control';
import { jailedEntry, makeForbiddenSyscall } from '../jail/jailed-entry';
import { EXIT_HIBERNATED, parseUsage, RefusedError } from './usage';

/** Runs `pvisor run ARGS`; resolves with the run's exit status. */
export async function cmdRun(argv: string[]): Promise<number> {
  const parsed = parseUsage('run', () => parseRunArgs(argv));
  // --from s3://...: Vm.restore reads it from the store (lazily where it can; the chunk cache is
  // $PVISOR_CHUNK_CACHE or its default).
  return runFrom(parsed, argv, undefined);
}

async function runFrom(args: RunArgs, argv: string[], afterRestore: (() => void) | undefined): Promise<number> {
  const { source } = args;
  const machine = source.kind === 'boot' ? source : await readSnapshotMachine(source.dir);
  // Probe steps are checked before anything starts; for --from, the snapshot says the guest.
  const steps = machine.guest === 'probe' ? parseUsage('run', () => parseProbeScript(args.command)) : undefined;
  const cursor = steps && new ScriptCursor(steps);
  // The options' own checks before the host's, so that a run says what is wrong with it on any
  // host. Not in a jail: there a writable image is an fd its launcher opened, its path not bound.
  if (!jailedEntry()) checkRootfsFile(args);
  // A KVM that cannot run the Linux guest refuses it before anything is claimed or printed, in
  // the CLI's words. A host without a usable KVM is left to Vm.start, after the options' checks.
  if (machine.guest === 'linux') {
    let host: KvmHostInfo | undefined;
    try {
      host = checkKvmHost();
    } catch {
      host = undefined;
    }
    if (host) requireKernelModeGuests(host, 'linux', 'cli');
  }
  // --isolation process: this process launches the VMM in a jail and relays its control socket.
  // In the jail (told by its environment) the same arguments run the VM here.
  const jailed = jailedEntry();
  if (args.isolation === 'process' && !jailed) {
    const { runJailed } = await import('./run-jailed');
    // A snapshot in a store: this process has the store's credentials and network, the jail has
    // neither. It fetches the snapshot whole (no lazy restore across the jail's wall), the jail
    // reads the local copy, and this process removes it after.
    if (source.kind !== 'snapshot' || !isStoreUrl(source.dir)) return runJailed(args, argv, machine);
    const fetched = await fetchSnapshotFrom(source.dir, args);
    try {
      return await runJailed({ ...args, source: { ...source, dir: fetched.dir } }, argv, machine, undefined, fetched.dir);
    } finally {
      fetched.remove();
    }
  }
  // Claim the id before booting, so that a taken id fails without starting anything.
  const control = await RunControl.open({
    listenFd: jailed?.controlFd,
    name: args.name,
    socketPath: args.socketPath,
    guest: machine.guest,
    memoryBytes: machine.memoryBytes,
    vcpus: machine.vcpus,
    labels: args.labels,
    carry: { flags: args.carriedFlags, backingDir: args.backingDir, command: args.command, script: cursor },
  }).catch((e: unknown) => {
    // The name was checked as a name above: here it can only be taken by a running VM.
    throw e instanceof InvalidOptionError && e.option === 'name' ? new RefusedError(e.message) : e;
  });
  // A hibernated VM its launcher resumes in this jail: its record is the launcher's, and a Linux
  // guest's CMD runs on in the guest, detached (as in ./resume-hibernated.ts).
  const resumed = jailed?.resumed ? { onReady: () => {} } : undefined;
  return runVm(control, { args, steps, cursor, afterRestore, resumed });
}

/**
 * Fetches the snapshot at `url` whole into the chunk cache (docs/object-store.md) for a jailed
 * run, saying on stderr how far it is, at most once a second, and what it moved. `--shared`: the
 * host's one copy in the cache, which every --shared clone maps.
 */
async function fetchSnapshotFrom(url: string, args: RunArgs): Promise<FetchedSnapshot> {
  const { fetchFromStore } = await import('../store/snapshot-store');
  const say = (line: string) => args.quiet || process.stderr.write(`pvisor: ${line}\n`);
  say(`fetching the snapshot ${url}...`);
  let lastMs = performance.now();
  const onProgress: StoreOptions['onProgress'] = (p) => {
    if (performance.now() - lastMs < 1000) return;
    lastMs = performance.now();
    say(`${url}: ${p.chunksDone}/${p.chunksTotal} RAM chunks, ${formatMiB(p.bytesTransferred)} fetched`);
  };
  const fetched = await fetchFromStore(url, { onProgress }, args.source.kind === 'snapshot' && args.source.shared);
  const t = fetched.transfer;
  say(`${url}: ${t.chunksTransferred} chunks fetched (${formatMiB(t.bytesTransferred)}), ${t.chunksPresent} from the cache, ${t.zeroChunks} zero, in ${Math.round(t.ms)} ms${t.sharedEntry === 'reused' ? ' (the snapshot shared in the cache, as other --shared clones map it)' : ''}`);
  return fetched;
}

/** What {@link runVm} runs. */
export interface RunPlan {
  args: RunArgs;
  /** Probe guest: the steps, followed by `cursor`. */
  steps?: ProbeStep[];
  cursor?: ScriptCursor;
  /**
   * The run continues a hibernated VM (args.source is its directory): its record goes once the VM
   * is back, and `onReady` is told; a Linux guest's CMD runs on in the guest, detached, so the
   * run waits until the VM is stopped instead of starting it again.
   */
  resumed?: { recordPath?: string; onReady(vm: Vm): void };
  /** Called once the VM is restored (or its restore failed): a snapshot fetched from a store is removed. */
  afterRestore?: () => void;
  /** The restore's store options, for an `s3://` source restored by Vm.restore itself (a resume from a store). */
  restoreStore?: StoreOptions;
}

/**
 * Boots or restores the VM of `plan` under `control` (which has claimed its id), runs its command
 * or steps, and ends it; resolves with the run's exit status.
 */
export async function runVm(control: RunControl, plan: RunPlan): Promise<number> {
  const { args, steps, cursor, resumed } = plan;
  const { source } = args;
  // --quiet: CMD's output and status only; warnings and what ends the run are still said.
  const progress = (line: string) => args.quiet || process.stderr.write(`pvisor: ${line}\n`);
  try {
    progress(`VM ${control.id}, control socket ${control.socketPath}`);
    const t0 = performance.now();
    let vm: Vm;
    if (source.kind === 'boot') {
      progress(`starting a ${source.memoryText} ${source.guest} VM with ${source.vcpus} vCPU(s)...`);
      const { memoryBytes: memory, vcpus, guest, kernel, initrd, rootfs, network } = source;
      vm = await Vm.start({ name: control.id, memory, vcpus, guest, strategies: args.strategies, kernel, initrd, rootfs, network, labels: args.labels });
      if (vm.network.mode !== 'none') progress(`${vm.name} network ${vm.network.mode}: guest ${vm.network.guestAddress ?? '(unconfigured)'} on ${vm.network.tap}`);
    } else {
      if (resumed) progress(`${new Date().toISOString()} resuming the hibernated VM ${control.id} from ${source.dir}...`);
      else progress(`restoring a ${formatMiB(control.description.memoryBytes)} ${control.description.guest} VM with ${control.description.vcpus} vCPU(s) from ${source.dir}${source.shared ? ", its RAM the snapshot's file shared copy-on-write" : ''}...`);
      // No --label: a hibernated VM keeps its own.
      const labels = Object.keys(args.labels).length ? { labels: args.labels } : {};
      try {
        vm = await Vm.restore(source.dir, { name: control.id, strategies: args.strategies, ...labels, ...(plan.restoreStore && { store: plan.restoreStore }) });
      } finally {
        plan.afterRestore?.();
      }
      // The VM is back in a process (the restore removed its directory): it is no longer hibernated.
      if (resumed?.recordPath) rmSync(resumed.recordPath, { force: true });
      const t = vm.restoreInfo?.store;
      if (t) {
        const how = vm.restoreInfo!.storeRamLoad === 'lazy' ? 'before the VM was ready (guest RAM comes lazily, the rest in the background)' : 'guest RAM fetched whole first';
        progress(`${source.dir}: ${t.chunksTransferred} chunks fetched (${formatMiB(t.bytesTransferred)}), ${t.chunksPresent} from the cache, ${t.zeroChunks} zero, in ${Math.round(t.ms)} ms, ${how}`);
      }
    }
    control.attach(vm);
    if (jailedEntry()?.forbiddenSyscallHook) makeForbiddenSyscall();
    try {
      for (const p of args.publish) {
        const f = await vm.forward(p.guestPort, { hostPort: p.hostPort });
        progress(`${f.host}:${f.port} reaches the guest's port ${p.guestPort}`);
      }
      if (args.console) {
        const copy = new ConsoleCopy(process.stderr);
        vm.on('console', (line) => copy.line(line));
        vm.once('exit', () => copy.close());
      }
      vm.on('warning', (m) => process.stderr.write(`pvisor: warning: ${m}\n`));
      const how = resumed ? ` (resumed from hibernation, guest RAM ${vm.restoreInfo?.ramLoad === 'lazy' ? 'loading lazily' : 'read'})` : source.kind === 'snapshot' ? ' (restored)' : '';
      progress(`${vm.name} ready in ${(performance.now() - t0).toFixed(0)} ms${how}`);
      resumed?.onReady(vm);
      if (steps) {
        try {
          await runProbeScript(vm, steps, (line) => process.stdout.write(`${line}\n`), cursor);
        } catch (e) {
          if (control.hibernation) return hibernated(control);
          // Stopped from outside (pvisor stop, a signal) before the steps were done: not a failure of pvisor.
          if (!control.stopCause) throw e;
          process.stderr.write(`pvisor: ${vm.name} was stopped (${control.stopCause}) before its steps finished\n`);
          return control.stopExitCode;
        }
        return control.hibernation ? hibernated(control) : 0;
      }
      if (resumed) return await untilStopped(vm, control);
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

/** The run's end once its VM has hibernated: after the answer has left, says where it went. */
async function hibernated(control: RunControl): Promise<number> {
  await control.hibernationSent();
  // Jailed: the launcher takes the VM out of the jail and says where it went.
  if (jailedEntry()) return EXIT_HIBERNATED;
  const h = control.hibernation!;
  if (h.store) process.stderr.write(`pvisor: ${control.id} hibernated to ${h.dir} (${formatMiB(h.store.bytesTransferred)} sent); this process ends (exit ${EXIT_HIBERNATED}). pvisor resume ${control.id} --store ${h.dir} continues it, here or on another host\n`);
  else
    process.stderr.write(
      `pvisor: ${control.id} hibernated into ${h.dir} (${formatMiB(h.bytesOnDisk)} on disk); this process ends (exit ${EXIT_HIBERNATED}). ` +
        `pvisor resume ${control.id} continues it in a new process, whose output goes to ${h.log}\n`,
    );
  return EXIT_HIBERNATED;
}

/**
 * The guest, memory and vCPUs of the VM a snapshot holds, read before restoring it: the guest
 * decides how CMD reads, and the control socket answers with them while the VM restores. A
 * damaged snapshot fails here, before the id is claimed; Vm.restore checks it again as it reads it.
 */
async function readSnapshotMachine(dir: string): Promise<{ guest: GuestKind; memoryBytes: number; vcpus: number }> {
  if (isStoreUrl(dir)) {
    const { readStoreSnapshotState } = await import('../store/lazy-ram');
    const { guest, memoryBytes, vcpus } = await readStoreSnapshotState(dir);
    return { guest, memoryBytes, vcpus };
  }
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
    if (control.hibernation) return hibernated(control);
    if (!control.stopCause) throw e;
    process.stderr.write(`pvisor: ${vm.name} was stopped (${control.stopCause}) before the command finished\n`);
    return control.stopExitCode;
  }
}

/**
 * A resumed Linux VM: its CMD runs on in the guest, detached (its output dropped by the agent),
 * and nothing here waits for its status; the run lasts until the VM is stopped or hibernates.
 */
async function untilStopped(vm: Vm, control: RunControl): Promise<number> {
  const end = await new Promise<{ error?: PvisorError }>((resolve) => {
    if (vm.state === 'stopped' || vm.state === 'crashed') resolve({ error: vm.error });
    else vm.once('exit', ({ error }) => resolve({ error }));
  });
  if (control.hibernation) return hibernated(control);
  if (end.error) throw end.error;
  process.stderr.write(`pvisor: ${vm.name} was stopped (${control.stopCause ?? 'its VM ended'})\n`);
  return control.stopExitCode;
}

/** A `--rootfs` that is not a regular file is refused as Vm.start refuses it, before the host is checked. */
function checkRootfsFile(args: RunArgs): void {
  const { source } = args;
  if (source.kind !== 'boot' || !source.rootfs) return;
  const path = source.rootfs.path;
  let isFile: boolean;
  try {
    isFile = statSync(path).isFile();
  } catch (e) {
    throw new InvalidOptionError('rootfs', `cannot use ${path}${source.rootfs.readOnly ? '' : ' read-write'}: ${(e as Error).message}`);
  }
  if (!isFile) throw new InvalidOptionError('rootfs', `${path} is not a regular file`);
}
