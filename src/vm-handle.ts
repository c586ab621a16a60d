/**
 * {@link VmHandle}: the SDK's reach to a VM that another process runs (`pvisor run --name ID`),
 * over that VM's control socket (docs/control-protocol.md).
 * @module
 */
import { createConnection, type Socket } from 'node:net';
import { resolve } from 'node:path';
import { EventEmitter } from 'eventemitter3';
import { controlRequest, CONTROL_PROTOCOL_VERSION, errorFromPayload, runtimeDir, socketPathFor, type ControlErrorPayload, type ControlMemory, type ControlRequest, type ControlResponse, type ControlVmInfo } from './control-socket';
import type { Command, ExecBufferOptions, ExecBufferResult, ExecOptions, ExecResult, SpawnOptions } from './guest/guest-types';
import type { GuestKind, SnapshotInfo, SnapshotOptions, VmState } from './vm-types';
import { ControlSocketError, type ControlProtocolError, type InvalidOptionError, type TimeoutError, type VmNotFoundError, type VmStateError } from './errors';
import { validateVmName } from './vm-name';
import type { VmApi, VmApiEvents } from './vm-api';
import type { VmFiles, VmProcess } from './guest/guest-types';
import { RemoteFiles, RemoteProcess, remoteExec, type RemoteVm } from './remote-guest';
import { ConnectionBudget, forwardPort, MAX_VM_FORWARD_CONNECTIONS, type ForwardOptions, type PortForward } from './network/port-forward';
import type { GuestProcess } from './guest/guest-process';

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
 * Options of {@link VmHandle.exec}: those of {@link Vm.exec} ({@link ExecOptions}).
 * @category VM
 */
export type HandleExecOptions = ExecOptions;

const STATUS_TIMEOUT_MS = 10_000;
const OPERATION_TIMEOUT_MS = 10 * 60 * 1000;
/** How often {@link VmHandle.stop} looks whether the run has ended. */
const STOP_POLL_MS = 50;
/** The longest event line taken from a watch. */
const MAX_EVENT_LINE_BYTES = 64 * 1024;
const VM_STATES: ReadonlySet<string> = new Set(['starting', 'running', 'paused', 'suspended', 'stopped', 'crashed']);

