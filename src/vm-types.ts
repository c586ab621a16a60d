/**
 * The public types of a {@link Vm}: its options, states, events and memory figures, and what its
 * snapshots, hibernations and restores take and give. They live apart from vm.ts because the
 * modules vm.ts is built from (the control socket, the handle, the jail, the list, the snapshot
 * files) name them too: importing them from vm.ts made those modules and vm.ts import each other.
 * @module
 */
// Links to Vm, the jail's handle and the strategies resolve in the public index: importing them
// here would close the circle this module removes.
import type { GuestCrashError, InvalidOptionError, NetworkSetupError, PvisorError, SnapshotError, TimeoutError } from './errors';
import type { TimeoutAction } from './lifetime';
import type { Logger } from './logger';
import type { MemoryStrategy, StrategyStats } from './memory/strategy';
import type { NetworkOption } from './network/options';
import type { StoreOptions, StoreTransfer } from './store/store-options';
import type { Size } from './units';
import type { WarningLimit } from './warning-limit';


/**
 * Which guest a VM runs.
 * @category VM
 */
export type GuestKind = 'linux' | 'probe';

/**
 * Options of {@link Vm.start}.
 * @category VM
 */
export interface VmOptions {
  /** Guest RAM: bytes or a size string such as `512MiB`. Default `512MiB`. A multiple of 4 KiB. */
  memory?: Size;
  /** Number of vCPUs, 1 to 8. Default 2. */
  vcpus?: number;
  /**
   * The guest: `linux` (the product default) or `probe`, the small CPL3 guest that tests and
   * benches drive. Default `linux`.
   */
  guest?: GuestKind;
  /** Linux guest: path of a bzImage to boot instead of the shipped kernel. */
  kernel?: string;
  /** Linux guest: path of an initramfs instead of the shipped one (its /init must be pvisor's agent). */
  initrd?: string;
  /** Linux guest: words appended to the kernel command line. */
  kernelArgs?: string;
  /**
   * Linux guest: a root filesystem image for the commands to run in, attached as a virtio-blk
   * disk (`/dev/vda`). The agent mounts it (ext4, or ext3/ext2), moves /dev, /proc, /sys, /tmp
   * and /run into it and makes it `/`, so {@link Vm.exec} and {@link Vm.files} see its `/bin/sh`,
   * its libraries and its files. A path (attached read-write) or {@link RootfsOptions}.
   *
   * The file is used in place: never truncated or grown; the guest's writes reach it as the guest
   * writes them back (its `sync` flushes them to the host's disk). Its size must be a non-zero
   * multiple of 512 bytes. Checked before anything boots: a missing, unreadable or badly sized
   * file is an {@link InvalidOptionError} naming it. If the guest cannot mount it, the start
   * rejects with a {@link GuestCrashError} carrying the agent's reason. Default: none (commands
   * run in the shipped initramfs).
   */
  rootfs?: string | RootfsOptions;
  /** How long to wait for the guest agent to say hello. Default 60000 ms. */
  bootTimeoutMs?: number;
  /**
   * A name for logs, files and the CLI: 1-64 letters, digits, `_`, `.`, `-`, beginning with a
   * letter or digit (it ends up in file names). Default: `vm-<n>`.
   */
  name?: string;
  /**
   * Memory strategies, composed in this order, e.g. `[new KsmAdvice(), new IdleRelease()]`. A
   * composition that cannot work (a resource driven twice, two strategies providing guest RAM's
   * backing, a strategy needing something of the backing that it does not offer) is a
   * `StrategyConflictError` naming both sides, before anything is allocated. Default none.
   */
  strategies?: readonly MemoryStrategy[];
  /**
   * How many `warning` events the VM emits: most are the guest's doing (a malformed device
   * request, garbage on the agent channel) and a guest can cause them without end, so by default
   * 20 at once, then 2 a second; what is dropped is counted and said in one warning when the
   * limit allows again. `{ burst: Infinity, perSecond: Infinity }` emits every one.
   */
  warningLimit?: WarningLimit;
  /**
   * Linux guest: the guest's network, off by default. `'none'`: no network device (the agent
   * channel still works). `'nat'`: a virtio-net device (eth0) on a TAP that pvisor creates, with a
   * /30 of its own and NAT to the host's uplinks, every destination allowed but the host itself;
   * `{ mode: 'nat', allow: ['api.openai.com', '*.pypi.org', '10.1.0.0/16:443'], deny: [...] }`:
   * only those (hostnames through pvisor's resolver, see `NatNetworkOptions.allow`;
   * `vm.network.update` changes them at runtime). IPv4 only: the host drops the
   * guest's IPv6, and whatever it sends from an address or MAC other than its own. Needs CAP_NET_ADMIN, /dev/net/tun,
   * /dev/vhost-net, nft and ip; otherwise the start fails with a {@link NetworkSetupError} and
   * nothing is left on the host. `{ tap: NAME }`: the user's own TAP, nothing configured on the host.
   * Everything pvisor made is removed when the VM ends (by a later start after a crash of this
   * process). See docs/networking.md. Default `'none'`.
   */
  network?: NetworkOption;
  /**
   * The caller's own tags, e.g. `{ team: 'search', task: 't-1234' }`: shown by {@link Vm.list}
   * (which can select by them) and {@link Vm.labels}. At most 64; a key is 1-63 letters, digits,
   * `.`, `_`, `-` or `/`, beginning with a letter or digit; a value a string of at most 256
   * characters without control characters. A hibernated VM keeps them. Default none.
   */
  labels?: Record<string, string>;
  /**
   * Linux guest: environment variables every command gets ({@link Vm.exec}, {@link Vm.spawn},
   * forwarded connections), under the command's own `env`, which overrides them; the host sends
   * them with each command. At most 64 KiB of `NAME=value`. Default none.
   */
  env?: Record<string, string>;
  /**
   * The VM's lifetime, in ms from when it is ready: then {@link VmOptions.onTimeout} happens. A
   * `timeout-warning` event comes first (10 s before, or half the lifetime before when it is
   * shorter than 20 s), so that a caller can extend it with {@link Vm.setTimeout}, which also
   * shortens or clears it. The timer does not keep the Node process alive, and ends with the VM.
   * At most 2147483647 (24.8 days). Default: no limit.
   */
  timeoutMs?: number;
  /**
   * What the lifetime's end does ({@link VmOptions.timeoutMs}); the `timeout` event then says how
   * it went. `'stop'`: {@link Vm.stop}. `'suspend'`: {@link Vm.suspend}, with the VM's memory
   * strategies (with {@link Offload} its RAM goes to disk and is released; without a strategy
   * only its vCPUs stop); a {@link Vm.resume} after it gives the VM the same lifetime again.
   * `'hibernate'`: {@link Vm.hibernate} into {@link VmOptions.hibernateDir} (from `suspended`,
   * it is resumed first), which needs what a hibernation needs (no network, no writable rootfs:
   * checked at the start). If the action fails, a `warning` says why and the VM goes on.
   * Default `'stop'`.
   */
  onTimeout?: TimeoutAction;
  /** With `onTimeout: 'hibernate'` (and only then): the directory the VM hibernates into, new or empty when it does. */
  hibernateDir?: string;
  /**
   * Where this VM's trace goes: each agent request (`debug`, with its call and `ms`), each
   * strategy operation (`debug`: map, suspend, resume, periodic work, with `ms`), state changes,
   * lifetimes and exits (`info`), warnings (`warn`), a crash (`error`). Every line's fields carry
   * `vm`, the VM's name. `console` works as it is. Default: silent.
   */
  logger?: Logger;
  /**
   * `'none'` (the default): the VM runs in this process. `'process'` runs it in a jailed child
   * instead and makes {@link Vm.start} resolve with a {@link JailedVmHandle}: see
   * {@link JailedVmOptions}.
   */
  isolation?: 'none';
}

