/**
 * The public `Vm`: lifecycle, options validation, events and memory figures, over the KVM backend.
 */
import { accessSync, constants as fsConstants, existsSync, fstatSync, readFileSync, rmSync, statSync } from 'node:fs';
import { handedRootfsFd } from './jail/handed-files';
import { resolve } from 'node:path';
import { EventEmitter } from 'eventemitter3';
import { checkOptionKeys, optionKeys } from './option-keys';
import { checkKvmHost, requireKernelModeGuests } from './backends/kvm/host-check';
import type { DiskConfig } from './backends/kvm/devices/virtio-blk';
import type { KvmMachine, MachineBoot } from './backends/kvm/kvm-machine';
import type { GuestMemory } from './backends/kvm/guest-memory';
import { GuestCrashError, GuestRequestError, InvalidOptionError, PvisorError, SnapshotError, TimeoutError, VmStateError, type BackingFileError, type NetworkSetupError, type StoreClaimedError, type StoreError } from './errors';
import type { GuestPtys } from './guest/pty';
import type { GuestProcessInfo } from './guest/process-registry';
import { LinuxGuest, type GuestFiles } from './guest/linux-client';
import type { GuestProcess } from './guest/guest-process';
import type { Command, ExecBufferOptions, ExecBufferResult, ExecOptions, ExecResult, GuestMemInfo, RequestTimeout, SpawnOptions } from './guest/guest-types';
import { ProbeGuest } from './guest/probe-client';
import { planSnapshotRam, refuseRestoreOnlyStrategies, type SnapshotRamFile } from './snapshot/ram-restore';
import { nativePrebuild, prebuildMismatch } from './native';
import { AgentClient, CommonOp } from './protocol/agent-client';
import type { Frame } from './protocol/frame';
import type { SnapshotReader, SnapshotState } from './snapshot/snapshot-dir';
import type { StoreOptions, StoreTransfer } from './store/store-options';
import { isStoreUrl } from './store/store-url';
import { processResident, rangeResident } from './memory-usage';
import { canLoadLazilyWith, MemoryComposition } from './memory/composition';
import { fileSharedBytes } from './guest-ram/ram-backing';
import type { MemoryStrategy } from './memory/strategy';
import { booleanOption, elapsedMs, parseTimeoutMs } from './units';
import { parseLogger, VmLog, type Logger } from './logger';
import { validateVmName } from './vm-name';
import { checkVmShape } from './vm-shape';
import type { GuestKind, HibernateInfo, HibernateOptions, RestoreInfo, RestoreOptions, RootfsOptions, SnapshotInfo, SnapshotOptions, VmEvents, VmMemoryUsage, VmOptions, VmState } from './vm-types';
import { VmHandle, type ConnectOptions } from './vm-handle';
import type { VmApi } from './vm-api';
import type { JailedVmHandle, JailedVmOptions } from './jail/jailed-vm';
import { parseWarningLimit, WarningLimiter, type WarningLimit } from './warning-limit';
import { vmBusy, vmGone, vmIdle, vmStarted } from './sys/process-pages';
import { parseEnvironment } from './guest/environment';
import { parseLabels, type Labels } from './labels';
import { Lifetime, parseLifetimeOptions, type LifetimeOptions } from './lifetime';
import { listVms, type VmListOptions, type VmListRow } from './vm-list';
import type { HostNetwork } from './network/host-network';
import { noNetwork, type VmNetwork } from './network/vm-network';
import { natOptionOf, parseNetworkOption } from './network/options';
import { ConnectionBudget, forwardPort, MAX_VM_FORWARD_CONNECTIONS, type ForwardOptions, type PortForward } from './network/port-forward';

const VM_OPTION_KEYS = optionKeys<VmOptions>({
  memory: true, vcpus: true, guest: true, kernel: true, initrd: true, kernelArgs: true, rootfs: true,
  bootTimeoutMs: true, name: true, strategies: true, warningLimit: true, network: true,
  labels: true, env: true, timeoutMs: true, onTimeout: true, hibernateDir: true, logger: true, isolation: true,
});
const ROOTFS_OPTION_KEYS = optionKeys<RootfsOptions>({ path: true, readOnly: true });
const RESTORE_OPTION_KEYS = optionKeys<RestoreOptions>({
  name: true, keep: true, strategies: true, warningLimit: true, verify: true, readyTimeoutMs: true,
  labels: true, env: true, timeoutMs: true, onTimeout: true, hibernateDir: true, logger: true, store: true,
});
const LIST_OPTION_KEYS = optionKeys<VmListOptions>({ labels: true });

/** What a VM is given besides its machine: its labels, its commands' environment, its lifetime. */
interface Sandbox {
  labels: Labels;
  env: Readonly<Record<string, string>>;
  lifetime: LifetimeOptions;
  logger: Logger | undefined;
}

/**
 * The sandbox options of a start or a restore, checked; `ownLabels`: a hibernated VM's. `guest`,
 * once known, with the words that say whose guest it is: only the Linux guest runs commands.
 */
function parseSandbox(options: VmOptions | RestoreOptions, ownLabels?: Labels, guest?: { kind: GuestKind; whose: string }): Sandbox {
  const env = parseEnvironment('env', options.env);
  if (guest && guest.kind !== 'linux' && Object.keys(env).length) throw new InvalidOptionError('env', `only the Linux guest runs commands (${guest.whose} the ${guest.kind} guest)`);
  return {
    labels: options.labels === undefined && ownLabels ? ownLabels : parseLabels('labels', options.labels),
    env,
    lifetime: parseLifetimeOptions(options),
    logger: parseLogger(options.logger),
  };
}

// Here, not with the other public types in vm-types.ts: it names the Vm class itself.
/**
 * One VM of {@link Vm.list}.
 * @category VM
 */
export interface VmListEntry extends VmListRow {
  /** The VM itself (`this-process`). */
  vm?: Vm;
}

const live = new Set<Vm>();
let vmCounter = 0;

/**
 * A virtual machine. Create one with {@link Vm.start}.
 * @category VM
 */
export class Vm extends EventEmitter<VmEvents> implements VmApi {
  /** Name given in the options, or `vm-<n>`. */
  readonly name: string;
  /** Guest RAM capacity in bytes. */
  readonly memoryBytes: number;
  /** Number of vCPUs. */
  readonly vcpus: number;
  /** The guest this VM runs. */
  readonly guest: GuestKind;
  /** Its labels ({@link VmOptions.labels}), frozen. */
  readonly labels: Labels;
  /** When {@link Vm.start} or {@link Vm.restore} was called for it. */
  readonly startedAt = new Date();
  /** Linux guest: the variables every command gets ({@link VmOptions.env}). */
  private readonly sandboxEnv: Readonly<Record<string, string>>;
  /** What the lifetime's end does, and where a hibernation goes. */
  private readonly lifetimeOptions: LifetimeOptions;
  private readonly lifetime: Lifetime;
  /** The lifetime ended in a suspend: a resume gives it again. */
  private suspendedByLifetime = false;
  /** Settles when a stop's teardown is done (deferred behind a suspend or resume at work). */
  private ended: Promise<void> | undefined;
  private _state: VmState = 'starting';
  private machine!: KvmMachine;
  private agent!: AgentClient;
  private _probe: ProbeGuest | undefined;
  private _linux: LinuxGuest | undefined;
  private hello: ((f: Frame) => void) | undefined;
  private endError: PvisorError | undefined;
  private readonly memory: MemoryComposition;
  /** A shutdown() asked the guest to end: its reboot is the VM's normal end, not a crash. */
  private shuttingDown = false;
  /** A writable rootfs is attached: ending it by a hard stop may lose what the guest has not written back. */
  private writableDisk = false;
  /** The rootfs attached, if any: a snapshot records it. */
  private rootfs: DiskConfig | undefined;
  private _restoreInfo: RestoreInfo | undefined;
  /** Set while {@link hibernate} to an `s3://` location writes its local part: where the VM goes. */
  private hibernatingToStore: string | undefined;
  /** A lazy restore from an object store: what its fetcher has moved so far. */
  private storeFetcher: { transfer(): StoreTransfer } | undefined;
  /**
   * Per RAM chunk, what this VM's RAM was last stored as in an object store or restored from: the
   * base of each page delta its next upload sends (store/upload.ts). Undefined: never stored.
   */
  private storeBases: (string | null)[] | undefined;
  private readonly warnings: WarningLimiter;
  /** Where the VM's trace goes (`logger`); silent without one. */
  private readonly log: VmLog;
  /** The host side of the guest's network, when it has one. */
  private hostNetwork: HostNetwork | undefined;
  /** Ports forwarded into the guest ({@link forward}), closed when the VM ends. */
  private readonly forwards = new Set<PortForward>();
  /** The connections all its forwards may have open at once. */
  private readonly forwardConnections = new ConnectionBudget(MAX_VM_FORWARD_CONNECTIONS);

