/**
 * The public types of the Linux guest's calls: a command and its options and results, the files
 * calls' options, and the process and files a VM hands out wherever it runs ({@link VmProcess},
 * {@link VmFiles}). They live apart from the classes that implement them, because those classes
 * (linux-client.ts, guest-process.ts), their helpers (pty, the process registry, exec's
 * collection), the port forward and the handle's remote side all name them: one module under
 * all of them, so none imports another for a type.
 * @module
 */
import type { Readable, Writable } from 'node:stream';
import type { DirEntry, FileStat } from './file-wire';
import type { OutputMode } from './output-ring';

/**
 * Options of a request to the agent.
 * @category Guest
 */
export interface RequestTimeout {
  /**
   * Reject with a {@link TimeoutError} if the agent has not answered after this long (for a write
   * of a file or of stdin, per frame of 512 KiB; for a read or a listing, the whole of it). A
   * whole number of milliseconds, 1 to 2^31-1. Default 30000.
   */
  timeoutMs?: number;
}

/**
 * Options of a files call: its timeout, and a signal that cancels it.
 * @category Guest
 */
export interface FilesCallOptions extends RequestTimeout {
  /**
   * Aborting rejects the call with an {@link AbortError} (at once if the signal has already
   * aborted: nothing is sent) and closes what it opened in the guest (a file being read or
   * written, a directory being listed). An operation the agent does at once (stat, mkdir, remove,
   * rename) is not undone if it was already sent.
   */
  signal?: AbortSignal;
  /**
   * Linux guest: the user the call runs as, a name from the guest's /etc/passwd (with its groups
   * from /etc/group) or `"uid:gid"`: the guest checks every path as that user's, and what the
   * call creates is that user's. Default: root. An unknown name is an {@link UnknownUserError}.
   */
  user?: string;
}

/**
 * A command: an argv array, or a string that `/bin/sh -c` runs.
 * @category Guest
 */
export type Command = string | readonly string[];

/**
 * Options of {@link Vm.spawn}.
 * @category Guest
 */
export interface SpawnOptions {
  /**
   * Variables added to (or overriding) the guest's base environment (PATH, HOME) and the VM's own
   * ({@link VmOptions.env}).
   */
  env?: Record<string, string>;
  /** Working directory in the guest. Default `/`. */
  cwd?: string;
  /** Keep stdin open for {@link GuestProcess.write}. Default false: stdin is /dev/null. */
  stdin?: boolean;
  /**
   * Kill the process (SIGKILL) after this long, and reject {@link GuestProcess.exited} with a
   * {@link TimeoutError} (a whole number of milliseconds, 1 to 2^31-1); if the guest does not
   * report the end of the killed process within 5 s more, `exited` rejects anyway. Default: no limit.
   */
  timeoutMs?: number;
  /**
   * Aborting kills the process (SIGKILL) and rejects {@link GuestProcess.exited} with an
   * {@link AbortError}; a signal that has already aborted starts nothing.
   */
  signal?: AbortSignal;
  /**
   * The user the command runs as: a name from the guest's /etc/passwd (its groups from
   * /etc/group, HOME, USER and LOGNAME from its entry), or `"uid:gid"` (no other groups, HOME
   * `/`). Groups, gid, then uid are set before the command's cwd is entered and it is executed.
   * Default: root. An unknown name rejects with an {@link UnknownUserError}; a malformed one, or an
   * agent that cannot run as a user, throws.
   */
  user?: string;
  /**
   * What becomes of the command's stdout: `'pipe'` (the default), the {@link GuestProcess.stdout}
   * stream, which holds the command once a window of it waits unread; `'ignore'`, dropped as it
   * comes (`stdout` is an empty stream); `{ keep: bytes }`, for a background process: drained as it
   * comes, its last `bytes` (1 to 64 MiB) kept, to be read later with {@link GuestProcess.keptOutput}
   * or followed with {@link GuestProcess.output}, also after {@link Vm.process} found it again
   * (`stdout` is an empty stream).
   */
  stdout?: OutputMode;
  /** As {@link stdout}, for stderr. */
  stderr?: OutputMode;
}

/**
 * What every {@link Vm.exec} takes, whatever the output's encoding.
 * @category Guest
 */