/**
 * A root filesystem image and how to attach it. See {@link VmOptions.rootfs}.
 * @category VM
 */
export interface RootfsOptions {
  /** The image file (e.g. made with `mke2fs -t ext4 -d DIR rootfs.img 256M`). */
  path: string;
  /**
   * Attach it read-only: the guest sees a read-only disk and mounts it read-only, the host opens
   * the file O_RDONLY. The image must then have `/dev` and `/proc` directories (the agent cannot
   * create mount points in it), and `/tmp` (and `/run`, `/sys`) for the guest's tmpfs (and
   * sysfs) to be there, the guest's only writable places; and a clean journal (a VM that wrote
   * to it and was stopped leaves one to replay: `e2fsck -p IMAGE` does), because a read-only disk
   * cannot replay it. Several VMs may share a read-only image, and only a read-only one can be
   * snapshotted ({@link Vm.snapshot}). Default false.
   */
  readOnly?: boolean;
}

/**
 * Options of {@link Vm.snapshot}.
 * @category VM
 */
export interface SnapshotOptions {
  /** Leave the VM paused after the snapshot instead of resuming it (when it was running). Default false. */
  leavePaused?: boolean;
  /** For an `s3://bucket/prefix` location: how the object store is reached, and progress. */
  store?: StoreOptions;
}

