// Guest RAM's backing is chosen by the memory layer, and "discard" means the right thing on each:
// a page the guest zeroed reads back as zero after an offload and resume whether guest RAM is
// private anonymous memory, a memfd or a file mapped MAP_PRIVATE. Needs /dev/kvm.
import { closeSync, mkdtempSync, openSync, readdirSync, readFileSync, readlinkSync, rmSync, writeSync } from 'node:fs';
import { join } from 'node:path';
import { KsmAdvice, Offload, StrategyConflictError, Vm, type MemoryStrategy } from '../../src';
import type { RamBackingRequest } from '../../src/strategy';
import { pageWords, type ProbeWorkingSet } from '../../src/guest/probe-content';
import type { StrategyContext } from '../../src/strategy';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { hexOf } from '../probe-digest';

const MiB = 2 ** 20;
const RAM_MIB = 64;
const WS_BASE = 4 * MiB; // docs/probe-guest.md: the working set starts at 4 MiB

/** A user's strategy that only chooses guest RAM's backing. */
const backedBy = (ramBacking: RamBackingRequest): MemoryStrategy => ({
  name: `${ramBacking.kind}-ram`,
  needs: [],
  exclusive: [],
  ramBacking,
  stats: () => ({ strategy: `${ramBacking.kind}-ram`, figures: {}, notes: [] }),
});

