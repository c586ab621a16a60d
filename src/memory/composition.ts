/**
 * The memory layer's orchestration: one composition of strategies per VM. It checks the
 * composition before anything is allocated, decides guest RAM's backing, gives every strategy its
 * context, and runs the hooks: map, suspend (undone in reverse if one fails), resume, periodic
 * work within a CPU budget, figures, and close (once). `Vm` calls it; it knows nothing of the VM's
 * devices or guest.
 */
import { closeSync } from 'node:fs';
import { GuestCrashError, PvisorError, VmStateError, type SystemCallError } from '../errors';
import { ownPageRuns, type PageRun } from '../guest-ram/pages';
import { BACKING_CAPABILITIES, describeBacking, openBacking, type DiscardTo, type RamBacking, type RamBackingKind, type RamBackingRequest } from '../guest-ram/ram-backing';
import { StrategyConflictError, type FileRunOver, type MemoryStrategy, type StrategyContext, type StrategyStats, type SuspendWork } from './strategy';
import type { FileRange, UffdServer, UffdSource } from './uffd-server';

/**
 * Where a lazy load's bytes come from when they are not in the file yet ({@link
 * MemoryComposition.loadLazily} with `deferred`): a fetcher that writes each range into the file
 * when the server asks for it, or ahead of that, and says so on the server's fetch channel.
 */
export interface DeferredRamFetcher {
  /**
   * The source exists: `fetchFd` is the fetcher's end of the server's fetch channel (the callee
   * owns it from now on), `sourceId` the source's tag in its records.
   */
  start(fetchFd: number, sourceId: number): void;
  /** The VM ends: stop fetching and let go of everything. Idempotent. */
  close(): void;
}

/** What the composition needs of guest RAM (the KVM backend's GuestMemory). */
export interface GuestRam {
  readonly hostAddr: number;
  readonly sizeBytes: number;
  readonly backing: { kind: RamBackingKind };
  hostView(offset: number, length: number): Buffer;
  advise(offset: number, length: number, advice: number, name: string): void;
  discard(gpa: number, length: number, to?: DiscardTo): void;
  discardHost(offset: number, length: number, to?: DiscardTo): void;
  discardHostRuns(runs: readonly PageRun[], to?: DiscardTo): void;
  hostOffset(gpa: number, length: number): number;
  mapFileRuns(fd: number, runs: readonly FileRunOver[]): { mapped: number; error?: SystemCallError };
}

/** What the composition tells its VM. */
export interface CompositionHooks {
  /** A strategy cannot go on: end the VM as a crash with this error. */
  fail(error: PvisorError): void;
  /** Something went wrong that the VM survives (a periodic tick failed). */
  warn(message: string): void;
  /** See {@link StrategyContext.withGuestPaused}. */
  withGuestPaused<T>(work: () => T): Promise<T | undefined>;
  /** A strategy's hook ran (`map`, `suspend`, `resume`, `tick`) and took `ms`: for the VM's trace. */
  trace?(hook: 'map' | 'suspend' | 'resume' | 'tick', strategy: string, ms: number): void;
}

const DEFAULT_BACKING: RamBackingRequest = { kind: 'anonymous' };

/**
 * Whether guest RAM of a VM of `strategies` can be loaded lazily (see
 * {@link MemoryComposition.canLoadLazily}), decided before anything is built.
 */
export function canLoadLazilyWith(strategies: readonly MemoryStrategy[]): boolean {
  return BACKING_CAPABILITIES[planComposition(strategies).kind].includes('userfaultfd-missing') && !strategies.some((s) => s.exclusive.includes('resident-pages'));
}

/**
 * Checks a composition before anything is allocated and returns the backing it chose: no strategy
 * twice, no resource driven by two, at most one strategy providing guest RAM's backing, and every
 * strategy's needs offered by that backing. Throws {@link StrategyConflictError} naming both sides.
 */
