// Stopping a VM gives back everything it took: fds, mappings, threads. Needs /dev/kvm.
import { existsSync, readdirSync, readFileSync, readlinkSync } from 'node:fs';
import { Offload, Vm, type MemoryStrategy } from '../../src';
import { processThreads } from '../process-threads';

function kvmFds(): number {
  return readdirSync('/proc/self/fd').filter((fd) => {
    try {
      return /kvm/.test(readlinkSync(`/proc/self/fd/${fd}`));
    } catch {
      return false; // closed while listing
    }
  }).length;
}

const maps = () => readFileSync('/proc/self/maps', 'utf8');
const kvmMappings = () => maps().split('\n').filter((l) => /kvm/.test(l)).length;
const threads = processThreads;
const throwsOnClose: MemoryStrategy = { name: 'broken', needs: [], exclusive: [], stats: () => ({ strategy: 'broken', figures: {}, notes: [] }), close: () => { throw new Error('cannot close'); } };

describe('teardown', () => {
  it('leaks no fd, mapping or thread across start/stop', async () => {
    // What a process opens once for all its VMs (guest RAM's SIGBUS guard: a socket pair, once
    // per module registry) is open before the first VM's start is compared with its stop.
    await (await Vm.start({ guest: 'probe', memory: '16MiB', vcpus: 1 })).stop();
    await new Promise((r) => setTimeout(r, 50));
    // Other test files share this process: compare with what is open now, not with zero.
    const threadsBefore = threads();
    const fdsBefore = readdirSync('/proc/self/fd').length;
    const kvmFdsBefore = kvmFds();
    const kvmMapsBefore = kvmMappings();
    for (let i = 0; i < 3; i++) {
      const vm = await Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 4 });
      expect(threads()).toBe(threadsBefore + 4);
      const [ram] = Vm.liveGuestRam();
      await vm.probe.fill({ sizeMiB: 4, content: 'random' });
      await vm.pause();
      await vm.resume();
      await vm.stop();
      await new Promise((r) => setTimeout(r, 50)); // the closed socket's handle goes on the next tick
      expect(threads()).toBe(threadsBefore);
      expect(kvmFds()).toBe(kvmFdsBefore);
      expect(kvmMappings()).toBe(kvmMapsBefore); // kvm_run mappings
      expect(maps()).not.toContain(`${ram.start.toString(16)}-${(ram.start + ram.length).toString(16)} `); // guest RAM
    }
    expect(readdirSync('/proc/self/fd').length).toBeLessThanOrEqual(fdsBefore + 1); // Node may open its own once
  });

  it('stop is idempotent and a stopped VM refuses work with a typed error', async () => {
    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1 });
    const exits: string[] = [];
    vm.on('exit', ({ state }) => exits.push(state));
    await vm.stop();
    await vm.stop();
    expect(vm.state).toBe('stopped');
    expect(exits).toEqual(['stopped']);
    await expect(vm.probe.digest()).rejects.toThrow(/stopped/);
    await expect(vm.pause()).rejects.toThrow(/stopped/);
    expect(() => vm.memoryUsage()).toThrow(/stopped/);
  });

  it('a strategy whose close throws: stop still frees everything, the other strategies close, and a warning says so', async () => {
    const threadsBefore = threads();
    const kvmFdsBefore = kvmFds();
    const closed: string[] = [];
    const fine: MemoryStrategy = { name: 'fine', needs: [], exclusive: [], stats: () => ({ strategy: 'fine', figures: {}, notes: [] }), close: () => void closed.push('fine') };
    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 2, strategies: [throwsOnClose, new Offload(), fine] });
    const warnings: string[] = [];
    vm.on('warning', (w) => warnings.push(w));
    const [ram] = Vm.liveGuestRam();
    await vm.probe.fill({ sizeMiB: 4, content: 'random' });
    await vm.suspend();
    await vm.stop();
    await new Promise((r) => setTimeout(r, 50));
    expect(vm.state).toBe('stopped');
    expect(closed).toEqual(['fine']);
    expect(warnings.join('\n')).toMatch(/broken: close failed while the VM ended: cannot close/);
    expect(threads()).toBe(threadsBefore);
    expect(kvmFds()).toBe(kvmFdsBefore);
    expect(maps()).not.toContain(`${ram.start.toString(16)}-${(ram.start + ram.length).toString(16)} `);
  });

  it('a strategy whose close throws during a lazy reload: stop still ends the userfaultfd server, the vCPUs, the mapping, every fd and the file', async () => {
    const threadsBefore = threads();
    const fdsBefore = readdirSync('/proc/self/fd').length;
    const kvmMapsBefore = kvmMappings();
    const offload = new Offload({ reload: 'lazy', prefetch: false });
    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 2, strategies: [throwsOnClose, offload] });
    const [ram] = Vm.liveGuestRam();
    await vm.probe.fill({ sizeMiB: 8, content: 'random' });
    await vm.suspend();
    await vm.memoryReleased();
    await vm.resume(); // lazy, no prefetch: the pieces wait in the file for a touch
    const path = offload.backingPath!;
    expect(existsSync(path)).toBe(true);
    expect(threads()).toBeGreaterThan(threadsBefore + 2); // the vCPUs and the server's thread
    await vm.stop();
    await new Promise((r) => setTimeout(r, 50));
    expect(vm.state).toBe('stopped');
    expect(existsSync(path)).toBe(false);
    expect(threads()).toBe(threadsBefore);
    expect(readdirSync('/proc/self/fd').length).toBeLessThanOrEqual(fdsBefore + 1); // Node may open one of its own
    expect(kvmMappings()).toBe(kvmMapsBefore);
    expect(maps()).not.toContain(`${ram.start.toString(16)}-${(ram.start + ram.length).toString(16)} `);
  });
});

