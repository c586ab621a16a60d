// Offload with lazy reload on real guest pages: resume returns before RAM is back, a native thread
// loads each piece on its first touch through userfaultfd, checks its CRC32, and a broken piece
// ends the VM instead of reaching the guest. Needs /dev/kvm.
import { existsSync, readdirSync, readFileSync, readlinkSync, renameSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { BackingFileError, Offload, PvisorError, Vm, type MemoryStrategy } from '../../src';
import type { StrategyContext } from '../../src/strategy';
import type { UffdSource } from '../../src/memory/uffd-server';
import { MAP_ANONYMOUS, MAP_PRIVATE, PROT_READ, PROT_WRITE } from '../../src/sys/constants';
import { mmap, munmap, viewAt } from '../../src/sys/libc';
import { hexOf } from '../probe-digest';
import { processThreads } from '../process-threads';

const MiB = 2 ** 20;
const WS_MIB = 32;
const SEED = 33;
const expected = hexOf({ content: 'random', seed: SEED, sizeBytes: WS_MIB * MiB, rewrites: [] });

// Without prefetch: only what the guest touches comes back (prefetch is tested below).
async function withLazyVm(body: (vm: Vm, offload: Offload) => Promise<void>, prefetch = false): Promise<void> {
  const offload = new Offload({ reload: 'lazy', prefetch });
  const vm = await Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 2, strategies: [offload] });
  try {
    await vm.probe.fill({ sizeMiB: WS_MIB, content: 'random', seed: SEED });
    await body(vm, offload);
  } finally {
    await vm.stop();
  }
}

const figures = (vm: Vm) => vm.memoryUsage().strategies.find((s) => s.strategy === 'offload')!.figures;
const fdTargets = () =>
  readdirSync('/proc/self/fd').map((fd) => {
    try {
      return readlinkSync(`/proc/self/fd/${fd}`);
    } catch {
      return ''; // closed while listing
    }
  });
const threads = processThreads;
const tick = () => new Promise((r) => setTimeout(r, 50));

