/**
 * {@link VmHandle}: the SDK's reach to a VM that another process runs (`pvisor run --name ID`),
 * over that VM's control socket (docs/control-protocol.md).
 * @module
 */
import { resolve } from 'node:path';
import { controlRequest, errorFromPayload, runtimeDir, socketPathFor, type ControlMemory, type ControlRequest, type ControlResponse, type ControlVmInfo } from './control-socket';
import type { Command, ExecResult } from './guest/linux-client';
import type { SnapshotInfo } from './vm';
import type { ControlProtocolError, InvalidOptionError, TimeoutError, VmNotFoundError, VmStateError } from './errors';
import { validateVmName } from './vm-name';

/**
 * Who a VM of another process is and what state it is in: the answer of {@link VmHandle.status}.
 * @category VM
 */
export type VmHandleStatus = ControlVmInfo;

/**
 * A VM's memory figures as its process reports them: the answer of {@link VmHandle.memoryUsage}.
 * @category VM
 */
export type VmHandleMemoryUsage = ControlMemory;

/**
 * Options of {@link VmHandle.connect}.
 * @category VM
 */
export interface ConnectOptions {
  /**
   * The VM's control socket, if `pvisor run` was given `--vm-socket PATH`. Default: `ID.sock` in
   * `$PVISOR_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/pvisor`, else `/run/pvisor` (root) or
   * `/tmp/pvisor-$UID`, where `pvisor run` listens.
   */
  socketPath?: string;
  /**
   * How long an operation (suspend, resume, snapshot, stop) may take before it rejects with a
   * {@link TimeoutError}, in ms. Default 10 minutes: a suspend writes all of guest RAM to disk.
   * `status` and `memoryUsage` wait at most 10 s.
   */
  operationTimeoutMs?: number;
}

/**
 * Options of {@link VmHandle.exec}.
 * @category VM
 */
export interface HandleExecOptions {
  /** The command is killed after this long, in ms (Linux guest). Default: no limit but the operation timeout. */
  timeoutMs?: number;
}

const STATUS_TIMEOUT_MS = 10_000;
const OPERATION_TIMEOUT_MS = 10 * 60 * 1000;

/**
 * A VM started by `pvisor run` in another process, reached over its control socket: the verbs of
 * {@link Vm} that make sense from outside (status, memory figures, pause, suspend, resume,
 * snapshot, stop, exec). Holds no connection: each call is one request and its answer, so a
 * handle outlives nothing and needs no closing. Every call rejects with a {@link VmNotFoundError}
 * once the VM's run has ended, and with the typed error of a failed operation (a
 * {@link VmStateError}, for instance), the VM left as it was.
 *
 * ```ts
 * import { VmHandle } from 'pvisor';
 * const vm = await VmHandle.connect('T1');   // pvisor run --name T1 ...
 * await vm.suspend();                        // its RAM goes to disk and is released
 * await vm.resume();
 * console.log((await vm.exec(['uname', '-a'])).stdout);
 * ```
 * @category VM
 */
export class VmHandle {
  private constructor(
    /** The VM's id (`pvisor run --name`). */
    readonly id: string,
    /** Its control socket. */
    readonly socketPath: string,
    private readonly operationTimeoutMs: number,
  ) {}

  /**
   * Reaches VM `id` and checks that it answers. Rejects with a {@link VmNotFoundError} if no VM of
   * that id runs, a {@link ControlProtocolError} if it runs under a pvisor that speaks another
   * protocol version, an {@link InvalidOptionError} for an id that cannot be one.
   */
  static async connect(id: string, options: ConnectOptions = {}): Promise<VmHandle> {
    validateVmName(id, 'id');
    const handle = new VmHandle(id, options.socketPath ?? socketPathFor(id, runtimeDir()), options.operationTimeoutMs ?? OPERATION_TIMEOUT_MS);
    await handle.status();
    return handle;
  }

  /** The VM's id, pid of its process, state, guest, memory, vCPUs, labels and when its run began. */
  async status(): Promise<VmHandleStatus> {
    return (await this.request({ op: 'status' }, STATUS_TIMEOUT_MS)).vm;
  }

  /**
   * What the VM's memory costs its host, as its process measures it: guest RAM resident (PSS),
   * the process's PSS, bytes on disk, each strategy's figures. Rejects with a
   * {@link VmStateError} while the VM is starting or after it ended.
   */
  async memoryUsage(): Promise<VmHandleMemoryUsage> {
    const r = await this.request({ op: 'status' }, STATUS_TIMEOUT_MS);
    if (!r.memory) throw errorFromPayload({ code: 'PVISOR_VM_STATE', message: `${this.id} is ${r.vm.state}: no memory figures` });
    return r.memory;
  }

  /** Stops every vCPU; guest RAM stays as it is ({@link Vm.pause}). */
  async pause(): Promise<void> {
    await this.request({ op: 'suspend', offload: false });
  }

  /**
   * Suspends the VM ({@link Vm.suspend}): its vCPUs stop and its memory strategies give its memory
   * back (`pvisor run` composes Offload by default: RAM goes to a file). Resolves once the memory
   * is released.
   */
  async suspend(): Promise<void> {
    await this.request({ op: 'suspend', offload: true });
  }

  /** Lets a paused or suspended VM run again, its memory brought back and verified first ({@link Vm.resume}). */
  async resume(): Promise<void> {
    await this.request({ op: 'resume' });
  }

  /**
   * Has the VM write a snapshot of itself into `dir` ({@link Vm.snapshot}); `dir` is made absolute
   * against this process's working directory. The VM runs on after, or stays paused with
   * `leavePaused`.
   */
  async snapshot(dir: string, options: { leavePaused?: boolean } = {}): Promise<SnapshotInfo> {
    const r = await this.request({ op: 'snapshot', dir: resolve(dir), leavePaused: options.leavePaused ?? false });
    return r.snapshot!;
  }

  /** Stops the VM; its `pvisor run` ends (status 0 after a `wait` step, 143 if its command was still running), as after `pvisor stop`. */
  async stop(): Promise<void> {
    await this.request({ op: 'stop' });
  }

  /**
   * Runs a command in the guest and resolves with its exit status and output, as {@link Vm.exec}:
   * an argv, or a string that `/bin/sh -c` runs, for the Linux guest; for the probe guest, probe
   * steps (`'fill 64MiB random 7, digest'`), whose printed lines are the stdout.
   */
  async exec(command: Command, options: HandleExecOptions = {}): Promise<ExecResult> {
    const argv = typeof command === 'string' ? command : [...command];
    const timeout = options.timeoutMs === undefined ? this.operationTimeoutMs : options.timeoutMs + STATUS_TIMEOUT_MS;
    return (await this.request({ op: 'exec', command: argv, timeoutMs: options.timeoutMs }, timeout)).exec!;
  }

  private async request(request: ControlRequest, timeoutMs = this.operationTimeoutMs): Promise<ControlResponse & { ok: true }> {
    const r = await controlRequest(this.socketPath, this.id, request, timeoutMs);
    if (!r.ok) throw errorFromPayload(r.error);
    return r;
  }
}
