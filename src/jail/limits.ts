/**
 * A jailed VM's resource limits (`limits: { memory, cpus, pids }`) and the cgroup files (v2, or
 * v1 on a host whose controllers are bound there) they become. Pure: it reads no file, so every
 * refusal happens before anything is created.
 * @module
 */
import { InvalidOptionError } from '../errors';
import { parseSize, type Size } from '../units';

/**
 * The limits of a jailed VM's process, as given: each one optional, with the defaults said on each.
 * @category VM
 */
export interface JailLimitsInput {
  /**
   * The most memory the VM's whole process may hold: guest RAM as the guest touches it, the VMM's
   * own heap and code, and the page cache its files charge (cgroup v2 `memory.max`, v1
   * `memory.limit_in_bytes`). Past it the kernel ends the process (and only it), and the VM ends
   * with a {@link VmLimitError}. Default: guest RAM + 192 MiB (node, V8 and the VMM's own buffers,
   * with room for a burst).
   */
  memory?: Size;
  /** CPU time, in CPUs (1.5 = one and a half CPUs' worth each period; cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`). Default: the VM's vCPUs + 1 (the VMM's own threads). */
  cpus?: number;
  /** The most tasks (threads count) the process may have (cgroup `pids.max`), 16 to 65536. Default 128. */
  pids?: number;
}

/** The limits once checked and completed. */
export interface JailLimits {
  memoryBytes: number;
  cpus: number;
  pids: number;
}

/**
 * Beyond guest RAM, what the VMM process needs by default: node and V8 (about 40 MiB measured
 * running, docs/memory-layer.md "The VMM process"), the native helpers' buffers, the page cache
 * of an Offload backing file being written, and room for a burst (a snapshot's JSON, a large exec
 * answer) without being killed for it.
 */
export const DEFAULT_MEMORY_HEADROOM_BYTES = 192 * 1024 * 1024;
/** Below this the VMM cannot even start node; a smaller `memory` limit is refused. */
export const MIN_MEMORY_LIMIT_BYTES = 64 * 1024 * 1024;
/**
 * Tasks by default: node has about a dozen threads (main, 4 libuv workers, V8's platform workers
 * and GC helpers, the inspector's), plus one per vCPU and the memory helpers' few; 128 leaves room
 * while stopping a fork bomb at once.
 */
export const DEFAULT_PIDS = 128;
/** A VMM needs its main thread, libuv and V8 threads and its vCPUs: fewer tasks cannot run it. */
export const MIN_PIDS = 16;
/** The most CPUs a limit may name (cgroup v2 takes any quota; this only catches a typo). */
export const MAX_CPUS = 1024;
/** The CPU limit's period (cgroup v2 `cpu.max`'s second field, v1 `cpu.cfs_period_us`), µs: the kernel's default (100 ms). */
export const CPU_PERIOD_US = 100_000;

/**
 * Checks `input` against the VM it limits and fills in the defaults. Throws an
 * {@link InvalidOptionError} naming the limit (`limits.memory`, ...) for a value out of range. A
 * memory limit below guest RAM's size is allowed: a guest that never touches all its RAM fits.
 */
export function resolveLimits(input: JailLimitsInput | undefined, vm: { memoryBytes: number; vcpus: number }): JailLimits {
  const given = input ?? {};
  if (typeof given !== 'object' || given === null || Array.isArray(given)) throw new InvalidOptionError('limits', 'expected an object { memory?, cpus?, pids? }');
  for (const key of Object.keys(given)) {
    if (key !== 'memory' && key !== 'cpus' && key !== 'pids') throw new InvalidOptionError(`limits.${key}`, 'unknown limit; the limits are memory, cpus and pids');
  }
  const memoryBytes = given.memory === undefined ? vm.memoryBytes + DEFAULT_MEMORY_HEADROOM_BYTES : parseSize('limits.memory', given.memory);
  if (memoryBytes < MIN_MEMORY_LIMIT_BYTES) throw new InvalidOptionError('limits.memory', `at least ${MIN_MEMORY_LIMIT_BYTES / 1024 / 1024} MiB (the VMM process alone needs about 40), got ${memoryBytes} bytes`);
  if (memoryBytes % 4096 !== 0) throw new InvalidOptionError('limits.memory', `must be a multiple of 4 KiB (the kernel counts pages), got ${memoryBytes} bytes`);
  const cpus = given.cpus === undefined ? vm.vcpus + 1 : given.cpus;
  if (typeof cpus !== 'number' || !Number.isFinite(cpus) || cpus < 0.01 || cpus > MAX_CPUS) throw new InvalidOptionError('limits.cpus', `expected a number of CPUs from 0.01 to ${MAX_CPUS} (1.5 = one and a half), got ${String(cpus)}`);
  const pids = given.pids === undefined ? DEFAULT_PIDS : given.pids;
  if (typeof pids !== 'number' || !Number.isSafeInteger(pids) || pids < MIN_PIDS || pids > 65536) throw new InvalidOptionError('limits.pids', `expected a whole number from ${MIN_PIDS} to 65536, got ${String(pids)}`);
  return { memoryBytes, cpus, pids };
}

/**
 * The cgroup v2 files (name, then the text written to it) that enforce `limits`, in the order
 * they are written. `memory.swap.max` 0: a limit the process could spill past into swap would
 * not be one. `memory.oom.group` 1: when the kernel kills for the limit it kills every task of
 * the group at once, so no half of a VMM (a vCPU thread's process without its event loop) lives on.
 */
export function cgroupFiles(limits: JailLimits): [file: string, value: string][] {
  const quotaUs = Math.max(1000, Math.round(limits.cpus * CPU_PERIOD_US));
  return [
    ['memory.max', String(limits.memoryBytes)],
    ['memory.swap.max', '0'],
    ['memory.oom.group', '1'],
    ['pids.max', String(limits.pids)],
    ['cpu.max', `${quotaUs} ${CPU_PERIOD_US}`],
  ];
}

/**
 * The cgroup v1 files that enforce `limits` on a host whose controllers are bound to v1
 * hierarchies: (controller, file, text), in the order written. `memory.memsw.limit_in_bytes`
 * equal to the memory limit is v2's `memory.swap.max` 0; it exists only where the kernel accounts
 * swap, so it is `optional`. The period goes before the quota: the kernel checks the quota against
 * the period in place. v1 has no `memory.oom.group`: the kernel's OOM killer ends the cgroup's
 * largest task, which is the VMM (guest RAM is charged to it), and bwrap, its pid namespace's init,
 * ends with it, taking the namespace's other tasks down.
 */
export function cgroupV1Files(limits: JailLimits): [controller: JailController, file: string, value: string, optional?: true][] {
  const quotaUs = Math.max(1000, Math.round(limits.cpus * CPU_PERIOD_US));
  return [
    ['memory', 'memory.limit_in_bytes', String(limits.memoryBytes)],
    ['memory', 'memory.memsw.limit_in_bytes', String(limits.memoryBytes), true],
    ['pids', 'pids.max', String(limits.pids)],
    ['cpu', 'cpu.cfs_period_us', String(CPU_PERIOD_US)],
    ['cpu', 'cpu.cfs_quota_us', String(quotaUs)],
  ];
}

/** The controllers a jail's cgroup needs (enabled in its parents' `cgroup.subtree_control` in v2). */
export const JAIL_CONTROLLERS = ['memory', 'pids', 'cpu'] as const;
/** One of {@link JAIL_CONTROLLERS}. */
export type JailController = (typeof JAIL_CONTROLLERS)[number];
