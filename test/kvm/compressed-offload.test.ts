// CompressedOffload on real guest pages: suspend compresses resident RAM into a frame file and
// drops it, resume verifies every frame before it reaches guest RAM; a broken file never does.
// Needs /dev/kvm.
import { existsSync, readFileSync, renameSync, rmSync, statSync, truncateSync, writeFileSync } from 'node:fs';
import { BackingFileError, CompressedOffload, KsmAdvice, Offload, StrategyConflictError, Vm } from '../../src';
import { FrameFileReader } from '../../src/memory/frame-file';
import { availableParallelism } from 'node:os';
import { hexOf } from '../probe-digest';
import { processThreads } from '../process-threads';

const MiB = 2 ** 20;
const SIZE_MIB = 32;

async function withVm(content: 'repetitive' | 'random', body: (vm: Vm, co: CompressedOffload, digest: string) => Promise<void>): Promise<void> {
  const co = new CompressedOffload();
  // KsmAdvice too: compressed offload works on the default private anonymous RAM.
  const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, strategies: [new KsmAdvice(), co] });
  try {
    await vm.probe.fill({ sizeMiB: SIZE_MIB, content, seed: 5 });
    await body(vm, co, hexOf({ content, seed: 5, sizeBytes: SIZE_MIB * MiB, rewrites: [] }));
  } finally {
    await vm.stop();
  }
}

const figures = (vm: Vm) => vm.memoryUsage().strategies.find((s) => s.strategy === 'compressed-offload')!.figures;

/** Flips one byte in the middle of the stored bytes of the first frame of `kind`. */
function corruptFrame(path: string, kind: 'raw' | 'zstd'): number {
  const r = FrameFileReader.open(path);
  const index = r.entries.findIndex((e) => e.kind === kind);
  const e = r.entries[index];
  r.close();
  const bytes = readFileSync(path);
  bytes[e.fileOffset + Math.floor(e.storedLength / 2)] ^= 0x10;
  writeFileSync(path, bytes);
  return index;
}

