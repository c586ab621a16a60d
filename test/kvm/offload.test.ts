// Offload on real guest pages: suspend writes RAM out and drops it, resume brings it back and
// verifies it; a broken backing file never reaches the guest. Needs /dev/kvm.
import { existsSync, readdirSync, readFileSync, renameSync, rmSync, statSync, truncateSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { BackingFileError, KsmAdvice, Offload, Vm } from '../../src';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { hexOf } from '../probe-digest';

const MiB = 2 ** 20;

async function withOffloadVm(body: (vm: Vm, offload: Offload) => Promise<void>): Promise<void> {
  const offload = new Offload();
  // KsmAdvice too: offload works on the default private anonymous RAM.
  const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, strategies: [new KsmAdvice(), offload] });
  try {
    await vm.probe.fill({ sizeMiB: 64, content: 'random', seed: 21 });
    await body(vm, offload);
  } finally {
    await vm.stop();
  }
}

const expected = hexOf({ content: 'random', seed: 21, sizeBytes: 64 * MiB, rewrites: [] });

describe('Offload', () => {
  it('suspend drops at least 99% of resident guest RAM; resume restores every byte', () =>
    withOffloadVm(async (vm, offload) => {
      const before = vm.memoryUsage().guestRamRssBytes;
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      expect(vm.state).toBe('suspended');
      const during = vm.memoryUsage();
      expect(during.guestRamRssBytes).toBeLessThanOrEqual(before * 0.01);
      const path = offload.backingPath!;
      expect(statSync(path).mode & 0o777).toBe(0o600);
      const st = during.strategies.find((s) => s.strategy === 'offload')!;
      expect(st.figures.pagesWritten).toBeGreaterThanOrEqual((64 * MiB) / 4096);
      expect(st.figures.bytesOnDisk).toBeLessThan(before + MiB);
      await vm.resume();
      expect(vm.state).toBe('running');
      expect((await vm.probe.digest()).hex).toBe(expected);
      expect(existsSync(path)).toBe(false);
    }));

  it('a corrupted byte is refused; the VM stays suspended and resumes once the file is right', () =>
    withOffloadVm(async (vm, offload) => {
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      const path = offload.backingPath!;
      const original = readFileSync(path);
      const corrupt = Buffer.from(original);
      const at = 0x400000 + 12345; // inside the working set
      corrupt[at] ^= 0xff;
      writeFileSync(path, corrupt);
      await expect(vm.resume()).rejects.toThrow(BackingFileError);
      await expect(vm.resume()).rejects.toThrow(/CRC32C mismatch/);
      expect(vm.state).toBe('suspended');
      expect(vm.memoryUsage().guestRamRssBytes).toBeLessThan(MiB); // nothing half-loaded stays
      writeFileSync(path, original);
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(expected);
    }));

  it('a truncated or missing file is refused without losing the VM', () =>
    withOffloadVm(async (vm, offload) => {
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      const path = offload.backingPath!;
      const original = readFileSync(path);
      truncateSync(path, 8 * MiB);
      await expect(vm.resume()).rejects.toThrow(/truncated/);
      renameSync(path, `${path}.away`);
      await expect(vm.resume()).rejects.toThrow(/missing/);
      expect(vm.state).toBe('suspended');
      writeFileSync(path, original);
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(expected);
      rmSync(`${path}.away`);
    }));

  it('a suspend that cannot write its file fails and leaves the VM running as it was', async () => {
    const vm = await Vm.start({ guest: 'probe', memory: '128MiB', vcpus: 1, strategies: [new Offload({ dir: '/nonexistent/pvisor' })] });
    try {
      await vm.probe.fill({ sizeMiB: 8, content: 'random', seed: 21 });
      await expect(vm.suspend()).rejects.toThrow(/ENOENT/);
      expect(vm.state).toBe('running');
      expect((await vm.probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 21, sizeBytes: 8 * MiB, rewrites: [] }));
    } finally {
      await vm.stop();
    }
  });

  it('suspend resolves before the write-out ends; memory is released progressively, then the event says so', () =>
    withOffloadVm(async (vm, offload) => {
      const released = new Promise<{ ms: number; error?: Error }>((resolve) => vm.once('released', resolve));
      const before = vm.memoryUsage().guestRamRssBytes;
      await vm.suspend();
      expect(vm.state).toBe('suspended');
      expect(existsSync(offload.backingPath!)).toBe(true);
      const info = await released;
      expect(info.error).toBeUndefined();
      expect(info.ms).toBeGreaterThan(0);
      await vm.memoryReleased(); // settled already
      expect(vm.memoryUsage().guestRamRssBytes).toBeLessThanOrEqual(before * 0.01);
      const f = vm.memoryUsage().strategies.find((s) => s.strategy === 'offload')!.figures;
      expect(f.lastReleaseMs).toBeGreaterThanOrEqual(f.lastSuspendMs);
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(expected);
    }));

  it('a resume during the write-out cancels it, keeps what is resident, brings back what was dropped, leaves no file', async () => {
    const offload = new Offload();
    const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, strategies: [offload] });
    try {
      await vm.probe.fill({ sizeMiB: 256, content: 'random', seed: 5 });
      const want = hexOf({ content: 'random', seed: 5, sizeBytes: 256 * MiB, rewrites: [] });
      let releasedEvent = false;
      vm.on('released', () => (releasedEvent = true));
      await vm.suspend();
      const path = offload.backingPath!;
      await vm.resume(); // at once: 256 MiB are still being written
      const f = vm.memoryUsage().strategies.find((s) => s.strategy === 'offload')!.figures;
      expect(f.lastReleaseCancelled).toBe(1);
      expect(f.pagesWritten).toBeLessThan((256 * MiB) / 4096);
      expect(existsSync(path)).toBe(false);
      expect((await vm.probe.digest()).hex).toBe(want);
      await new Promise((r) => setTimeout(r, 50));
      expect(releasedEvent).toBe(false); // a release overtaken by a resume says nothing
    } finally {
      await vm.stop();
    }
  });

  it('stopping during the write-out neither hangs nor leaks; the file is removed', async () => {
    const fds = readdirSync('/proc/self/fd').length;
    const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, strategies: [new Offload()] });
    await vm.probe.fill({ sizeMiB: 128, content: 'random', seed: 6 });
    await vm.suspend();
    const path = readdirSync(DEFAULT_BACKING_DIR).filter((n) => n.startsWith(`pvisor-${vm.name}-${process.pid}-`));
    expect(path.length).toBe(1);
    await vm.stop();
    expect(vm.state).toBe('stopped');
    expect(existsSync(join(DEFAULT_BACKING_DIR, path[0]))).toBe(false);
    await new Promise((r) => setTimeout(r, 200)); // the write in flight ends, its fd closes
    expect(readdirSync('/proc/self/fd').length).toBeLessThanOrEqual(fds + 1); // Node may open one of its own
    expect(existsSync(join(DEFAULT_BACKING_DIR, path[0]))).toBe(false);
  });

  it('the backing file is removed when a suspended VM stops', async () => {
    let path = '';
    await withOffloadVm(async (vm, offload) => {
      await vm.suspend();
      await vm.memoryReleased(); // suspend resolves before the write-out ends
      path = offload.backingPath!;
      expect(existsSync(path)).toBe(true);
    });
    expect(existsSync(path)).toBe(false);
  });
});