  /** Checks the strategies' composition; allocates nothing. */
  private constructor(name: string, memoryBytes: number, vcpus: number, guest: GuestKind, strategies: readonly MemoryStrategy[], warningLimit: Required<WarningLimit>, sandbox: Sandbox) {
    super();
    this.warnings = new WarningLimiter((m) => this.emit('warning', m), warningLimit);
    this.name = name;
    this.labels = sandbox.labels;
    this.sandboxEnv = sandbox.env;
    this.lifetimeOptions = sandbox.lifetime;
    this.lifetime = new Lifetime({
      warn: (remainingMs) => this.emit('timeout-warning', { remainingMs, expiresAt: new Date(Date.now() + remainingMs), onTimeout: this.lifetimeOptions.onTimeout }),
      expire: () => void this.onLifetimeEnd(),
    });
    this.memoryBytes = memoryBytes;
    this.vcpus = vcpus;
    this.guest = guest;
    this.log = new VmLog(sandbox.logger, name);
    this.log.followEvents(this);
    this.memory = new MemoryComposition(strategies, name, {
      fail: (error) => this.failByStrategy(error),
      warn: (message) => this.warnings.warn(message),
      withGuestPaused: (work) => this.withGuestPaused(work),
      ...(this.log.enabled && { trace: (hook, strategy, ms) => this.log.write('debug', `${strategy}.${hook}`, { strategy, hook, ms: Math.round(ms * 1000) / 1000 }) }),
    });
  }

  /**
   * Validates the options, creates the VM, boots its guest and resolves once the guest agent is
   * ready. Invalid options and an unusable host reject before anything is allocated; so does a
   * key that is not an option (an {@link InvalidOptionError} naming it and the option it
   * resembles: `memroy` is not taken for `memory`).
   */
  static start(options: JailedVmOptions): Promise<JailedVmHandle>;
  static start(options?: VmOptions): Promise<Vm>;
  /**
   * With `isolation: 'process'` ({@link JailedVmOptions}): the VM runs in a jailed child process
   * (its own uid, namespaces, seccomp filter and cgroup limits; docs/security.md), and the promise
   * resolves with a {@link VmHandle} connected to it ({@link JailedVmHandle}); its `stop()` ends
   * the child. Needs root, bubblewrap and the cgroup memory, pids and cpu controllers, v2 or v1 (a {@link JailUnavailableError} otherwise).
   */
  static async start(options: VmOptions | JailedVmOptions = {}): Promise<Vm | JailedVmHandle> {
    if ((options as { isolation?: unknown }).isolation === 'process') {
      const { startJailedVm } = await import('./jail/jailed-vm');
      return startJailedVm(options as JailedVmOptions);
    }
    return Vm.startHere(options as VmOptions);
  }

  private static async startHere(options: VmOptions): Promise<Vm> {
    checkOptionKeys('Vm.start', options, VM_OPTION_KEYS);
    const isolation: unknown = options.isolation;
    if (isolation !== undefined && isolation !== 'none') throw new InvalidOptionError('isolation', `expected 'none' or 'process', got ${JSON.stringify(isolation)}`);
    const { memoryBytes, vcpus, guest } = checkVmShape(options);
    const disk = rootfsDisk(options.rootfs, guest);
    const bootTimeoutMs = options.bootTimeoutMs === undefined ? 60000 : parseTimeoutMs('bootTimeoutMs', options.bootTimeoutMs);
    const name = options.name === undefined ? `vm-${++vmCounter}` : validateVmName(options.name);
    const warningLimit = parseWarningLimit(options.warningLimit);
    const strategies = [...(options.strategies ?? [])];
    refuseRestoreOnlyStrategies(strategies);
    const sandbox = parseSandbox(options, undefined, { kind: guest, whose: 'this VM runs' });
    const network = parseNetworkOption(options.network);
    if (network.kind !== 'none' && guest !== 'linux') throw new InvalidOptionError('network', `only the Linux guest has a network device (this VM runs the ${guest} guest)`);
    if (sandbox.lifetime.onTimeout === 'hibernate' && (network.kind !== 'none' || (disk && !disk.readOnly))) {
      throw new InvalidOptionError('onTimeout', `'hibernate' needs a VM that can hibernate: no network${disk && !disk.readOnly ? ', and its rootfs read-only' : ''} (see Vm.hibernate)`);
    }
    const vm = new Vm(name, memoryBytes, vcpus, guest, strategies, warningLimit, sandbox);
    const host = checkKvmHost();
    if (guest === 'linux') requireKernelModeGuests(host, 'linux');
    const boot = guest === 'linux' ? loadLinuxGuest(options, disk) : ({ kind: 'probe', image: loadProbeImage() } as const);

    vm.writableDisk = disk !== undefined && !disk.readOnly;
    vm.rootfs = disk;
    if (network.kind !== 'none') {
      const { HostNetwork } = await import('./network/host-network');
      vm.hostNetwork = await HostNetwork.setup(network);
      if (vm.hostNetwork.kernelArg && boot.kind === 'linux') boot.cmdline = `${boot.cmdline} ${vm.hostNetwork.kernelArg}`;
    }
    try {
      await vm.boot(host.devicePath, boot, bootTimeoutMs, disk);
    } catch (e) {
      vm.releaseNetwork();
      throw e;
    }
    return vm;
  }

  private async boot(kvmPath: string, boot: MachineBoot, bootTimeoutMs: number, disk: DiskConfig | undefined): Promise<void> {
    await this.build(kvmPath, disk);
    const ready = new Promise<void>((resolve, reject) => {
      const timer = setTimeout(() => {
        this.hello = undefined;
        // Where the boot got to, in the guest's own words: a panic, or the last line before a hang.
        const said = this.machine.lastConsoleLines(3);
        reject(new TimeoutError(`the ${this.guest} guest did not become ready within ${bootTimeoutMs} ms; ` +
          (said.length ? `its console's last lines: ${said.join(' / ')}` : 'its console printed nothing')));
      }, bootTimeoutMs);
      this.hello = () => {
        clearTimeout(timer);
        this.hello = undefined;
        resolve();
      };
      this.once('exit', ({ error }) => {
        clearTimeout(timer);
        reject(error ?? new VmStateError('the VM stopped while booting'));
      });
    });
    ready.catch(() => {}); // a failure before it is awaited is thrown below
    try {
      // The guest is in RAM before the strategies take it over, as a restore's RAM is.
      this.machine.boot(boot);
      this.memory.attach(this.machine.memory);
      this.machine.start();
      await ready;
      if (this.guest === 'linux' && !this.agent.speaksStreamCredit) {
        // Its streams would be cut at their first window (the host holds no more of a stream).
        throw new GuestRequestError(
          1,
          "the guest agent does not send its output under stream credit (its HELLO lacks the feature): its initramfs was built before this pvisor's agent protocol; rebuild it with this pvisor's agent (native-prebuilds/linux-guest/build-initramfs.sh)",
        );
      }
    } catch (e) {
      await this.stop();
      throw e;
    }
    this.becomeRunning();
  }

