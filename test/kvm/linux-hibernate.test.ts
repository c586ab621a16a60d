// pvisor suspend --hibernate and pvisor resume of the Linux guest, with real pvisor processes: a
// file written in the guest survives the hibernation, and CMD runs on in the guest, detached.
// Needs a /dev/kvm that runs guest kernel code (hardware virtualisation, or the nested harness:
// scripts/with-kvm.js --linux).
import { randomBytes } from 'node:crypto';
import { existsSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { controlRequest } from '../../src/control-socket';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { gone, pvisorOnce, startPvisor, type Run } from '../cli-runs';

describe('pvisor suspend --hibernate and pvisor resume (Linux guest)', () => {
  let dir: string;
  let env: NodeJS.ProcessEnv;
  let run: Run | undefined;
  let resumedPid: number | undefined;

  beforeEach(() => {
    dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-linux-hibernate-'));
    env = { ...process.env, PVISOR_RUNTIME_DIR: join(dir, 'run') };
  });
  afterEach(() => {
    if (run && run.child.exitCode === null && run.child.signalCode === null) run.child.kill('SIGKILL');
    if (resumedPid !== undefined && !gone(resumedPid)) process.kill(resumedPid, 'SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  });

  const pvisor = (...args: string[]) => pvisorOnce(env, args);
  const exec = async (command: string) => {
    const r = await controlRequest(join(dir, 'run', 'L1.sock'), 'L1', { op: 'exec', command, timeoutMs: 120_000 }, 180_000);
    if (!r.ok) throw new Error(r.error.message);
    return r.exec!;
  };

  it('a file written in the guest survives hibernate and resume; CMD runs on, detached', async () => {
    run = startPvisor(env, ['run', '--vm-backing-dir', dir, '--memory', '256MiB', '--vcpus', '1', '--name', 'L1', '--', 'sh', '-c', 'echo started; exec sleep 100000']);
    await run.waitFor(/^started$/m);
    const text = randomBytes(16).toString('hex');
    expect(await exec(`echo ${text} > /tmp/survives && sync && cat /tmp/survives`)).toMatchObject({ exitCode: 0, stdout: `${text}\n` });

    const h = await pvisor('suspend', 'L1', '--hibernate');
    expect(h.stderr).toBe('');
    expect(h.status).toBe(0);
    const m = /^L1 hibernated in ([\d.]+) ms: guest RAM resident (.+), process (.+) -> 0; (.+) on disk in .*; its process \(pid \d+\) has ended/m.exec(h.stdout);
    expect(m).not.toBeNull();
    expect((await run.exited).code).toBe(148);
    expect(readdirSync(dir).filter((f) => f.startsWith('pvisor-hibernated-L1-'))).toHaveLength(1);

    const r = await pvisor('resume', 'L1');
    expect(r.stderr).toBe('');
    expect(r.status).toBe(0);
    const rm = /^L1 resumed from hibernation in ([\d.]+) ms \(ready ([\d.]+) ms after its process began restoring; guest RAM loading lazily\): pid (\d+), guest RAM resident (.+), process (.+); its output/m.exec(r.stdout);
    expect(rm).not.toBeNull();
    resumedPid = Number(rm![3]);
    expect(readdirSync(dir).filter((f) => f.startsWith('pvisor-hibernated-'))).toEqual([]);

    // The same guest: its file, and CMD still running (its output now dropped by the agent).
    expect(await exec('cat /tmp/survives')).toMatchObject({ exitCode: 0, stdout: `${text}\n` });
    expect((await exec('ps')).stdout).toMatch(/sleep 100000/);
    const bootMs = /^pvisor: L1 ready in (\d+) ms$/m.exec(run.err())?.[1];
    process.stdout.write(
      `linux hibernate figures (256 MiB; its boot to ready took ${bootMs} ms): hibernate ${m![1]} ms, guest RAM ${m![2]}, process ${m![3]} -> 0, ${m![4]} on disk; ` +
        `resume (command) ${rm![1]} ms, ready ${rm![2]} ms after its process began restoring, guest RAM ${rm![4]}, process ${rm![5]}\n`,
    );

    const stop = await pvisor('stop', 'L1');
    expect(stop.stdout).toMatch(/^L1 stopped \(it was running/m);
    expect(stop.status).toBe(0);
    for (let i = 0; i < 200 && !gone(resumedPid); i++) await new Promise((res) => setTimeout(res, 100));
    expect(gone(resumedPid)).toBe(true);
    expect(existsSync(join(dir, 'run', 'L1.sock'))).toBe(false);
  }, 900000);
});
