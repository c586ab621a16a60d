// The foundation on real KVM: the probe guest in a 512 MiB, 2-vCPU VM. Needs /dev/kvm (on a host
// without one, `npm test` runs this file inside scripts/nested-kvm.sh).
import { IdleRelease, Vm } from '../../src';
import { hexOf } from '../probe-digest';
import type { ProbeWorkingSet } from '../../src/guest/probe-content';

const MiB = 1024 * 1024;

describe('probe guest on KVM', () => {
  let vm: Vm;
  beforeAll(async () => {
    vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, strategies: [new IdleRelease()] });
  });
  afterAll(() => vm?.stop());

  it('boots to running with 2 vCPUs and 512 MiB', () => {
    expect(vm.state).toBe('running');
    expect(vm.vcpus).toBe(2);
    expect(vm.memoryBytes).toBe(512 * MiB);
  });

  it('guest RAM costs the host about nothing before a fill, and about 64 MiB more after', async () => {
    const before = vm.memoryUsage();
    expect(before.guestRamPssBytes).toBeLessThan(8 * MiB);
    await vm.probe.fill({ sizeMiB: 64, content: 'repetitive', seed: 3 });
    const after = vm.memoryUsage();
    const grown = after.guestRamPssBytes - before.guestRamPssBytes;
    expect(grown).toBeGreaterThan(63 * MiB);
    expect(grown).toBeLessThan(66 * MiB);
  });

  it('a 64 MiB repetitive fill digests in the guest to the host-computed value', async () => {
    await vm.probe.fill({ sizeMiB: 64, content: 'repetitive', seed: 11 });
    const d = await vm.probe.digest();
    expect(d.bytes).toBe(64 * MiB);
    expect(d.hex).toBe(hexOf({ content: 'repetitive', seed: 11, sizeBytes: 64 * MiB, rewrites: [] }));
  });

  it.each([
    ['random', 64, 42, 7],
    ['compressible', 16, 21, 8],
  ] as const)('a %s fill of %d MiB digests to the host-computed value, and a rewrite changes it as predicted', async (content, sizeMiB, seed, rewriteSeed) => {
    await vm.probe.fill({ sizeMiB, content, seed });
    const ws: ProbeWorkingSet = { content, seed, sizeBytes: sizeMiB * MiB, rewrites: [] };
    expect((await vm.probe.digest()).hex).toBe(hexOf(ws));
    const r = await vm.probe.rewrite({ fraction: 0.25, seed: rewriteSeed });
    expect(r.pagesRewritten).toBe((sizeMiB * MiB) / 4096 / 4);
    ws.rewrites.push({ permille: 250, seed: rewriteSeed });
    expect((await vm.probe.digest()).hex).toBe(hexOf(ws));
  });

  it('pause and resume keep the working set and the digest', async () => {
    await vm.probe.fill({ sizeMiB: 16, content: 'random', seed: 5 });
    const before = await vm.probe.digest();
    await vm.pause();
    expect(vm.state).toBe('paused');
    // A request made while paused waits for resume instead of failing.
    const during = vm.probe.digest();
    await vm.resume();
    expect(vm.state).toBe('running');
    expect((await during).hex).toBe(before.hex);
    expect((await vm.probe.digest()).hex).toBe(before.hex);
  });

  it('touch reads the hot part of the working set', async () => {
    await vm.probe.fill({ sizeMiB: 8, content: 'repetitive' });
    const t = await vm.probe.touch({ hotMiB: 4, rounds: 3 });
    expect(t.pagesTouched).toBe(3 * 1024);
  });

  it('release reports the range through free page reporting and the host drops it', async () => {
    await vm.probe.fill({ sizeMiB: 32, content: 'random', seed: 9 });
    const before = vm.memoryUsage().guestRamPssBytes;
    const r = await vm.probe.release({ offsetMiB: 0, sizeMiB: 32 });
    expect(r.bytesReported).toBe(32 * MiB);
    const after = vm.memoryUsage().guestRamPssBytes;
    expect(before - after).toBeGreaterThan(31 * MiB);
  });

  it('guest-side bad arguments are typed errors and the VM goes on', async () => {
    await expect(vm.probe.fill({ sizeMiB: 1024, content: 'random' })).rejects.toThrow(/refused/);
    await expect(vm.probe.release({ offsetMiB: 600, sizeMiB: 4 })).rejects.toThrow(/refused/);
    await vm.probe.fill({ sizeMiB: 4, content: 'random', seed: 1 });
    expect((await vm.probe.digest()).bytes).toBe(4 * MiB);
  });

  it('speaks through its doorbell page, with IOPL 0 (no port I/O): exits, idle and park', async () => {
    // The probe runs at IOPL 0, so a single `in` or `out` would have been a triple fault by now;
    // both vCPUs got here by ringing the doorbell (vCPU 1 parks there, vCPU 0 idles there).
    const storm = await vm.probe.exitStorm(500);
    expect(storm.exits).toBe(500);
    expect(vm.state).toBe('running');
  });

  it('its console text and abort code reach the VMM through the doorbell', async () => {
    const other = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1 });
    try {
      const lines: string[] = [];
      other.on('console', (line) => lines.push(line));
      const crashed = new Promise<Error>((resolve) => other.once('crash', resolve));
      other.probe.fault('abort');
      expect((await crashed).message).toMatch(/aborted with code 255/);
      expect(lines.join('\n')).toMatch(/probe: abort 0xff: FAULT 3 requested/);
    } finally {
      await other.stop();
    }
  });

  it('zero writes zeros over part of the working set, as the host model predicts', async () => {
    await vm.probe.fill({ sizeMiB: 8, content: 'random', seed: 77 });
    const z = await vm.probe.zero({ offsetMiB: 2, sizeMiB: 1 });
    expect(z.bytes).toBe(MiB);
    const ws: ProbeWorkingSet = { content: 'random', seed: 77, sizeBytes: 8 * MiB, rewrites: [], zeroed: [{ offset: 2 * MiB, length: MiB }] };
    expect((await vm.probe.digest()).hex).toBe(hexOf(ws));
    await expect(vm.probe.zero({ offsetMiB: 7, sizeMiB: 2 })).rejects.toThrow(/beyond the working set/);
  });
});