export function planComposition(strategies: readonly MemoryStrategy[]): RamBackingRequest {
  for (let i = 0; i < strategies.length; i++) {
    for (let j = i + 1; j < strategies.length; j++) {
      const a = strategies[i];
      const b = strategies[j];
      if (a.name === b.name) throw new StrategyConflictError(a.name, b.name, 'the same strategy is given twice');
      const shared = a.exclusive.find((r) => b.exclusive.includes(r));
      if (shared) throw new StrategyConflictError(a.name, b.name, `both drive ${shared}`);
      if (a.ramBacking && b.ramBacking) throw new StrategyConflictError(a.name, b.name, "both provide guest RAM's backing");
    }
  }
  const provider = strategies.find((s) => s.ramBacking);
  const backing = provider?.ramBacking ?? DEFAULT_BACKING;
  const offered = BACKING_CAPABILITIES[backing.kind];
  if (!offered) throw new StrategyConflictError(provider!.name, provider!.name, `unknown guest RAM backing ${JSON.stringify(backing.kind)}`);
  for (const s of strategies) {
    const missing = s.needs.find((c) => !offered.includes(c));
    if (!missing) continue;
    if (!provider) throw new StrategyConflictError(s.name, s.name, `it needs ${missing}, which ${describeBacking(backing)} does not offer`);
    throw new StrategyConflictError(provider.name, s.name, `${s.name} needs ${missing}, which ${describeBacking(backing)} (from ${provider.name}) does not offer`);
  }
  return backing;
}

/** The strategies of one VM, and everything that runs them. */
export class MemoryComposition {
  /** The backing the composition chose (before it is opened). */
  readonly backingRequest: RamBackingRequest;
  private ctx: StrategyContext | undefined;
  private closed = false;
  private running = false;
  private tickTimers = new Map<MemoryStrategy, NodeJS.Timeout>();
  /** Ticks running now: a suspend waits for them, so that no periodic work overlaps it. */
  private ticking = new Set<Promise<void>>();
  private releasing: Promise<void> = Promise.resolve();
  /** The VM's userfaultfd server, once a strategy asked for it; `serverReady` once it exists. */
  private server: Promise<UffdServer> | undefined;
  private serverReady: UffdServer | undefined;
  /** Guest RAM still loading from a snapshot's RAM file (see {@link loadLazily}); a suspend waits for it. */
  private loading: Promise<void> | undefined;

  /** The last lazy load's source and ranges: its touch order outlives it (see {@link lazyTouchOrder}). */
  private lazySource: { source: UffdSource; ranges: readonly FileRange[] } | undefined;
  private fetcher: DeferredRamFetcher | undefined;

  /** Checks the composition (see {@link planComposition}); allocates nothing. */
  constructor(
    private readonly strategies: readonly MemoryStrategy[],
    private readonly vmName: string,
    private readonly hooks: CompositionHooks,
  ) {
    this.backingRequest = planComposition(strategies);
  }

  /** Opens (or creates) the chosen backing for guest RAM of `sizeBytes`; guest memory takes its fd. */
  openBacking(sizeBytes: number): RamBacking {
    return openBacking(this.backingRequest, sizeBytes, this.vmName);
  }

  /**
   * Where free-page reports go, if a strategy drives them (the balloon offers reporting only
   * then): to that strategy, then to every other strategy that listens for them, in order.
   */
  get freePageSink(): ((gpa: number, length: number) => void) | undefined {
    if (!this.strategies.some((x) => x.exclusive.includes('free-page-reporting'))) return undefined;
    const listeners = this.strategies.filter((x) => x.freePagesReported);
    const ordered = [...listeners.filter((x) => x.exclusive.includes('free-page-reporting')), ...listeners.filter((x) => !x.exclusive.includes('free-page-reporting'))];
    return (gpa, length) => {
      for (const s of ordered) s.freePagesReported!(this.context, gpa, length);
    };
  }

  private get context(): StrategyContext {
    if (!this.ctx) throw new GuestCrashError('vmm-error', 'memory strategies used before guest RAM was mapped');
    return this.ctx;
  }

  /** Guest RAM is mapped, no vCPU has run: builds the context and runs every map hook in order. */
  attach(ram: GuestRam): void {
    const backing = ram.backing.kind;
    this.ctx = {
      vmName: this.vmName,
      ram: {
        hostAddr: ram.hostAddr,
        sizeBytes: ram.sizeBytes,
        backing,
        capabilities: BACKING_CAPABILITIES[backing],
        view: (offset, length) => ram.hostView(offset, length),
        advise: (offset, length, advice, name) => ram.advise(offset, length, advice, name),
        discard: (gpa, length, to) => ram.discard(gpa, length, to),
        discardHost: (offset, length, to) => ram.discardHost(offset, length, to),
        discardHostRuns: (runs, to) => ram.discardHostRuns(runs, to),
        hostOffset: (gpa, length) => ram.hostOffset(gpa, length),
        mapFileRuns: (fd, runs) => ram.mapFileRuns(fd, runs),
        ownPageRuns: () => ownPageRuns(ram.hostAddr, ram.sizeBytes, backing),
      },
      uffd: () => this.uffdServer(ram, backing),
      fail: (error) => this.hooks.fail(error),
      withGuestPaused: (work) => this.hooks.withGuestPaused(work),
      warn: (message) => this.hooks.warn(message),
    };
    for (const s of this.strategies) {
      if (!s.map) continue;
      const t0 = performance.now();
      s.map(this.ctx);
      this.hooks.trace?.('map', s.name, performance.now() - t0);
    }
  }

