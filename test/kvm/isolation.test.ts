// Several VMs in one process, and a misbehaving guest ending only its own VM. Needs /dev/kvm.
import { GuestCrashError, Vm } from '../../src';
import { hexOf } from '../probe-digest';

const MiB = 1024 * 1024;

describe('several VMs and crash isolation', () => {
  it('runs two VMs at once with independent working sets', async () => {
    const [a, b] = await Promise.all([Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 1 }), Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 2 })]);
    try {
      await Promise.all([a.probe.fill({ sizeMiB: 16, content: 'random', seed: 1 }), b.probe.fill({ sizeMiB: 16, content: 'random', seed: 2 })]);
      const [da, db] = await Promise.all([a.probe.digest(), b.probe.digest()]);
      expect(da.hex).toBe(hexOf({ content: 'random', seed: 1, sizeBytes: 16 * MiB, rewrites: [] }));
      expect(db.hex).toBe(hexOf({ content: 'random', seed: 2, sizeBytes: 16 * MiB, rewrites: [] }));
      expect(a.memoryUsage().vmsInProcess).toBe(2);
      // Each VM's figure is its own RAM only (adjacent RAM mappings must not be counted together).
      for (const vm of [a, b]) {
        expect(vm.memoryUsage().guestRamPssBytes).toBeGreaterThan(16 * MiB);
        expect(vm.memoryUsage().guestRamPssBytes).toBeLessThan(17 * MiB);
      }
    } finally {
      await a.stop();
      await b.stop();
    }
  });

  it.each([
    ['triple-fault', 'shutdown'],
    ['stray-mmio', 'unhandled-mmio'],
    ['abort', 'guest-abort'],
  ] as const)('a guest %s ends only that VM, with a crash event', async (kind, reason) => {
    const victim = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 2 });
    const bystander = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1 });
    try {
      const crashed = new Promise<Error>((resolve) => victim.once('crash', resolve));
      await victim.probe.fill({ sizeMiB: 1, content: 'random' });
      victim.probe.fault(kind);
      // Queued behind the fault, this request is in flight when the guest dies: the crash fails it.
      const inFlight = victim.probe.digest().then(() => 'answered', (e: Error) => e);
      const err = await crashed;
      expect(err).toBeInstanceOf(GuestCrashError);
      expect((err as GuestCrashError).reason).toBe(reason);
      expect(victim.state).toBe('crashed');
      expect(await inFlight).toBeInstanceOf(GuestCrashError);
      await expect(victim.probe.digest()).rejects.toThrow(GuestCrashError);
      await bystander.probe.fill({ sizeMiB: 4, content: 'repetitive', seed: 4 });
      expect((await bystander.probe.digest()).hex).toBe(hexOf({ content: 'repetitive', seed: 4, sizeBytes: 4 * MiB, rewrites: [] }));
    } finally {
      await victim.stop();
      await bystander.stop();
    }
  });
});