describe('CompressedOffload', () => {
  it('repetitive: the backing is a small fraction of the working set, every byte comes back; a corrupt, truncated or missing file is refused without losing the VM', () =>
    withVm('repetitive', async (vm, co, digest) => {
      const before = vm.memoryUsage().guestRamRssBytes;
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      const path = co.backingPath!;
      expect(statSync(path).mode & 0o777).toBe(0o600);
      expect(vm.memoryUsage().guestRamRssBytes).toBeLessThanOrEqual(before * 0.01);
      const f = figures(vm);
      expect(f.bytesOnDisk).toBeLessThan((SIZE_MIB * MiB) / 20);
      expect(f.bytesUncompressed).toBeGreaterThanOrEqual(SIZE_MIB * MiB);
      expect(f.framesZstd).toBeGreaterThanOrEqual(SIZE_MIB);
      expect(f.compressionRatio).toBeGreaterThan(20);
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(digest);
      expect(existsSync(path)).toBe(false);
      expect(figures(vm).lastResumeMs).toBeGreaterThan(0);

      await vm.suspend();

      await vm.memoryReleased(); // suspend resolves before the write-out ends
      const original = readFileSync(co.backingPath!);
      const index = corruptFrame(co.backingPath!, 'zstd');
      const err = await vm.resume().catch((e: unknown) => e);
      expect(err).toBeInstanceOf(BackingFileError);
      expect((err as Error).message).toMatch(new RegExp(`frame ${index} \\(guest offset 0x[0-9a-f]+, zstd\\) (is corrupt|cannot be decoded)`));
      expect(vm.state).toBe('suspended');
      expect(vm.memoryUsage().guestRamRssBytes).toBeLessThan(MiB); // nothing half-loaded stays
      truncateSync(co.backingPath!, Math.floor(original.length / 2));
      await expect(vm.resume()).rejects.toThrow(/truncated/);
      renameSync(co.backingPath!, `${co.backingPath}.away`);
      await expect(vm.resume()).rejects.toThrow(/missing/);
      expect(vm.state).toBe('suspended');
      rmSync(`${co.backingPath}.away`);
      writeFileSync(co.backingPath!, original);
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(digest);
    }));

  it('random: frames are stored raw, a corrupt raw frame is refused, every byte comes back; the file is removed on stop', async () => {
    let path = '';
    await withVm('random', async (vm, co, digest) => {
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      path = co.backingPath!;
      const f = figures(vm);
      expect(f.framesRaw).toBeGreaterThanOrEqual(SIZE_MIB);
      expect(f.bytesOnDisk).toBeGreaterThanOrEqual(SIZE_MIB * MiB);
      const original = readFileSync(path);
      const index = corruptFrame(path, 'raw');
      await expect(vm.resume()).rejects.toThrow(new RegExp(`frame ${index} .*raw\\) is corrupt \\(CRC32 mismatch\\)`));
      expect(vm.state).toBe('suspended');
      writeFileSync(path, original);
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(digest);
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      path = co.backingPath!;
      expect(existsSync(path)).toBe(true);
    });
    expect(existsSync(path)).toBe(false);
  });

  it('a suspend that cannot write its file fails and leaves the VM running as it was', async () => {
    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1, strategies: [new CompressedOffload({ dir: '/nonexistent/pvisor' })] });
    try {
      await vm.probe.fill({ sizeMiB: 4, content: 'random', seed: 3 });
      await expect(vm.suspend()).rejects.toThrow(/ENOENT/);
      expect(vm.state).toBe('running');
      expect((await vm.probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 3, sizeBytes: 4 * MiB, rewrites: [] }));
    } finally {
      await vm.stop();
    }
  });

  it('keepWorkers: the workers start with the VM and stay across operations; every byte comes back', async () => {
    const threadsBefore = processThreads();
    const co = new CompressedOffload({ keepWorkers: true });
    const vm = await Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 1, strategies: [co] });
    try {
      await vm.probe.fill({ sizeMiB: 16, content: 'repetitive', seed: 8 });
      const want = hexOf({ content: 'repetitive', seed: 8, sizeBytes: 16 * MiB, rewrites: [] });
      const startMs: number[] = [];
      for (let round = 0; round < 2; round++) {
        await vm.suspend();
        await vm.memoryReleased();
        await vm.resume();
        expect((await vm.probe.digest()).hex).toBe(want);
        startMs.push(figures(vm).lastWorkerStartMs);
      }
      const f = figures(vm);
      expect(f.workersKept).toBe(1);
      expect(startMs[1]).toBe(startMs[0]); // started once, with the VM, not for each operation
      // The VM's vCPU, plus the workers (min(2, CPUs), each at least a thread), still alive.
      expect(processThreads()).toBeGreaterThanOrEqual(threadsBefore + 1 + Math.min(2, availableParallelism()));
    } finally {
      await vm.stop();
    }
    await new Promise((r) => setTimeout(r, 300)); // workers end asynchronously
    expect(processThreads()).toBeLessThanOrEqual(threadsBefore);
  });

  it('a resume during the write-out stops it and brings back only what was dropped; a stop during it leaves nothing', async () => {
    const co = new CompressedOffload();
    const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, strategies: [co] });
    try {
      await vm.probe.fill({ sizeMiB: 128, content: 'random', seed: 12 });
      const want = hexOf({ content: 'random', seed: 12, sizeBytes: 128 * MiB, rewrites: [] });
      await vm.suspend();
      const path = co.backingPath!;
      // Resume once two batches are in the file (the first is then dropped or being dropped), with
      // 96 MiB still to go.
      while (!existsSync(path) || statSync(path).size < 32 * MiB) await new Promise((r) => setTimeout(r, 2));
      await vm.resume();
      expect(figures(vm).lastReleaseCancelled).toBe(1);
      expect(existsSync(path)).toBe(false);
      expect((await vm.probe.digest()).hex).toBe(want);
      await vm.suspend();
      const second = co.backingPath!;
      await vm.stop();
      expect(existsSync(second)).toBe(false);
    } finally {
      await vm.stop();
    }
  });

  it('cannot be combined with Offload: refused before anything is allocated', async () => {
    const err = await Vm.start({ guest: 'probe', strategies: [new Offload(), new CompressedOffload()] }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(StrategyConflictError);
    expect((err as StrategyConflictError).strategies).toEqual(['offload', 'compressed-offload']);
    expect((err as Error).message).toMatch(/both drive suspend-image/);
  });
});
