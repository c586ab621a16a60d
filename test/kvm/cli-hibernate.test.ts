// pvisor suspend --hibernate and pvisor resume of a hibernated VM, with real pvisor processes: the
// run's process ends and its VM costs no memory, the VM goes on in a new process under the same
// id and control socket with the same digest, a second resume is refused, a stop discards it.
// Needs /dev/kvm.
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { controlRequest } from '../../src/control-socket';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { gone, pvisorOnce, startPvisor, type Run } from '../cli-runs';
import { hexOf } from '../probe-digest';

const MiB = 2 ** 20;

describe('pvisor suspend --hibernate and pvisor resume (probe guest)', () => {
  let dir: string;
  let env: NodeJS.ProcessEnv;
  let runs: Run[];
  /** Processes that pvisor resume left running (detached): ended after each test. */
  let resumed: number[];

  beforeEach(() => {
    // On a disk: the hibernated state goes under the run's backing directory.
    dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-cli-hibernate-'));
    env = { ...process.env, PVISOR_RUNTIME_DIR: join(dir, 'run') };
    runs = [];
    resumed = [];
  });
  afterEach(() => {
    for (const r of runs) if (r.child.exitCode === null && r.child.signalCode === null) r.child.kill('SIGKILL');
    for (const pid of resumed) if (!gone(pid)) process.kill(pid, 'SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  });

  const start = (...args: string[]) => {
    const r = startPvisor(env, ['run', '--vm-backing-dir', dir, ...args]);
    runs.push(r);
    return r;
  };
  const pvisor = (...args: string[]) => pvisorOnce(env, args);
  const socketOf = (id: string) => join(dir, 'run', `${id}.sock`);
  const recordOf = (id: string) => join(dir, 'run', `${id}.hibernated`);
  const hibernatedDirs = () => readdirSync(dir).filter((f) => f.startsWith('pvisor-hibernated-'));
  const mib = (text: string) => {
    const m = /^([\d.]+) (KiB|MiB)$/.exec(text);
    if (!m) throw new Error(`not a size: ${text}`);
    return Number(m[1]) * (m[2] === 'KiB' ? 1024 : MiB);
  };
  const ws = hexOf({ content: 'random', seed: 42, sizeBytes: 16 * MiB, rewrites: [] });
  const digestOver = async (id: string) => {
    const r = await controlRequest(socketOf(id), id, { op: 'exec', command: 'digest' }, 120000);
    if (!r.ok) throw new Error(r.error.message);
    return /^digest: ([0-9a-f]{16}) over 16\.0 MiB/m.exec(r.exec!.stdout)?.[1];
  };
  type PsRow = { id: string; state: string; pid: number | null; processPssBytes?: number; guestRamResidentBytes?: number; bytesOnDisk?: number; dir?: string };
  const ps = async () => JSON.parse((await pvisor('ps', '--json')).stdout) as PsRow[];

  it('hibernates a probe VM out of its process and resumes it in a new one with the same id, socket and digest', async () => {
    const run = start('--guest', 'probe', '--name', 'H1', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 16MiB random 42, digest, wait');
    await run.waitFor(/^digest: /m);
    expect(/^digest: ([0-9a-f]{16})/m.exec(run.out())![1]).toBe(ws);
    const processBefore = (await ps()).find((r) => r.id === 'H1')!.processPssBytes!;

    const h = await pvisor('suspend', 'H1', '--vm-offload', '--hibernate');
    expect(h.stderr).toBe('');
    expect(h.status).toBe(0);
    const m = new RegExp(`^H1 hibernated in ([\\d.]+) ms: guest RAM resident (.+), process (.+) -> 0; (.+) on disk in (${dir}/pvisor-hibernated-H1-[0-9a-f]{8}); its process \\(pid ${run.child.pid}\\) has ended \\(pvisor run exits 148\\)\\. pvisor resume H1 continues it$`, 'm').exec(h.stdout);
    expect(m).not.toBeNull();
    const [hibernateMs, guestRam, processPss, onDisk, state] = [Number(m![1]), mib(m![2]), mib(m![3]), mib(m![4]), m![5]];
    expect(guestRam).toBeGreaterThanOrEqual(16 * MiB);
    expect(onDisk).toBeGreaterThanOrEqual(16 * MiB);
    expect(onDisk).toBeLessThan(24 * MiB);

    // The run ends with the status that says so, its socket gone; the state and the record stay, private.
    const end = await run.exited;
    expect(end.code).toBe(148);
    expect(run.err()).toMatch(/^pvisor: H1 hibernated into .* pvisor resume H1 continues it in a new process, whose output goes to .*H1\.log$/m);
    expect(run.out()).not.toMatch(/^wait: /m);
    expect(existsSync(socketOf('H1'))).toBe(false);
    expect(hibernatedDirs()).toEqual([state.split('/').pop()]);
    expect(statSync(state).mode & 0o777).toBe(0o700);
    expect(statSync(recordOf('H1')).mode & 0o777).toBe(0o600);
    expect(JSON.parse(readFileSync(recordOf('H1'), 'utf8'))).toMatchObject({ id: 'H1', dir: state, guest: 'probe', steps: 'wait' });

    // A hibernated VM has no process: it costs no memory, and ps says so.
    expect((await pvisor('ps')).stdout).toMatch(/^H1\s+hibernated\s+0 KiB\s+64\.0 MiB\s+1\d\.\d MiB\s+-\s+-$/m); // no pid, no labels
    // Its id is not free, and what needs its process is refused (exit 1).
    const taken = await pvisor('run', '--guest', 'probe', '--name', 'H1', '--', 'digest');
    expect(taken.stderr).toMatch(/pvisor: name: H1 is hibernated .*: pvisor resume H1 continues it, pvisor stop H1 discards it/);
    expect(taken.status).toBe(1);
    const suspend = await pvisor('suspend', 'H1', '--vm-offload');
    expect(suspend.stderr).toMatch(/^pvisor: suspend H1 refused: H1 is hibernated \(its state is on disk in .*\); pvisor resume H1 continues it$/m);
    expect(suspend.status).toBe(1);

    // Two resumes at once: one continues it, the other is refused.
    const [r1, r2] = await Promise.all([pvisor('resume', 'H1', '--vm-load'), pvisor('resume', 'H1')]);
    const [won, lost] = r1.status === 0 ? [r1, r2] : [r2, r1];
    const rm = /^H1 resumed from hibernation in ([\d.]+) ms \(ready ([\d.]+) ms after its process began restoring; guest RAM loading lazily\): pid (\d+), guest RAM resident (.+), process (.+); its output goes to (.+)$/m.exec(won.stdout);
    expect(rm).not.toBeNull();
    const pid = Number(rm![3]);
    resumed.push(pid);
    expect(won.status).toBe(0);
    expect(lost.stderr).toMatch(/^pvisor: resume H1 refused: H1 (is (running|starting), not paused, suspended or hibernated: nothing to resume|is not hibernated)/m);
    expect(lost.status).toBe(1);
    expect(pid).not.toBe(run.child.pid);
    expect(gone(pid)).toBe(false);
    // Moved back into a process: the record and the state are gone, the socket is the same path.
    expect(existsSync(recordOf('H1'))).toBe(false);
    expect(hibernatedDirs()).toEqual([]);
    expect(existsSync(socketOf('H1'))).toBe(true);
    expect(await digestOver('H1')).toBe(ws);
    const after = (await ps()).find((r) => r.id === 'H1')!;
    expect(after).toMatchObject({ state: 'running', pid });

    // A second resume of the running VM: nothing to resume.
    const again = await pvisor('resume', 'H1');
    expect(again.stderr).toMatch(/^pvisor: resume H1 refused: H1 is running, not paused, suspended or hibernated: nothing to resume$/m);
    expect(again.status).toBe(1);

    // The resumed VM answers the control commands as the run did.
    const s = await pvisor('suspend', 'H1', '--vm-offload');
    expect(s.stdout).toMatch(/^H1 suspended in [\d.]+ ms: guest RAM resident [12]\d\.\d MiB -> \d+ KiB/m);
    expect((await pvisor('resume', 'H1', '--vm-load')).status).toBe(0);
    const snap = await pvisor('snapshot', 'H1', join(dir, 'snap'));
    expect(snap.status).toBe(0);
    expect(await digestOver('H1')).toBe(ws);

    const bootMs = /^pvisor: H1 ready in (\d+) ms$/m.exec(run.err())?.[1];
    process.stdout.write(
      `cli hibernate figures (probe, 64 MiB, 16 MiB random; its start to ready took ${bootMs} ms): hibernate ${hibernateMs} ms, guest RAM ${(guestRam / MiB).toFixed(1)} MiB, ` +
        `process ${(processPss / MiB).toFixed(1)} MiB (ps before: ${(processBefore / MiB).toFixed(1)} MiB) -> 0 while hibernated, ${(onDisk / MiB).toFixed(1)} MiB on disk; ` +
        `resume (command) ${rm![1]} ms, ready ${rm![2]} ms after its process began restoring, then guest RAM ${rm![4]}, process ${rm![5]}; ` +
        `after a digest, process ${(after.processPssBytes! / MiB).toFixed(1)} MiB\n`,
    );

    // Hibernated again, then stopped: a stop discards it, state and record.
    const h2 = await pvisor('suspend', 'H1', '--hibernate');
    expect(h2.status).toBe(0);
    expect(gone(pid)).toBe(true);
    expect(hibernatedDirs()).toHaveLength(1);
    const stop = await pvisor('stop', 'H1');
    expect(stop.stdout).toMatch(/^H1 discarded \(it was hibernated; 1\d\.\d MiB on disk removed with .*pvisor-hibernated-H1-[0-9a-f]{8}\)$/m);
    expect(stop.status).toBe(0);
    expect(hibernatedDirs()).toEqual([]);
    expect(existsSync(recordOf('H1'))).toBe(false);
    expect(await ps()).toEqual([]);
    const none = await pvisor('resume', 'H1');
    expect(none.stderr).toMatch(/^pvisor: no VM named H1 is running or hibernated/m);
    expect(none.status).toBe(1);
    // The resumed process's output went to the log beside the socket, private.
    const log = join(dir, 'run', 'H1.log');
    expect(statSync(log).mode & 0o777).toBe(0o600);
    expect(readFileSync(log, 'utf8')).toMatch(/resuming the hibernated VM H1 from .*\n(.*\n)*pvisor: H1 ready in \d+ ms \(resumed from hibernation, guest RAM loading lazily\)/);
  }, 600000);

  it('the steps that were left go on after the resume: a sleep cut short, the digest after it', async () => {
    const run = start('--guest', 'probe', '--name', 'H2', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 16MiB random 42, sleep 40, digest, wait');
    await run.waitFor(/^fill: /m);
    const h = await pvisor('suspend', 'H2', '--hibernate');
    expect(h.status).toBe(0);
    expect((await run.exited).code).toBe(148);
    const steps = JSON.parse(readFileSync(recordOf('H2'), 'utf8')).steps as string;
    expect(steps).toMatch(/^sleep \d+ms, digest, wait$/);
    expect(Number(/^sleep (\d+)ms/.exec(steps)![1])).toBeLessThanOrEqual(40000);

    // --foreground: the run goes on in this process, its output here.
    const fg = startPvisor(env, ['resume', 'H2', '--foreground']);
    runs.push(fg);
    await fg.waitFor(/^digest: /m);
    expect(fg.out()).toMatch(/^sleep: \d+ ms\ndigest: [0-9a-f]{16} over 16\.0 MiB/m);
    expect(/^digest: ([0-9a-f]{16})/m.exec(fg.out())![1]).toBe(ws);
    expect(fg.err()).toMatch(/^pvisor: H2 ready in \d+ ms \(resumed from hibernation, guest RAM loading lazily\)$/m);
    expect(existsSync(recordOf('H2'))).toBe(false);
    expect((await pvisor('stop', 'H2')).status).toBe(0);
    expect((await fg.exited).code).toBe(0);
    expect(fg.out()).toMatch(/^wait: H2 was stopped after/m);
  }, 600000);
});
