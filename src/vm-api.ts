/**
 * {@link VmApi}: the calls a VM answers wherever it runs, in this process ({@link Vm}) or in
 * another one ({@link VmHandle}, over the VM's control socket). Code written against it works
 * with either; the compiler checks that both keep to it.
 * @module
 */
import type { Command, ExecBufferOptions, ExecBufferResult, ExecOptions, ExecResult, SpawnOptions, VmFiles, VmProcess } from './guest/guest-types';
import type { ForwardOptions, PortForward } from './network/port-forward';
import type { SnapshotInfo, SnapshotOptions, VmEvents, VmMemoryUsage } from './vm-types';

/**
 * The events every {@link VmApi} emits: its state changes and its end.
 * @category VM
 */
export type VmApiEvents = Pick<VmEvents, 'state' | 'exit'>;

/**
 * The calls a VM answers wherever it runs: {@link Vm} (this process) and {@link VmHandle} (a
 * `pvisor run` in another process, over its control socket) both implement it, so an
 * orchestrator can take either.
 *
 * Where the two cannot be the same, this interface says what holds for both:
 * - {@link memoryUsage} is synchronous on a {@link Vm} (it reads this process's own smaps) and a
 *   round trip on a {@link VmHandle}: `await` it, which works for both.
 * - The VM's `state` is a property on a {@link Vm}, a round trip on a handle
 *   ({@link VmHandle.status}), so it is not here; the `state` event is.
 * - `exec`, `spawn` and `files` need the Linux guest; on a probe guest a {@link Vm} throws a
 *   VmStateError, and a handle's `exec` runs probe steps (as `pvisor run` does).
 *
 * ```ts
 * async function tryIt(vm: VmApi) {
 *   await vm.files.write('/tmp/in.txt', 'hello');
 *   const r = await vm.exec('wc -c < /tmp/in.txt', { env: { LANG: 'C' } });
 *   await vm.suspend();
 *   await vm.resume();
 * }
 * await tryIt(await Vm.start({ guest: 'linux' }));
 * await tryIt(await VmHandle.connect('T1'));
 * ```
 * @category VM
 */
export interface VmApi {
  /** The VM's name (a {@link VmHandle}'s id). */
  readonly name: string;
  /**
   * Runs a command in the Linux guest to its end (a string runs under `/bin/sh -c`, an array is
   * the argv) with `env`, `cwd`, `stdin`, `timeoutMs`, `signal`, `maxBuffer` and
   * `onStdout`/`onStderr`; the output as bytes with `encoding: 'buffer'`.
   */
  exec(command: Command, options: ExecBufferOptions): Promise<ExecBufferResult>;
  exec(command: Command, options?: ExecOptions): Promise<ExecResult>;
  /** Starts a command in the Linux guest; its output streams, its stdin can be written, it can be killed. */
  spawn(command: Command, options?: SpawnOptions): VmProcess;
  /** Files of the Linux guest. */
  readonly files: VmFiles;
  /**
   * Listens on the host (default 127.0.0.1, a free port) and relays each connection to
   * `guestPort` in the guest; a {@link VmHandle}'s listener is in the caller's process.
   */
  forward(guestPort: number, options?: ForwardOptions): Promise<PortForward>;
  /** Stops every vCPU; guest RAM stays as it is. */
  pause(): Promise<void>;
  /** Stops every vCPU and has the memory strategies give the VM's memory back. */
  suspend(): Promise<void>;
  /** Lets a paused or suspended VM run again. */
  resume(): Promise<void>;
  /** Writes a sealed snapshot into `dir` (new or empty). */
  snapshot(dir: string, options?: SnapshotOptions): Promise<SnapshotInfo>;
  /** Stops the VM; resolves once it is stopped (a handle's: once its run has it). */
  stop(): Promise<void>;
  /** What the VM's memory costs its host: synchronous on a {@link Vm}, a round trip on a handle; `await` it. */
  memoryUsage(): VmMemoryUsage | Promise<VmMemoryUsage>;
  /** Listens for a state change (`state`, the one before). */
  on(event: 'state', listener: VmApiEvents['state']): this;
  /** Listens for the VM's end: stopped, crashed (with the error) or hibernated (where to). */
  on(event: 'exit', listener: VmApiEvents['exit']): this;
  /** As {@link on}, once. */
  once(event: 'state', listener: VmApiEvents['state']): this;
  once(event: 'exit', listener: VmApiEvents['exit']): this;
  /** Removes a listener added with {@link on} or {@link once}. */
  off(event: 'state', listener: VmApiEvents['state']): this;
  off(event: 'exit', listener: VmApiEvents['exit']): this;
}
