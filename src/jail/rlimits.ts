/**
 * The resource limits (setrlimit) of a jailed VMM's process, as Firecracker's jailer sets them with
 * `--resource-limit`. They are set by util-linux's `prlimit` on itself right before it execs
 * bubblewrap, so they hold for every process of the jail from its first instruction, and they
 * are set hard and soft alike: once pvisor-jail-exec has dropped root, the VMM cannot raise them.
 *
 * Chosen:
 * - `RLIMIT_CORE` 0: a crashing VMM leaves no core dump, which would hold guest RAM (the
 *   guest's secrets) in a file of the host's. The kernel ignores RLIMIT_CORE for a core_pattern
 *   that pipes to a program; systemd-coredump honours it (it drops the dump of a process whose
 *   limit is 0).
 * - `RLIMIT_NOFILE` {@link JAIL_OPEN_FILES}, Firecracker's default: a VM holds a few dozen fds
 *   (node's own, each vCPU's fd and eventfds, each virtio queue's ioeventfd and irqfd, the
 *   userfaultfd, backing files, vhost-net and the TAP) and one per control connection and
 *   forwarded connection (at most 256: MAX_VM_FORWARD_CONNECTIONS), far below it. Past it, an fd
 *   the VMM opens fails with EMFILE; the host's own limit (often a million for root) is not the
 *   jail's.
 *
 * Not set:
 * - `RLIMIT_FSIZE` (Firecracker's jailer sets it only when asked): the VMM writes files as large
 *   as guest RAM (an Offload backing file, a snapshot's `ram`) and writes a writable rootfs image
 *   at any offset it has; a smaller limit would kill it with SIGXFSZ in the middle of a suspend.
 *   What it may write is bounded by what it is given (its backing directory, a rootfs), not by
 *   this.
 * - `RLIMIT_NPROC`: it counts every process of the real uid host-wide, and the jail's uid (65534
 *   by default) is shared by every jailed VM; the cgroup's `pids.max` bounds each VM's tasks
 *   alone (./limits.ts).
 * @module
 */

/** RLIMIT_NOFILE of a jailed VMM (soft and hard), as Firecracker's jailer's default `no-file`. */
export const JAIL_OPEN_FILES = 2048;

/** The limits set, by `prlimit`'s option names: [soft, hard]. */
export const JAIL_RLIMITS: Readonly<Record<'core' | 'nofile', readonly [number, number]>> = {
  core: [0, 0],
  nofile: [JAIL_OPEN_FILES, JAIL_OPEN_FILES],
};

/** util-linux's prlimit (Debian's util-linux is essential: every host has it). */
export const PRLIMIT = '/usr/bin/prlimit';

/** `command`, run with the jail's rlimits: prlimit sets them on itself, then execs it. Pure. */
export function withJailRlimits(command: readonly string[]): string[] {
  return [PRLIMIT, ...Object.entries(JAIL_RLIMITS).map(([name, [soft, hard]]) => `--${name}=${soft}:${hard}`), '--', ...command];
}