export interface ExecCommonOptions {
  /** As {@link SpawnOptions.env}: over the VM's {@link VmOptions.env}. */
  env?: Record<string, string>;
  cwd?: string;
  /** Bytes given to the command's stdin, which is then closed. */
  stdin?: string | Uint8Array;
  /**
   * Kill the command (SIGKILL) and reject with TimeoutError after this long (a whole number of
   * milliseconds, 1 to 2^31-1); if the guest does not report the end of the killed command within
   * 5 s more, reject anyway. Default: no limit.
   */
  timeoutMs?: number;
  /** Aborting kills the command (SIGKILL) and rejects with an {@link AbortError}. */
  signal?: AbortSignal;
  /** As {@link SpawnOptions.user}. */
  user?: string;
  /**
   * The most bytes of stdout, and of stderr, that are collected: beyond it the command is killed
   * (SIGKILL) and exec rejects with an {@link OutputLimitError}. A whole number of bytes, or
   * Infinity. Default 1 MiB, as Node's `child_process.exec`. For more, stream with
   * {@link Vm.spawn}.
   */
  maxBuffer?: number;
}

/**
 * Options of {@link Vm.exec}: the output as strings.
 * @category Guest
 */
export interface ExecOptions extends ExecCommonOptions {
  /**
   * `'utf8'` (the default): `stdout` and `stderr` are strings. For the bytes as the command
   * wrote them, `'buffer'` ({@link ExecBufferOptions}).
   */
  encoding?: 'utf8';
  /**
   * Called with each piece of stdout as it comes (a UTF-8 character is never split between two
   * calls), while exec also collects it.
   */
  onStdout?: (chunk: string) => void;
  /** As {@link onStdout}, for stderr. */
  onStderr?: (chunk: string) => void;
}

/**
 * Options of {@link Vm.exec} asking for the output as bytes ({@link ExecBufferResult}), for binary output.
 * @category Guest
 */
export interface ExecBufferOptions extends ExecCommonOptions {
  encoding: 'buffer';
  /** Called with each piece of stdout as it comes, while exec also collects it. */
  onStdout?: (chunk: Buffer) => void;
  /** As {@link onStdout}, for stderr. */
  onStderr?: (chunk: Buffer) => void;
}

/**
 * How a process ended.
 * @category Guest
 */
export interface ExitStatus {
  /** Exit code, or null when a signal ended it. */
  exitCode: number | null;
  /** The signal that ended it, e.g. `SIGKILL`, or null. */
  signal: NodeJS.Signals | null;
}

/**
 * What {@link Vm.exec} resolves to.
 * @category Guest
 */
export interface ExecResult extends ExitStatus {
  stdout: string;
  stderr: string;
}

/**
 * What exec resolves with for `encoding: 'buffer'`: the output's bytes.
 * @category Guest
 */
export interface ExecBufferResult extends ExitStatus {
  stdout: Buffer;
  stderr: Buffer;
}

/**
 * Guest memory figures from /proc/meminfo, bytes.
 * @category Guest
 */
export interface GuestMemInfo {
  totalBytes: number;
  freeBytes: number;
  availableBytes: number;
  cachedBytes: number;
}

/**
 * Options of {@link GuestFiles.read}.
 * @category Guest
 */
export interface ReadOptions extends FilesCallOptions {
  /** The most bytes kept: a larger file rejects with an {@link OutputLimitError}. A whole number or Infinity; default 256 MiB. */
  maxBytes?: number;
}

/**
 * Options of {@link GuestFiles.write} and {@link GuestFiles.writeStream}.
 * @category Guest
 */
export interface WriteOptions extends FilesCallOptions {
  /** The file's mode, set exactly (not masked by a umask), 0 to 0o7777; default 0o644. */
  mode?: number;
}

/**
 * Options of {@link GuestFiles.list}.
 * @category Guest
 */
export interface ListOptions extends FilesCallOptions {
  /** The most entries kept: a larger directory rejects with an {@link OutputLimitError}. A whole number or Infinity; default 100000. */
  maxEntries?: number;
}

/**
 * Options of {@link GuestFiles.stat}.
 * @category Guest
 */
export interface StatOptions extends FilesCallOptions {
  /** Describe what a symlink points to rather than the symlink itself. Default false (lstat). */
  followSymlinks?: boolean;
}

/**
 * Options of {@link GuestFiles.mkdir}.
 * @category Guest
 */
export interface MkdirOptions extends FilesCallOptions {
  /** Create missing parents too (mode 0o755), and take an existing directory as done. Default false. */
  recursive?: boolean;
  /** The directory's mode, set exactly (not masked by a umask), 0 to 0o7777; default 0o755. */
  mode?: number;
}

/**
 * Options of {@link GuestFiles.remove}.
 * @category Guest
 */
export interface RemoveOptions extends FilesCallOptions {
  /**
   * Remove a directory with everything in it (up to 256 levels deep). Symlinks are removed, never
   * followed. The first entry that cannot be removed stops it, and the error names that entry;
   * what was removed before stays removed. Default false: a file, a symlink or an empty directory.
   */
  recursive?: boolean;
}

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
