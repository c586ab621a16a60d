// A VM process killed (SIGKILL) in the middle of a suspend's write-out or of a lazy resume leaves
// its backing file behind; the next suspend in any pvisor process on that directory removes it,
// and nothing else of the killed process survives it. Real KVM, real processes. Needs /dev/kvm.
import { spawn } from 'node:child_process';
import { mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { Offload, Vm } from '../../src';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';

const index = join(__dirname, '..', '..', 'src', 'index.js');

/** A child process with a 64 MiB VM that suspends with Offload into `dir`, then does `then`. */
function victim(dir: string, then: 'hold' | 'lazy-resume') {
  const script = `
    const { Vm, Offload } = require(${JSON.stringify(index)});
    (async () => {
      const vm = await Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 1, strategies: [new Offload({ dir: ${JSON.stringify(dir)}, reload: 'lazy', prefetch: false })] });
      await vm.probe.fill({ sizeMiB: 64, content: 'random', seed: 1 });
      await vm.suspend();
      console.log('suspended');
      if (${JSON.stringify(then)} === 'lazy-resume') {
        await vm.memoryReleased();
        await vm.resume();
        console.log('resumed');
        await vm.probe.digest();
      }
      setInterval(() => {}, 1000);
    })().catch((e) => { console.error(e); process.exit(1); });`;
  const child = spawn(process.execPath, ['-e', script], { stdio: ['ignore', 'pipe', 'inherit'] });
  const lines = createInterface({ input: child.stdout! })[Symbol.asyncIterator]();
  return { child, next: async () => (await lines.next()).value as string };
}

describe('a VM process killed mid-operation', () => {
  const dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-killed-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));
  const files = () => readdirSync(dir).filter((f) => f.endsWith('.ram'));

  it.each(['hold', 'lazy-resume'] as const)('leaves a backing file that the next suspend removes (killed during %s)', async (then) => {
    const v = victim(dir, then);
    expect(await v.next()).toBe('suspended');
    if (then === 'lazy-resume') expect(await v.next()).toBe('resumed');
    // Killed with the write-out under way (hold) or with pieces still loading lazily (lazy-resume).
    v.child.kill('SIGKILL');
    await new Promise((r) => v.child.once('exit', r));
    const left = files();
    expect(left.some((f) => f.includes(`-${v.child.pid}-`))).toBe(true);

    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1, strategies: [new Offload({ dir })] });
    try {
      await vm.probe.fill({ sizeMiB: 4, content: 'random', seed: 2 });
      await vm.suspend();
      await vm.memoryReleased();
      expect(files().filter((f) => f.includes(`-${v.child.pid}-`))).toEqual([]);
      await vm.resume();
    } finally {
      await vm.stop();
    }
  });
});
