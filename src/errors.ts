/**
 * Typed errors raised by pvisor. Every error is a {@link PvisorError}; switch on the class or on
 * `code` to handle one kind.
 * @module
 */

/**
 * Base class of every error that pvisor raises.
 * @category Errors
 */
export class PvisorError extends Error {
  /** A stable, machine-readable code, e.g. `PVISOR_INVALID_OPTION`. */
  readonly code: string;
  constructor(code: string, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.code = code;
  }
}

/**
 * An option given to pvisor is out of range, malformed or unusable; nothing was allocated. One
 * that can only be checked when it is used (a strategy's backing directory, at each suspend)
 * fails that operation and leaves the VM as it was.
 * @category Errors
 */
export class InvalidOptionError extends PvisorError {
  /** The option that was rejected, e.g. `memory`. */
  readonly option: string;
  constructor(option: string, message: string) {
    super('PVISOR_INVALID_OPTION', `${option}: ${message}`);
    this.option = option;
  }
}

/**
 * The host cannot run this VM: no /dev/kvm, no permission, or a KVM that cannot run this guest.
 * @category Errors
 */
export class HostUnsupportedError extends PvisorError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('PVISOR_HOST_UNSUPPORTED', message, options);
  }
}

/**
 * A system call failed. Carries the call's name and errno.
 * @category Errors
 */
export class SystemCallError extends PvisorError {
  /** The call that failed, e.g. `ioctl(KVM_CREATE_VM)`. */
  readonly call: string;
  /** The errno value, e.g. 12 for ENOMEM. */
  readonly errno: number;
  constructor(call: string, errno: number, detail?: string) {
    super('PVISOR_SYSCALL', `${call} failed: errno ${errno} (${errnoName(errno)})${detail ? `: ${detail}` : ''}`);
    this.call = call;
    this.errno = errno;
  }
}

/**
 * The guest crashed or misbehaved (triple fault, stray MMIO, abort); the VM was ended.
 * @category Errors
 */
export class GuestCrashError extends PvisorError {
  /** What the VMM saw, e.g. `shutdown` (triple fault) or `unhandled-mmio`. */
  readonly reason: string;
  constructor(reason: string, message: string) {
    super('PVISOR_GUEST_CRASH', message);
    this.reason = reason;
  }
}

/**
 * An operation is not valid in the VM's current state (e.g. a command to a stopped VM).
 * @category Errors
 */
export class VmStateError extends PvisorError {
  constructor(message: string) {
    super('PVISOR_VM_STATE', message);
  }
}

/**
 * The guest agent answered a request with an error.
 * @category Errors
 */
export class GuestRequestError extends PvisorError {
  /** The agent's error code (1 = unsupported operation, others per operation). */
  readonly guestCode: number;
  /** The protocol's op code of the request (0 when the error is not the guest's answer to one). */
  readonly op: number;
  /** The call that made the request, with its path or command, e.g. `files.read('/nope.txt')`. */
  readonly call: string | undefined;
  /** The guest's errno name (`ENOENT`, `EACCES`...) when a system call in the guest failed. */
  readonly errno: string | undefined;
  constructor(guestCode: number, message: string, details: { op?: number; call?: string; errno?: string } = {}) {
    super('PVISOR_GUEST_REQUEST', message);
    this.guestCode = guestCode;
    this.op = details.op ?? 0;
    this.call = details.call;
    this.errno = details.errno;
  }
}

/**
 * A command that does not exist in the guest (or is not executable there): exec and spawn reject
 * with it, and it carries the shell's status for such a command, 127, as {@link exitCode}.
 * @category Errors
 */
export class CommandNotFoundError extends GuestRequestError {
  /** The command's first word, as given. */
  readonly command: string;
  /** 127: what a shell gives for a command it cannot find. */
  readonly exitCode = 127;
  constructor(command: string, cause: GuestRequestError) {
    super(cause.guestCode, `${cause.call ?? 'exec'}: ${command}: command not found (${cause.errno ?? 'ENOENT'}); exit status 127`, { op: cause.op, call: cause.call, errno: cause.errno });
    this.command = command;
  }
}

/**
 * A command or file call was asked to run as a user (`user: 'name'`) that the guest's /etc/passwd
 * does not have: nothing ran. A user that is neither a name nor `uid:gid` is an
 * {@link InvalidOptionError} instead, and one whose passwd or group entry is malformed a
 * {@link GuestRequestError} (guest code 2).
 * @category Errors
 */
