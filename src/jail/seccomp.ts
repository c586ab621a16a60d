/**
 * The seccomp filter of a jailed VMM: the system calls it may make, the ioctl requests among
 * them, and the BPF program they become (through libseccomp, in the helper
 * native-prebuilds/helpers/seccomp_bpf.c). Everything else kills the process with SIGSYS.
 *
 * The list was taken from what a `pvisor run` really calls (`strace -f` in the nested harness: the
 * probe guest with fill, digest, suspend and resume under Offload, release, idle, pause; the probe
 * under cold compression, whose userfaultfd server write-protects and copies; the Linux guest
 * running a command), then completed with the calls the same code paths make on other branches
 * (an fsync where an fdatasync was seen, fallocate's hole punch, posix_fadvise). Firecracker
 * installs one filter per thread kind (its VMM, API and vCPU threads); pvisor's is one list for
 * the whole process, installed before node starts: node and V8 run in the same process as the
 * vCPUs and start threads of their own, so the list also holds what an event loop and a JIT need
 * (futex, epoll, mprotect, clone3 for threads). ioctl is allowed request by request
 * ({@link ALLOWED_IOCTLS}), as Firecracker's filters allow it.
 * @module
 */
import { spawnSync } from 'node:child_process';
import { JailUnavailableError } from '../errors';
import { nativePrebuild } from '../native';
import * as C from '../sys/constants';

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

/** The kind of fd an allowed ioctl request goes to. */
export type IoctlTarget = '/dev/kvm' | 'VM fd' | 'vCPU fd' | '/dev/userfaultfd' | 'userfaultfd' | '/dev/vhost-net' | 'TAP fd' | 'stdio and pipes';

/** One ioctl request the filter allows: its number, the fd it goes to, and why the VMM makes it. */
export interface AllowedIoctl {
  request: number;
  target: IoctlTarget;
  why: string;
}

/**
 * The ioctl requests the filter allows, one by one, by name (the kernel header's): each is
 * compared whole (the low 32 bits of ioctl's second argument, which is all the kernel reads), as
 * Firecracker's filters do. A request of the same driver that is not here (KVM_CREATE_DEVICE,
 * KVM_SET_USER_MEMORY_REGION2, KVM_GET_DIRTY_LOG, UFFDIO_POISON, VHOST_SET_LOG_BASE, TUNSETIFF,
 * TIOCSTI) kills the process like any other call outside the filter.
 *
 * The list is what the VMM's code issues, pinned against that code by test/unit/jail.test.ts: the
 * requests of src/backends/kvm/ioctls.ts, src/backends/kvm/devices/vhost-net.ts and
 * src/network/tap.ts, the KVM_RUN of native-prebuilds/helpers/vcpu_runner.c and the userfaultfd
 * requests of native-prebuilds/helpers/uffd_server.c, and what node does on its stdio. Unlike
 * Firecracker's, the list holds the calls that build the VM too (KVM_CREATE_VM, KVM_CREATE_VCPU,
 * KVM_SET_USER_MEMORY_REGION): the filter is installed before node starts, not after the VM is
 * built (docs/security.md says what a second filter, stacked then, would take).
 */
