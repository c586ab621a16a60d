// pvisor suspend/resume/snapshot/stop/ps from another process, against a VM started by pvisor run
// (booted, or restored with --from): real KVM, real processes, the control socket between them.
// Needs /dev/kvm.
import { existsSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { pvisorOnce, startPvisor, type Run } from '../cli-runs';
import { hexOf } from '../probe-digest';

describe('pvisor suspend/resume/snapshot/stop/ps on a VM started by pvisor run', () => {
  let dir: string;
  let env: NodeJS.ProcessEnv;
  let runs: Run[];

  beforeEach(() => {
    // On a disk: the runtime directory, and the Offload backing files of these runs (the temp
    // directory may be tmpfs, which Offload refuses); both watched by the tests.
    dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-cli-control-'));
    env = { ...process.env, PVISOR_RUNTIME_DIR: join(dir, 'run') };
    runs = [];
  });
  afterEach(() => {
    for (const r of runs) if (r.child.exitCode === null && r.child.signalCode === null) r.child.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  });

  function start(...args: string[]): Run {
    const run = startPvisor(env, ['run', '--vm-backing-dir', dir, ...args]);
    runs.push(run);
    return run;
  }

  const pvisor = (...args: string[]) => pvisorOnce(env, args);
  const pvisorIn = (cwd: string, ...args: string[]) => pvisorOnce(env, args, cwd);

  const socketOf = (id: string) => join(dir, 'run', `${id}.sock`);
  // A jailed run's VMM (the default) writes them in its own backing directory, pvisor-jail-ID under dir.
  const ramFiles = () => [dir, ...readdirSync(dir).filter((f) => f.startsWith('pvisor-jail-')).map((f) => join(dir, f))].flatMap((d) => readdirSync(d).filter((f) => f.endsWith('.ram')));
  const mib = (text: string) => {
    const m = /^([\d.]+) (KiB|MiB)$/.exec(text);
    if (!m) throw new Error(`not a size: ${text}`);
    return Number(m[1]) * (m[2] === 'KiB' ? 1024 : 2 ** 20);
  };

  it('suspend --vm-offload drops guest RAM, ps shows it, resume --vm-load brings it back intact', async () => {
    // Steps that reach the guest while it is suspended wait for the resume: the sleep only has to
    // outlast the suspend's start, and 45 s is generous even inside the nested harness.
    const run = start('--guest', 'probe', '--name', 'T1', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 16MiB random 7, digest, sleep 45, digest');
    await run.waitFor(/^digest: /m);
    expect(run.err()).toContain(`pvisor: VM T1, control socket ${socketOf('T1')}`);

    const s = await pvisor('suspend', 'T1', '--vm-offload');
    expect(s.stderr).toBe('');
    expect(s.status).toBe(0);
    const m = /^T1 suspended in [\d.]+ ms: guest RAM resident (.+) -> (.+), (.+) on disk$/m.exec(s.stdout);
    expect(m).not.toBeNull();
    const [before, after, onDisk] = [mib(m![1]), mib(m![2]), mib(m![3])];
    expect(before).toBeGreaterThanOrEqual(16 * 2 ** 20);
    expect(after).toBeLessThanOrEqual(before / 100);
    expect(onDisk).toBeGreaterThanOrEqual(16 * 2 ** 20);
    expect(ramFiles()).toHaveLength(1);

    const ps = await pvisor('ps');
    expect(ps.status).toBe(0);
    // The last column is the labels: none here.
    expect(ps.stdout).toMatch(new RegExp(`^T1\\s+suspended\\s+\\d+ KiB\\s+64\\.0 MiB\\s+[\\d.]+ MiB\\s+${run.child.pid}\\s+-$`, 'm'));

    const r = await pvisor('resume', 'T1', '--vm-load');
    expect(r.stderr).toBe('');
    expect(r.stdout).toMatch(/^T1 resumed in [\d.]+ ms: guest RAM resident \d+ KiB -> 1\d\.\d MiB, loaded back and verified$/m);
    expect(r.status).toBe(0);

    const end = await run.exited;
    expect(run.err()).not.toMatch(/error/i);
    expect(end.code).toBe(0);
    const digests = [...run.out().matchAll(/^digest: ([0-9a-f]{16}) over 16\.0 MiB/gm)].map((d) => d[1]);
    expect(digests).toEqual([hexOf({ content: 'random', seed: 7, sizeBytes: 16 * 2 ** 20, rewrites: [] }), digests[0]]);
    expect(existsSync(socketOf('T1'))).toBe(false);
    expect(ramFiles()).toEqual([]);
  }, 300000);

  it('wrong id, wrong state and a taken id are clear errors that leave the VM alone; pvisor stop ends a wait', async () => {
    const run = start('--guest', 'probe', '--name', 'T2', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 16MiB random 9, wait');
    await run.waitFor(/^fill: /m);

    const nope = await pvisor('suspend', 'NOPE', '--vm-offload');
    expect(nope.stderr).toMatch(/^pvisor: no VM named NOPE is running/);
    expect(nope.status).toBe(1);

    // Nothing to resume: the caller's mistake (1), told apart from a resume that failed (125).
    const early = await pvisor('resume', 'T2', '--vm-load');
    expect(early.stderr).toMatch(/^pvisor: resume T2 refused: T2 is running, not paused, suspended or hibernated: nothing to resume$/m);
    expect(early.stdout).toBe('');
    expect(early.status).toBe(1);

    const twice = await pvisor('run', '--guest', 'probe', '--name', 'T2', '--', 'digest');
    expect(twice.stderr).toMatch(/pvisor: name: a VM named T2 is already running/);
    expect(twice.stderr).not.toMatch(/starting/);
    expect(twice.status).toBe(1);

    // The VM went on as it was: running, its working set still resident, its socket still there.
    const ps = await pvisor('ps', '--json');
    const rows = JSON.parse(ps.stdout) as { id: string; state: string; pid: number; guestRamResidentBytes: number }[];
    expect(rows.map((r) => [r.id, r.state])).toEqual([['T2', 'running']]);
    expect(rows[0].guestRamResidentBytes).toBeGreaterThanOrEqual(16 * 2 ** 20);
    expect(rows[0].pid).toBe(run.child.pid);

    // --json: a plain object, the state the stop left it in.
    const stop = await pvisor('stop', 'T2', '--json');
    expect(JSON.parse(stop.stdout)).toMatchObject({ id: 'T2', command: 'stop', state: 'stopped', pid: run.child.pid });
    expect(stop.status).toBe(0);
    const end = await run.exited;
    expect(end.code).toBe(0);
    expect(run.out()).toMatch(/^wait: T2 was stopped after/m);
    expect(existsSync(socketOf('T2'))).toBe(false);
    expect((await pvisor('ps')).stdout).not.toMatch(/T2/);
  }, 300000);

  it('SIGTERM stops a suspended VM cleanly: the run exits, its socket and backing file are gone', async () => {
    const run = start('--guest', 'probe', '--name', 'T3', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 16MiB random 3, sleep 600, digest');
    await run.waitFor(/^fill: /m);
    const s = await pvisor('suspend', 'T3', '--vm-offload');
    expect(s.status).toBe(0);
    expect(ramFiles()).toHaveLength(1);

    const t0 = Date.now();
    run.child.kill('SIGTERM');
    const end = await run.exited;
    expect(Date.now() - t0).toBeLessThan(60000); // not the 600 s sleep
    expect(end.code).toBe(143);
    expect(run.err()).toMatch(/pvisor: T3 was stopped \(SIGTERM\) before its steps finished/);
    expect(existsSync(socketOf('T3'))).toBe(false);
    expect(ramFiles()).toEqual([]);
    const after = await pvisor('resume', 'T3');
    expect(after.stderr).toMatch(/no VM named T3 is running/);
    expect(after.status).toBe(1);
  }, 300000);

  const literal = (text: string) => text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
  const digestsOf = (text: string) => [...text.matchAll(/^digest: ([0-9a-f]{16}) over 64\.0 MiB/gm)].map((d) => d[1]);
  const ws64 = hexOf({ content: 'random', seed: 7, sizeBytes: 64 * 2 ** 20, rewrites: [] });

  it('pvisor snapshot writes a running VM into DIR (relative to the client), pvisor run --from DIR continues it with the same digest', async () => {
    const run = start('--guest', 'probe', '--name', 'S1', '--memory', '256MiB', '--vcpus', '2', '--', 'fill 64MiB random 7, digest, wait');
    await run.waitFor(/^digest: /m);

    // Relative to the client's cwd, which is not the run's.
    const s = await pvisorIn(dir, 'snapshot', 'S1', 'snap');
    // A snapshot that takes more than 2 s (the nested harness) says so on stderr as it goes.
    expect(s.stderr).toMatch(/^(pvisor: (still )?writing the snapshot of S1[^\n]*\n)*$/);
    expect(s.status).toBe(0);
    const m = new RegExp(`^S1 snapshot: (\\d+) RAM pages \\(([\\d.]+) MiB\\) written to ${literal(join(dir, 'snap'))} in [\\d.]+ ms; S1 is running$`, 'm').exec(s.stdout);
    expect(m).not.toBeNull();
    expect(Number(m![1])).toBeGreaterThanOrEqual((64 * 2 ** 20) / 4096);
    expect(Number(m![1])).toBeLessThan((72 * 2 ** 20) / 4096); // the working set and the probe's own pages, not all 256 MiB
    expect(readdirSync(join(dir, 'snap')).sort()).toEqual(['manifest.json', 'ram', 'state.json']);

    // A snapshot goes into a new or empty directory, refused before the VM pauses (exit 1); the
    // VM is left running as it was.
    const again = await pvisor('snapshot', 'S1', join(dir, 'snap'));
    expect(again.stderr).toMatch(new RegExp(`^pvisor: snapshot S1 refused: ${literal(join(dir, 'snap'))} is not empty; a snapshot goes into a new or empty directory$`, 'm'));
    expect(again.stdout).toBe('');
    expect(again.status).toBe(1);

    const restored = await pvisor('run', '--from', join(dir, 'snap'), '--name', 'S2', '--', 'digest, memory');
    expect(restored.stderr).toMatch(/restoring a 256\.0 MiB probe VM with 2 vCPU\(s\) from /);
    expect(restored.stderr).toMatch(/S2 ready in \d+ ms \(restored\)/);
    expect(restored.status).toBe(0);
    expect(digestsOf(restored.stdout)).toEqual([ws64]);
    expect(restored.stdout).toMatch(/^memory: guest RAM PSS 6\d\.\d MiB of 256\.0 MiB/m);

    const ps = JSON.parse((await pvisor('ps', '--json')).stdout) as { id: string; state: string }[];
    expect(ps.map((r) => [r.id, r.state])).toEqual([['S1', 'running']]);
    expect((await pvisor('stop', 'S1')).status).toBe(0);
    expect((await run.exited).code).toBe(0);
    expect(digestsOf(run.out())).toEqual([ws64]);
  }, 300000);

  it('a VM started with --from answers suspend, resume, snapshot and stop on its control socket', async () => {
    const run = start('--guest', 'probe', '--name', 'S3', '--memory', '128MiB', '--vcpus', '1', '--', 'fill 64MiB random 7, wait');
    await run.waitFor(/^fill: /m);
    expect((await pvisor('snapshot', 'S3', join(dir, 'base'))).status).toBe(0);
    expect((await pvisor('stop', 'S3')).status).toBe(0);
    expect((await run.exited).code).toBe(0);

    const clone = start('--from', join(dir, 'base'), '--name', 'S4', '--', 'digest, wait');
    await clone.waitFor(/^digest: /m);
    expect(digestsOf(clone.out())).toEqual([ws64]);
    expect(clone.err()).toContain(`pvisor: VM S4, control socket ${socketOf('S4')}`);

    const s = await pvisor('suspend', 'S4', '--vm-offload');
    expect(s.stdout).toMatch(/^S4 suspended in [\d.]+ ms: guest RAM resident 6\d\.\d MiB -> \d+ KiB, 6\d\.\d MiB on disk$/m);
    expect(s.status).toBe(0);
    // A suspended VM's RAM is on disk, not in guest RAM: the library refuses, the client says it once.
    const refused = await pvisor('snapshot', 'S4', join(dir, 'while-suspended'));
    expect(refused.stderr).toMatch(/^pvisor: snapshot S4 refused: S4 is suspended; this needs it running or paused$/m);
    expect(refused.status).toBe(1);
    expect(existsSync(join(dir, 'while-suspended'))).toBe(false);
    expect((await pvisor('resume', 'S4', '--vm-load')).status).toBe(0);

    // What came back from the backing file is what the snapshot of the clone holds.
    const snap = await pvisor('snapshot', 'S4', join(dir, 'second'), '--leave-paused');
    expect(snap.stdout).toMatch(/; S4 is paused \(pvisor resume S4 lets it run\)$/m);
    expect(snap.status).toBe(0);
    const ps = JSON.parse((await pvisor('ps', '--json')).stdout) as { id: string; state: string }[];
    expect(ps.map((r) => [r.id, r.state])).toEqual([['S4', 'paused']]);
    expect((await pvisor('resume', 'S4')).status).toBe(0);
    const second = await pvisor('run', '--from', join(dir, 'second'), '--', 'digest');
    expect(second.status).toBe(0);
    expect(digestsOf(second.stdout)).toEqual([ws64]);

    const stop = await pvisor('stop', 'S4');
    expect(stop.stdout).toMatch(/^S4 stopped \(it was running/m);
    expect((await clone.exited).code).toBe(0);
    expect(clone.out()).toMatch(/^wait: S4 was stopped after/m);
    expect(existsSync(socketOf('S4'))).toBe(false);
  }, 300000);

  it('--shared clones continue with the same digest, their RAM the snapshot file\'s until written; a suspend offloads only what a clone wrote', async () => {
    const run = start('--guest', 'probe', '--name', 'S5', '--memory', '256MiB', '--vcpus', '2', '--', 'fill 64MiB random 7, wait');
    await run.waitFor(/^fill: /m);
    expect((await pvisor('snapshot', 'S5', join(dir, 'base'))).status).toBe(0);
    expect((await pvisor('stop', 'S5')).status).toBe(0);
    expect((await run.exited).code).toBe(0);

    const once = await pvisor('run', '--from', join(dir, 'base'), '--shared', '--', 'digest, memory');
    expect(once.stderr).toMatch(/from .*base, its RAM the snapshot's file shared copy-on-write\.\.\./);
    expect(once.status).toBe(0);
    expect(digestsOf(once.stdout)).toEqual([ws64]);
    // It read all of its working set and wrote none of it.
    const split = /^ {2}guest RAM resident: ([\d.]+) MiB shared \(the snapshot's RAM file\), ([\d.]+) MiB private$/m.exec(once.stdout);
    expect(split).not.toBeNull();
    expect(Number(split![1])).toBeGreaterThanOrEqual(64);
    expect(Number(split![2])).toBeLessThan(4);

    const rewritten = hexOf({ content: 'random', seed: 7, sizeBytes: 64 * 2 ** 20, rewrites: [{ permille: 100, seed: 3 }] });
    const clone = start('--from', join(dir, 'base'), '--shared', '--name', 'S6', '--', 'rewrite 10% 3, digest, wait');
    await clone.waitFor(/^digest: /m);
    expect(digestsOf(clone.out())).toEqual([rewritten]);
    const s = await pvisor('suspend', 'S6', '--vm-offload');
    expect(s.status).toBe(0);
    const m = /^S6 suspended in [\d.]+ ms: guest RAM resident .+ -> .+, (.+) on disk$/m.exec(s.stdout);
    expect(m).not.toBeNull();
    // The 6.4 MiB it wrote (and the probe's own pages), not the 64 MiB it shares with the file.
    expect(mib(m![1])).toBeGreaterThanOrEqual(6 * 2 ** 20);
    expect(mib(m![1])).toBeLessThan(16 * 2 ** 20);
    expect((await pvisor('resume', 'S6', '--vm-load')).status).toBe(0);
    expect((await pvisor('snapshot', 'S6', join(dir, 'after'))).status).toBe(0);
    const after = await pvisor('run', '--from', join(dir, 'after'), '--shared', '--', 'digest');
    expect(after.status).toBe(0);
    expect(digestsOf(after.stdout)).toEqual([rewritten]);
    expect((await pvisor('stop', 'S6')).status).toBe(0);
    expect((await clone.exited).code).toBe(0);
  }, 300000);
});