  /**
   * Builds the machine (RAM, devices, vCPUs) and the agent client over it; nothing runs yet, and
   * the memory strategies are attached once RAM holds the guest. A machine `restoring` a snapshot
   * offers every device feature a saved guest may have negotiated.
   */
  private async build(kvmPath: string, disk: DiskConfig | undefined, restoring = false): Promise<void> {
    // Loaded here, not at the top: importing pvisor must not load native code until a VM starts.
    const { KvmMachine } = await import('./backends/kvm/kvm-machine');
    const { VhostNet } = await import('./backends/kvm/devices/vhost-net');
    const net = this.hostNetwork;
    this.agent = new AgentClient(
      (bytes) => this.machine.sendToAgent(bytes),
      (f) => this.onAgentEvent(f),
      (message) => this.warnings.warn(`agent protocol: ${message}`),
      this.log.enabled ? ({ op, call, ms, error }) => this.log.write('debug', `${call ?? `op 0x${op.toString(16)}`}${error ? `: ${error.message}` : ''}`, { op, ms, ok: !error }) : undefined,
    );
    this.machine = KvmMachine.create(
      {
        memoryBytes: this.memoryBytes,
        vcpus: this.vcpus,
        guest: this.guest,
        openRamBacking: () => this.memory.openBacking(this.memoryBytes),
        // Free page reporting is offered only when a strategy takes the reports (IdleRelease).
        freePageSink: this.memory.freePageSink,
        offerFreePageReporting: restoring || undefined,
        disk,
        ...(net && { net: { tap: net.tap, openDataPath: () => VhostNet.open(), mac: net.mac } }),
      },
      {
        onConsole: (line) => this.emit('console', line),
        onAgentData: (bytes) => this.agent.receive(bytes),
        onCrash: (error) => this.onCrash(error),
        onDeviceError: (message) => this.warnings.warn(message),
        // Strategies close before vCPU threads are joined: a userfaultfd may hold one in a fault.
        onEnding: () => this.closeStrategies(),
      },
      kvmPath,
    );
    live.add(this);
  }

  private becomeRunning(): void {
    if (this.guest === 'probe') this._probe ??= new ProbeGuest(this.agent);
    else this._linux ??= new LinuxGuest(this.agent, this.sandboxEnv);
    this.setState('running');
    this.memory.setRunning(true);
    vmStarted(this);
    if (this.lifetimeOptions.timeoutMs !== undefined) this.lifetime.set(this.lifetimeOptions.timeoutMs);
  }

  /**
   * Restores a VM from a directory {@link Vm.snapshot} wrote: the manifest and the state are
   * checked, a new machine is built, guest RAM comes into private memory, each chunk checked
   * against the manifest before the guest can see it (lazily by default, as the guest touches it:
   * see {@link RestoreOptions.verify}), and the saved state is put back. Resolves
   * with the VM running from where the snapshot was taken; the directory is not used afterwards.
   * With a {@link SharedSnapshot} among the strategies, guest RAM maps the RAM file instead
   * (checked in full first, once per process per unchanged file): clones share what they only
   * read, and the file must stay as it is while they run (deleting it is fine).
   * A snapshot that was changed, truncated or written by a newer pvisor is a {@link SnapshotError},
   * and nothing has run.
   *
   * Linux guest: the snapshot's read-only rootfs, if any, is attached read-only again, and must be
   * the same image, unchanged (else a {@link SnapshotError}). Once the machine runs, the agent is
   * told it was restored: it reseeds the guest's RNG with host entropy (clones of one snapshot
   * must not share random state) and sets its wall clock to the host's; its answer is the
   * readiness (see {@link RestoreOptions.readyTimeoutMs}), so {@link exec} works as soon as this
   * resolves. What the snapshotted VM had in flight is not this VM's: see {@link restoreInfo}.
   * A host whose KVM cannot run the Linux guest refuses it as {@link Vm.start} does.
   *
   * A snapshot of a VM with `network: 'nat'` gives each VM restored from it a network of its own,
   * with the snapshot's policy (`allow`, `subnetRange`, `dns`): a new TAP and /30 on the host,
   * set up as {@link Vm.start} does (it needs CAP_NET_ADMIN; a failure is a
   * {@link NetworkSetupError}). The guest keeps its MAC, and before this resolves its agent gives
   * `eth0` the clone's own address, gateway and resolver, so {@link network} says what the guest
   * uses and clones never share an address. Connections the snapshotted guest had open are gone
   * in the clone (their address is); servers it ran listen on. See docs/networking.md,
   * "Snapshots and clones".
   *
   * `dir` may be an object store location, `s3://bucket/prefix`, that {@link Vm.snapshot} wrote
   * (see {@link RestoreOptions.store} and docs/object-store.md): its manifest and small files are
   * fetched and checked, and the VM runs at once; each chunk of guest RAM is fetched (from the
   * host's chunk cache or the store, its SHA-256 checked before it is cached or used) when the
   * guest first touches it, and the rest are prefetched in the background once this resolves
   * ({@link RestoreInfo.storeRamLoad} `lazy`; {@link storeTransfer} says how far). A chunk that
   * fails its check, or a store that does not answer within {@link StoreOptions.requestTimeoutMs},
   * then ends the VM with a {@link StoreError} before the guest reads a byte of it. Where guest
   * RAM cannot load lazily (`verify`, a composition that cannot, a `store.client`) every chunk is
   * fetched first (`fetched`), and such a failure is thrown with nothing run.
   * A malformed manifest is a {@link StoreError} either way.
   *
   * A VM hibernated there ({@link hibernate} of an `s3://` location) is continued at most once:
   * the restore claims it in the store before any of its RAM is fetched, and a VM another restore
   * claimed is a {@link StoreClaimedError} naming who and when (see
   * {@link StoreOptions.takeOverClaim} for a claimant that died before its VM ran). With a
   * {@link SharedSnapshot} among the strategies the snapshot is assembled once per host, in the
   * cache's `snapshots/`, and every such clone on the host, in any process that uses the same
   * cache, maps that one RAM file (`restoreInfo.store.sharedEntry` says whether this restore
   * found it there); a cache entry that another user could change is a {@link SnapshotError}.
   */
  static async restore(dir: string, options: RestoreOptions = {}): Promise<Vm> {
    const t0 = performance.now();
    checkOptionKeys('Vm.restore', options, RESTORE_OPTION_KEYS);
    const givenName = options.name === undefined ? undefined : validateVmName(options.name);
    const readyTimeoutMs = options.readyTimeoutMs === undefined ? 60000 : parseTimeoutMs('readyTimeoutMs', options.readyTimeoutMs);
    const warningLimit = parseWarningLimit(options.warningLimit);
    const verify = booleanOption('verify', options.verify, false);
    const keep = booleanOption('keep', options.keep, false);
    parseSandbox(options); // checked before the snapshot is opened; again below with its labels
    if (isStoreUrl(dir)) return Vm.restoreFromStore(dir, options, t0, { givenName, readyTimeoutMs, warningLimit, verify });
    const { SnapshotReader } = await import('./snapshot/snapshot-dir');
    const snapshot = SnapshotReader.open(dir);
    try {
      const { state } = snapshot;
      const name = givenName ?? state.hibernated?.name ?? `vm-${++vmCounter}`;
      const sandbox = parseSandbox(options, state.hibernated?.labels, { kind: state.guest, whose: 'the snapshot is of' });
      if (!state.hibernated) return await Vm.restoreFrom(snapshot, name, t0, { readyTimeoutMs, warningLimit, verify, strategies: options.strategies, sandbox });
      // A hibernated VM continues in one process: the restore claims it, and consumes it once done.
      const { claimHibernatedDir } = await import('./snapshot/hibernation-dir');
      const release = claimHibernatedDir(dir);
      let vm: Vm;
      try {
        vm = await Vm.restoreFrom(snapshot, name, t0, { readyTimeoutMs, warningLimit, verify, strategies: options.strategies, sandbox });
      } catch (e) {
        release();
        throw e;
      }
      vm._restoreInfo!.hibernated = true;
      if (keep) release();
      else {
        // A lazy load reads from a descriptor of its own: the RAM file lives until it is done.
        try {
          rmSync(dir, { recursive: true, force: true });
        } catch (e) {
          vm.warnings.warn(`the hibernated VM's directory ${dir} could not be removed after its restore: ${(e as Error).message}`);
        }
      }
      return vm;
    } finally {
      // Its RAM file is read, loaded from a duplicate, or mapped through one by now.
      snapshot.close();
    }
  }