describe('Offload, lazy reload', () => {
  it('resume returns before RAM is back; first touches load it, every byte right; the file goes once all is loaded', () =>
    withLazyVm(async (vm, offload) => {
      const before = vm.memoryUsage().guestRamRssBytes;
      expect(before).toBeGreaterThanOrEqual(WS_MIB * MiB);
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      const path = offload.backingPath!;
      await vm.resume();
      expect(vm.state).toBe('running');
      // The guest idles polling its queues: only the pieces it touches are back.
      const right = vm.memoryUsage().guestRamRssBytes;
      expect(right).toBeLessThan((WS_MIB * MiB) / 4);
      expect(existsSync(path)).toBe(true);
      expect((await vm.probe.digest()).hex).toBe(expected);
      expect(vm.memoryUsage().guestRamRssBytes).toBeGreaterThanOrEqual(WS_MIB * MiB);
      const f = figures(vm);
      expect(f.reloadLazy).toBe(1);
      expect(f.piecesLoadedLazily).toBeGreaterThanOrEqual(WS_MIB / 4); // pieces are at most 4 MiB
      expect(f.faultsServed).toBeGreaterThanOrEqual(f.piecesLoadedLazily);
      // Each loaded piece is punched out of the file: what remains on disk is what nobody touched.
      expect(f.bytesOnDisk).toBeLessThan(4 * MiB);
      // Pieces that nothing touched (e.g. the boot info page) are loaded on request.
      await offload.finishReload();
      expect(existsSync(path)).toBe(false);
      expect(offload.backingPath).toBeUndefined();
      const done = figures(vm);
      expect(done.lastFullLoadMs).toBeGreaterThan(0);
      expect(done.bytesOnDisk).toBe(0);
      expect((await vm.probe.digest()).hex).toBe(expected);
    }));

  it('suspending again during an unfinished lazy load loads the rest first, losing nothing', () =>
    withLazyVm(async (vm, offload) => {
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      const first = offload.backingPath!;
      await vm.resume();
      await vm.suspend(); // nothing of the working set has been touched since the resume
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      // A fresh file; the first went once everything in it was back.
      expect(offload.backingPath).not.toBe(first);
      expect(existsSync(first)).toBe(false);
      expect(existsSync(offload.backingPath!)).toBe(true);
      expect(figures(vm).pagesWritten).toBeGreaterThanOrEqual((WS_MIB * MiB) / 4096);
      expect(vm.memoryUsage().guestRamRssBytes).toBeLessThan(MiB);
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(expected);
    }));

  it('a truncated or missing file is refused, the VM stays suspended and stops cleanly', () =>
    withLazyVm(async (vm, offload) => {
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      const path = offload.backingPath!;
      const fdsBefore = fdTargets().length;
      truncateSync(path, 8 * MiB);
      await expect(vm.resume()).rejects.toThrow(BackingFileError);
      await expect(vm.resume()).rejects.toThrow(/truncated/);
      renameSync(path, `${path}.away`);
      await expect(vm.resume()).rejects.toThrow(/missing/);
      expect(vm.state).toBe('suspended');
      expect(vm.memoryUsage().guestRamRssBytes).toBeLessThan(MiB);
      expect(fdTargets().length).toBe(fdsBefore); // no loader was left behind
      expect(fdTargets().some((t) => /userfaultfd/.test(t))).toBe(false);
      await vm.stop();
      expect(vm.state).toBe('stopped');
      rmSync(`${path}.away`);
    }));

  it('a corrupt piece ends the VM with a BackingFileError at first touch; the guest never gets its bytes', () =>
    withLazyVm(async (vm, offload) => {
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      const path = offload.backingPath!;
      const data = readFileSync(path);
      data[0x400000 + 8 * MiB + 4321] ^= 0x5a; // inside the working set, third piece
      writeFileSync(path, data);
      const crashes: PvisorError[] = [];
      vm.on('crash', (e) => crashes.push(e));
      await vm.resume(); // lazy: nothing is read yet
      expect(vm.state).toBe('running');
      // The digest reads that piece: the request must fail, not answer with a wrong digest.
      const err = await vm.probe.digest().then(
        (d) => new Error(`the digest answered ${d.hex}`),
        (e: unknown) => e,
      );
      expect(err).toBeInstanceOf(BackingFileError);
      expect((err as Error).message).toMatch(/CRC32C mismatch/);
      expect(vm.state).toBe('crashed');
      expect(crashes).toHaveLength(1);
      expect(crashes[0]).toBe(vm.error);
      expect(crashes[0]).toBeInstanceOf(BackingFileError);
      expect(existsSync(path)).toBe(false);
      expect(fdTargets().some((t) => /userfaultfd/.test(t))).toBe(false);
    }));

  it('stopping during an unfinished lazy load neither hangs nor leaks; the file is removed', async () => {
    const threadsBefore = threads();
    const fdsBefore = fdTargets().length;
    let path = '';
    let digest: Promise<unknown> | undefined;
    await withLazyVm(async (vm, offload) => {
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      path = offload.backingPath!;
      await vm.resume();
      expect(fdTargets().filter((t) => /userfaultfd/.test(t))).toHaveLength(1);
      expect(threads()).toBe(threadsBefore + 3); // 2 vCPUs and the userfaultfd server
      digest = vm.probe.digest().catch((e: unknown) => e); // vCPUs fault their way through
      await new Promise((r) => setTimeout(r, 20));
      expect(figures(vm).lastFullLoadMs).toBeUndefined();
      await vm.stop();
    });
    expect(await digest).toBeInstanceOf(PvisorError);
    expect(existsSync(path)).toBe(false);
    await tick(); // the closed sockets' handles go on the next tick
    expect(threads()).toBe(threadsBefore);
    expect(fdTargets().some((t) => /userfaultfd/.test(t))).toBe(false);
    expect(fdTargets().length).toBeLessThanOrEqual(fdsBefore + 1); // Node may open its own once
  });

  it('with prefetch, everything comes back in the background, hottest first next time, and the file goes by itself', () =>
    withLazyVm(async (vm, offload) => {
      for (let round = 0; round < 2; round++) {
        await vm.suspend();
        await vm.memoryReleased();
        const path = offload.backingPath!;
        await vm.resume();
        expect((await vm.probe.digest()).hex).toBe(expected);
        const deadline = Date.now() + 10_000;
        while (existsSync(path) && Date.now() < deadline) await tick();
        expect(existsSync(path)).toBe(false); // no finishReload: the prefetch brought the rest
        const f = figures(vm);
        expect(f.prefetch).toBe(1);
        expect(f.piecesPrefetched).toBeGreaterThan(0);
        expect(f.piecesLoadedLazily + f.piecesPrefetched).toBeGreaterThanOrEqual(WS_MIB / 2); // 2 MiB pieces
        expect(vm.memoryUsage().guestRamRssBytes).toBeGreaterThanOrEqual(WS_MIB * MiB);
      }
      expect((await vm.probe.digest()).hex).toBe(expected);
    }, true));

  it('stopping during a prefetch neither hangs nor leaks', async () => {
    const threadsBefore = threads();
    let path = '';
    await withLazyVm(async (vm, offload) => {
      await vm.suspend();
      await vm.memoryReleased();
      path = offload.backingPath!;
      await vm.resume();
      await vm.stop(); // the server is loading pieces in the background
    }, true);
    expect(existsSync(path)).toBe(false);
    await tick();
    expect(threads()).toBe(threadsBefore);
    expect(fdTargets().some((t) => /userfaultfd/.test(t))).toBe(false);
  });
});