/**
 * What {@link Vm.snapshot} wrote.
 * @category VM
 */
export interface SnapshotInfo {
  /** The snapshot directory. */
  dir: string;
  /** Guest RAM pages written to the RAM file; the rest of RAM was zero and is a hole in it. */
  ramDataPageCount: number;
  /** Milliseconds from the call to the directory being sealed (including the pause), or to the upload's end for an `s3://` location; fractional, to the microsecond. */
  ms: number;
  /** For an `s3://` location: what was sent to the object store. */
  store?: StoreTransfer;
}

/**
 * Options of {@link Vm.hibernate}.
 * @category VM
 */
export interface HibernateOptions {
  /**
   * Runs once the VM's state is written and synced, while the VM is still paused: e.g. to record
   * where it went. If it throws or rejects, the directory's contents are removed, the VM is left
   * running (or paused) as it was, and hibernate rejects with that error.
   */
  beforeStop?: (info: HibernateInfo) => void | Promise<void>;
  /** For an `s3://bucket/prefix` location: how the object store and the chunk cache (its work directory) are reached, and progress. */
  store?: StoreOptions;
}

/**
 * What {@link Vm.hibernate} wrote.
 * @category VM
 */
export interface HibernateInfo {
  /** The directory that now holds the VM. */
  dir: string;
  /** Guest RAM pages written to the RAM file; the rest of RAM was zero and is a hole in it. */
  ramDataPageCount: number;
  /** What the directory takes on disk. */
  bytesOnDisk: number;
  /** Milliseconds from the call to the directory being synced (including the pause), or to the upload's end for an `s3://` location; fractional, to the microsecond. */
  ms: number;
  /**
   * For an `s3://` location: what was sent to the object store. `dir` is then the location, and
   * `bytesOnDisk` what the hibernation took in the chunk cache's work directory before it was
   * sent (removed since).
   */
  store?: StoreTransfer;
}

/**
 * Options of {@link Vm.restore}.
 * @category VM
 */