  /**
   * {@link restore} of an `s3://` location: lazily where guest RAM can load through userfaultfd
   * (store/lazy-ram.ts: the VM runs once the small files are here, chunks come on first touch,
   * the rest is prefetched once it is ready); otherwise fetched whole into the chunk cache and
   * restored from there (`verify`, a SharedSnapshot clone, a composition that cannot load lazily,
   * a client given as `store.client`: store/hibernate-store.ts). A hibernated VM is claimed
   * first either way. `restoreInfo.storeRamLoad` says which.
   */
  private static async restoreFromStore(
    url: string,
    options: RestoreOptions,
    t0: number,
    checked: { givenName?: string; readyTimeoutMs: number; warningLimit: Required<WarningLimit>; verify: boolean },
  ): Promise<Vm> {
    const { store, ...local } = options;
    const strategies = options.strategies ?? [];
    const { canRestoreLazily, LazyStoreSnapshot } = await import('./store/lazy-ram');
    const { SharedSnapshot } = await import('./memory/strategies/shared-snapshot');
    const lazyOk = canRestoreLazily({ verify: checked.verify, sharedSnapshot: strategies.some((s) => s instanceof SharedSnapshot), compositionLoadsLazily: canLoadLazilyWith(strategies), store });
    const fetchWhole = async (): Promise<Vm> => {
      const { restoreFromStore } = await import('./store/hibernate-store');
      const shared = strategies.some((s) => s instanceof SharedSnapshot);
      const r = await restoreFromStore(url, store, (dir) => Vm.restore(dir, local), shared);
      const vm = r.restored;
      vm._restoreInfo = { ...vm._restoreInfo!, dir: url, readyMs: elapsedMs(t0), store: r.transfer, storeRamLoad: 'fetched' };
      vm.storeBases = r.bases;
      if (r.claimWarning) vm.warnings.warn(r.claimWarning);
      return vm;
    };
    if (!lazyOk) return fetchWhole();
    // A hibernated VM is claimed before any of its RAM is fetched, then loads lazily as any snapshot.
    const lazy = await LazyStoreSnapshot.open(url, store, { claimHibernated: true });
    if (lazy === 'hibernated') return fetchWhole();
    let vm: Vm;
    try {
      const { state } = lazy.reader;
      // A hibernated VM keeps its own name and labels, as from a directory.
      const name = checked.givenName ?? state.hibernated?.name ?? `vm-${++vmCounter}`;
      const sandbox = parseSandbox(options, state.hibernated?.labels, { kind: state.guest, whose: 'the snapshot is of' });
      vm = await Vm.restoreFrom(lazy.reader, name, t0, { ...checked, strategies, sandbox, ramFile: lazy.ramFile });
    } catch (e) {
      await lazy.claim?.release().catch(() => false);
      lazy.close();
      throw e;
    } finally {
      // The server and the fetcher hold the scratch RAM file open; nothing else of it is needed.
      lazy.removeDir();
    }
    vm._restoreInfo = { ...vm._restoreInfo!, dir: url, readyMs: elapsedMs(t0), store: lazy.transfer(), storeRamLoad: 'lazy', hibernated: lazy.claim !== undefined };
    vm.storeFetcher = lazy;
    vm.storeBases = lazy.bases;
    lazy.startPrefetch();
    if (lazy.claim) {
      const warning = await lazy.claim.markResumed();
      if (warning) vm.warnings.warn(warning);
    }
    return vm;
  }

  private static async restoreFrom(
    snapshot: SnapshotReader,
    name: string,
    t0: number,
    options: { readyTimeoutMs: number; warningLimit: Required<WarningLimit>; verify: boolean; strategies?: readonly MemoryStrategy[]; sandbox: Sandbox; ramFile?: SnapshotRamFile<GuestMemory> },
  ): Promise<Vm> {
    const { readyTimeoutMs, warningLimit, verify } = options;
    const { state, dir } = snapshot;
    const strategies = [...(options.strategies ?? [])];
    // Before the composition is planned: the RAM file may be guest RAM's backing.
    const ramPlan = planSnapshotRam(strategies, options.ramFile ?? snapshot, { verify });
    const vm = new Vm(name, state.memoryBytes, state.vcpus, state.guest, strategies, warningLimit, options.sandbox);
    const host = checkKvmHost();
    if (state.guest === 'linux') requireKernelModeGuests(host, 'linux');
    const disk = state.rootfs && { path: state.rootfs.path, readOnly: true };
    vm.rootfs = disk;
    if (state.network) {
      // A network of its own, with the snapshot's policy and MAC (docs/networking.md, "Snapshots and clones").
      const { HostNetwork } = await import('./network/host-network');
      const { parseMac } = await import('./network/addresses');
      const plan = parseNetworkOption(state.network.option);
      if (plan.kind !== 'nat') throw new SnapshotError("snapshot.network.option: only a 'nat' network is restored");
      vm.hostNetwork = await HostNetwork.setup(plan, { mac: parseMac(state.network.mac) });
    }
    try {
      await vm.build(host.devicePath, disk, true);
    } catch (e) {
      vm.releaseNetwork();
      if (disk && e instanceof InvalidOptionError) throw new SnapshotError(`the snapshot's rootfs cannot be attached again: ${e.message}`, { cause: e });
      throw e;
    }
    let report = { detachedProcesses: 0, endedRequests: 0 };
    const phases = { ramMs: 0, agentMs: 0 };
    let ramLoad: RestoreInfo['ramLoad'] = 'read';
    try {
      const tRam = performance.now();
      ramLoad = await ramPlan.load(vm.memory, vm.machine.memory);
      phases.ramMs = elapsedMs(tRam);
      vm.agent.restoreState(state.agent, 'snapshot.agent');
      if (state.guest === 'probe') (vm._probe = new ProbeGuest(vm.agent)).restoreState(state.guestClient, 'snapshot.guestClient');
      else vm._linux = new LinuxGuest(vm.agent, vm.sandboxEnv);
      await vm.machine.restoreSaved({ machine: state.machine, devices: state.devices });
      if (vm.memory.freePageSink && !vm.machine.freePageReportingActive) {
        throw new InvalidOptionError('strategies', "the snapshot's guest did not set up free page reporting (its VM ran without IdleRelease), so its clones cannot report freed pages: snapshot a VM started with IdleRelease");
      }
      const tResume = performance.now();
      vm.machine.resume();
      // A crash meanwhile closes the agent client, which rejects this at once.
      if (vm._linux) report = await vm._linux.restored({ timeoutMs: readyTimeoutMs });
      const netConfig = vm.hostNetwork?.guestConfig;
      if (vm._linux && netConfig) await vm._linux.configureNetwork(netConfig, { timeoutMs: readyTimeoutMs });
      phases.agentMs = elapsedMs(tResume);
      // It may have ended meanwhile (a chunk of a lazy load failed its check).
      if (vm.endError) throw vm.endError;
    } catch (e) {
      await vm.stop();
      throw e;
    }
    vm._restoreInfo = { dir, readyMs: elapsedMs(t0), ...phases, ramLoad, inFlightRequests: vm.agent.inFlightAtSnapshot, ...report, hibernated: false };
    vm.becomeRunning();
    return vm;
  }

  /** How this VM came from a snapshot ({@link Vm.restore}); undefined for a VM that was started. */
  get restoreInfo(): RestoreInfo | undefined {
    return this._restoreInfo;
  }

  /**
   * For a VM restored from an `s3://` location: what has been fetched from the object store so far.
   * After a lazy restore ({@link RestoreInfo.storeRamLoad} `lazy`) it grows as the guest touches
   * RAM and as the rest is prefetched in the background; {@link RestoreInfo.store} is the same
   * figure when the restore resolved. Undefined for any other VM.
   */
  get storeTransfer(): StoreTransfer | undefined {
    return this.storeFetcher?.transfer() ?? this._restoreInfo?.store;
  }

