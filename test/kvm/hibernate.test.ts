// Vm.hibernate and the restore that continues it, on real KVM with the probe guest: the VM's state
// goes to a private directory on disk and the VM ends, its RAM freed; Vm.restore brings the same
// VM back (same name, same digest, RAM loaded lazily), consumes the directory and is refused a
// second time; a failed hibernation leaves the VM as it was. Needs /dev/kvm.
import { existsSync, mkdtempSync, readdirSync, rmSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { Offload, SnapshotError, Vm, VmStateError } from '../../src';
import { processResident, rangeResident } from '../../src/memory-usage';
import { hexOf } from '../probe-digest';

// The first test compares the process's PSS before and after the VM leaves it. The process also
// gives back its own idle pages a moment after a VM starts (src/sys/process-pages.ts, tested in
// test/unit/process-pages.test.ts), which would move the rest of the process between the two
// readings by more than the guest RAM's slack: here it keeps them.
process.env.PVISOR_KEEP_PROCESS_PAGES = '1';

const MiB = 1024 * 1024;
const ws = { content: 'random' as const, seed: 42, sizeBytes: 16 * MiB, rewrites: [] };
const fmt = (bytes: number) => `${(bytes / MiB).toFixed(1)} MiB`;

describe('Vm.hibernate and Vm.restore of a hibernated VM (probe guest)', () => {
  let base: string;
  const vms: Vm[] = [];
  beforeEach(() => {
    // On a disk, as a hibernated VM must be.
    base = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-hibernate-test-'));
  });
  afterEach(async () => {
    for (const vm of vms.splice(0)) await vm.stop();
    rmSync(base, { recursive: true, force: true });
  });

  async function started(name: string): Promise<Vm> {
    const vm = await Vm.start({ guest: 'probe', memory: '128MiB', vcpus: 1, name, strategies: [new Offload({ dir: base })] });
    vms.push(vm);
    await vm.probe.fill({ sizeMiB: 16, content: 'random', seed: 42 });
    return vm;
  }

  it('writes the VM into a private directory, ends it and frees its RAM; the restore is the same VM, lazily loaded, and consumes the directory', async () => {
    const vm = await started('H1');
    expect((await vm.probe.digest()).hex).toBe(hexOf(ws));
    const before = vm.memoryUsage();
    expect(before.guestRamPssBytes).toBeGreaterThanOrEqual(16 * MiB);
    // Where its guest RAM is mapped (internal: the test reads it to look at that range afterwards).
    const ram = (vm as unknown as { machine: { memory: { hostAddr: number; sizeBytes: number } } }).machine.memory;
    expect(rangeResident(ram.hostAddr, ram.sizeBytes).pssBytes).toBeGreaterThanOrEqual(16 * MiB);
    const ended = new Promise<{ state: string; hibernatedTo?: string }>((resolve) => vm.once('exit', resolve));

    const dir = join(base, 'H1');
    const info = await vm.hibernate(dir);
    expect(await ended).toEqual({ state: 'stopped', hibernatedTo: dir });
    expect(vm.state).toBe('stopped');
    expect(() => vm.memoryUsage()).toThrow(VmStateError);
    const after = processResident();
    // Private: the directory 0700, its files 0400, only what the guest wrote on disk.
    expect(statSync(dir).mode & 0o777).toBe(0o700);
    expect(readdirSync(dir).sort()).toEqual(['manifest.json', 'ram', 'state.json']);
    for (const f of readdirSync(dir)) expect(statSync(join(dir, f)).mode & 0o777).toBe(0o400);
    expect(info.ramDataPageCount).toBeGreaterThanOrEqual((16 * MiB) / 4096);
    expect(info.bytesOnDisk).toBeGreaterThanOrEqual(16 * MiB);
    expect(info.bytesOnDisk).toBeLessThan(24 * MiB);
    // Its guest RAM left the process with it: nothing of it is resident where it was mapped, and
    // the process shrank by most of it. (Not by all of it: writing the directory grows node's heap
    // and malloc arenas by a few MiB that the two readings cannot tell apart from guest RAM; in
    // CI, 16.0 MiB of guest RAM left and the process shrank by 9.5 MiB.)
    expect(rangeResident(ram.hostAddr, ram.sizeBytes).pssBytes).toBeLessThan(1 * MiB);
    expect(before.processPssBytes - after.pssBytes).toBeGreaterThanOrEqual(before.guestRamPssBytes / 2);

    const t0 = performance.now();
    const back = await Vm.restore(dir, { strategies: [new Offload({ dir: base })] });
    const readyMs = performance.now() - t0;
    vms.push(back);
    expect(back.name).toBe('H1');
    expect(back.restoreInfo).toMatchObject({ hibernated: true, ramLoad: 'lazy', dir });
    expect(existsSync(dir)).toBe(false);
    expect((await back.probe.digest()).hex).toBe(hexOf(ws));
    const resumed = back.memoryUsage();
    process.stdout.write(
      `hibernate figures (probe, 128 MiB, 16 MiB random): hibernate ${info.ms.toFixed(1)} ms, ${fmt(info.bytesOnDisk)} on disk; ` +
        `process PSS ${fmt(before.processPssBytes)} (guest RAM ${fmt(before.guestRamPssBytes)}) -> ${fmt(after.pssBytes)} hibernated; ` +
        `restore to ready ${readyMs.toFixed(1)} ms (RAM ${back.restoreInfo!.ramMs.toFixed(1)} ms, ${back.restoreInfo!.ramLoad}); after a digest guest RAM ${fmt(resumed.guestRamPssBytes)}, process ${fmt(resumed.processPssBytes)}\n`,
    );

    // It is a VM like any other: it suspends, resumes and hibernates again.
    await back.suspend();
    await back.memoryReleased();
    await back.resume();
    expect((await back.probe.digest()).hex).toBe(hexOf(ws));
    await back.hibernate(dir);
    const again = await Vm.restore(dir, { name: 'H1b' });
    vms.push(again);
    expect(again.name).toBe('H1b');
    expect((await again.probe.digest()).hex).toBe(hexOf(ws));
  }, 300000);

  it('a hibernated VM is restored once: a second restore while the first runs is refused; keep leaves the directory', async () => {
    const vm = await started('H2');
    const dir = join(base, 'H2');
    await vm.hibernate(dir);
    const [first, second] = await Promise.allSettled([Vm.restore(dir), Vm.restore(dir)]);
    const won = [first, second].filter((r) => r.status === 'fulfilled') as PromiseFulfilledResult<Vm>[];
    const lost = [first, second].filter((r) => r.status === 'rejected') as PromiseRejectedResult[];
    won.forEach((r) => vms.push(r.value));
    expect(won).toHaveLength(1);
    expect(lost).toHaveLength(1);
    expect(lost[0].reason).toBeInstanceOf(SnapshotError);
    expect(String(lost[0].reason.message)).toMatch(new RegExp(`is being restored by process ${process.pid}: a hibernated VM is restored once`));
    // And once it is restored there is nothing left to restore.
    await expect(Vm.restore(dir)).rejects.toThrow(SnapshotError);

    const vm2 = won[0].value;
    await vm2.hibernate(dir);
    const kept = await Vm.restore(dir, { keep: true });
    vms.push(kept);
    expect(readdirSync(dir).sort()).toEqual(['manifest.json', 'ram', 'state.json']);
    await kept.stop();
    const again = await Vm.restore(dir);
    vms.push(again);
    expect((await again.probe.digest()).hex).toBe(hexOf(ws));
    expect(existsSync(dir)).toBe(false);
  }, 300000);

  it('a failed hibernation leaves the VM as it was: beforeStop throws, the directory is emptied; a suspended VM is refused', async () => {
    const vm = await started('H3');
    const dir = join(base, 'H3');
    await expect(vm.hibernate(dir, { beforeStop: () => { throw new Error('no record'); } })).rejects.toThrow('no record');
    expect(vm.state).toBe('running');
    expect(existsSync(dir)).toBe(false);
    expect((await vm.probe.digest()).hex).toBe(hexOf(ws));

    await vm.suspend();
    await expect(vm.hibernate(dir)).rejects.toThrow(/H3 is suspended; this needs it running or paused/);
    expect(existsSync(dir)).toBe(false);
    await vm.resume();
    // A directory that is not empty is refused before anything is paused.
    const full = join(base, 'full');
    require('node:fs').mkdirSync(full);
    require('node:fs').writeFileSync(join(full, 'x'), 'x');
    await expect(vm.hibernate(full)).rejects.toThrow(/is not empty/);
    expect(readdirSync(full)).toEqual(['x']);
    expect((await vm.probe.digest()).hex).toBe(hexOf(ws));
  }, 300000);
});