export interface RestoreOptions {
  /**
   * A name for the restored VM, as {@link VmOptions.name}. Default: a hibernated VM's own name
   * ({@link Vm.hibernate}), else `vm-<n>`.
   */
  name?: string;
  /**
   * A hibernated VM's directory ({@link Vm.hibernate}) is removed once the restore has
   * succeeded: the VM has moved back into a process, and is restored once. `keep: true` leaves
   * it, as a snapshot that can be restored again. A snapshot's directory is never removed.
   * Default false.
   */
  keep?: boolean;
  /** Memory strategies of the restored VM, as {@link VmOptions.strategies}. Default none. */
  strategies?: readonly MemoryStrategy[];
  /** As {@link VmOptions.warningLimit}. */
  warningLimit?: WarningLimit;
  /** As {@link VmOptions.labels}. Default: a hibernated VM's own, else none. */
  labels?: Record<string, string>;
  /** As {@link VmOptions.env}. Default none (a hibernated VM's is not kept: give it again). */
  env?: Record<string, string>;
  /** As {@link VmOptions.timeoutMs}, from when the restored VM is ready. Default: no limit. */
  timeoutMs?: number;
  /** As {@link VmOptions.onTimeout}. */
  onTimeout?: TimeoutAction;
  /** As {@link VmOptions.hibernateDir}. */
  hibernateDir?: string;
  /** As {@link VmOptions.logger}. */
  logger?: Logger;
  /**
   * Read and check all of guest RAM before the VM runs. By default a restore into private memory
   * is lazy: the VM runs at once, and each chunk of the RAM file is read and checked against the
   * manifest when the guest first touches it, or before, by a background load of every chunk
   * (a native thread behind userfaultfd); a chunk that fails its check is never mapped, and the
   * VM ends with a {@link SnapshotError}. With `verify: true` such a snapshot is refused before
   * anything runs. Restores where userfaultfd cannot serve guest RAM (beside ColdCompression or
   * PoolClient) always read it first. {@link SharedSnapshot} has its own `verify`. Default false.
   */
  verify?: boolean;
  /**
   * Linux guest: how long to wait, once the machine runs, for the agent to answer that it was
   * restored (see {@link Vm.restore}); then the restore rejects with a {@link TimeoutError} and
   * the VM is stopped. Default 60000 ms.
   */
  readyTimeoutMs?: number;
  /** For an `s3://bucket/prefix` snapshot: how the object store and the chunk cache are reached, and progress. */
  store?: StoreOptions;
}

/**
 * How a VM came from a snapshot: {@link Vm.restoreInfo}.
 * @category VM
 */
export interface RestoreInfo {
  /** The snapshot directory, or its `s3://` location. */
  dir: string;
  /**
   * For an `s3://` location: what was fetched from the object store before the VM was ready
   * (included in `readyMs`). With `storeRamLoad: 'lazy'` the rest of guest RAM comes after.
   */
  store?: StoreTransfer;
  /**
   * For an `s3://` location, how guest RAM came from the store: `lazy` (the VM ran once the
   * manifest and the small files were here; each chunk was fetched when the guest first touched
   * it, and the rest are prefetched once the VM is ready) or `fetched` (every chunk was fetched
   * into the chunk cache first: {@link RestoreOptions.verify}, a {@link SharedSnapshot} clone, a
   * composition that cannot load lazily, or a client given as {@link StoreOptions.client}, which
   * the fetcher thread cannot use). See docs/object-store.md.
   */
  storeRamLoad?: 'lazy' | 'fetched';
  /** Milliseconds from the {@link Vm.restore} call to the VM being ready (Linux: the agent answered); fractional, to the microsecond, as every duration here. */
  readyMs: number;
  /**
   * How guest RAM came from the snapshot: `read` (read and checked in full before the VM ran),
   * `lazy` (loaded and checked chunk by chunk as the guest touched it, and in the background; see
   * {@link RestoreOptions.verify}) or `mapped` (a {@link SharedSnapshot} clone's).
   */
  ramLoad: 'read' | 'lazy' | 'mapped';
  /** Of `readyMs`, the milliseconds spent reading and checking guest RAM from the snapshot (setting up a lazy load: see `ramLoad`). */
  ramMs: number;
  /** Of `readyMs`, the milliseconds from the machine's resume to the agent's answer (0 for the probe). */
  agentMs: number;
  /**
   * Agent requests the snapshotted VM had in flight (a command running, a file being read): their
   * callers are in that VM. Here, each one's answer, when the guest gives it, is dropped with a
   * `warning`.
   */
  inFlightRequests: number;
  /**
   * Linux guest: processes started before the snapshot. They run on in this VM (a server left
   * running is running here too), detached: their stdin closed, their output dropped by the agent.
   */
  detachedProcesses: number;
  /** Linux guest: requests of before the snapshot the agent ended at once (a stdin write, a file read). */
  endedRequests: number;
  /**
   * The directory held a hibernated VM ({@link Vm.hibernate}): this VM is that VM, continued, and
   * the directory was removed unless {@link RestoreOptions.keep}.
   */
  hibernated: boolean;
}

