// The CLI refuses what it cannot do before any VM starts: no KVM needed.
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';

const main = join(__dirname, '..', '..', 'src', 'cli', 'main.js');
const pvisor = (...args: string[]) => spawnSync(process.execPath, [main, ...args], { encoding: 'utf8' });

describe('pvisor run option checks', () => {
  it('--vm-cold-ram-compression says plainly that it is not available yet', () => {
    const r = pvisor('run', '--guest', 'probe', '--vm-cold-ram-compression', '--', 'digest');
    expect(r.stderr).toMatch(/pvisor: --vm-cold-ram-compression: not yet available/);
    expect(r.stderr).not.toMatch(/starting/);
    expect(r.status).toBe(125);
  });

  it('--vm-ram-compression with --vm-offload is refused before a VM is made', () => {
    const r = pvisor('run', '--guest', 'probe', '--vm-offload', '--vm-ram-compression', '--', 'digest');
    expect(r.stderr).toMatch(/memory strategies offload and compressed-offload cannot be combined: both drive suspend-image/);
    expect(r.stderr).not.toMatch(/ready in/);
    expect(r.status).toBe(125);
  });

  it('an unknown option is a usage error', () => {
    const r = pvisor('run', '--memroy', '1G', '--', 'digest');
    expect(r.stderr).toMatch(/Unknown option '--memroy'/);
    expect(r.status).toBe(125);
  });
});