  /**
   * Writes a snapshot of this VM into `dir` (created, or empty): guest RAM as a sparse file, the
   * machine's state (vCPUs, VM, devices, agent channel, options, guest kind) and a manifest with
   * a CRC32C per RAM chunk and of the state; the files are made read-only. A running VM is paused
   * for it and resumed after, unless {@link SnapshotOptions.leavePaused}. Requests in flight on
   * the agent channel go on in this VM; a VM restored from the snapshot does not answer to them.
   *
   * Linux guest: the guest's files in its initramfs (and in `/tmp`) are in RAM, so each clone has
   * its own. A rootfs must be attached read-only ({@link RootfsOptions.readOnly}): every clone
   * then shares the image, read-only, with its own writes in RAM (its `/tmp`). A VM with a
   * writable rootfs is refused with a {@link SnapshotError} before it is paused: its image goes
   * on changing after the snapshot, under the clones' feet.
   *
   * Network: a VM with `network: 'nat'` can be snapshotted; each clone gets its own TAP and address
   * (see {@link Vm.restore}). One on the user's TAP (`{ tap }`) is refused with a
   * {@link SnapshotError} before it is paused: its clones would each need a TAP of their own.
   *
   * A state larger than a restore reads (4 MiB of JSON: only bytes in flight on the agent
   * channel, requests the guest has not taken yet, make it that large) is refused with a
   * {@link SnapshotError} before anything is written, and the VM runs on.
   *
   * `dir` may be an object store location, `s3://bucket/prefix` (a prefix with no snapshot yet):
   * the snapshot is written into a work directory of the chunk cache (the VM is paused only for
   * that), then sent while the VM runs on: guest RAM as 2 MiB chunks named by their SHA-256, each
   * sent only if the bucket lacks it (so a child of a template sends only what it changed), all-zero
   * chunks not at all, and the manifest last, so that a half-sent snapshot is never restored. The
   * client comes from the standard AWS environment (see {@link SnapshotOptions.store}); a store
   * that fails or does not answer is a {@link StoreError}. See docs/object-store.md.
   */
  snapshot(dir: string, options: SnapshotOptions = {}): Promise<SnapshotInfo> {
    if (isStoreUrl(dir)) return this.snapshotToStore(dir, options);
    return this.transition(async () => {
      const t0 = performance.now();
      this.requireState('running', 'paused');
      this.refuseUnsavable('a snapshot');
      const wasRunning = await this.pauseForSaving('snapshot');
      try {
        const { writeSnapshot } = await import('./snapshot/snapshot-dir');
        const written = writeSnapshot(dir, this.machine.memory, await this.captureSnapshotState());
        return { dir, ramDataPageCount: written.ramDataPageCount, ms: elapsedMs(t0) };
      } finally {
        if (wasRunning && !options.leavePaused && this._state === 'paused') this.resumeAfterSaving();
      }
    });
  }

  /** {@link snapshot} to an `s3://` location: written locally (the pause), then sent while the VM runs on. */
  private async snapshotToStore(url: string, options: SnapshotOptions): Promise<SnapshotInfo> {
    const t0 = performance.now();
    const { snapshotToStore } = await import('./store/snapshot-store');
    const { store, ...local } = options;
    // A VM restored lazily records the order its guest touched RAM in: a restore of this snapshot prefetches in it.
    // Its RAM as last stored or restored: the child sends page deltas against it.
    const { written, transfer, bases } = await snapshotToStore(url, store, (dir) => this.snapshot(dir, local), () => this.memory.lazyTouchOrder(), this.storeBases);
    this.storeBases = bases;
    return { ...written, dir: url, ms: elapsedMs(t0), store: transfer };
  }

  /**
   * Moves this VM out of its process into `dir` (created 0700, or an empty directory of this
   * user) and ends it: a {@link snapshot} whose files are 0400 and synced, marked as this VM's
   * (its name), followed at once by a {@link stop} that frees all of its memory. {@link Vm.restore}
   * of `dir` brings it back, in this process or another: the same VM, under the same name, going
   * on from where it was; that restore consumes the directory (see {@link RestoreOptions.keep}),
   * and a second restore of it is refused while the first runs.
   *
   * What was in flight here ends here: requests to the guest pending now reject as after a
   * {@link stop}, while the guest, once restored, still carries them out (their answers are
   * dropped with a `warning`). In the Linux guest, processes started from this process (exec,
   * spawn, forwarded connections) keep running after the restore, detached: their stdin closed,
   * their output dropped (docs/agent-protocol.md, RESTORED).
   *
   * Needs the VM running or paused (a suspended VM's RAM is offloaded: resume it first), and what
   * a snapshot needs: no writable rootfs, no user TAP (`network: 'nat'` is fine: the restored VM
   * gets a new TAP and address, see {@link Vm.restore}). If writing fails (a full disk), or
   * {@link HibernateOptions.beforeStop} throws, what was written is removed and the VM goes on as
   * it was.
   *
   * `dir` may be an object store location, `s3://bucket/prefix` (a new prefix): the hibernation
   * is written into a work directory of the chunk cache and sent, as {@link snapshot} sends one,
   * while the VM is still paused; only then does the VM end, and `Vm.restore(url)` on any host
   * continues it, once (the first restore claims it in the store). A failed upload leaves the VM
   * going on here, its hibernation withdrawn in the store so that nobody resumes it. See
   * {@link HibernateOptions.store} and docs/object-store.md, "Hibernated VMs in a store".
   */
  hibernate(dir: string, options: HibernateOptions = {}): Promise<HibernateInfo> {
    if (isStoreUrl(dir)) return this.hibernateToStore(dir, options);
    return this.transition(async () => {
      const t0 = performance.now();
      this.requireState('running', 'paused');
      this.refuseUnsavable('hibernation');
      const { prepareHibernationDir, clearHibernationDir, syncDir, diskUsageBytes } = await import('./snapshot/hibernation-dir');
      const { writeSnapshot } = await import('./snapshot/snapshot-dir');
      const { created } = prepareHibernationDir(dir);
      let wasRunning = false;
      let info: HibernateInfo;
      try {
        wasRunning = await this.pauseForSaving('hibernate');
        const labels = Object.keys(this.labels).length ? { labels: this.labels } : {};
        const state: SnapshotState = { ...(await this.captureSnapshotState()), hibernated: { name: this.name, ...labels } };
        const written = writeSnapshot(dir, this.machine.memory, state, { fileMode: 0o400 });
        syncDir(dir);
        this.checkNotEnded('hibernate');
        info = { dir, ramDataPageCount: written.ramDataPageCount, bytesOnDisk: diskUsageBytes(dir), ms: elapsedMs(t0) };
        await options.beforeStop?.(info);
      } catch (e) {
        clearHibernationDir(dir, created);
        if (wasRunning && this._state === 'paused') this.resumeAfterSaving();
        throw e;
      }
      // From here the directory is the VM (a crash meanwhile ended a machine already saved).
      await this.end({ hibernatedTo: this.hibernatingToStore ?? dir });
      return info;
    });
  }

  /** {@link hibernate} to an `s3://` location: written locally, sent while paused, then the VM ends. */
  private async hibernateToStore(url: string, options: HibernateOptions): Promise<HibernateInfo> {
    const t0 = performance.now();
    const { hibernateToStore } = await import('./store/hibernate-store');
    const info = await hibernateToStore(url, options.store, options.beforeStop, async (dir, beforeStop) => {
      // The exit event says where the VM went: the store, not the work directory it passed through.
      this.hibernatingToStore = url;
      try {
        return await this.hibernate(dir, { beforeStop });
      } finally {
        this.hibernatingToStore = undefined;
      }
    }, this.storeBases);
    return { ...info, ms: elapsedMs(t0) };
  }

  /** What a snapshot cannot hold, refused before the VM is paused. */
  private refuseUnsavable(what: string): void {
    if (this.rootfs && !this.rootfs.readOnly) {
      // A hibernated VM is restored once, but its image could still change under it while it has
      // no process; a snapshot records a disk only as read-only, the one kind nothing changes.
      const why = what === 'a snapshot' ? 'since the image goes on changing after the snapshot and every clone would mount it' : 'since a snapshot, which it writes, records a disk only as read-only, so that nothing can change it before the restore';
      throw new SnapshotError(
        `${this.name} has its rootfs ${this.rootfs.path} attached read-write: ${what} needs it read-only, ${why}. ` +
          'Start the VM with rootfs: { path, readOnly: true } (the guest then writes to its /tmp, in RAM).',
      );
    }
    if (this.hostNetwork && this.hostNetwork.plan.kind !== 'nat') {
      throw new SnapshotError(
        `${this.name} has its network on the user's TAP ${this.hostNetwork.info.tap}: ${what} of it is not supported, since each VM restored from it would need a TAP of its own; ` +
          "start it with network: 'nat', whose clones each get their own TAP and address, or 'none'",
      );
    }
  }

  /** Pauses a running VM for its state to be saved; says whether it was running. */
  private async pauseForSaving(what: string): Promise<boolean> {
    if (this._state !== 'running') return false;
    this.memory.setRunning(false);
    await this.machine.pause();
    this.checkNotEnded(what);
    this.setState('paused');
    return true;
  }

