// The pvisor command as a user runs it: a separate process, real KVM. Needs /dev/kvm.
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { hexOf } from '../probe-digest';

const main = join(__dirname, '..', '..', 'src', 'cli', 'main.js');
const pvisor = (...args: string[]) => spawnSync(process.execPath, [main, ...args], { encoding: 'utf8' });

describe('pvisor run --guest probe', () => {
  it('boots, runs the steps, prints results and exits 0', () => {
    const r = pvisor('run', '--guest', 'probe', '--memory', '256MiB', '--vcpus', '2', '--', 'fill 8MiB random 5, digest, memory');
    expect(r.stderr).toMatch(/ready in \d+ ms/);
    expect(r.stdout).toContain(`digest: ${hexOf({ content: 'random', seed: 5, sizeBytes: 8 * 2 ** 20, rewrites: [] })} over 8.0 MiB`);
    expect(r.stdout).toMatch(/memory: guest RAM PSS 8\.\d MiB of 256\.0 MiB/);
    expect(r.status).toBe(0);
  });

  it('--vm-cold-ram-compression compresses an idle working set, which comes back intact', () => {
    // Under the nested harness's emulation, scans take 10-50 times as long.
    const idle = process.env.PVISOR_NESTED === '1' ? '40s' : '4s';
    const r = pvisor('run', '--guest', 'probe', '--memory', '256MiB', '--vm-cold-ram-compression', '--vm-cold-after', '500ms', '--', `fill 16MiB repetitive 3, sleep ${idle}, memory, digest`);
    const stored = /cold-compression: blocksStored (\d+)/.exec(r.stdout);
    expect(stored).not.toBeNull();
    expect(Number(stored![1])).toBeGreaterThanOrEqual(200); // of the 256 blocks of 64 KiB
    expect(r.stdout).toMatch(/memory: guest RAM PSS [0-3]\.\d MiB of 256\.0 MiB/);
    expect(r.stdout).toContain(`digest: ${hexOf({ content: 'repetitive', seed: 3, sizeBytes: 16 * 2 ** 20, rewrites: [] })} over 16.0 MiB`);
    expect(r.status).toBe(0);
  });

  it('--console copies the guest console to stderr as [console] lines (through the bounded copy, test/unit/console-copy.test.ts)', () => {
    const r = pvisor('run', '--guest', 'probe', '--memory', '64MiB', '--console', '--', 'digest');
    expect(r.stderr.split('\n')).toContain('[console] probe: ready');
    expect(r.stderr).not.toMatch(/dropped/);
    expect(r.status).toBe(0);
    // Without --console the console stays out of stderr.
    expect(pvisor('run', '--guest', 'probe', '--memory', '64MiB', '--', 'digest').stderr).not.toContain('[console]');
  });

  it('a guest-side error fails the run with a clear message and status 125', () => {
    const r = pvisor('run', '--guest', 'probe', '--memory', '64MiB', '--', 'fill 512MiB');
    expect(r.stderr).toMatch(/pvisor: guest refused op 0x101: FILL: size beyond wsLimit/);
    expect(r.status).toBe(125);
  });

  it('bad options are a usage error (2) before a VM starts', () => {
    const r = pvisor('run', '--guest', 'probe', '--memory', '12 parsecs', '--', 'digest');
    expect(r.stderr).toMatch(/pvisor: memory: cannot parse size/);
    expect(r.stderr).not.toMatch(/starting/);
    expect(r.status).toBe(2);
  });
});
