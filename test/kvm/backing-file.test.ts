// Where Offload and CompressedOffload put guest RAM, on real KVM: a directory that would keep it
// in RAM is refused, and the VM goes on as it was. Needs /dev/kvm.
import { mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { CompressedOffload, InvalidOptionError, Offload, Vm, type MemoryStrategy } from '../../src';
import type { ProbeWorkingSet } from '../../src/guest/probe-content';
import { hexOf } from '../probe-digest';

const MiB = 2 ** 20;
const FILL: ProbeWorkingSet = { content: 'random', seed: 11, sizeBytes: 4 * MiB, rewrites: [] };

/** A 64 MiB probe VM with 4 MiB of known content; stopped whatever the body does. */
async function withVm(strategy: MemoryStrategy, body: (vm: Vm, digest: string) => Promise<void>): Promise<void> {
  const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1, strategies: [strategy] });
  try {
    await vm.probe.fill({ sizeMiB: FILL.sizeBytes / MiB, content: FILL.content, seed: FILL.seed });
    await body(vm, hexOf(FILL));
  } finally {
    vm.stop();
  }
}

describe('a backing directory on tmpfs', () => {
  let shmDir: string;
  beforeEach(() => (shmDir = mkdtempSync('/dev/shm/pvisor-backing-')));
  afterEach(() => rmSync(shmDir, { recursive: true, force: true }));

  it.each([
    ['Offload', (dir: string) => new Offload({ dir })],
    ['CompressedOffload', (dir: string) => new CompressedOffload({ dir })],
  ])('%s: the suspend is refused with a typed error naming the option; the VM runs on, every byte intact', (_name, make) =>
    withVm(make(shmDir), async (vm, digest) => {
      const err = await vm.suspend().catch((e: unknown) => e);
      expect(err).toBeInstanceOf(InvalidOptionError);
      expect((err as InvalidOptionError).option).toBe('dir');
      expect((err as Error).message).toMatch(/is on tmpfs.*allowMemoryBackedDir/);
      expect(vm.state).toBe('running');
      expect(readdirSync(shmDir)).toEqual([]);
      expect((await vm.probe.digest()).hex).toBe(digest);
    }));

  it('allowMemoryBackedDir: the user insists, and the suspend goes there', () =>
    withVm(new Offload({ dir: shmDir, allowMemoryBackedDir: true }), async (vm, digest) => {
      await vm.suspend();
      await vm.memoryReleased();
      expect(readdirSync(shmDir)).toHaveLength(1);
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(digest);
    }));
});
