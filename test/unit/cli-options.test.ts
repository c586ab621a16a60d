// The CLI refuses what it cannot do before any VM starts: no KVM needed.
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';

const main = join(__dirname, '..', '..', 'src', 'cli', 'main.js');
const pvisor = (...args: string[]) => spawnSync(process.execPath, [main, ...args], { encoding: 'utf8' });

describe('pvisor run option checks', () => {
  it.each(['--vm-ram-compression', '--vm-cold-ram-compression'])('%s says plainly that it is not available yet', (flag) => {
    const r = pvisor('run', '--guest', 'probe', flag, '--', 'digest');
    expect(r.stderr).toMatch(new RegExp(`pvisor: ${flag}: not yet available`));
    expect(r.stderr).not.toMatch(/starting/);
    expect(r.status).toBe(125);
  });

  it('--vm-offload-reload needs --vm-offload and eager or lazy', () => {
    const alone = pvisor('run', '--guest', 'probe', '--vm-offload-reload', 'lazy', '--', 'digest');
    expect(alone.stderr).toMatch(/--vm-offload-reload: only goes with --vm-offload/);
    expect(alone.status).toBe(125);
    const bad = pvisor('run', '--guest', 'probe', '--vm-offload', '--vm-offload-reload', 'sometimes', '--', 'digest');
    expect(bad.stderr).toMatch(/--vm-offload-reload: expected eager or lazy, got "sometimes"/);
    expect(bad.stderr).not.toMatch(/starting/);
    expect(bad.status).toBe(125);
  });

  it('an unknown option is a usage error', () => {
    const r = pvisor('run', '--memroy', '1G', '--', 'digest');
    expect(r.stderr).toMatch(/Unknown option '--memroy'/);
    expect(r.status).toBe(125);
  });
});