  private uffdServer(ram: GuestRam, backing: RamBackingKind): Promise<UffdServer> {
    if (this.closed) return Promise.reject(new VmStateError(`${this.vmName} has ended`));
    if (!BACKING_CAPABILITIES[backing].includes('userfaultfd-missing')) {
      return Promise.reject(new VmStateError(`${this.vmName}: userfaultfd's missing mode is not offered for ${backing} guest RAM (a strategy that uses it must say so in its needs)`));
    }
    // Loaded on first use: importing pvisor loads no native code.
    this.server ??= import('./uffd-server').then(({ UffdServer }) => {
      if (this.closed) throw new VmStateError(`${this.vmName} has ended`);
      this.serverReady = UffdServer.create(ram.hostAddr, ram.sizeBytes);
      return this.serverReady;
    });
    return this.server;
  }

  /**
   * Whether guest RAM can be loaded lazily (see {@link loadLazily}): its backing is served by
   * userfaultfd, and no strategy drops or replaces resident pages on its own (ColdCompression,
   * PoolClient), which a range still loading would race with.
   */
  get canLoadLazily(): boolean {
    return canLoadLazilyWith(this.strategies);
  }

  /**
   * Guest RAM offsets of the ranges that the guest's (or the VMM's) faults loaded in the last
   * lazy load, in the order they did, while it runs and after: what a snapshot of this VM records
   * as the order to prefetch in. Undefined if RAM was not loaded lazily.
   */
  lazyTouchOrder(): number[] | undefined {
    const lazy = this.lazySource;
    if (!lazy) return undefined;
    try {
      return lazy.source.touchOrder().map((i) => lazy.ranges[i].offset);
    } catch {
      return undefined; // the server is gone with the VM
    }
  }

  /**
   * Serves guest RAM (fresh: nothing may have touched it) from `ranges` of the file `fd` through
   * the VM's userfaultfd server: a range loads whole, checked against its CRC32C, when the guest
   * or the VMM first touches it, and every range loads in the background from now on, in address
   * order. A range that fails its check is never mapped: `failure(why, offset)` makes the error
   * the VM ends with. A suspend waits until every range is loaded (its strategies read and drop
   * guest RAM as a whole). Call after {@link attach}, before any vCPU runs.
   */
  async loadLazily(fd: number, ranges: readonly FileRange[], failure: (why: string, offset: number, code: number) => PvisorError, deferred?: DeferredRamFetcher): Promise<void> {
    if (ranges.length === 0) {
      deferred?.close();
      return;
    }
    let server: UffdServer;
    try {
      server = await this.context.uffd();
      if (this.closed) throw new VmStateError(`${this.vmName} has ended`);
    } catch (e) {
      deferred?.close();
      throw e;
    }
    // The fetcher is this composition's from now: close() ends it with the VM.
    this.fetcher = deferred;
    let settle!: () => void;
    this.loading = new Promise<void>((resolve) => (settle = resolve));
    const fetchFd = deferred ? server.openFetchChannel() : undefined;
    let source: UffdSource;
    try {
      // Deferred: loaded ranges are punched out of the file, a scratch file of the fetcher's.
      source = server.addSource({ kind: 'file', fd, ranges, checksum: true, ...(deferred && { deferred: true, punch: true }) }, (event) => {
        if (event.kind === 'error') this.hooks.fail(failure(event.why, event.offset, event.code));
        else this.tryStep('userfaultfd source', () => source.remove());
        if (event.kind === 'done') this.tryStep('chunk fetcher', () => deferred?.close());
        // A VM that failed has ended: nothing waits for the rest.
        this.loading = undefined;
        settle();
      });
    } catch (e) {
      if (fetchFd !== undefined) closeSync(fetchFd);
      throw e;
    }
    this.lazySource = { source, ranges };
    if (deferred) deferred.start(fetchFd!, source.id);
    else source.loadAll();
  }

