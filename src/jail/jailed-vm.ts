/**
 * `Vm.start({ isolation: 'process' })`: the VM runs in a jailed child process (a `pvisor run`
 * under ./launcher.ts), and this process gets a {@link VmHandle} connected to that child's control
 * socket, plus {@link JailedVmHandle.jail} to learn how the child ended (the typed error of a limit
 * or of seccomp). Stopping the handle ends the child; so does this process's exit (the jail dies
 * with its parent).
 * @module
 */
import { randomBytes } from 'node:crypto';
import { resolve } from 'node:path';
import { InvalidOptionError, PvisorError, TimeoutError, VmStateError, type JailUnavailableError, type JailViolationError, type VmLimitError } from '../errors';
import { parseTimeoutMs, type Size } from '../units';
import { VmHandle } from '../vm-handle';
import { validateVmName } from '../vm-name';
import { checkVmShape } from '../vm-shape';
import type { GuestKind, SnapshotInfo, SnapshotOptions } from '../vm-types';
import { parseNetworkOption, type NetworkOption } from '../network/options';
import { noNetwork, type VmNetwork } from '../network/vm-network';
import { JailedVmm, type JailOutcome } from './launcher';
import { handOffSnapshot } from './snapshot-handoff';
import { resolveLimits, type JailLimitsInput } from './limits';

/**
 * The options of a VM started in a jailed process (a subset of {@link VmOptions}, with `limits`).
 * @category VM
 */
export interface JailedVmOptions {
  /** Runs the VM in a jailed child process: see docs/security.md. */
  isolation: 'process';
  /** The child's limits (its cgroup): memory, CPUs, tasks; defaults in {@link JailLimitsInput}. */
  limits?: JailLimitsInput;
  memory?: Size;
  vcpus?: number;
  guest?: GuestKind;
  kernel?: string;
  initrd?: string;
  name?: string;
  labels?: Record<string, string>;
  /** How long the child may take to have its VM ready. Default 60000 ms. */
  bootTimeoutMs?: number;
  /** The directory the VM's own backing directory is made in (Offload's files on suspend). Default /var/tmp. */
  backingDir?: string;
  /**
   * The guest's network, as {@link VmOptions.network} (Linux guest). Its host side (the TAP, its
   * nftables rules, the resolver of hostname rules) is made and kept by this process, which
   * hands the jailed child only the TAP's open fd: the child needs no CAP_NET_ADMIN. It is
   * removed when the child ends, however it ends. Needs what `'nat'` needs in-process.
   */
  network?: NetworkOption;
}

/**
 * How the jailed child of a {@link JailedVmHandle} is doing.
 * @category VM
 */
export interface JailInfo {
  /** The pid of the jail's outermost process (bubblewrap). */
  readonly pid: number;
  /**
   * Resolves when the child has ended and its jail is taken down: with its exit status, with the
   * typed error of what killed it ({@link VmLimitError}, {@link JailViolationError}), or with the
   * signal that did.
   */
  exited(): Promise<JailOutcome>;
  /** Ends the child at once (SIGKILL), without the clean stop {@link VmHandle.stop} makes. */
  kill(): void;
  /**
   * Set when a launcher of this name was killed before it could take its jail down: what was
   * left, and what became of it (its backing directory is moved aside, never removed).
   */
  readonly reclaimed?: string;
}

/**
 * A {@link VmHandle} on a VM that runs in a jailed child of this process.
 * @category VM
 */
export type JailedVmHandle = VmHandle & {
  /**
   * {@link VmHandle.snapshot}: the jailed child writes the snapshot into its own backing
   * directory (the only one it can write), and this process copies it into `dir` as files of
   * its own, checked as hostile input (docs/security.md).
   */
  snapshot(dir: string, options?: SnapshotOptions): Promise<SnapshotInfo>;
  readonly jail: JailInfo;
  /**
   * The VM's network, as {@link Vm.network} says it; its {@link VmNetwork.update} changes the
   * egress rules, which this process keeps.
   */
  readonly network: VmNetwork;
};

const UNSUPPORTED = ['strategies', 'rootfs', 'env', 'kernelArgs', 'timeoutMs', 'onTimeout', 'hibernateDir', 'warningLimit'] as const;
const KNOWN = ['isolation', 'limits', 'memory', 'vcpus', 'guest', 'kernel', 'initrd', 'name', 'labels', 'bootTimeoutMs', 'backingDir', 'network'];

/**
 * Starts a jailed VM. Rejects with an {@link InvalidOptionError} for an option a jailed VM does
 * not take yet, a {@link JailUnavailableError} when the host cannot jail, and the typed error of
 * the child's end if it ends before its VM is ready.
 */