  private resumeAfterSaving(): void {
    this.machine.resume();
    this.setState('running');
    this.memory.setRunning(true);
    vmStarted(this);
  }

  /** Everything a snapshot holds besides RAM; the guest is paused. */
  private async captureSnapshotState(): Promise<SnapshotState> {
    return {
      version: 1,
      guest: this.guest,
      memoryBytes: this.memoryBytes,
      vcpus: this.vcpus,
      ...(this.rootfs && { rootfs: { path: this.rootfs.path, readOnly: true } }),
      ...(this.hostNetwork?.plan.kind === 'nat' && { network: { mac: this.hostNetwork.info.mac!, option: natOptionOf(this.hostNetwork.plan) } }),
      machine: await this.machine.captureState(),
      devices: this.machine.captureDevices(),
      agent: this.agent.saveState(),
      // The Linux client keeps nothing of its own: its processes are this VM's alone.
      guestClient: this._probe?.saveState() ?? null,
    };
  }

  private onAgentEvent(f: Frame): void {
    if (f.op === CommonOp.Hello) this.hello?.(f);
  }

  /** A strategy cannot go on: the VM ends as if the guest had crashed. */
  private failByStrategy(error: PvisorError): void {
    if (this._state === 'stopped' || this._state === 'crashed') return;
    this.machine.stop();
    this.onCrash(error);
  }

  private onCrash(error: PvisorError): void {
    this.lifetime.clear();
    if (this.shuttingDown && error instanceof GuestCrashError && error.reason === 'shutdown') {
      live.delete(this);
      this.closeStrategies();
      this.releaseNetwork();
      this.agent.close();
      this.setState('stopped');
      this.emit('exit', { state: 'stopped' });
      return;
    }
    this.endError = error;
    live.delete(this);
    this.closeStrategies();
    this.releaseNetwork();
    this.agent.close(error);
    this.setState('crashed');
    this.emit('crash', error);
    this.emit('exit', { state: 'crashed', error });
  }

  private setState(state: VmState): void {
    const previous = this._state;
    if (previous === state) return;
    this._state = state;
    if (state === 'stopped' || state === 'crashed') vmGone(this);
    else if (state !== 'suspended') vmBusy(this);
    this.emit('state', state, previous);
  }

  /** The current lifecycle state. */
  get state(): VmState {
    return this._state;
  }

  /** The error that ended a crashed VM. */
  get error(): PvisorError | undefined {
    return this.endError;
  }

  /** The probe guest's operations. Throws {@link VmStateError} on another guest. */
  get probe(): ProbeGuest {
    if (!this._probe) throw new VmStateError(`vm.probe needs guest: "probe" (this VM runs ${this.guest})`);
    return this._probe;
  }

  private get linuxGuest(): LinuxGuest {
    if (!this._linux) throw new VmStateError(`this needs guest: "linux" (this VM runs ${this.guest})`);
    return this._linux;
  }

  /**
   * Runs a command in the Linux guest to its end: a string runs under `/bin/sh -c`, an array is
   * the argv. Resolves with its exit status and output; several may run at once.
   */
  exec(command: Command, options: ExecBufferOptions): Promise<ExecBufferResult>;
  exec(command: Command, options?: ExecOptions): Promise<ExecResult>;
  exec(command: Command, options?: ExecOptions | ExecBufferOptions): Promise<ExecResult | ExecBufferResult> {
    // The overloads above give the result its type; LinuxGuest.exec serves both encodings.
    return this.linuxGuest.exec(command, options as ExecOptions);
  }

  /**
   * Starts a command in the Linux guest; its output streams, stdin can be written, it can be
   * killed. `timeoutMs` and `signal` kill it and reject its `exited` ({@link SpawnOptions}).
   */
  spawn(command: Command, options?: SpawnOptions): GuestProcess {
    return this.linuxGuest.spawn(command, options);
  }

  /**
   * Files of the Linux guest: read, write (whole or streamed), list, stat, mkdir, remove, rename;
   * each call takes `timeoutMs` and an AbortSignal.
   */
  get files(): GuestFiles {
    return this.linuxGuest.files;
  }

  /**
   * The processes {@link spawn} started in the Linux guest that this VM still has: each running
   * one, and the last 64 ended ones whose output was kept (`stdout: { keep }`), with pid, command
   * and state.
   */
  processes(): GuestProcessInfo[] {
    return this.linuxGuest.processes();
  }

  /**
   * The spawned process of guest pid `pid` that {@link processes} lists (undefined if none): the
   * same {@link GuestProcess}, to follow its kept output ({@link GuestProcess.output}), signal it,
   * write to it or await its end.
   */
  process(pid: number): GuestProcess | undefined {
    return this.linuxGuest.process(pid);
  }

  /**
   * Terminals of the Linux guest: `vm.pty.create({ cols, rows, cmd })` runs a command on a new
   * pseudo-terminal, with its output, input, `resize` and `kill` ({@link GuestPtys}).
   */
  get pty(): GuestPtys {
    return this.linuxGuest.pty;
  }

  /** The Linux guest's own memory figures (/proc/meminfo). */
  guestMemInfo(options?: RequestTimeout): Promise<GuestMemInfo> {
    return this.linuxGuest.memInfo(options);
  }

  private requireState(...states: VmState[]): void {
    if (!states.includes(this._state)) {
      throw new VmStateError(`${this.name} is ${this._state}${this.endError ? ` (${this.endError.message})` : ''}; this needs it ${states.join(' or ')}`);
    }
  }

  /**
   * Runs pause, suspend and resume one at a time (the CLI's control socket and a script may ask
   * at once): each starts from the state the previous one left.
   */
  private inTransition = false;
  private lifecycle: Promise<void> = Promise.resolve();
  private transition<T>(op: () => Promise<T>): Promise<T> {
    const run = this.lifecycle.then(async () => {
      this.inTransition = true;
      try {
        return await op();
      } finally {
        this.inTransition = false;
      }
    });
    this.lifecycle = run.then(() => {}, () => {});
    return run;
  }

  /**
   * A strategy's brief pause (see StrategyContext.withGuestPaused). It takes no part in the
   * transitions' queue: a suspend waits for running ticks, so a tick waiting for the queue would
   * wait for itself. Instead, a transition that starts meanwhile takes the pause over: it pauses
   * the machine itself (already paused, at once), and the vCPUs run again only when it says so.
   */
  private async withGuestPaused<T>(work: () => T): Promise<T | undefined> {
    if (this._state === 'paused' || this._state === 'suspended') return this.inTransition ? undefined : work();
    if (this._state !== 'running' || this.inTransition) return undefined;
    await this.machine.pause();
    if (this._state !== 'running' && this._state !== 'paused' && this._state !== 'suspended') return undefined;
    try {
      return work();
    } finally {
      if (this._state === 'running' && !this.inTransition) this.machine.resume();
    }
  }

  /** After an await inside a transition: the VM may have been stopped meanwhile. */
  private checkNotEnded(what: string): void {
    if (this._state === 'stopped' || this._state === 'crashed') throw new VmStateError(`${this.name} was ${this._state} during ${what}`);
  }

  /** Stops every vCPU; guest memory stays as it is. Requests wait until {@link resume}. */
  pause(): Promise<void> {
    return this.transition(async () => {
      this.requireState('running');
      this.memory.setRunning(false);
      await this.machine.pause();
      this.checkNotEnded('pause');
      this.setState('paused');
    });
  }

  /**
   * Stops every vCPU, then lets each memory strategy act on the idle RAM in composition order
   * (Offload starts writing it out). Resolves as soon as the VM is suspended: every vCPU has
   * stopped and every strategy's work is safely under way; memory is then released progressively,
   * which {@link memoryReleased} and the `released` event tell. Undo it with {@link resume}, which
   * may come before the release has ended (what is still resident stays).
   */
  suspend(): Promise<void> {
    return this.transition(async () => {
      this.requireState('running', 'paused');
      const t0 = performance.now();
      const wasRunning = this._state === 'running';
      this.memory.setRunning(false);
      if (wasRunning) await this.machine.pause();
      try {
        await this.memory.suspend(() => this.checkNotEnded('suspend'));
      } catch (e) {
        if (wasRunning && this._state === 'running') {
          this.machine.resume();
          this.memory.setRunning(true);
        }
        throw e;
      }
      this.setState('suspended');
      const resumes = this.resumeCount;
      const released = (error?: PvisorError) => {
        if (this.resumeCount !== resumes || this._state !== 'suspended') return;
        this.emit('released', error ? { ms: elapsedMs(t0), error } : { ms: elapsedMs(t0) });
        vmIdle(this);
      };
      this.memory.memoryReleased().then(() => released(), released);
    });
  }