let dir: string;
let ramFile: string;
beforeAll(() => {
  // On a disk, where Offload's backing files may go (the temp directory may be tmpfs).
  dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-ram-backing-'));
  // Zero where the probe keeps its own tables and queues (it expects fresh RAM to read zero);
  // 0x5a from the working set on, so a page that fell back to the file would show.
  ramFile = join(dir, 'ram');
  const fd = openSync(ramFile, 'w');
  writeSync(fd, Buffer.alloc(WS_BASE), 0, WS_BASE, 0);
  writeSync(fd, Buffer.alloc(RAM_MIB * MiB - WS_BASE, 0x5a), 0, RAM_MIB * MiB - WS_BASE, WS_BASE);
  closeSync(fd);
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const kvmFds = () => readdirSync('/proc/self/fd').filter((fd) => {
  try {
    return /kvm/.test(readlinkSync(`/proc/self/fd/${fd}`));
  } catch {
    return false;
  }
}).length;

describe('guest RAM backings', () => {
  it.each([
    ['anonymous', undefined],
    ['memfd', { kind: 'memfd' }],
    ['private-file', 'file'],
  ] as const)('%s: a page the guest zeroed reads back as zero after offload and resume', async (_name, request) => {
    const strategies: MemoryStrategy[] = [new Offload({ dir })];
    if (request === 'file') strategies.unshift(backedBy({ kind: 'private-file', path: ramFile }));
    else if (request) strategies.unshift(backedBy(request));
    const vm = await Vm.start({ guest: 'probe', memory: `${RAM_MIB}MiB`, vcpus: 1, strategies });
    try {
      await vm.probe.fill({ sizeMiB: 8, content: 'random', seed: 3 });
      await vm.probe.zero({ offsetMiB: 2, sizeMiB: 2 });
      const ws: ProbeWorkingSet = { content: 'random', seed: 3, sizeBytes: 8 * MiB, rewrites: [], zeroed: [{ offset: 2 * MiB, length: 2 * MiB }] };
      expect((await vm.probe.digest()).hex).toBe(hexOf(ws));
      const before = vm.memoryUsage().guestRamRssBytes;
      expect(before).toBeGreaterThanOrEqual(8 * MiB);
      await vm.suspend();
      await vm.memoryReleased();
      // The VM's own pages are gone (a private file mapping may keep the file's pages it maps).
      expect(vm.memoryUsage().guestRamRssBytes).toBeLessThan(request === 'file' ? before - 7 * MiB : MiB);
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(hexOf(ws));
    } finally {
      await vm.stop();
    }
  });

  it('a composition whose needs its backing does not offer is refused before anything is allocated', async () => {
    const fds = kvmFds();
    const attempt = Vm.start({ guest: 'probe', memory: '64MiB', strategies: [backedBy({ kind: 'memfd' }), new KsmAdvice()] });
    await expect(attempt).rejects.toThrow(StrategyConflictError);
    await expect(attempt).rejects.toThrow(/ksm-advice needs ksm-mergeable, which memfd-backed guest RAM \(from memfd-ram\) does not offer/);
    expect(kvmFds()).toBe(fds);
  });

  it('a private file smaller than guest RAM is a typed error, and nothing stays open', async () => {
    const fds = readdirSync('/proc/self/fd').length;
    await expect(Vm.start({ guest: 'probe', memory: '128MiB', strategies: [backedBy({ kind: 'private-file', path: ramFile })] })).rejects.toThrow(/smaller than guest RAM/);
    expect(readdirSync('/proc/self/fd').length).toBe(fds);
  });

  it('a file mapped over runs of anonymous RAM (as a page pool would): the guest reads its pages, a write copies, the file is untouched', async () => {
    // The file holds what the guest's working set holds at pages 512..1023 (its 2nd and 3rd MiB... of 8).
    const first = 512;
    const count = 512;
    const words = new Uint32Array(1024);
    const content = Buffer.alloc(count * 4096);
    for (let p = 0; p < count; p++) {
      pageWords('random', 3, first + p, words);
      Buffer.from(words.buffer).copy(content, p * 4096);
    }
    const poolFile = join(dir, 'pool');
    const fd = openSync(poolFile, 'w+');
    writeSync(fd, content, 0, content.length, 0);
    let ctx: StrategyContext | undefined;
    const pool: MemoryStrategy = { name: 'pool', needs: [], exclusive: [], map: (c) => void (ctx = c), stats: () => ({ strategy: 'pool', figures: {}, notes: [] }) };
    const vm = await Vm.start({ guest: 'probe', memory: `${RAM_MIB}MiB`, vcpus: 1, strategies: [pool] });
    try {
      await vm.probe.fill({ sizeMiB: 8, content: 'random', seed: 3 });
      const ws: ProbeWorkingSet = { content: 'random', seed: 3, sizeBytes: 8 * MiB, rewrites: [] };
      const ownBefore = ctx!.ram.ownPageRuns().reduce((n, r) => n + r.length, 0);
      await vm.pause();
      // Two runs in one call; a bad fd maps nothing and says why, leaving the RAM as it was.
      expect(() => ctx!.ram.mapFileRuns(-1, [{ offset: WS_BASE + first * 4096, length: 4096, fileOffset: 0 }])).toThrow(RangeError);
      const bad = ctx!.ram.mapFileRuns(1 << 20, [{ offset: WS_BASE + first * 4096, length: 4096, fileOffset: 0 }]);
      expect(bad.mapped).toBe(0);
      expect(bad.error).toMatchObject({ call: 'mmap', errno: 9 });
      const half = (count / 2) * 4096;
      expect(ctx!.ram.mapFileRuns(fd, [
        { offset: WS_BASE + first * 4096, length: half, fileOffset: 0 },
        { offset: WS_BASE + first * 4096 + half, length: half, fileOffset: half },
      ])).toEqual({ mapped: 2 });
      await vm.resume();
      // Those 2 MiB are the file's now, not the VM's: the VM's own pages shrank by them.
      expect(ctx!.ram.ownPageRuns().reduce((n, r) => n + r.length, 0)).toBe(ownBefore - count * 4096);
      expect((await vm.probe.digest()).hex).toBe(hexOf(ws));
      await vm.probe.rewrite({ fraction: 1, seed: 4 });
      ws.rewrites.push({ permille: 1000, seed: 4 });
      expect((await vm.probe.digest()).hex).toBe(hexOf(ws));
      expect(readFileSync(poolFile).equals(content)).toBe(true); // writes made private copies
    } finally {
      await vm.stop();
      closeSync(fd);
    }
  });
});