export async function startJailedVm(options: JailedVmOptions): Promise<JailedVmHandle> {
  for (const key of Object.keys(options)) {
    if ((UNSUPPORTED as readonly string[]).includes(key)) throw new InvalidOptionError(key, "not available with isolation: 'process' yet (docs/security.md says what a jailed VM takes)");
    if (!KNOWN.includes(key)) throw new InvalidOptionError(key, `not an option of Vm.start with isolation: 'process' (its options: ${KNOWN.join(', ')})`);
  }
  const { memoryBytes, vcpus, guest } = checkVmShape(options);
  const network = parseNetworkOption(options.network);
  if (network.kind !== 'none' && guest !== 'linux') throw new InvalidOptionError('network', `only the Linux guest has a network device (this VM runs the ${guest} guest)`);
  const limits = resolveLimits(options.limits, { memoryBytes, vcpus });
  const bootTimeoutMs = options.bootTimeoutMs === undefined ? 60_000 : parseTimeoutMs('bootTimeoutMs', options.bootTimeoutMs);
  const id = options.name === undefined ? `jail-${randomBytes(3).toString('hex')}` : validateVmName(options.name);
  const readOnly: string[] = [];
  const runArgv = ['--quiet', '--guest', guest, '--memory', String(memoryBytes), '--vcpus', String(vcpus)];
  for (const [flag, path] of [['--kernel', options.kernel], ['--initrd', options.initrd]] as const) {
    if (path === undefined) continue;
    readOnly.push(resolve(path));
    runArgv.push(flag, resolve(path));
  }
  for (const [k, v] of Object.entries(options.labels ?? {})) runArgv.push('--label', `${k}=${v}`);
  // The child takes the network it is handed; this says only that it has one.
  if (network.kind !== 'none') runArgv.push('--net', 'nat');
  // The run lasts until the handle stops it: the probe waits, the Linux guest sleeps.
  runArgv.push('--', ...(guest === 'probe' ? ['wait'] : ['sleep', '2147483647']));
  const vmm = await JailedVmm.start(
    { id, limits, runArgv, readOnly, readWrite: [], backingParent: options.backingDir ?? '/var/tmp', ...(network.kind !== 'none' && { network }) },
    { stdout: 'ignore', stderr: 'inherit' },
  );
  const ended = vmm.exited();
  try {
    const handle = await Promise.race([untilJailedReady(id, vmm.innerSocketPath, bootTimeoutMs), ended.then((o) => Promise.reject(errorOfEnd(id, o)))]);
    const jail: JailInfo = { pid: vmm.pid, exited: () => ended, kill: () => vmm.kill(), ...(vmm.reclaimed && { reclaimed: vmm.reclaimed }) };
    Object.defineProperty(handle, 'network', { value: vmm.network?.view() ?? noNetwork(), enumerable: true });
    // The jailed VMM sees no directory of the caller's: it writes into its own, and this process copies it out.
    const snapshot = (dir: string, opts?: SnapshotOptions): Promise<SnapshotInfo> => {
      const target = resolve(dir);
      return handOffSnapshot(vmm, memoryBytes, target, async (staging) => ({ written: true, value: { ...(await VmHandle.prototype.snapshot.call(handle, staging, opts)), dir: target } }));
    };
    Object.defineProperty(handle, 'snapshot', { value: snapshot });
    return Object.defineProperty(handle, 'jail', { value: jail, enumerable: true }) as JailedVmHandle;
  } catch (e) {
    vmm.kill();
    await ended;
    throw e;
  }
}

/** Connects to a jailed VMM's control socket and waits until its VM is no longer starting. */
export async function untilJailedReady(id: string, socketPath: string, timeoutMs: number): Promise<VmHandle> {
  const deadline = Date.now() + timeoutMs;
  let handle: VmHandle | undefined;
  for (;;) {
    try {
      handle ??= await VmHandle.connect(id, { socketPath });
      const state = (await handle.status()).state;
      if (state !== 'starting') return handle;
    } catch (e) {
      // The child's node is still loading (its socket listens from the start, and waits), or the
      // VM is booting: asked again until the deadline.
      if (!(e instanceof TimeoutError || e instanceof VmStateError)) throw e;
    }
    if (Date.now() > deadline) throw new TimeoutError(`${id}: the jailed VM was not ready within ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

function errorOfEnd(id: string, o: JailOutcome): PvisorError | VmLimitError | JailViolationError | JailUnavailableError {
  if ('error' in o) return o.error;
  if ('signal' in o) return new VmStateError(`${id}: the jailed VM process was killed by ${o.signal} before its VM was ready`);
  return new VmStateError(`${id}: the jailed VM process exited (status ${o.exitCode}) before its VM was ready`);
}