/**
 * A user's strategy that keeps one range of guest RAM in host memory while the VM is suspended
 * and brings it back lazily through the VM's userfaultfd server: a second source beside Offload's.
 */
class StashRange implements MemoryStrategy {
  readonly name = 'stash-range';
  readonly needs = ['zero-on-discard', 'userfaultfd-missing'] as const;
  readonly exclusive = [] as const;
  private stash: number | undefined;
  source: UffdSource | undefined;
  loaded = false;
  constructor(private readonly offset: number, private readonly length: number) {}

  async suspend(ctx: StrategyContext): Promise<void> {
    this.stash ??= mmap(0, this.length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, 'stash');
    viewAt(this.stash, this.length).set(ctx.ram.view(this.offset, this.length));
    ctx.ram.discardHost(this.offset, this.length, 'zero'); // before Offload's walk: not its pages any more
  }

  async resume(ctx: StrategyContext): Promise<void> {
    const server = await ctx.uffd();
    this.source = server.addSource({ kind: 'memory', ranges: [{ offset: this.offset, length: this.length, srcAddr: this.stash! }] }, (e) => {
      if (e.kind === 'done') this.loaded = true;
    });
  }

  stats() {
    return { strategy: this.name, figures: {}, notes: [] };
  }

  close(): void {
    if (this.stash) munmap(this.stash, this.length);
  }
}

describe('the userfaultfd server, shared', () => {
  it('serves two sources on one VM at once, lazy Offload and a host-memory stash, with every byte right', async () => {
    const stash = new StashRange(4 * MiB + 24 * MiB, 4 * MiB); // the working set starts at 4 MiB
    const offload = new Offload({ reload: 'lazy', prefetch: false });
    const vm = await Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 2, strategies: [stash, offload] });
    try {
      await vm.probe.fill({ sizeMiB: WS_MIB, content: 'random', seed: SEED });
      await vm.suspend();
      await vm.memoryReleased();
      expect(vm.memoryUsage().guestRamRssBytes).toBeLessThan(MiB);
      await vm.resume();
      expect(stash.loaded).toBe(false); // nothing touched yet: both sources wait
      expect((await vm.probe.digest()).hex).toBe(expected);
      expect(stash.loaded).toBe(true);
      expect(stash.source!.figures().faultsServed).toBeGreaterThan(0);
      expect(figures(vm).piecesLoadedLazily).toBeGreaterThan(0);
      await offload.finishReload();
      expect((await vm.probe.digest()).hex).toBe(expected);
    } finally {
      await vm.stop();
    }
  });
});
