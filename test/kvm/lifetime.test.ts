// Lifetimes (Vm.start's timeoutMs and onTimeout, vm.setTimeout) and the async stop, on real KVM
// with the probe guest. Kept short: lifetimes of 1-2 s.
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { Offload, Vm, VmStateError, type TimeoutAction } from '../../src';

const MiB = 2 ** 20;

describe('VM lifetimes', () => {
  let dir: string;
  beforeEach(() => {
    // On a disk: Offload refuses a tmpfs backing directory.
    dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-lifetime-'));
  });
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  it("onTimeout 'suspend': warned, then suspended with Offload (RAM released); a resume brings the same RAM back and the lifetime again", async () => {
    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1, strategies: [new Offload({ dir })], onTimeout: 'suspend' });
    try {
      expect(vm.expiresAt).toBeUndefined(); // no timeoutMs: no limit until setTimeout
      await vm.probe.fill({ sizeMiB: 16, content: 'random', seed: 11 });
      const digest = (await vm.probe.digest()).hex;
      const seen: string[] = [];
      const warned = new Promise<{ remainingMs: number; onTimeout: TimeoutAction }>((resolve) => vm.once('timeout-warning', (w) => (seen.push('warning'), resolve(w))));
      const ended = new Promise<{ onTimeout: TimeoutAction; error?: Error }>((resolve) => vm.once('timeout', (t) => (seen.push(`timeout in ${vm.state}`), resolve(t))));
      const t0 = Date.now();
      vm.setTimeout(2000);
      expect(vm.expiresAt!.getTime()).toBeGreaterThanOrEqual(t0 + 2000);
      const warning = await warned;
      // Half the lifetime before its end, as it is shorter than 20 s.
      expect(warning.onTimeout).toBe('suspend');
      expect(warning.remainingMs).toBeGreaterThan(0);
      expect(warning.remainingMs).toBeLessThanOrEqual(1000);
      expect(vm.state).toBe('running');
      expect(await ended).toEqual({ onTimeout: 'suspend' });
      expect(Date.now() - t0).toBeGreaterThanOrEqual(2000);
      expect(seen).toEqual(['warning', 'timeout in suspended']);
      expect(vm.expiresAt).toBeUndefined();
      await vm.memoryReleased();
      expect(vm.memoryUsage().guestRamRssBytes).toBeLessThan(MiB);

      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(digest);
      // Resumed after its lifetime suspended it: the same lifetime again, from the resume.
      expect(vm.expiresAt).toBeDefined();
      vm.setTimeout(null);
      expect(vm.expiresAt).toBeUndefined();
    } finally {
      await vm.stop();
    }
  });

  it("timeoutMs with onTimeout 'stop' ends the VM; setTimeout extended it once; await stop() resolves with everything freed", async () => {
    const vm = await Vm.start({ guest: 'probe', memory: '32MiB', vcpus: 1, timeoutMs: 1200, onTimeout: 'stop', labels: { test: 'lifetime' } });
    let warnings = 0;
    vm.on('timeout-warning', () => {
      // The first warning extends the lifetime once: the VM must outlive the first deadline.
      if (++warnings === 1) vm.setTimeout(1200);
    });
    const t0 = Date.now();
    const exit = new Promise<{ state: string }>((resolve) => vm.once('exit', resolve));
    const timedOut = new Promise<{ onTimeout: TimeoutAction }>((resolve) => vm.once('timeout', resolve));
    expect(await exit).toEqual({ state: 'stopped' });
    expect(await timedOut).toEqual({ onTimeout: 'stop' });
    expect(warnings).toBe(2);
    expect(Date.now() - t0).toBeGreaterThanOrEqual(1500); // two deadlines of 1200 ms, the second set 600 ms in
    expect((await Vm.list({ labels: { test: 'lifetime' } })).length).toBe(0);
    expect(() => vm.setTimeout(1000)).toThrow(VmStateError);

    // stop() is async: it returns a promise, resolved once the teardown is done, as often as asked.
    const other = await Vm.start({ guest: 'probe', memory: '32MiB', vcpus: 1, labels: { test: 'lifetime' } });
    expect((await Vm.list({ labels: { test: 'lifetime' } })).map((e) => e.name)).toEqual([other.name]);
    const stopping = other.stop();
    expect(stopping).toBeInstanceOf(Promise);
    expect(other.state).toBe('stopped'); // at once; the promise says when it is freed
    await expect(stopping).resolves.toBeUndefined();
    await expect(other.stop()).resolves.toBeUndefined();
    expect(() => other.memoryUsage()).toThrow(VmStateError);
    expect(await Vm.list({ labels: { test: 'lifetime' } })).toEqual([]);
  });

  it("onTimeout 'hibernate': the VM goes to hibernateDir and ends; restored, it is the same VM, with its name and labels", async () => {
    const to = join(dir, 'hibernated');
    const vm = await Vm.start({ guest: 'probe', memory: '32MiB', vcpus: 1, name: 'sleeper', labels: { test: 'lifetime', role: 'sleeper' }, onTimeout: 'hibernate', hibernateDir: to });
    await vm.probe.fill({ sizeMiB: 4, content: 'random', seed: 5 });
    const digest = (await vm.probe.digest()).hex;
    const exit = new Promise<{ hibernatedTo?: string }>((resolve) => vm.once('exit', resolve));
    const timedOut = new Promise<{ onTimeout: TimeoutAction; hibernatedTo?: string }>((resolve) => vm.once('timeout', resolve));
    vm.setTimeout(500);
    expect(await timedOut).toEqual({ onTimeout: 'hibernate', hibernatedTo: to });
    expect((await exit).hibernatedTo).toBe(to);
    expect(vm.state).toBe('stopped');
    const back = await Vm.restore(to);
    try {
      expect(back.name).toBe('sleeper');
      expect(back.labels).toEqual({ test: 'lifetime', role: 'sleeper' });
      expect(back.expiresAt).toBeUndefined(); // a lifetime is the restoring caller's to give
      expect((await back.probe.digest()).hex).toBe(digest);
    } finally {
      await back.stop();
    }
  });
});