export class UnknownUserError extends GuestRequestError {
  /** The user as given. */
  readonly user: string;
  constructor(user: string, cause: GuestRequestError) {
    super(cause.guestCode, cause.message, { op: cause.op, call: cause.call, errno: cause.errno });
    this.user = user;
  }
}

/**
 * The guest's agent cannot do what was asked (run as a user, open a terminal): its HELLO lacks
 * the feature, because its initramfs was built before this pvisor. Nothing was sent; rebuild the
 * initramfs with this pvisor's agent (native-prebuilds/linux-guest/build-initramfs.sh).
 * @category Errors
 */
export class GuestFeatureError extends PvisorError {
  /** The feature the agent lacks, e.g. `users` or `pty`. */
  readonly feature: string;
  constructor(feature: string, message: string) {
    super('PVISOR_GUEST_FEATURE', message);
    this.feature = feature;
  }
}

/**
 * A guest command's output, a guest file or a guest directory listing was larger than the caller
 * allowed (`maxBuffer`, `maxBytes`, `maxEntries`): the host stopped collecting it (and killed the
 * command, or closed the file or directory in the guest), so a guest that prints without end
 * cannot grow the host process without bound.
 * @category Errors
 */
export class OutputLimitError extends PvisorError {
  /** The limit that was passed: bytes (entries for `files.list`'s `maxEntries`). */
  readonly limitBytes: number;
  constructor(limitBytes: number, message: string) {
    super('PVISOR_OUTPUT_LIMIT', message);
    this.limitBytes = limitBytes;
  }
}

/**
 * A memory strategy's backing file cannot be made or used. At suspend, it cannot be created
 * (something is at the path already, the directory is missing or read-only): the suspend fails
 * and the VM runs on as it was. While it is written, a write fails (a full disk): what was not
 * written stays resident, the VM stays suspended and resumes as usual. At resume, it is missing,
 * truncated or corrupt: the VM stays suspended, the file untouched. The guest never sees a wrong
 * byte.
 * @category Errors
 */
export class BackingFileError extends PvisorError {
  /** The file. */
  readonly path: string;
  constructor(path: string, message: string, options?: { cause?: unknown }) {
    super('PVISOR_BACKING_FILE', `${path}: ${message}`, options);
    this.path = path;
  }
}

/**
 * A request to the guest agent is larger than one frame carries (1 MiB of payload): it was
 * refused before anything was sent, and the channel goes on. An `exec` or `spawn` command line and
 * environment must fit in it; large data goes in several frames (`files.write` does this).
 * @category Errors
 */
export class RequestTooLargeError extends PvisorError {
  /** The request's payload, in bytes. */
  readonly sizeBytes: number;
  /** The most a frame carries, in bytes. */
  readonly limitBytes: number;
  constructor(sizeBytes: number, limitBytes: number, message: string) {
    super('PVISOR_REQUEST_TOO_LARGE', message);
    this.sizeBytes = sizeBytes;
    this.limitBytes = limitBytes;
  }
}

/**
 * A guest request did not answer in time.
 * @category Errors
 */
export class TimeoutError extends PvisorError {
  constructor(message: string) {
    super('PVISOR_TIMEOUT', message);
  }
}

/**
 * A call was cancelled through its `signal` (an AbortSignal); what it started in the guest was
 * stopped where that can be done (a process killed, a file stream closed). Its `name` is
 * `AbortError`, as Node's own aborted calls say; `cause` is the signal's `reason`.
 * @category Errors
 */
export class AbortError extends PvisorError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('PVISOR_ABORTED', message, options);
  }
}

/** The {@link AbortError} of `what` (e.g. `the command`), which `signal` aborted: caused by the signal's reason. */
export function abortError(what: string, signal: AbortSignal): AbortError {
  return new AbortError(`${what} was aborted`, { cause: signal.reason });
}

/**
 * No running VM of that id (for the CLI, or the SDK reaching a VM of another process): no control socket, or one whose process has gone.
 * @category Errors
 */
export class VmNotFoundError extends PvisorError {
  /** The VM id asked for. */
  readonly vmId: string;
  constructor(vmId: string, message: string) {
    super('PVISOR_VM_NOT_FOUND', message);
    this.vmId = vmId;
  }
}

