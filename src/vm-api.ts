/**
 * {@link VmApi}: the calls a VM answers wherever it runs, in this process ({@link Vm}) or in
 * another one ({@link VmHandle}, over the VM's control socket). Code written against it works
 * with either; the compiler checks that both keep to it.
 * @module
 */
import type { Readable, Writable } from 'node:stream';
import type { DirEntry, FileStat } from './guest/file-wire';
import type {
  Command,
  ExecBufferOptions,
  ExecBufferResult,
  ExecOptions,
  ExecResult,
  ExitStatus,
  FilesCallOptions,
  ListOptions,
  MkdirOptions,
  ReadOptions,
  RemoveOptions,
  RequestTimeout,
  SpawnOptions,
  StatOptions,
  WriteOptions,
} from './guest/linux-client';
import type { ForwardOptions, PortForward } from './network/port-forward';
import type { SnapshotInfo, SnapshotOptions, VmEvents, VmMemoryUsage } from './vm-types';

/**
 * A process started by {@link VmApi.spawn}: a {@link GuestProcess} in this process, a process
 * streamed over the control socket from a {@link VmHandle}. Its output streams are under credit
 * either way: one nobody reads holds only its own process in the guest.
 * @category Guest
 */
export interface VmProcess {
  /** The command's standard output; read it, pipe it or destroy it (the process ends only once its output has come). */
  readonly stdout: Readable;
  /** The command's standard error; as {@link stdout}. */
  readonly stderr: Readable;
  /** The command's standard input (spawned with `stdin: true`, else null): `pipeline(source, p.stdin)` feeds it and finishes once the guest has it all. */
  readonly stdin: Writable | null;
  /** The guest pid, once the program has started; rejects as {@link exited} if it never started. */
  readonly pid: Promise<number>;
  /** Resolves when the process has ended and its output is complete; rejects if it never started, or was killed for a timeout or signal of the caller's. */
  readonly exited: Promise<ExitStatus>;
  /** Writes to stdin (spawned with `stdin: true`); resolves once the guest side has taken it. */
  write(data: string | Uint8Array, options?: RequestTimeout): Promise<void>;
  /** Closes stdin after everything written so far; resolves once the guest has it all. */
  end(options?: RequestTimeout): Promise<void>;
  /** Sends a signal (default SIGTERM) to the process and everything it started. */
  kill(signal?: NodeJS.Signals | number, options?: RequestTimeout): Promise<void>;
}

/**
 * Files of a VM's Linux guest ({@link GuestFiles} in this process): read, write (whole or
 * streamed), list, stat, mkdir, remove, rename. Every call takes `timeoutMs` and an AbortSignal.
 * @category Guest
 */
export interface VmFiles {
  /** The whole content of a regular file; larger than `maxBytes` (default 256 MiB) rejects with an OutputLimitError. */
  read(path: string, options?: ReadOptions): Promise<Buffer>;
  /** A file's content as a stream under credit: at most a window (256 KiB) ahead of its consumer. */
  readStream(path: string, options?: FilesCallOptions): Readable;
  /** Creates or replaces a file (missing parents created) with bytes, a string, or the chunks of an async iterable. */
  write(path: string, data: string | Uint8Array | AsyncIterable<string | Uint8Array>, options?: WriteOptions): Promise<void>;
  /** A stream that writes a file as data comes; it finishes once the guest has closed the file and confirmed every byte. */
  writeStream(path: string, options?: WriteOptions): Writable;
  /** The entries of a directory, as lstat sees them. */
  list(path: string, options?: ListOptions): Promise<DirEntry[]>;
  /** A file's type, mode, owner, size and mtime. */
  stat(path: string, options?: StatOptions): Promise<FileStat>;
  /** Creates a directory. */
  mkdir(path: string, options?: MkdirOptions): Promise<void>;
  /** Removes a file, a symlink or an empty directory; with `recursive`, a whole tree. */
  remove(path: string, options?: RemoveOptions): Promise<void>;
  /** Renames `from` to `to`, replacing `to` as rename(2) does. */
  rename(from: string, to: string, options?: FilesCallOptions): Promise<void>;
}

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
