// What a jailed `pvisor run` (src/cli/run-jailed.ts) hands in and takes out besides its control
// socket: a hibernation (taken out of the jail, resumed into a new one), a connection to the pool
// daemon (made by the launcher, so the daemon sees the user's credentials), and a snapshot's RAM
// file shared copy-on-write (--shared). Probe guest; needs /dev/kvm, root, bwrap and the cgroup
// controllers, v2 or v1 (the nested harness's L1 has them).
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { poolStatus } from '../../src/memory/pool-link';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { VmHandle } from '../../src/vm-handle';
import { gone, pvisorOnce, startPvisor, type Run } from '../cli-runs';
import { hexOf } from '../probe-digest';
import { jailCgroupExists, jailCgroupLimits, jailedVmmPid } from '../jail-cgroups';

const MiB = 2 ** 20;
const daemonMain = join(__dirname, '..', '..', 'src', 'cli', 'daemon-main.js');


const until = async (what: string, ok: () => boolean | Promise<boolean>, ms = 60_000) => {
  const deadline = Date.now() + ms;
  while (!(await ok())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 200));
  }
};

describe('a jailed pvisor run hands in and takes out', () => {
  let dir: string;
  let env: NodeJS.ProcessEnv;
  let runs: Run[];
  let detached: number[];

  beforeEach(() => {
    dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-jail-handoffs-'));
    env = { ...process.env, PVISOR_RUNTIME_DIR: join(dir, 'run') };
    runs = [];
    detached = [];
  });
  afterEach(() => {
    for (const r of runs) if (r.child.exitCode === null && r.child.signalCode === null) r.child.kill('SIGKILL');
    for (const pid of detached) if (!gone(pid)) process.kill(pid, 'SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  });

  const start = (...args: string[]) => {
    const run = startPvisor(env, ['run', '--isolation', 'process', '--vm-backing-dir', dir, ...args]);
    runs.push(run);
    return run;
  };
  const pvisor = (...args: string[]) => pvisorOnce(env, args);
  const socketOf = (id: string) => join(dir, 'run', `${id}.sock`);

  it('a hibernation: out of the jail into a private directory, and back by pvisor resume into a new jail, same id and digest', async () => {
    const ws = hexOf({ content: 'random', seed: 42, sizeBytes: 16 * MiB, rewrites: [] });
    const run = start('--guest', 'probe', '--name', 'JH', '--memory', '64MiB', '--vcpus', '1', '--limit-pids', '96', '--', 'fill 16MiB random 42, digest, wait');
    await run.waitFor(/^digest: /m);
    expect(/^digest: ([0-9a-f]{16})/m.exec(run.out())![1]).toBe(ws);
    const firstVmm = jailedVmmPid('JH');

    const h = await pvisor('suspend', 'JH', '--hibernate', '--json');
    expect(h.stderr).toBe('');
    expect(h.status).toBe(0);
    const answer = JSON.parse(h.stdout) as { hibernation: { dir: string; record: string } };
    expect((await run.exited).code).toBe(148);
    expect(run.err()).toMatch(/^pvisor: JH hibernated into .*, out of its jail, to come back in a new one; .* pvisor resume JH continues it in a new process, whose output goes to .*JH\.log$/m);
    // The VM left its jail: a directory of this user's, private, beside the run's other hibernations; the jail is gone.
    const state = answer.hibernation.dir;
    expect(state.startsWith(`${dir}/pvisor-hibernated-JH-`)).toBe(true);
    const st = statSync(state);
    expect({ uid: st.uid, mode: st.mode & 0o777 }).toEqual({ uid: process.getuid!(), mode: 0o700 });
    for (const f of readdirSync(state)) expect(statSync(join(state, f)).mode & 0o777).toBe(0o400);
    expect(readdirSync(dir).filter((f) => f.startsWith('pvisor-jail-'))).toEqual([]);
    expect(jailCgroupExists('JH')).toBe(false);
    const record = JSON.parse(readFileSync(answer.hibernation.record, 'utf8')) as { dir: string; flags: string[]; steps: string };
    expect(record).toMatchObject({ dir: state, steps: 'wait' });
    expect(record.flags).toEqual(expect.arrayContaining(['--isolation=process', '--limit-pids=96']));

    // Back, jailed again: a new jailed process (nobody, seccomp, its cgroup with the same limits), the same digest.
    const r = await pvisor('resume', 'JH', '--json');
    expect({ status: r.status, stderr: r.stderr }).toEqual({ status: 0, stderr: '' });
    const resumed = JSON.parse(r.stdout) as { pid: number };
    detached.push(resumed.pid);
    const vmm = jailedVmmPid('JH');
    expect(vmm).not.toBe(firstVmm);
    expect(readFileSync(`/proc/${vmm}/status`, 'utf8')).toMatch(/^Seccomp:\s+2$/m);
    expect(jailCgroupLimits('JH').pids).toBe(96);
    const handle = await VmHandle.connect('JH', { socketPath: socketOf('JH') });
    expect((await handle.status()).state).toBe('running');
    expect((await handle.exec('digest')).stdout).toMatch(new RegExp(`^digest: ${ws} `, 'm'));
    // Consumed: no record, no hibernated directory left.
    expect(existsSync(answer.hibernation.record)).toBe(false);
    expect(existsSync(state)).toBe(false);
    expect(readdirSync(join(dir, 'pvisor-jail-JH')).filter((f) => f.startsWith('pvisor-hibernated-'))).toEqual([]);

    // Hibernated again from its second jail, and discarded by pvisor stop.
    const again = await pvisor('suspend', 'JH', '--hibernate');
    expect(again.status).toBe(0);
    await until('the resumed run to end', () => gone(resumed.pid));
    const stop = await pvisor('stop', 'JH');
    expect(stop.status).toBe(0);
    expect(readdirSync(dir).filter((f) => f.startsWith('pvisor-hibernated-') || f.startsWith('pvisor-jail-'))).toEqual([]);
  }, 300_000);

  it('--vm-pool: the launcher connects, so the daemon sees the user and the launcher, not the jail\'s nobody', async () => {
    const socket = join(dir, 'pool.sock');
    const daemon: ChildProcess = spawn(process.execPath, [daemonMain, 'serve', '--memory-pool', '--socket', socket, '--max-pool', '256MiB'], { stdio: ['ignore', 'ignore', 'pipe'] });
    try {
      await new Promise<void>((resolve, reject) => {
        let err = '';
        daemon.stderr!.on('data', (b: Buffer) => {
          err += b.toString();
          if (/page pool of up to/.test(err)) resolve();
        });
        daemon.once('exit', (code) => reject(new Error(`pvisor-daemon exited with ${code}: ${err}`)));
      });
      const ws = hexOf({ content: 'random', seed: 7, sizeBytes: 16 * MiB, rewrites: [] });
      const a = start('--guest', 'probe', '--name', 'JP1', '--memory', '64MiB', '--vcpus', '1', '--vm-pool', socket, '--', 'fill 16MiB random 7, digest, wait');
      const b = start('--guest', 'probe', '--name', 'JP2', '--memory', '64MiB', '--vcpus', '1', '--vm-pool', socket, '--', 'fill 16MiB random 7, digest, wait');
      await a.waitFor(/^digest: /m);
      await b.waitFor(/^digest: /m);
      // Both clients are the launchers' (pid, uid), under the user's scope.
      const status = await poolStatus(socket, 5000);
      const clients = status.clients.filter((c) => c.name === 'JP1' || c.name === 'JP2').sort((x, y) => x.name.localeCompare(y.name));
      expect(clients.map((c) => ({ name: c.name, pid: c.pid, uid: c.uid }))).toEqual([
        { name: 'JP1', pid: a.child.pid, uid: process.getuid!() },
        { name: 'JP2', pid: b.child.pid, uid: process.getuid!() },
      ]);
      // The merges go through the handed connection: the common 16 MiB is pooled once.
      await until('the pool to hold the common pages', async () => (await poolStatus(socket, 5000)).pagesUsed >= (12 * MiB) / 4096, 120_000);
      const h = await VmHandle.connect('JP1', { socketPath: socketOf('JP1') });
      expect((await h.exec('digest')).stdout).toMatch(new RegExp(`^digest: ${ws} `, 'm'));
      const pool = (await h.memoryUsage()).strategies.find((s) => s.strategy === 'pool-client');
      expect(pool?.figures.connected).toBe(1);
      for (const id of ['JP1', 'JP2']) await pvisor('stop', id);
      await a.exited;
      await b.exited;
    } finally {
      daemon.kill('SIGKILL');
    }
  }, 300_000);

  it('--shared: two jailed clones map the snapshot\'s RAM file copy-on-write and read the same digest', async () => {
    const ws = hexOf({ content: 'random', seed: 9, sizeBytes: 16 * MiB, rewrites: [] });
    const src = start('--guest', 'probe', '--name', 'JS0', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 16MiB random 9, digest, wait');
    await src.waitFor(/^digest: /m);
    const snap = join(dir, 'snap');
    expect((await pvisor('snapshot', 'JS0', snap)).status).toBe(0);
    await pvisor('stop', 'JS0');
    await src.exited;
    const clones = ['JS1', 'JS2'].map((id) => start('--from', snap, '--shared', '--name', id, '--', 'digest, wait'));
    for (const c of clones) await c.waitFor(/^digest: /m);
    for (const c of clones) {
      expect(c.out()).toMatch(new RegExp(`^digest: ${ws} `, 'm'));
      expect(c.err()).toMatch(/its RAM the snapshot's file shared copy-on-write/);
    }
    // The jailed VMM maps the snapshot's RAM file (read-only, bound into its jail).
    const maps = readFileSync(`/proc/${jailedVmmPid('JS1')}/maps`, 'utf8');
    expect(maps).toContain(join(snap, 'ram'));
    for (const id of ['JS1', 'JS2']) await pvisor('stop', id);
    for (const c of clones) expect((await c.exited).code).toBe(0);
  }, 300_000);
});