  /** Counts resumes, so that a release that ends after a resume says nothing. */
  private resumeCount = 0;

  /**
   * Settles when the memory the last {@link suspend} set out to release is released: at once if
   * there is none pending (or the VM is not suspended). Rejects with why a strategy could not
   * release all of it (e.g. a {@link BackingFileError} for a full disk); the VM then stays
   * suspended with those pages resident, and resumes as usual.
   */
  memoryReleased(): Promise<void> {
    if (this._state !== 'suspended') return Promise.resolve();
    return this.memory.memoryReleased();
  }

  /**
   * Lets a paused or suspended VM run again. From `suspended`, every strategy first brings back
   * and verifies what it took (in reverse order), cancelling a release still in progress; if one
   * fails, the VM stays suspended and the error (e.g. a {@link BackingFileError}) is thrown.
   */
  resume(): Promise<void> {
    return this.transition(async () => {
      this.requireState('paused', 'suspended');
      if (this._state === 'suspended') {
        this.resumeCount++;
        await this.memory.resume(() => this.checkNotEnded('resume'));
      }
      this.machine.resume();
      this.setState('running');
      this.memory.setRunning(true);
      if (this.suspendedByLifetime) {
        this.suspendedByLifetime = false;
        this.lifetime.set(this.lifetime.lastLifetimeMs!);
      }
    });
  }

  /**
   * Sets the VM's lifetime to end `ms` from now (extending or shortening it), with the action of
   * {@link VmOptions.onTimeout}; `null` clears it (no limit). Works on a VM started without
   * `timeoutMs` too. The `timeout-warning` event comes again before the new deadline.
   */
  setTimeout(ms: number | null): void {
    this.requireState('running', 'paused', 'suspended');
    this.suspendedByLifetime = false;
    if (ms === null) this.lifetime.clear();
    else this.lifetime.set(ms);
  }

  /** When the lifetime ends ({@link VmOptions.timeoutMs}, {@link setTimeout}); undefined when it has no limit. */
  get expiresAt(): Date | undefined {
    const at = this.lifetime.expiresAtMs;
    return at === undefined ? undefined : new Date(at);
  }

  /** The lifetime has ended: its action, then the `timeout` event. */
  private async onLifetimeEnd(): Promise<void> {
    const { onTimeout, hibernateDir } = this.lifetimeOptions;
    let error: PvisorError | undefined;
    let hibernatedTo: string | undefined;
    try {
      if (onTimeout === 'stop') await this.stop();
      else if (onTimeout === 'suspend') {
        if (this._state === 'running' || this._state === 'paused') await this.suspend();
        this.suspendedByLifetime = this._state === 'suspended';
      } else {
        // Its RAM is offloaded: back first, for the hibernation to write it.
        if (this._state === 'suspended') await this.resume();
        await this.hibernate(hibernateDir!);
        hibernatedTo = hibernateDir;
      }
    } catch (e) {
      error = e instanceof PvisorError ? e : new PvisorError('PVISOR_INTERNAL', e instanceof Error ? e.message : String(e), { cause: e });
      this.warnings.warn(`the lifetime ended, and its ${onTimeout} failed: ${error.message}`);
    }
    this.emit('timeout', { onTimeout, ...(error && { error }), ...(hibernatedTo !== undefined && { hibernatedTo }) });
  }

  /**
   * Stops the VM and frees everything it holds: the guest gets no say, so writes a writable
   * rootfs has not written back yet are lost ({@link shutdown} ends it cleanly first). The VM is
   * `stopped` (and its `exit` emitted) at once; resolves once its memory, vCPUs, devices and
   * network are freed, which during a suspend or resume waits for the strategy at work to return
   * (it may be reading guest RAM). Safe to call more than once: each call resolves when that is done.
   */
  stop(): Promise<void> {
    return this.end({ deferTeardown: this.inTransition });
  }

  /**
   * Ends the VM: {@link stop}'s work. During a suspend or resume (`deferTeardown`) guest RAM is
   * freed when the strategy at work returns; a hibernation ends it from inside its own
   * transition, where no strategy is at work, and frees everything at once.
   */
  private end(how: { deferTeardown?: boolean; hibernatedTo?: string }): Promise<void> {
    if (this._state === 'stopped' || this._state === 'crashed') return this.ended ?? Promise.resolve();
    live.delete(this);
    this.lifetime.clear();
    this.agent?.close();
    this.setState('stopped');
    const teardown = () => {
      this.machine?.stop();
      this.closeStrategies();
      this.releaseNetwork();
    };
    if (how.deferTeardown) this.ended = this.lifecycle.then(teardown);
    else {
      try {
        teardown();
        this.ended = Promise.resolve();
      } catch (e) {
        this.ended = Promise.reject(e as Error);
      }
    }
    this.emit('exit', { state: 'stopped', ...(how.hibernatedTo !== undefined && { hibernatedTo: how.hibernatedTo }) });
    return this.ended;
  }

  private closeStrategies(): void {
    this.memory.close();
  }

  /**
   * Linux guest: listens on the host (127.0.0.1, a free port unless `hostPort` is given) and
   * relays each connection to TCP port `guestPort` inside the guest, through the agent channel:
   * no network device is needed (`network: 'none'` works). Each connection runs `nc 127.0.0.1
   * PORT` in the guest (busybox's, in the shipped initramfs; a rootfs needs its own `nc`). The
   * listener closes when the VM ends, or with the returned `close()`. A connection stays open
   * until the guest's side has ended and all it sent has reached the peer. At most
   * `maxConnections` (default 64) are open per forward and 256 in all the forwards of this VM;
   * one more is closed at once, with a `warning`.
   */
  async forward(guestPort: number, options?: ForwardOptions): Promise<PortForward> {
    this.requireState('running', 'paused', 'suspended');
    const guest = this.linuxGuest;
    const f = await forwardPort((command, spawnOptions) => guest.spawn(command, spawnOptions), guestPort, options, {
      vmConnections: this.forwardConnections,
      onRefused: (message) => this.warnings.warn(message),
    });
    const close = f.close;
    const tracked: PortForward = { ...f, close: () => (this.forwards.delete(tracked), close()) };
    this.forwards.add(tracked);
    return tracked;
  }

  /** Removes the host side of the network (after the machine, whose vhost uses the TAP, stopped). */
  private releaseNetwork(): void {
    for (const f of [...this.forwards]) void f.close();
    const problem = this.hostNetwork?.close();
    if (problem) this.emit('warning', `network teardown: ${problem}`);
  }

  /**
   * The guest's network: `{ mode: 'none' }`, or its TAP, addresses, MAC, resolver and policy
   * (see {@link VmOptions.network}), as they are when read; `vm.network.update({ allow, deny })`
   * replaces a `'nat'` VM's egress rules while it runs ({@link VmNetwork.update}).
   */
  get network(): VmNetwork {
    return this.hostNetwork?.view() ?? noNetwork();
  }

  /**
   * Ends a running Linux guest cleanly, then frees everything as {@link stop} does: the agent
   * stops every process, remounts a writable {@link VmOptions.rootfs} read-only (so all that was
   * written reaches the image, which then needs no journal replay) and reboots, which ends the VM.
   * A guest that has not ended after `timeoutMs` (default 10000), a probe guest, and a VM that is
   * not running are stopped at once instead. Resolves once the VM is stopped.
   */
  async shutdown(options: { timeoutMs?: number } = {}): Promise<void> {
    const timeoutMs = options.timeoutMs === undefined ? 10_000 : parseTimeoutMs('timeoutMs', options.timeoutMs);
    if (this._state === 'stopped' || this._state === 'crashed') return;
    if (this.guest !== 'linux' || this._state !== 'running' || this.inTransition) return await this.stop();
    this.shuttingDown = true;
    const ended = new Promise<void>((resolve) => this.once('exit', () => resolve()));
    let timer: NodeJS.Timeout | undefined;
    const timeout = new Promise<void>((resolve) => (timer = setTimeout(resolve, timeoutMs)));
    // The guest may end before its answer leaves: the VM's end is what counts.
    this.linuxGuest.shutdown().catch(() => {});
    await Promise.race([ended, timeout]);
    clearTimeout(timer);
    await this.stop();
  }