export const ALLOWED_IOCTLS: Readonly<Record<string, AllowedIoctl>> = {
  // /dev/kvm (src/backends/kvm/ioctls.ts, class Kvm)
  KVM_GET_API_VERSION: { request: C.KVM_GET_API_VERSION, target: '/dev/kvm', why: 'checks the KVM API is the one pvisor speaks (12), before anything else' },
  KVM_CHECK_EXTENSION: { request: C.KVM_CHECK_EXTENSION, target: '/dev/kvm', why: "asks for a capability (on /dev/kvm and on the VM fd): XSAVE2's size, SREGS2, XCRS, feature MSRs" },
  KVM_GET_VCPU_MMAP_SIZE: { request: C.KVM_GET_VCPU_MMAP_SIZE, target: '/dev/kvm', why: "the size of each vCPU's kvm_run mapping" },
  KVM_GET_SUPPORTED_CPUID: { request: C.KVM_GET_SUPPORTED_CPUID, target: '/dev/kvm', why: 'the CPUID the guest is given' },
  KVM_GET_MSR_INDEX_LIST: { request: C.KVM_GET_MSR_INDEX_LIST, target: '/dev/kvm', why: 'the MSRs a snapshot saves' },
  KVM_GET_MSR_FEATURE_INDEX_LIST: { request: C.KVM_GET_MSR_FEATURE_INDEX_LIST, target: '/dev/kvm', why: 'the feature MSRs a snapshot saves too' },
  KVM_CREATE_VM: { request: C.KVM_CREATE_VM, target: '/dev/kvm', why: 'the VM (once, at its start or restore)' },
  // The VM's fd (class VmFd)
  KVM_SET_USER_MEMORY_REGION: { request: C.KVM_SET_USER_MEMORY_REGION, target: 'VM fd', why: "guest RAM's memory slots" },
  KVM_SET_TSS_ADDR: { request: C.KVM_SET_TSS_ADDR, target: 'VM fd', why: 'the TSS pages Intel VT needs below 4 GiB' },
  KVM_CREATE_IRQCHIP: { request: C.KVM_CREATE_IRQCHIP, target: 'VM fd', why: 'the in-kernel PIC, IOAPIC and local APICs' },
  KVM_CREATE_PIT2: { request: C.KVM_CREATE_PIT2, target: 'VM fd', why: 'the in-kernel PIT (the Linux guest calibrates its clock on it)' },
  KVM_CREATE_VCPU: { request: C.KVM_CREATE_VCPU, target: 'VM fd', why: 'each vCPU' },
  KVM_IRQ_LINE: { request: C.KVM_IRQ_LINE, target: 'VM fd', why: "the serial port's and devices' interrupts raised from the event loop" },
  KVM_IRQFD: { request: C.KVM_IRQFD, target: 'VM fd', why: 'virtio interrupts signalled from an eventfd (vhost-net, devices) without a return to node' },
  KVM_IOEVENTFD: { request: C.KVM_IOEVENTFD, target: 'VM fd', why: "virtio queue notifications as eventfd writes, in the kernel" },
  KVM_GET_IRQCHIP: { request: C.KVM_GET_IRQCHIP, target: 'VM fd', why: "a snapshot's interrupt controllers" },
  KVM_SET_IRQCHIP: { request: C.KVM_SET_IRQCHIP, target: 'VM fd', why: 'their restore' },
  KVM_GET_PIT2: { request: C.KVM_GET_PIT2, target: 'VM fd', why: "a snapshot's PIT" },
  KVM_SET_PIT2: { request: C.KVM_SET_PIT2, target: 'VM fd', why: 'its restore' },
  KVM_GET_CLOCK: { request: C.KVM_GET_CLOCK, target: 'VM fd', why: "a snapshot's kvm-clock" },
  KVM_SET_CLOCK: { request: C.KVM_SET_CLOCK, target: 'VM fd', why: 'its restore' },
  // Each vCPU's fd (class VcpuFd; KVM_RUN from the vCPU threads)
  KVM_RUN: { request: C.KVM_RUN, target: 'vCPU fd', why: 'runs the vCPU (native-prebuilds/helpers/vcpu_runner.c, one thread each)' },
  KVM_SET_CPUID2: { request: C.KVM_SET_CPUID2, target: 'vCPU fd', why: "the vCPU's CPUID" },
  KVM_GET_REGS: { request: C.KVM_GET_REGS, target: 'vCPU fd', why: 'general registers: boot (set) and snapshot (get and set)' },
  KVM_SET_REGS: { request: C.KVM_SET_REGS, target: 'vCPU fd', why: 'boot and restore' },
  KVM_GET_SREGS: { request: C.KVM_GET_SREGS, target: 'vCPU fd', why: 'segment and control registers: boot and snapshot (where SREGS2 is missing)' },
  KVM_SET_SREGS: { request: C.KVM_SET_SREGS, target: 'vCPU fd', why: 'boot and restore' },
  KVM_GET_SREGS2: { request: C.KVM_GET_SREGS2, target: 'vCPU fd', why: 'the same with the PDPTRs: snapshot, where KVM has KVM_CAP_SREGS2' },
  KVM_SET_SREGS2: { request: C.KVM_SET_SREGS2, target: 'vCPU fd', why: 'restore' },
  KVM_GET_FPU: { request: C.KVM_GET_FPU, target: 'vCPU fd', why: 'FPU and SSE state: snapshot, where XSAVE is missing' },
  KVM_SET_FPU: { request: C.KVM_SET_FPU, target: 'vCPU fd', why: 'restore' },
  KVM_GET_XSAVE: { request: C.KVM_GET_XSAVE, target: 'vCPU fd', why: 'extended state: snapshot' },
  KVM_GET_XSAVE2: { request: C.KVM_GET_XSAVE2, target: 'vCPU fd', why: 'the same past 4 KiB (AMX), where KVM has KVM_CAP_XSAVE2' },
  KVM_SET_XSAVE: { request: C.KVM_SET_XSAVE, target: 'vCPU fd', why: 'restore (either size)' },
  KVM_GET_XCRS: { request: C.KVM_GET_XCRS, target: 'vCPU fd', why: 'XCR0: snapshot' },
  KVM_SET_XCRS: { request: C.KVM_SET_XCRS, target: 'vCPU fd', why: 'restore' },
  KVM_GET_LAPIC: { request: C.KVM_GET_LAPIC, target: 'vCPU fd', why: 'the local APIC: boot (LINT0/LINT1) and snapshot' },
  KVM_SET_LAPIC: { request: C.KVM_SET_LAPIC, target: 'vCPU fd', why: 'boot and restore' },
  KVM_GET_MSRS: { request: C.KVM_GET_MSRS, target: 'vCPU fd', why: 'MSRs: boot and snapshot' },
  KVM_SET_MSRS: { request: C.KVM_SET_MSRS, target: 'vCPU fd', why: 'boot and restore' },
  KVM_GET_VCPU_EVENTS: { request: C.KVM_GET_VCPU_EVENTS, target: 'vCPU fd', why: 'pending exceptions and interrupts: snapshot' },
  KVM_SET_VCPU_EVENTS: { request: C.KVM_SET_VCPU_EVENTS, target: 'vCPU fd', why: 'restore' },
  KVM_GET_DEBUGREGS: { request: C.KVM_GET_DEBUGREGS, target: 'vCPU fd', why: 'debug registers: snapshot' },
  KVM_SET_DEBUGREGS: { request: C.KVM_SET_DEBUGREGS, target: 'vCPU fd', why: 'restore' },
  KVM_GET_MP_STATE: { request: C.KVM_GET_MP_STATE, target: 'vCPU fd', why: 'running, halted or waiting for SIPI: snapshot' },
  KVM_SET_MP_STATE: { request: C.KVM_SET_MP_STATE, target: 'vCPU fd', why: 'restore' },
  KVM_GET_TSC_KHZ: { request: C.KVM_GET_TSC_KHZ, target: 'vCPU fd', why: "the guest's TSC frequency: snapshot" },
  KVM_SET_TSC_KHZ: { request: C.KVM_SET_TSC_KHZ, target: 'vCPU fd', why: 'restored on a host whose TSC differs' },
  // userfaultfd (native-prebuilds/helpers/uffd_server.c): lazy reload after Offload, cold compression
  USERFAULTFD_IOC_NEW: { request: C.USERFAULTFD_IOC_NEW, target: '/dev/userfaultfd', why: 'a userfaultfd that also takes the faults KVM makes for the guest' },
  UFFDIO_API: { request: C.UFFDIO_API, target: 'userfaultfd', why: 'the handshake, with the features asked for' },
  UFFDIO_REGISTER: { request: C.UFFDIO_REGISTER, target: 'userfaultfd', why: "guest RAM, for missing pages (and write-protection under cold compression)" },
  UFFDIO_UNREGISTER: { request: C.UFFDIO_UNREGISTER, target: 'userfaultfd', why: 'when every page is back' },
  UFFDIO_COPY: { request: C.UFFDIO_COPY, target: 'userfaultfd', why: 'places a page read from the backing file or decompressed' },
  UFFDIO_ZEROPAGE: { request: C.UFFDIO_ZEROPAGE, target: 'userfaultfd', why: 'places a page that was zero' },
  UFFDIO_WAKE: { request: C.UFFDIO_WAKE, target: 'userfaultfd', why: 'wakes a thread whose page another fault already placed' },
  UFFDIO_WRITEPROTECT: { request: C.UFFDIO_WRITEPROTECT, target: 'userfaultfd', why: 'cold compression: notices the first write to a page it keeps compressed' },
  // vhost-net (src/backends/kvm/devices/vhost-net.ts): the guest network's data path in the host kernel
  VHOST_SET_OWNER: { request: C.VHOST_SET_OWNER, target: '/dev/vhost-net', why: "binds vhost's worker to this process's memory" },
  VHOST_GET_FEATURES: { request: C.VHOST_GET_FEATURES, target: '/dev/vhost-net', why: 'what it offers' },
  VHOST_SET_FEATURES: { request: C.VHOST_SET_FEATURES, target: '/dev/vhost-net', why: 'what the guest accepted' },
  VHOST_SET_MEM_TABLE: { request: C.VHOST_SET_MEM_TABLE, target: '/dev/vhost-net', why: 'where guest RAM is' },
  VHOST_SET_VRING_NUM: { request: C.VHOST_SET_VRING_NUM, target: '/dev/vhost-net', why: 'each queue: its size' },
  VHOST_SET_VRING_ADDR: { request: C.VHOST_SET_VRING_ADDR, target: '/dev/vhost-net', why: 'its rings' },
  VHOST_SET_VRING_BASE: { request: C.VHOST_SET_VRING_BASE, target: '/dev/vhost-net', why: 'its next index (0, or a snapshot\'s)' },
  VHOST_GET_VRING_BASE: { request: C.VHOST_GET_VRING_BASE, target: '/dev/vhost-net', why: 'stops it and reads its index (snapshot, reset)' },
  VHOST_SET_VRING_KICK: { request: C.VHOST_SET_VRING_KICK, target: '/dev/vhost-net', why: 'its notify eventfd (the KVM_IOEVENTFD one)' },
  VHOST_SET_VRING_CALL: { request: C.VHOST_SET_VRING_CALL, target: '/dev/vhost-net', why: 'its interrupt eventfd (the KVM_IRQFD one)' },
  VHOST_NET_SET_BACKEND: { request: C.VHOST_NET_SET_BACKEND, target: '/dev/vhost-net', why: 'the TAP it moves packets to and from' },
  // The TAP the launcher made and handed over (src/network/tap.ts): never TUNSETIFF (a TAP of its
  // own) nor TUN's type byte, which is the terminal ioctls' too ('T', TIOCSTI among them).
  TUNSETOFFLOAD: { request: C.TUNSETOFFLOAD, target: 'TAP fd', why: 'the offloads the guest accepted' },
  // What node (libuv) does on the stdio it inherits and its own pipes.
  TCGETS: { request: C.TCGETS, target: 'stdio and pipes', why: 'is it a terminal?' },
  // node's exit puts back the terminal settings it found on each stdio terminal, changed or not
  // (Firecracker allows it for the same reason). Settings only: typing into it (TIOCSTI) is refused.
  TCSETS: { request: C.TCSETS, target: 'stdio and pipes', why: "puts back a terminal's settings at exit (node)" },
  TIOCGWINSZ: { request: C.TIOCGWINSZ, target: 'stdio and pipes', why: "the terminal's width" },
  FIONBIO: { request: C.FIONBIO, target: 'stdio and pipes', why: 'non-blocking' },
  FIONREAD: { request: C.FIONREAD, target: 'stdio and pipes', why: 'bytes waiting' },
  FIONCLEX: { request: C.FIONCLEX, target: 'stdio and pipes', why: 'close-on-exec off' },
  FIOCLEX: { request: C.FIOCLEX, target: 'stdio and pipes', why: 'close-on-exec on' },
  // libuv's uv_tty_init on a terminal: is it a pty's slave (then it reopens it by name)? Without
  // it and TCSETS, a jailed `pvisor run` whose stdout is a terminal was killed by SIGSYS at its
  // first output line.
  TIOCGPTN: { request: C.TIOCGPTN, target: 'stdio and pipes', why: "is the terminal a pty's slave? (libuv, when stdout or stderr is a terminal)" },
};

/**
 * The allowlist as the helper reads it: one rule a line (`allow NAME` for a system call with any
 * arguments, `ioctl 0xNNNNNNNN` for one ioctl request). Pure, so a unit test can hold it.
 */
export function filterRules(): string {
  const lines: string[] = [];
  for (const names of Object.values(ALLOWED_SYSCALLS)) for (const n of names) lines.push(`allow ${n}`);
  for (const { request } of Object.values(ALLOWED_IOCTLS)) lines.push(`ioctl 0x${request.toString(16)}`);
  return `${lines.join('\n')}\n`;
}

/** The allowed ioctls as a Markdown table (docs/security.md holds it; a unit test checks that it is this one). Pure. */
export function ioctlTableMarkdown(): string {
  const rows = ['| request | number | on | why |', '|---|---|---|---|'];
  for (const [name, { request, target, why }] of Object.entries(ALLOWED_IOCTLS)) rows.push(`| ${name} | 0x${request.toString(16)} | ${target} | ${why} |`);
  return `${rows.join('\n')}\n`;
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
