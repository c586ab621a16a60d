/**
 * The seccomp filter of a jailed VMM: the system calls it may make, the ioctl requests among
 * them, and the BPF program they become (through libseccomp, in the helper
 * native-prebuilds/helpers/seccomp_bpf.c). Everything else kills the process with SIGSYS.
 *
 * The list was taken from what a `pvisor run` really calls (`strace -f` in the nested harness: the
 * probe guest with fill, digest, suspend and resume under Offload, release, idle, pause; the probe
 * under cold compression, whose userfaultfd server write-protects and copies; the Linux guest
 * running a command), then completed with the calls the same code paths make on other branches
 * (an fsync where an fdatasync was seen, fallocate's hole punch, posix_fadvise). As Firecracker's
 * filters do, it is one list per process, not per thread; unlike them, node and V8 run in the
 * same process as the vCPUs, so the list holds what an event loop and a JIT need (futex, epoll,
 * mprotect, clone3 for threads).
 * @module
 */
import { spawnSync } from 'node:child_process';
import { JailUnavailableError } from '../errors';
import { nativePrebuild } from '../native';

/**
 * The system calls allowed with any arguments, grouped by why the VMM needs them.
 * Not here, so killed: ptrace, process_vm_readv/writev, mount and every namespace call (setns,
 * unshare, pivot_root, chroot), bpf, perf_event_open, keyctl/add_key, the kexec and module
 * calls, reboot, setuid and its family, io_uring, open_by_handle_at, personality, acct.
 */
export const ALLOWED_SYSCALLS: Readonly<Record<string, readonly string[]>> = {
  'files (guest images, backing files, /proc/self for memory figures)': [
    'read', 'write', 'readv', 'writev', 'pread64', 'pwrite64', 'preadv', 'pwritev', 'lseek', 'openat', 'close',
    'statx', 'newfstatat', 'fstat', 'lstat', 'stat', 'access', 'faccessat', 'faccessat2', 'readlink', 'readlinkat',
    'getdents64', 'getcwd', 'mkdir', 'mkdirat', 'rmdir', 'unlink', 'unlinkat', 'rename', 'renameat', 'renameat2',
    'chmod', 'fchmod', 'ftruncate', 'fallocate', 'fsync', 'fdatasync', 'statfs', 'fstatfs', 'fadvise64', 'flock',
    'copy_file_range', 'sendfile',
    // A hibernated VM's restore claims its directory by linking a claim file into place (src/snapshot/hibernation-dir.ts).
    'link', 'linkat',
  ],
  'file descriptors and the event loop': [
    'fcntl', 'dup', 'dup2', 'dup3', 'pipe2', 'eventfd2', 'epoll_create1', 'epoll_ctl', 'epoll_wait', 'epoll_pwait', 'poll', 'ppoll',
  ],
  'guest RAM and the heap': ['mmap', 'munmap', 'mprotect', 'madvise', 'mremap', 'mincore', 'msync', 'brk', 'memfd_create', 'pkey_alloc', 'userfaultfd'],
  'threads (vCPUs, libuv and V8 workers) and their wake-ups': [
    'clone', 'clone3', 'futex', 'set_robust_list', 'get_robust_list', 'rseq', 'set_tid_address', 'arch_prctl', 'exit', 'exit_group',
    'gettid', 'getpid', 'getppid', 'tgkill', 'kill', 'sched_yield', 'sched_getaffinity', 'nanosleep', 'clock_nanosleep',
    'clock_gettime', 'clock_getres', 'gettimeofday', 'restart_syscall',
  ],
  signals: ['rt_sigaction', 'rt_sigprocmask', 'rt_sigreturn', 'sigaltstack'],
  'identity and limits, read only': ['uname', 'getuid', 'getgid', 'geteuid', 'getegid', 'getresuid', 'getresgid', 'getgroups', 'capget', 'prlimit64', 'getrlimit', 'getrusage', 'sysinfo', 'getrandom'],
  'sockets (the control socket; the jail has no network but loopback)': [
    'socket', 'socketpair', 'bind', 'listen', 'accept', 'accept4', 'connect', 'getsockname', 'getpeername', 'getsockopt', 'setsockopt',
    'sendto', 'recvfrom', 'sendmsg', 'recvmsg', 'shutdown',
  ],
  // bwrap installs the filter and then execs node: the exec itself is filtered.
  'starting node': ['execve'],
};

/**
 * ioctl requests allowed, by their type byte (`_IOC_TYPE`, bits 8-15): every request of that
 * driver, none of any other.
 */
export const ALLOWED_IOCTL_TYPES: Readonly<Record<number, string>> = {
  0xae: "KVM (/dev/kvm, the VM's and each vCPU's fd)",
  0xaa: 'userfaultfd (lazy reload, cold compression)',
  0xaf: "vhost (/dev/vhost-net: the guest network's data path in the host kernel)",
};

/** ioctl requests allowed one by one (<asm-generic/ioctls.h>): what node does on its stdio. */
export const ALLOWED_IOCTLS: Readonly<Record<number, string>> = {
  0x5401: 'TCGETS (is stdout a terminal?)',
  0x5413: 'TIOCGWINSZ (its width)',
  0x5421: 'FIONBIO (non-blocking stdio)',
  0x541b: 'FIONREAD (bytes waiting)',
  0x5450: 'FIONCLEX',
  0x5451: 'FIOCLEX',
  // Not TUN's whole type byte: it is 'T' (0x54), the terminal ioctls' too (TIOCSTI among them).
  // The TAP comes from the launcher already made (TUNSETIFF, TUNSETVNETHDRSZ): the device only
  // says which offloads the guest accepts (src/network/tap.ts).
  0x400454d0: "TUNSETOFFLOAD (the TAP's offloads, on the TAP fd the launcher handed over)",
};

/**
 * The allowlist as the helper reads it: one rule a line (`allow NAME`, `ioctl-type 0xHH`,
 * `ioctl 0xNNNN`). Pure, so a unit test can hold it.
 */
export function filterRules(): string {
  const lines: string[] = [];
  for (const names of Object.values(ALLOWED_SYSCALLS)) for (const n of names) lines.push(`allow ${n}`);
  for (const t of Object.keys(ALLOWED_IOCTL_TYPES)) lines.push(`ioctl-type 0x${Number(t).toString(16)}`);
  for (const r of Object.keys(ALLOWED_IOCTLS)) lines.push(`ioctl 0x${Number(r).toString(16)}`);
  return `${lines.join('\n')}\n`;
}

/** A classic-BPF instruction is 8 bytes (struct sock_filter). */
export const BPF_INSTRUCTION_BYTES = 8;

/**
 * The filter's BPF program, from libseccomp through the helper. Throws a
 * {@link JailUnavailableError} when the helper cannot run (libseccomp2 missing) or refuses a rule.
 */
export function buildFilter(rules: string = filterRules()): Buffer {
  const helper = nativePrebuild('pvisor-seccomp-bpf');
  const r = spawnSync(helper, [], { input: rules, maxBuffer: 1024 * 1024 });
  if (r.error) throw new JailUnavailableError(`cannot run ${helper}: ${r.error.message}`, { cause: r.error });
  if (r.status !== 0) throw new JailUnavailableError(`${helper} refused the seccomp allowlist (exit ${r.status}): ${r.stderr.toString().trim()} (is libseccomp2 installed?)`);
  const program = r.stdout;
  if (program.length === 0 || program.length % BPF_INSTRUCTION_BYTES !== 0) throw new JailUnavailableError(`${helper} wrote ${program.length} bytes, not a BPF program`);
  return program;
}