/**
 * A VM's control socket could not be used: refused access, a malformed answer, a broken connection.
 * @category Errors
 */
export class ControlSocketError extends PvisorError {
  /** The socket's path. */
  readonly socketPath: string;
  constructor(socketPath: string, message: string, options?: { cause?: unknown }) {
    super('PVISOR_CONTROL_SOCKET', `${socketPath}: ${message}`, options);
    this.socketPath = socketPath;
  }
}

/**
 * The other end of a VM's control socket speaks another version of the control protocol
 * (docs/control-protocol.md): a `pvisor run` of another pvisor version. Nothing was done.
 * @category Errors
 */
export class ControlProtocolError extends PvisorError {
  /** The version the other end spoke (`undefined` if it said none). */
  readonly version: unknown;
  constructor(version: unknown, message: string) {
    super('PVISOR_CONTROL_PROTOCOL', message);
    this.version = version;
  }
}

/**
 * Saved machine state (a snapshot's description of vCPUs, VM or devices) is malformed, from
 * another format version, or cannot be applied to this machine. Raised before any of it is applied.
 * @category Errors
 */
export class SnapshotError extends PvisorError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('PVISOR_SNAPSHOT', message, options);
  }
}

/**
 * An object store (`s3://bucket/prefix`, see docs/object-store.md) refused, failed or did not
 * answer, or what it returned is not what was stored. `reason`: `url` (the URL is malformed;
 * nothing was sent), `unreachable` (no connection, or an S3 error answer), `timeout` (no answer
 * within the request timeout), `not-found` (no snapshot at that URL), `exists` (a snapshot is
 * there already), `malformed` (the manifest is too large or not of the expected shape),
 * `corrupt` (a chunk's bytes do not have the hash that names them), `claimed` (a hibernated
 * VM in the store is being resumed or was resumed by another restore: {@link StoreClaimedError}).
 * Raised before anything is restored from what the store returned: no VM runs on bytes that
 * failed a check.
 * @category Errors
 */
export class StoreError extends PvisorError {
  readonly reason: StoreErrorReason;
  constructor(reason: StoreErrorReason, message: string, options?: { cause?: unknown }) {
    super('PVISOR_STORE', message, options);
    this.reason = reason;
  }
}

/**
 * Who holds a hibernated VM's claim in an object store (docs/object-store.md, "Hibernated VMs in
 * a store"). `state`: `claimed` (a restore took it and had not said the VM runs), `resumed` (the
 * VM ran there), `withdrawn` (its hibernation failed after the upload and the VM went on where it
 * was: the store's copy is not that VM any more).
 * @category Errors
 */
export interface StoreClaimInfo {
  /** The claim's own id: give it as {@link StoreOptions.takeOverClaim} to take the VM over. */
  claimId: string;
  state: 'claimed' | 'resumed' | 'withdrawn';
  /** The host name and pid of the process that claimed it. */
  host: string;
  pid: number;
  /** When it claimed the VM, and when it said the VM runs (ISO 8601). */
  claimedAt: string;
  resumedAt?: string;
}

/**
 * A restore of a hibernated VM from an object store was refused because another restore claimed
 * that VM first: a VM is resumed at most once. `claim` says who and when. Nothing was restored.
 * @category Errors
 */
export class StoreClaimedError extends StoreError {
  readonly claim: StoreClaimInfo;
  constructor(claim: StoreClaimInfo, message: string, options?: { cause?: unknown }) {
    super('claimed', message, options);
    this.claim = claim;
  }
}

/**
 * {@link StoreError.reason}.
 * @category Errors
 */
export type StoreErrorReason = 'url' | 'unreachable' | 'timeout' | 'not-found' | 'exists' | 'malformed' | 'corrupt' | 'claimed';

/**
 * The host side of a VM's network could not be set up; nothing of it is left on the host (no TAP,
 * rule or address), and the VM did not start. `reason`: `permission` (pvisor lacks CAP_NET_ADMIN or
 * access to /dev/net/tun or /dev/vhost-net), `unsupported` (the host lacks a device, kernel feature
 * or tool: vhost-net, nftables, iproute2), `failed` (anything else; see the message and `cause`).
 * @category Errors
 */
