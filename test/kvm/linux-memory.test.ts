// Every memory strategy on the guest users run: a process in the Linux guest (pvisor-workset, in
// the shipped initramfs) holds a working set, and after each strategy has taken the guest's RAM
// away and brought it back, the guest digests it exactly as the host's model says. Needs a
// /dev/kvm that runs guest kernel code (hardware virtualisation, or the nested harness:
// scripts/with-kvm.js --linux).
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { ColdCompression, CompressedOffload, IdleRelease, Offload, SharedSnapshot, Vm, type MemoryStrategy } from '../../src';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { LinuxWorkingSet } from '../../src/guest/linux-workset';

const SLOW = process.env.PVISOR_NESTED === '1' ? 10 : 1;
const BOOT_TIMEOUT_MS = 180_000;
const MiB = 2 ** 20;
// On a disk, as backings and snapshots are kept.
const dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-linux-memory-'));
const vms: Vm[] = [];
// Each case's VMs end with it: in the nested harness's two emulated CPUs, the five Linux guests
// the earlier cases left idling slowed the last case's boot past its timeout (CI, stop 31).
afterEach(async () => {
  for (const vm of vms.splice(0)) await vm.stop();
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function boot(strategies: MemoryStrategy[]): Promise<{ vm: Vm; ws: LinuxWorkingSet }> {
  const vm = await Vm.start({ memory: '256MiB', vcpus: 2, strategies, bootTimeoutMs: BOOT_TIMEOUT_MS });
  vms.push(vm);
  return { vm, ws: await LinuxWorkingSet.start(vm) };
}

/** Polls `check` until it is true or `ms` have passed; returns its last value. */
async function eventually(check: () => boolean | Promise<boolean>, ms: number): Promise<boolean> {
  const end = performance.now() + ms;
  for (;;) {
    if (await check()) return true;
    if (performance.now() > end) return false;
    await sleep(250);
  }
}

const guestRamMiB = (vm: Vm) => vm.memoryUsage().guestRamPssBytes / MiB;

describe('the Linux guest\'s working set through every strategy', () => {
  it('idle release of a part, an eager offload, and SharedSnapshot clones with a rewrite in one of them', async () => {
    const { vm, ws } = await boot([new IdleRelease(), new Offload({ dir })]);
    await ws.fill({ sizeMiB: 16, content: 'random', seed: 42 });
    await ws.check();
    // The program frees a quarter of its heap: the guest reports it, the host drops it.
    const before = guestRamMiB(vm);
    await ws.release({ offsetMiB: 4, sizeMiB: 4 });
    expect(await eventually(() => guestRamMiB(vm) < before - 3, 20_000 * SLOW)).toBe(true);
    await ws.check();

    await vm.suspend();
    await vm.memoryReleased();
    expect(vm.memoryUsage().guestRamPssBytes).toBe(0);
    await vm.resume();
    await ws.check();

    const snap = join(dir, 'snapshot');
    await vm.snapshot(snap);
    const model = ws.model;
    const clones: Vm[] = [];
    for (const name of ['lmem-a', 'lmem-b']) {
      const clone = await Vm.restore(snap, { name, strategies: [new SharedSnapshot()], readyTimeoutMs: 60_000 * SLOW });
      vms.push(clone);
      clones.push(clone);
    }
    const [a, b] = clones.map((c) => LinuxWorkingSet.attach(c, model));
    await a.rewrite({ fraction: 0.5, seed: 7 });
    await a.check();
    await b.check();
    await ws.check();
    expect(a.expectedDigest()).not.toBe(b.expectedDigest());
  }, 240_000 * SLOW);

  it('a lazy offload brings the working set back as the guest touches it', async () => {
    const { vm, ws } = await boot([new Offload({ dir, reload: 'lazy' })]);
    await ws.fill({ sizeMiB: 16, content: 'compressible', seed: 5 });
    await vm.suspend();
    await vm.memoryReleased();
    expect(vm.memoryUsage().guestRamPssBytes).toBe(0);
    await vm.resume();
    await ws.check();
    await ws.rewrite({ fraction: 0.3 });
    await ws.check();
  }, 120_000 * SLOW);

  it('a compressed offload', async () => {
    const { vm, ws } = await boot([new CompressedOffload({ dir })]);
    await ws.fill({ sizeMiB: 16, content: 'repetitive', seed: 3 });
    await vm.suspend();
    await vm.memoryReleased();
    await vm.resume();
    await ws.check();
  }, 120_000 * SLOW);

  it('cold compression takes the idle working set and gives it back on touch', async () => {
    const cold = new ColdCompression({ coldAfterMs: 1000 });
    const { vm, ws } = await boot([cold]);
    await ws.fill({ sizeMiB: 16, content: 'repetitive', seed: 9 });
    const stored = () => (vm.memoryUsage().strategies.find((s) => s.strategy === 'cold-compression')?.figures.blocksStored ?? 0);
    // 16 MiB are 256 blocks of 64 KiB; the guest's own pages may go cold too.
    expect(await eventually(() => stored() >= 128, 60_000 * SLOW)).toBe(true);
    await ws.check();
  }, 120_000 * SLOW);
});