  /**
   * Runs every suspend hook in order (the vCPUs are stopped). If one throws, those before it are
   * resumed in reverse, so the VM is as it was, and the error is rethrown. Resolves when every hook
   * has returned; memory may still be being released (see {@link memoryReleased}).
   */
  async suspend(checkNotEnded: () => void): Promise<void> {
    await this.loading;
    checkNotEnded();
    this.setRunning(false);
    await Promise.all(this.ticking);
    const ctx = this.context;
    const done: MemoryStrategy[] = [];
    const work: Promise<void>[] = [];
    try {
      for (const s of this.strategies) {
        checkNotEnded();
        const t0 = performance.now();
        const w: SuspendWork | void = await s.suspend?.(ctx);
        if (s.suspend) this.hooks.trace?.('suspend', s.name, performance.now() - t0);
        done.push(s);
        if (w) work.push(w.released);
      }
      checkNotEnded();
    } catch (e) {
      // A VM that ended meanwhile has closed its strategies: there is nothing to undo.
      if (!this.closed) for (const s of done.reverse()) await s.resume?.(ctx);
      // The undone work settles by itself (cancelled); nobody waits for it.
      for (const w of work) w.catch(() => {});
      throw e;
    }
    this.releasing = Promise.all(work).then(() => {});
    this.releasing.catch(() => {}); // observed through memoryReleased()
  }

  /**
   * Settles when the memory the last suspend set out to release is released (at once if none is
   * pending), or rejects with why a strategy could not finish: what it did not release then stays
   * resident, and the VM stays suspended and resumable.
   */
  memoryReleased(): Promise<void> {
    return this.releasing;
  }

  /** Runs every resume hook in reverse order; a failure leaves the VM suspended. */
  async resume(checkNotEnded: () => void): Promise<void> {
    const ctx = this.context;
    for (const s of [...this.strategies].reverse()) {
      const t0 = performance.now();
      await s.resume?.(ctx);
      if (s.resume) this.hooks.trace?.('resume', s.name, performance.now() - t0);
      checkNotEnded();
    }
  }

  /**
   * The guest runs (true) or not: periodic work happens only while it runs, spaced so that it
   * stays within each strategy's CPU share.
   */
  setRunning(running: boolean): void {
    if (this.closed || this.running === running) return;
    this.running = running;
    if (!running) {
      for (const t of this.tickTimers.values()) clearTimeout(t);
      this.tickTimers.clear();
      return;
    }
    for (const s of this.strategies) if (s.tick && s.periodic) this.scheduleTick(s, s.periodic.intervalMs);
  }

  private scheduleTick(s: MemoryStrategy, delayMs: number): void {
    const timer = setTimeout(async () => {
      this.tickTimers.delete(s);
      if (!this.running) return;
      const t0 = performance.now();
      const tick = (async () => {
        try {
          await s.tick!(this.context);
          this.hooks.trace?.('tick', s.name, performance.now() - t0);
        } catch (e) {
          if (!this.closed) this.hooks.warn(`${s.name}: periodic work failed: ${(e as Error).message}`);
        }
      })();
      this.ticking.add(tick);
      await tick;
      this.ticking.delete(tick);
      if (this.running && !this.tickTimers.has(s)) this.scheduleTick(s, nextTickDelayMs(s.periodic!, performance.now() - t0));
    }, delayMs);
    // Periodic work never keeps the process alive by itself.
    timer.unref();
    this.tickTimers.set(s, timer);
  }

  /** Every strategy's figures, in composition order. */
  stats(): StrategyStats[] {
    return this.strategies.map((s) => s.stats(this.context));
  }

  /**
   * Closes every strategy, once, then the userfaultfd server (closing its userfaultfd releases any
   * thread blocked in a fault, so the vCPU threads can be joined); periodic work stops.
   */
  close(): void {
    if (this.closed) return;
    this.setRunning(false);
    this.closed = true;
    // Each runs whatever the others throw: one strategy's failure must not leak the others'
    // files and threads, nor keep a vCPU in a fault.
    for (const s of this.strategies) this.tryStep(`${s.name}: close`, () => s.close?.());
    if (this.fetcher) this.tryStep('chunk fetcher', () => this.fetcher!.close());
    // Now, not later: the caller joins the vCPU threads next. A server still being created has
    // no source yet, so no thread can wait on it; it sees `closed` and is never made.
    this.tryStep('userfaultfd server', () => this.serverReady?.destroy());
  }

  private tryStep(what: string, step: () => void): void {
    try {
      step();
    } catch (e) {
      this.hooks.warn(`${what} failed while the VM ended: ${(e as Error).message}`);
    }
  }
}

/**
 * The wait before the next tick, given how long the last one took: at least the interval, and long
 * enough that ticks use at most `cpuShare` of one CPU.
 */
export function nextTickDelayMs(periodic: { intervalMs: number; cpuShare: number }, lastTickMs: number): number {
  const share = Math.min(1, Math.max(periodic.cpuShare, 1e-3));
  return Math.max(periodic.intervalMs, lastTickMs / share - lastTickMs);
}
