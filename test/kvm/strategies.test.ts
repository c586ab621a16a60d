// Memory strategies on real guest pages: IdleRelease, KsmAdvice, and the periodic work the
// memory layer runs for strategies that act while the guest runs. Needs /dev/kvm.
import { readFileSync, writeFileSync } from 'node:fs';
import { GuestRequestError, IdleRelease, KsmAdvice, Vm, type MemoryStrategy, type VmOptions } from '../../src';

const MiB = 2 ** 20;
const KSM = '/sys/kernel/mm/ksm';

// Jest's module sandbox has no Symbol.asyncDispose on Node 20, so no `await using` here.
async function withVms(options: VmOptions[], body: (vms: Vm[]) => Promise<void>): Promise<void> {
  const vms: Vm[] = [];
  try {
    for (const o of options) vms.push(await Vm.start({ guest: 'probe', vcpus: 1, memory: '128MiB', ...o }));
    await body(vms);
  } finally {
    for (const vm of vms) await vm.stop();
  }
}

const figure = (vm: Vm, strategy: string, name: string) => vm.memoryUsage().strategies.find((s) => s.strategy === strategy)?.figures[name];

describe('IdleRelease', () => {
  it('without it the balloon offers no free page reporting, and release says so', () =>
    withVms([{}], async ([vm]) => {
      await vm.probe.fill({ sizeMiB: 8, content: 'random' });
      const err = await vm.probe.release().catch((e: unknown) => e);
      expect(err).toBeInstanceOf(GuestRequestError);
      expect((err as GuestRequestError).guestCode).toBe(4);
      expect(vm.memoryUsage().guestRamPssBytes).toBeGreaterThan(8 * MiB);
    }));

  it('with it the host drops what the guest frees and counts the pages', () =>
    withVms([{ memory: '256MiB', vcpus: 2, strategies: [new IdleRelease()] }], async ([vm]) => {
      await vm.probe.fill({ sizeMiB: 48, content: 'random', seed: 3 });
      const before = vm.memoryUsage().guestRamPssBytes;
      await vm.probe.release({ offsetMiB: 16, sizeMiB: 32 });
      expect(before - vm.memoryUsage().guestRamPssBytes).toBeGreaterThan(31 * MiB);
      expect(figure(vm, 'idle-release', 'pagesReleased')).toBe((32 * MiB) / 4096);
    }));
});

describe('KsmAdvice', () => {
  const saved: Record<string, string> = {};
  const setKsm = (name: string, value: string) => {
    saved[name] ??= readFileSync(`${KSM}/${name}`, 'utf8').trim();
    writeFileSync(`${KSM}/${name}`, value);
  };
  afterAll(() => {
    for (const [name, value] of Object.entries(saved)) writeFileSync(`${KSM}/${name}`, value);
  });

  it('every guest RAM mapping accepted the advice; with KSM off it says so and claims nothing', () =>
    withVms([{ strategies: [new KsmAdvice()] }], async ([vm]) => {
      setKsm('run', '0');
      const st = vm.memoryUsage().strategies[0];
      expect(st.figures.advisedMappings).toBeGreaterThanOrEqual(1);
      expect(st.notes.join(' ')).toMatch(/KSM is not running on this host/);
    }));

  it('with KSM on, identical pages of two VMs are merged', async () => {
    if (process.getuid?.() !== 0) return; // turning KSM on needs root; the rest of this file does not
    setKsm('pages_to_scan', '4096');
    setKsm('sleep_millisecs', '10');
    setKsm('run', '1');
    await withVms([{ strategies: [new KsmAdvice()] }, { strategies: [new KsmAdvice()] }], async ([a, b]) => {
      await Promise.all([a.probe.fill({ sizeMiB: 8, content: 'random', seed: 77 }), b.probe.fill({ sizeMiB: 8, content: 'random', seed: 77 })]);
      const merged = () => figure(a, 'ksm-advice', 'guestPagesMerged') ?? figure(a, 'ksm-advice', 'processPagesMerged') ?? 0;
      const deadline = Date.now() + 150_000;
      while (merged() < 2048 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 1000));
      // 2048 pages of identical content per VM: at least that many pages end up merged.
      expect(merged()).toBeGreaterThanOrEqual(2048);
      expect((await a.probe.digest()).hex).toBe((await b.probe.digest()).hex);
    });
  }, 200_000);
});

describe('periodic work of a strategy', () => {
  it('ticks while the guest runs, within its CPU share, never while paused or suspended, and not after stop', async () => {
    const ticks: { at: number; state: string }[] = [];
    let vm: Vm | undefined;
    const busyMs = 20;
    const scanner: MemoryStrategy = {
      name: 'scanner',
      needs: [],
      exclusive: [],
      periodic: { intervalMs: 10, cpuShare: 0.25 },
      tick: () => {
        ticks.push({ at: performance.now(), state: vm!.state });
        const until = performance.now() + busyMs;
        while (performance.now() < until); // a tick that costs CPU
      },
      stats: () => ({ strategy: 'scanner', figures: { ticks: ticks.length }, notes: [] }),
    };
    vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1, strategies: [scanner] });
    try {
      await new Promise((r) => setTimeout(r, 700));
      const running = ticks.length;
      // 20 ms of work at a 25% share: one tick per 80 ms at most, so about 8 in 700 ms.
      expect(running).toBeGreaterThanOrEqual(3);
      expect(running).toBeLessThanOrEqual(10);
      for (let i = 1; i < ticks.length; i++) expect(ticks[i].at - ticks[i - 1].at).toBeGreaterThanOrEqual(busyMs / 0.25 - 5);
      await vm.pause();
      await new Promise((r) => setTimeout(r, 300));
      await vm.resume();
      await vm.suspend();
      await new Promise((r) => setTimeout(r, 300));
      await vm.resume();
      await new Promise((r) => setTimeout(r, 300));
      expect(ticks.every((t) => t.state === 'running')).toBe(true);
      expect(ticks.length).toBeGreaterThan(running);
    } finally {
      await vm.stop();
    }
    const atStop = ticks.length;
    await new Promise((r) => setTimeout(r, 300));
    expect(ticks.length).toBe(atStop);
  });
});