/**
 * A VM started by `pvisor run` in another process, reached over its control socket. It
 * implements {@link VmApi}, as {@link Vm} does: exec (with env, cwd, stdin, output callbacks,
 * bytes), spawn (stdout and stderr streamed under credit, stdin writable), files, forward, pause,
 * suspend, resume, snapshot, stop, memoryUsage, and the `state` and `exit` events; plus
 * {@link status}. A call is one request and its answer; a spawned process, a file stream and the
 * events (while someone listens) each have a connection of their own, so a stream nobody reads
 * holds nothing but itself. Every call rejects with a {@link VmNotFoundError} once the VM's run
 * has ended, and with the typed error of a failed operation (a {@link VmStateError}, a guest's
 * `GuestRequestError` with its errno...), the VM left as it was.
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
export class VmHandle extends EventEmitter<VmApiEvents> implements VmApi {
  /** Files of the VM's Linux guest, as {@link Vm.files}. */
  readonly files: VmFiles;
  private readonly remote: RemoteVm;
  private watchConn: Socket | undefined;
  private readonly forwardConnections = new ConnectionBudget(MAX_VM_FORWARD_CONNECTIONS);

  private constructor(
    /** The VM's id (`pvisor run --name`). */
    readonly id: string,
    /** Its control socket. */
    readonly socketPath: string,
    private readonly operationTimeoutMs: number,
    /** The VM's guest (a probe guest's exec runs probe steps). */
    readonly guest: GuestKind,
  ) {
    super();
    this.remote = { socketPath, id, request: (r, timeoutMs) => this.request(r, timeoutMs) };
    this.files = new RemoteFiles(this.remote);
  }

  /**
   * Reaches VM `id` and checks that it answers. Rejects with a {@link VmNotFoundError} if no VM of
   * that id runs, a {@link ControlProtocolError} if it runs under a pvisor that speaks another
   * protocol version, an {@link InvalidOptionError} for an id that cannot be one.
   */
  static async connect(id: string, options: ConnectOptions = {}): Promise<VmHandle> {
    validateVmName(id, 'id');
    const socketPath = options.socketPath ?? socketPathFor(id, runtimeDir());
    const r = await controlRequest(socketPath, id, { op: 'status' }, STATUS_TIMEOUT_MS);
    if (!r.ok) throw errorFromPayload(r.error);
    return new VmHandle(id, socketPath, options.operationTimeoutMs ?? OPERATION_TIMEOUT_MS, r.vm.guest);
  }

  /** The VM's name: its id. */
  get name(): string {
    return this.id;
  }

  /** The VM's id, pid of its process, state, guest, memory, vCPUs, labels and when its run began. */
  async status(): Promise<VmHandleStatus> {
    return (await this.request({ op: 'status' }, STATUS_TIMEOUT_MS)).vm;
  }

  /**
   * What the VM's memory costs its host, as its process measures it: the figures of
   * {@link Vm.memoryUsage} (`vmsInProcess` counts that process's VMs), and `guestRamResidentBytes`
   * and `bytesOnDisk`. Rejects with a {@link VmStateError} while the VM is starting or after it
   * ended.
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
  async snapshot(dir: string, options: SnapshotOptions = {}): Promise<SnapshotInfo> {
    const r = await this.request({ op: 'snapshot', dir: resolve(dir), leavePaused: options.leavePaused ?? false });
    return r.snapshot!;
  }

  /**
   * Stops the VM; its `pvisor run` ends (status 0 after a `wait` step, 143 if its command was
   * still running), as after `pvisor stop`. Resolves once the run has ended the VM and closed its
   * socket.
   */
  async stop(): Promise<void> {
    await this.request({ op: 'stop' });
    const deadline = Date.now() + this.operationTimeoutMs;
    for (;;) {
      try {
        await controlRequest(this.socketPath, this.id, { op: 'status' }, STATUS_TIMEOUT_MS);
      } catch (e) {
        // Gone, or going (the connection closed unanswered): the run has ended its VM.
        if ((e as { code?: string }).code === 'PVISOR_VM_NOT_FOUND' || e instanceof ControlSocketError) return;
        throw e;
      }
      if (Date.now() > deadline) throw errorFromPayload({ code: 'PVISOR_TIMEOUT', message: `${this.id} answered stop but its run had not ended after ${this.operationTimeoutMs} ms` });
      await new Promise((r) => setTimeout(r, STOP_POLL_MS));
    }
  }

  /**
   * Runs a command in the guest and resolves with its exit status and output, as {@link Vm.exec}
   * (env, cwd, stdin, timeoutMs, signal, maxBuffer, onStdout/onStderr, `encoding: 'buffer'`): its
   * output streams over the socket as it comes. For the probe guest, the command is probe steps
   * (`'fill 64MiB random 7, digest'`), whose printed lines are the stdout, and only `timeoutMs`
   * applies.
   */
  exec(command: Command, options: ExecBufferOptions): Promise<ExecBufferResult>;
  exec(command: Command, options?: ExecOptions): Promise<ExecResult>;
  async exec(command: Command, options: ExecOptions | ExecBufferOptions = {}): Promise<ExecResult | ExecBufferResult> {
    if (this.guest === 'linux') return remoteExec(this.remote, command, options);
    const argv = typeof command === 'string' ? command : [...command];
    const timeout = options.timeoutMs === undefined ? this.operationTimeoutMs : options.timeoutMs + STATUS_TIMEOUT_MS;
    return (await this.request({ op: 'exec', command: argv, ...(options.timeoutMs !== undefined && { timeoutMs: options.timeoutMs }) }, timeout)).exec!;
  }

  /**
   * Starts a command in the Linux guest, as {@link Vm.spawn}: stdout and stderr stream over a
   * connection of its own under credit (one nobody reads holds only this process), stdin takes
   * writes with `stdin: true`, `kill` signals it. Closing the connection (destroying both outputs
   * before the end, or this process ending) kills it.
   */
  spawn(command: Command, options?: SpawnOptions): VmProcess {
    return new RemoteProcess(this.remote, command, options);
  }

  /**
   * Forwards a port of this host to `guestPort` in the guest, as {@link Vm.forward}: the listener
   * is in this process, and each connection is a guest `nc` spawned over the control socket.
   */
  async forward(guestPort: number, options?: ForwardOptions): Promise<PortForward> {
    // forwardPort uses only what VmProcess has of a GuestProcess (stdout, stdin writes, end, kill, exited).
    return forwardPort((c, o) => this.spawn(c, o) as unknown as GuestProcess, guestPort, options, { vmConnections: this.forwardConnections });
  }

  // The events need a connection, which is opened by the first listener and closed with the last.
  override on<T extends keyof VmApiEvents>(event: T, fn: EventEmitter.EventListener<VmApiEvents, T>, context?: unknown): this {
    super.on(event, fn, context);
    this.watch();
    return this;
  }

  override once<T extends keyof VmApiEvents>(event: T, fn: EventEmitter.EventListener<VmApiEvents, T>, context?: unknown): this {
    super.once(event, fn, context);
    this.watch();
    return this;
  }

  override off<T extends keyof VmApiEvents>(event: T, fn?: EventEmitter.EventListener<VmApiEvents, T>, context?: unknown, once?: boolean): this {
    super.off(event, fn, context, once);
    this.unwatchIfUnheard();
    return this;
  }

  override removeAllListeners(event?: keyof VmApiEvents): this {
    super.removeAllListeners(event);
    this.unwatchIfUnheard();
    return this;
  }

  private unwatchIfUnheard(): void {
    if (this.watchConn && this.listenerCount('state') + this.listenerCount('exit') === 0) {
      this.watchConn.destroy();
      this.watchConn = undefined;
    }
  }

  /** Opens the watch connection: each line is a state change or the VM's end. */
  private watch(): void {
    if (this.watchConn) return;
    const conn = (this.watchConn = createConnection(this.socketPath));
    let buffered = '';
    let answered = false;
    let exited = false;
    conn.setEncoding('utf8');
    conn.write(`${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, op: 'watch' })}\n`);
    const gone = (error: Error) => {
      if (exited || this.watchConn !== conn) return;
      exited = true;
      this.watchConn = undefined;
      this.emit('exit', { state: 'crashed', error: error as ControlSocketError });
    };
    conn.on('data', (chunk: string) => {
      buffered += chunk;
      let nl: number;
      while ((nl = buffered.indexOf('\n')) >= 0) {
        const line = buffered.slice(0, nl);
        buffered = buffered.slice(nl + 1);
        let e: Record<string, unknown>;
        try {
          e = JSON.parse(line) as Record<string, unknown>;
          if (!e || typeof e !== 'object' || e.v !== CONTROL_PROTOCOL_VERSION) throw new Error('not a version 1 line');
        } catch (err) {
          conn.destroy();
          return gone(new ControlSocketError(this.socketPath, `malformed event: ${(err as Error).message}`));
        }
        if (!answered) {
          answered = true;
          // A VM that cannot be watched (still starting): no events, the listeners stay.
          if (e.ok !== true) return void conn.destroy();
          continue;
        }
        if (e.event === 'state' && VM_STATES.has(e.state as string) && VM_STATES.has(e.previous as string)) {
          this.emit('state', e.state as VmState, e.previous as VmState);
          this.unwatchIfUnheard(); // a `once` listener that has heard
        }
        else if (e.event === 'exit' && (e.state === 'stopped' || e.state === 'crashed')) {
          exited = true;
          const error = e.error && typeof e.error === 'object' ? errorFromPayload(e.error as ControlErrorPayload) : undefined;
          this.emit('exit', { state: e.state, ...(error && { error }), ...(typeof e.hibernatedTo === 'string' && { hibernatedTo: e.hibernatedTo }) });
          conn.destroy();
          if (this.watchConn === conn) this.watchConn = undefined;
        }
      }
      if (buffered.length > MAX_EVENT_LINE_BYTES) {
        conn.destroy();
        gone(new ControlSocketError(this.socketPath, `an event line longer than ${MAX_EVENT_LINE_BYTES} bytes`));
      }
    });
    conn.on('error', () => {});
    conn.on('close', () => {
      if (answered) gone(new ControlSocketError(this.socketPath, `${this.id}'s run ended without saying how its VM ended`));
      else if (this.watchConn === conn) this.watchConn = undefined;
    });
  }

  private async request(request: ControlRequest, timeoutMs = this.operationTimeoutMs): Promise<ControlResponse & { ok: true }> {
    const r = await controlRequest(this.socketPath, this.id, request, timeoutMs);
    if (!r.ok) throw errorFromPayload(r.error);
    return r;
  }
}