/**
 * Lifecycle states. `paused`: vCPUs stopped, RAM as it was. `suspended`: vCPUs stopped and every
 * memory strategy's suspend hook has run (e.g. RAM offloaded). `crashed` and `stopped` are final.
 * @category VM
 */
export type VmState = 'starting' | 'running' | 'paused' | 'suspended' | 'stopped' | 'crashed';

/**
 * Events a {@link Vm} emits.
 * @category VM
 */
export interface VmEvents {
  /** The state changed. */
  state: (state: VmState, previous: VmState) => void;
  /** A line the guest printed on its serial console. */
  console: (line: string) => void;
  /** The guest crashed or misbehaved; the VM has ended (state `crashed`). */
  crash: (error: PvisorError) => void;
  /**
   * The VM ended, by {@link Vm.stop}, {@link Vm.hibernate} (`hibernatedTo` says where it went)
   * or a crash.
   */
  exit: (info: { state: 'stopped' | 'crashed'; error?: PvisorError; hibernatedTo?: string }) => void;
  /**
   * A device refused a malformed request from the guest, the agent channel carried garbage, or a
   * strategy reports a problem; the guest goes on. At most as many as
   * {@link VmOptions.warningLimit} allows (by default 20 at once, then 2 a second).
   */
  warning: (message: string) => void;
  /**
   * The lifetime ({@link VmOptions.timeoutMs}) ends in `remainingMs`: {@link Vm.setTimeout}
   * now extends it (or clears it). Once per deadline.
   */
  'timeout-warning': (info: { remainingMs: number; expiresAt: Date; onTimeout: TimeoutAction }) => void;
  /**
   * The lifetime ended and its action ({@link VmOptions.onTimeout}) was carried out, or `error`
   * says why not (the VM then goes on as it was). `hibernatedTo`: where a hibernation went.
   */
  timeout: (info: { onTimeout: TimeoutAction; error?: PvisorError; hibernatedTo?: string }) => void;
  /**
   * After {@link Vm.suspend} resolved: the memory the strategies set out to release is released
   * (`ms` after the suspend began), or `error` says why not all of it could be (what was not
   * released stays resident; the VM stays suspended and resumable). Not emitted when a resume or
   * stop came first.
   */
  released: (info: { ms: number; error?: PvisorError }) => void;
}

/**
 * Memory figures of one VM, in bytes. See {@link Vm.memoryUsage}.
 * @category VM
 */
export interface VmMemoryUsage {
  /** Guest RAM capacity. */
  capacityBytes: number;
  /** PSS of the guest RAM mapping (what the guest's pages cost the host). */
  guestRamPssBytes: number;
  /** RSS of the guest RAM mapping. */
  guestRamRssBytes: number;
  /**
   * Resident guest RAM that is still the snapshot's RAM file's (a {@link SharedSnapshot} clone's
   * pages it has only read): page cache shared with every other clone. 0 for other VMs.
   */
  guestRamSharedBytes: number;
  /**
   * Resident guest RAM that is this VM's own: what it wrote (a clone's private copies), or all of
   * its resident RAM when it is not a clone.
   */
  guestRamPrivateBytes: number;
  /** PSS of the whole host process (all its VMs, Node and pvisor itself). */
  processPssBytes: number;
  /** Number of live VMs in this process: the process's overhead is shared among them. */
  vmsInProcess: number;
  /** What each memory strategy has done, in composition order. */
  strategies: StrategyStats[];
}