export class NetworkSetupError extends PvisorError {
  readonly reason: 'permission' | 'unsupported' | 'failed';
  constructor(reason: 'permission' | 'unsupported' | 'failed', message: string, options?: { cause?: unknown }) {
    super('PVISOR_NETWORK_SETUP', message, options);
    this.reason = reason;
  }
}

const ERRNO_NAMES: Record<number, string> = {
  1: 'EPERM', 2: 'ENOENT', 4: 'EINTR', 5: 'EIO', 9: 'EBADF', 11: 'EAGAIN', 12: 'ENOMEM', 13: 'EACCES',
  14: 'EFAULT', 16: 'EBUSY', 17: 'EEXIST', 19: 'ENODEV', 22: 'EINVAL', 24: 'EMFILE', 25: 'ENOTTY',
  28: 'ENOSPC', 38: 'ENOSYS', 95: 'EOPNOTSUPP',
};

/** The symbolic name of an errno value, or `errno N`. */
export function errnoName(errno: number): string {
  return ERRNO_NAMES[errno] ?? `errno ${errno}`;
}

/**
 * The page pool daemon cannot be reached, refused, or broke its protocol. The VM runs on.
 * @category Errors
 */
export class PoolUnavailableError extends PvisorError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('PVISOR_POOL_UNAVAILABLE', message, options);
  }
}

/**
 * A feature needs an optional dependency that is not installed. npm leaves an optional dependency
 * out when its install fails (zstd-napi compiles from source, so a host without python3, make and
 * g++ goes without it); everything that does not need it works. Raised when the feature is asked
 * for (e.g. `new CompressedOffload()`), before any VM exists.
 * @category Errors
 */
export class OptionalDependencyError extends PvisorError {
  /** The npm package that is missing, e.g. `zstd-napi`. */
  readonly dependency: string;
  /** What needs it, e.g. `CompressedOffload`. */
  readonly feature: string;
  constructor(dependency: string, feature: string, howToGet: string, options?: { cause?: unknown }) {
    super('PVISOR_OPTIONAL_DEPENDENCY', `${feature} needs the optional dependency ${dependency}, which is not installed (or did not build): ${howToGet}`, options);
    this.dependency = dependency;
    this.feature = feature;
  }
}

/**
 * A VM cannot be jailed on this host (`isolation: 'process'`): no bubblewrap, no cgroup (v2 or
 * v1) with the memory, pids and cpu controllers, no right to create a cgroup or to change user, or no
 * seccomp. The message says what is missing; nothing was started.
 * @category Errors
 */
export class JailUnavailableError extends PvisorError {
  constructor(message: string, options?: { cause?: unknown }) {
    super('PVISOR_JAIL_UNAVAILABLE', message, options);
  }
}

/**
 * A jailed VM's process was ended by the kernel for one of its limits (`limits.memory`: the
 * cgroup's OOM kill). Only that VM ended; the host and every other VM run on.
 * @category Errors
 */
export class VmLimitError extends PvisorError {
  /** The limit that was reached: `memory`. */
  readonly limit: 'memory';
  /** Its value, bytes. */
  readonly limitBytes: number;
  /** The VM's id. */
  readonly vmId: string;
  constructor(vmId: string, limit: 'memory', limitBytes: number) {
    super('PVISOR_VM_LIMIT', `${vmId}: the VM's process reached its limits.${limit} of ${limitBytes} bytes (${(limitBytes / 1048576).toFixed(0)} MiB) and the kernel ended it (cgroup OOM kill); only this VM ended`);
    this.limit = limit;
    this.limitBytes = limitBytes;
    this.vmId = vmId;
  }
}

/**
 * A jailed VM's process made a system call (or an ioctl) outside its seccomp filter and the kernel
 * killed it (SIGSYS). Either the guest found a way to make the VMM do what it never does, or this
 * build of pvisor needs a call its filter lacks (docs/security.md lists what the filter allows).
 * @category Errors
 */
export class JailViolationError extends PvisorError {
  /** The VM's id. */
  readonly vmId: string;
  /** The signal that ended the process: `SIGSYS`. */
  readonly signal: string;
  constructor(vmId: string, signal: string) {
    super('PVISOR_JAIL_VIOLATION', `${vmId}: the jailed VM process was killed by ${signal}: it made a system call its seccomp filter does not allow`);
    this.vmId = vmId;
    this.signal = signal;
  }
}
