// Many VMs in one process, each suspended and resumed over and over by `pvisor bench soak`'s
// loop, every strategy among them: every byte survives every cycle, and stopping them leaves
// nothing behind. The bench runs the long version (`pvisor bench soak --vms 8 --cycles 100`).
// Needs /dev/kvm.
import { readdirSync } from 'node:fs';
import { CompressedOffload, Vm, type MemoryStrategy } from '../../src';
import { SOAK_STRATEGIES, soakVm } from '../../src/bench/soak';
import type { ProbeWorkingSet } from '../../src/guest/probe-content';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { hexOf } from '../probe-digest';
import { processThreads } from '../process-threads';

const MiB = 2 ** 20;
const CYCLES = 20;
const keptWorkers = (dir: string) => [new CompressedOffload({ dir, keepWorkers: true })];
/**
 * Every strategy of the bench, CompressedOffload with its workers kept: started for each
 * operation they would cost the test 40 worker starts per VM, seconds each in the nested harness
 * (the bench's compressed-offload measures that way).
 */
const STRATEGIES: [string, (dir: string) => MemoryStrategy[]][] = [
  ...['offload-eager', 'offload-lazy', 'none', 'idle-release', 'offload-eager', 'offload-lazy'].map((name): [string, (dir: string) => MemoryStrategy[]] => [name, SOAK_STRATEGIES[name]]),
  ['compressed-offload, kept workers', keptWorkers],
  ['compressed-offload, kept workers', keptWorkers],
];

describe('soak', () => {
  it(`8 VMs in one process, ${CYCLES} suspend/resume cycles each, all at once: every digest intact every time, nothing left after`, async () => {
    // What a process opens once for all its VMs (guest RAM's SIGBUS guard) is open before the count.
    await (await Vm.start({ guest: 'probe', memory: '16MiB', vcpus: 1 })).stop();
    await new Promise((r) => setTimeout(r, 50));
    const threadsBefore = processThreads();
    const fdsBefore = readdirSync('/proc/self/fd').length;
    const ours = () => readdirSync(DEFAULT_BACKING_DIR).filter((n) => n.startsWith('pvisor-') && n.includes(`-${process.pid}-`));
    const vms: Vm[] = [];
    try {
      const sets: ProbeWorkingSet[] = STRATEGIES.map((_, i) => ({ content: 'random', seed: 500 + i, sizeBytes: 4 * MiB, rewrites: [] }));
      for (const [i, [, make]] of STRATEGIES.entries()) {
        const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1, strategies: make(DEFAULT_BACKING_DIR) });
        vms.push(vm);
        await vm.probe.fill({ sizeMiB: 4, content: 'random', seed: sets[i].seed });
      }
      const digests = sets.map(hexOf);
      const results = await Promise.all(vms.map((vm, i) => soakVm(vm, digests[i], CYCLES)));
      for (const [i, r] of results.entries()) {
        const strategy = STRATEGIES[i][0];
        expect({ strategy, cycles: r.cycles, failures: r.failures, firstFailure: r.firstFailure }).toEqual({ strategy, cycles: CYCLES, failures: 0, firstFailure: undefined });
        expect(r.cycleMs).toHaveLength(CYCLES);
      }
      // Checked here too, not only by the loop under test.
      for (const [i, vm] of vms.entries()) {
        expect(vm.state).toBe('running');
        expect((await vm.probe.digest()).hex).toBe(digests[i]);
      }
    } finally {
      for (const vm of vms) await vm.stop();
    }
    // What ends in the background once the VMs have stopped: kept compression workers terminate,
    // closed sockets' handles go, backing files are unlinked on libuv's pool. Given up to a
    // minute (the nested harness is slow), what is still there then has leaked.
    const ended = () => processThreads() === threadsBefore && readdirSync('/proc/self/fd').length <= fdsBefore + 1 && !ours().length;
    for (const t0 = Date.now(); !ended() && Date.now() - t0 < 60_000; ) await new Promise((r) => setTimeout(r, 20));
    expect(processThreads()).toBe(threadsBefore);
    expect(readdirSync('/proc/self/fd').length).toBeLessThanOrEqual(fdsBefore + 1); // Node may open one of its own
    expect(ours()).toEqual([]);
    // Seconds on a host's KVM; the nested harness emulates every instruction of eight VMs on one CPU.
  }, 600_000);

  it('a cycle that finds another digest is counted as a failure and the loop goes on', async () => {
    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1 });
    try {
      await vm.probe.fill({ sizeMiB: 1, content: 'random', seed: 1 });
      const r = await soakVm(vm, '0000000000000000', 3);
      expect(r).toMatchObject({ cycles: 3, failures: 3, cycleMs: [] });
      expect(r.firstFailure).toMatch(/^cycle 1: the digest is [0-9a-f]{16}, not 0000000000000000$/);
      expect(vm.state).toBe('running');
    } finally {
      await vm.stop();
    }
  });
});