  /**
   * `await using vm = await Vm.start(...)` ends the VM at the end of the scope: {@link shutdown}
   * when a writable rootfs is attached, else {@link stop}.
   */
  async [Symbol.asyncDispose](): Promise<void> {
    if (this.writableDisk) await this.shutdown();
    else await this.stop();
  }

  /**
   * Memory figures: PSS of guest RAM (from /proc/self/smaps) and of the whole process. Several VMs
   * in one process share its overhead; `vmsInProcess` says how many.
   */
  memoryUsage(): VmMemoryUsage {
    this.requireState('running', 'paused', 'suspended');
    const mem = this.machine.memory;
    const ram = rangeResident(mem.hostAddr, mem.sizeBytes);
    const sharedBytes = fileSharedBytes(mem.backing.kind, ram);
    return {
      capacityBytes: this.memoryBytes,
      guestRamPssBytes: ram.pssBytes,
      guestRamRssBytes: ram.rssBytes,
      guestRamSharedBytes: sharedBytes,
      guestRamPrivateBytes: ram.rssBytes - sharedBytes,
      processPssBytes: processResident().pssBytes,
      vmsInProcess: live.size,
      strategies: this.memory.stats(),
    };
  }

  /** @internal The KVM machine under this VM, for tests of its saved state. */
  get kvmMachine(): KvmMachine {
    return this.machine;
  }

  /** @internal Guest RAM host ranges of every live VM in this process (for the bench). */
  static liveGuestRam(): { start: number; length: number }[] {
    return [...live].map((vm) => ({ start: vm.machine.memory.hostAddr, length: vm.machine.memory.sizeBytes }));
  }

  /**
   * Every VM on this host that this user may reach: this process's VMs (`where: 'this-process'`,
   * with the {@link Vm} itself), the `pvisor run` processes whose control sockets are in the
   * runtime directory that `pvisor ps` reads (`control-socket`: {@link VmHandle.connect} reaches
   * them; a VM of this process that has a socket too is listed once) and the hibernated VMs whose
   * records are there. Each with its name, labels, state, pid, memory and age; with
   * `options.labels`, only those that have all of them. Another process's answer is checked: a
   * row whose answer was refused says so in `error`.
   */
  static async list(options: VmListOptions = {}): Promise<VmListEntry[]> {
    checkOptionKeys('Vm.list', options, LIST_OPTION_KEYS);
    const nowMs = Date.now();
    return listVms([...live].map((vm) => vm.listEntry(nowMs)), options);
  }

  private listEntry(nowMs: number): VmListEntry {
    const measurable = this._state === 'running' || this._state === 'paused' || this._state === 'suspended';
    const mem = measurable ? this.machine.memory : undefined;
    return {
      name: this.name,
      where: 'this-process',
      state: this._state,
      pid: process.pid,
      guest: this.guest,
      labels: this.labels,
      memoryBytes: this.memoryBytes,
      ...(mem && { residentBytes: rangeResident(mem.hostAddr, mem.sizeBytes).pssBytes }),
      startedAt: this.startedAt,
      ageMs: Math.max(0, nowMs - this.startedAt.getTime()),
      vm: this,
    };
  }

  /** A VM that another process runs (`pvisor run --name ID`), reached over its control socket: {@link VmHandle.connect}. */
  static connect(id: string, options?: ConnectOptions): Promise<VmHandle> {
    return VmHandle.connect(id, options);
  }
}

let probeImage: Buffer | undefined;

/** The shipped probe image, checked against its checksum file. */
function loadProbeImage(): Buffer {
  probeImage ??= loadShipped('probe.bin');
  return probeImage;
}

/** A shipped guest artifact, checked against its checksum file. */
function loadShipped(name: string): Buffer {
  const path = nativePrebuild(name);
  const image = readFileSync(path);
  const mismatch = prebuildMismatch(path, image);
  if (mismatch) throw new GuestCrashError('corrupt-image', `${mismatch}; reinstall pvisor`);
  return image;
}

/**
 * The kernel command line every Linux guest gets: console on the UART, and a reboot or panic
 * ends the VM (a triple fault the VMM sees) instead of hanging it.
 */
const LINUX_CMDLINE = 'console=ttyS0 reboot=t panic=-1 quiet';

/**
 * The `rootfs` option checked before anything boots: a regular file the VMM can open as asked,
 * of whole 512-byte sectors (virtio-blk's unit; a partial sector would be unreachable).
 */
function rootfsDisk(rootfs: VmOptions['rootfs'], guest: GuestKind): DiskConfig | undefined {
  if (rootfs === undefined) return undefined;
  checkOptionKeys('rootfs', rootfs, ROOTFS_OPTION_KEYS, 'rootfs.');
  const { path, readOnly: readOnlyOption } = typeof rootfs === 'string' ? { path: rootfs } : (rootfs ?? {}) as RootfsOptions;
  if (typeof path !== 'string' || !path) throw new InvalidOptionError('rootfs', 'expected a path or { path, readOnly }');
  const readOnly = booleanOption('rootfs.readOnly', readOnlyOption, false);
  if (guest !== 'linux') throw new InvalidOptionError('rootfs', `only the Linux guest has a root filesystem (this VM runs the ${guest} guest)`);
  let sizeBytes: number;
  // A jailed VMM's writable rootfs is an fd its launcher opened (src/jail/handed-files.ts): the
  // jail's uid could not open the image for writing, and its path is not in the jail.
  const openFd = readOnly ? undefined : handedRootfsFd();
  try {
    const st = openFd !== undefined ? fstatSync(openFd) : statSync(path);
    if (!st.isFile()) throw new InvalidOptionError('rootfs', `${path} is not a regular file`);
    sizeBytes = st.size;
    if (openFd === undefined) accessSync(path, readOnly ? fsConstants.R_OK : fsConstants.R_OK | fsConstants.W_OK);
  } catch (e) {
    if (e instanceof InvalidOptionError) throw e;
    throw new InvalidOptionError('rootfs', `cannot use ${path}${readOnly ? '' : ' read-write'}: ${(e as Error).message}`);
  }
  if (sizeBytes === 0 || sizeBytes % 512 !== 0) {
    throw new InvalidOptionError('rootfs', `${path} is ${sizeBytes} bytes; a disk image must be a non-zero multiple of 512 bytes`);
  }
  // Absolute: a snapshot names the image, and may be restored from another working directory.
  return { path: resolve(path), readOnly, ...(openFd !== undefined && { openFd }) };
}

/** The Linux guest's kernel and initramfs: the user's files or the shipped ones. */
function loadLinuxGuest(options: VmOptions, disk: DiskConfig | undefined): MachineBoot {
  const read = (what: 'kernel' | 'initrd', path: string) => {
    try {
      return readFileSync(path);
    } catch (e) {
      throw new InvalidOptionError(what, `cannot read ${path}: ${(e as Error).message}`);
    }
  };
  if (!options.kernel && !existsSync(nativePrebuild('vmlinuz'))) {
    throw new PvisorError('PVISOR_GUEST_UNAVAILABLE', 'the Linux guest is not shipped in this version of pvisor yet; use guest: "probe" or give kernel and initrd');
  }
  const kernel = options.kernel ? read('kernel', options.kernel) : loadShipped('vmlinuz');
  const initrd = options.initrd ? read('initrd', options.initrd) : loadShipped('initramfs.cpio.gz');
  // The disk is the guest's only virtio-blk device, hence /dev/vda; the agent mounts it as `/`.
  const rootfsArgs = disk ? `pvisor.rootfs=/dev/vda${disk.readOnly ? ' pvisor.rootfs_ro=1' : ''}` : '';
  const cmdline = [LINUX_CMDLINE, rootfsArgs, options.kernelArgs ?? ''].filter(Boolean).join(' ').trim();
  return { kind: 'linux', kernel, initrd, cmdline };
}
