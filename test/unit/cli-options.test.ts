// The CLI refuses what it cannot do before any VM starts: no KVM needed.
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const main = join(__dirname, '..', '..', 'src', 'cli', 'main.js');
const pvisor = (...args: string[]) => spawnSync(process.execPath, [main, ...args], { encoding: 'utf8' });

describe('pvisor run option checks', () => {
  it('--vm-cold-after needs --vm-cold-ram-compression and a duration', () => {
    const alone = pvisor('run', '--guest', 'probe', '--vm-cold-after', '5s', '--', 'digest');
    expect(alone.stderr).toMatch(/pvisor: --vm-cold-after: only goes with --vm-cold-ram-compression/);
    expect(alone.status).toBe(2);
    const bad = pvisor('run', '--guest', 'probe', '--vm-cold-ram-compression', '--vm-cold-after', 'soon', '--', 'digest');
    expect(bad.stderr).toMatch(/--vm-cold-after: expected a duration such as 30, 1.5s, 500ms or 2m, got "soon"/);
    expect(bad.stderr).not.toMatch(/starting/);
    expect(bad.status).toBe(2);
  });

  it('--vm-offload-reload needs --vm-offload and eager or lazy', () => {
    const alone = pvisor('run', '--guest', 'probe', '--vm-offload-reload', 'lazy', '--', 'digest');
    expect(alone.stderr).toMatch(/--vm-offload-reload: only goes with --vm-offload/);
    expect(alone.status).toBe(2);
    const bad = pvisor('run', '--guest', 'probe', '--vm-offload', '--vm-offload-reload', 'sometimes', '--', 'digest');
    expect(bad.stderr).toMatch(/--vm-offload-reload: expected eager or lazy, got "sometimes"/);
    expect(bad.stderr).not.toMatch(/starting/);
    expect(bad.status).toBe(2);
  });

  it('--vm-ram-compression with --vm-offload is refused before a VM is made', () => {
    const r = pvisor('run', '--guest', 'probe', '--vm-offload', '--vm-ram-compression', '--', 'digest');
    expect(r.stderr).toMatch(/memory strategies offload and compressed-offload cannot be combined: both drive suspend-image/);
    expect(r.stderr).not.toMatch(/ready in|starting|control socket/);
    expect(r.status).toBe(2);
  });

  it('--rootfs names a missing image before anything boots; --rootfs-readonly needs --rootfs', () => {
    const r = pvisor('run', '--rootfs', '/no/such/rootfs.img', '--', 'true');
    expect(r.stderr).toMatch(/pvisor: rootfs: cannot use \/no\/such\/rootfs\.img read-write: ENOENT/);
    expect(r.stderr).not.toMatch(/ready in/);
    expect(r.status).toBe(125);
    const alone = pvisor('run', '--rootfs-readonly', '--', 'true');
    expect(alone.stderr).toMatch(/--rootfs-readonly: only goes with --rootfs/);
    expect(alone.status).toBe(2);
  });

  it('--from refuses what the snapshot says, naming the flag, before anything is read or started', () => {
    const r = pvisor('run', '--from', '/no/such/snapshot', '--memory', '1GiB', '--', 'digest');
    expect(r.stderr).toMatch(/^pvisor: --memory: does not go with --from: a VM restored from a snapshot has the memory, vCPUs, guest and disks it was taken with$/m);
    expect(r.stderr).not.toMatch(/restoring|starting/);
    expect(r.status).toBe(2);
  });

  it('--from a directory that is not a snapshot says which file is missing, before a VM starts', () => {
    const dir = mkdtempSync(join(tmpdir(), 'pvisor-not-a-snapshot-'));
    try {
      const r = pvisor('run', '--from', dir, '--', 'digest');
      expect(r.stderr).toMatch(new RegExp(`^pvisor: ${dir}/manifest.json: ENOENT`, 'm'));
      expect(r.stderr).not.toMatch(/restoring|control socket/);
      expect(r.status).toBe(125);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('an unknown option is a usage error (exit 2)', () => {
    const r = pvisor('run', '--memroy', '1G', '--', 'digest');
    expect(r.stderr).toMatch(/Unknown option '--memroy'/);
    expect(r.status).toBe(2);
  });
});

describe('pvisor suspend/resume/snapshot/stop/ps without a VM', () => {
  let dir: string;
  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-rt-'));
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));
  const cli = (...args: string[]) => spawnSync(process.execPath, [main, ...args], { encoding: 'utf8', env: { ...process.env, PVISOR_RUNTIME_DIR: dir } });

  it.each(['suspend', 'resume', 'stop'])('%s of an unknown id names it and exits 1 (refused)', (cmd) => {
    const r = cli(cmd, 'NOPE', ...(cmd === 'suspend' ? ['--vm-offload'] : []));
    expect(r.stderr).toMatch(/pvisor: no VM named NOPE is running/);
    expect(r.stdout).toBe('');
    expect(r.status).toBe(1);
  });

  it('snapshot of an unknown id names it and exits 1 (refused)', () => {
    const r = cli('snapshot', 'NOPE', join(dir, 'snap'));
    expect(r.stderr).toMatch(/^pvisor: no VM named NOPE is running/);
    expect(r.stdout).toBe('');
    expect(r.status).toBe(1);
  });

  it('snapshot without a directory is refused', () => {
    const r = cli('snapshot', 'T1');
    expect(r.stderr).toMatch(/^pvisor: dir: where to\? e.g. pvisor snapshot T1 DIR/);
    expect(r.status).toBe(2);
  });

  it('an id and a different job id are refused', () => {
    const r = cli('suspend', 'A', '--vm-job-id', 'B');
    expect(r.stderr).toMatch(/vm-job-id: "B" is not the VM id given/);
    expect(r.status).toBe(2);
  });

  it('ps with no VM prints only its header', () => {
    const r = cli('ps');
    expect(r.stdout.trim().split('\n')).toEqual([expect.stringMatching(/^ID\s+STATE\s+GUEST RAM RESIDENT/)]);
    expect(r.status).toBe(0);
  });

  it('a bad --name fails before a VM starts', () => {
    const r = cli('run', '--guest', 'probe', '--name', '../x', '--', 'digest');
    expect(r.stderr).toMatch(/name: "..\/x" is not a VM id/);
    expect(r.stderr).not.toMatch(/starting/);
    expect(r.status).toBe(2);
  });
});
