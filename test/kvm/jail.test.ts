// Jailed VMs (pvisor run --isolation process, src/jail/): real KVM, real bubblewrap, a real
// cgroup (v2, or v1 on a hybrid host) and seccomp filter. Needs /dev/kvm, root, bwrap and the
// cgroup controllers (the nested harness's L1 has them). Each test says what it shows;
// docs/security.md lists them.
import { existsSync, mkdtempSync, readdirSync, readFileSync, readlinkSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { JailViolationError, VmLimitError } from '../../src/errors';
import { JailedVmm, JAIL_RUN_DIR } from '../../src/jail/launcher';
import { resolveLimits } from '../../src/jail/limits';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { Vm } from '../../src/vm';
import { VmHandle } from '../../src/vm-handle';
import { pvisorOnce, startPvisor, type Run } from '../cli-runs';
import { jailCgroupExists, jailCgroupLimits, jailedVmmPid } from '../jail-cgroups';

const MiB = 1024 * 1024;

describe('a VM in a jailed process', () => {
  let dir: string;
  let env: NodeJS.ProcessEnv;
  let runs: Run[];

  beforeEach(() => {
    dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-jail-'));
    env = { ...process.env, PVISOR_RUNTIME_DIR: join(dir, 'run') };
    runs = [];
  });
  afterEach(() => {
    for (const r of runs) if (r.child.exitCode === null && r.child.signalCode === null) r.child.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  });

  function start(...args: string[]): Run {
    const run = startPvisor(env, ['run', '--isolation', 'process', '--vm-backing-dir', dir, ...args]);
    runs.push(run);
    return run;
  }


  it('runs as nobody in its own namespaces, with no_new_privs, seccomp and its cgroup limits; suspend and resume go through', async () => {
    const run = start('--guest', 'probe', '--name', 'J1', '--memory', '64MiB', '--vcpus', '1', '--limit-memory', '160MiB', '--limit-cpus', '1.5', '--limit-pids', '96', '--', 'fill 16MiB random 7, digest, sleep 20, digest, wait');
    await run.waitFor(/^digest: (\w+)/m);
    const before = /^digest: (\w+)/m.exec(run.out())![1];
    const pid = jailedVmmPid('J1');
    const status = readFileSync(`/proc/${pid}/status`, 'utf8');
    expect(status).toMatch(/^Uid:\s+65534\s+65534\s+65534\s+65534$/m);
    expect(status).toMatch(/^Gid:\s+65534\s+65534\s+65534\s+65534$/m);
    expect(status).toMatch(/^Groups:\s*$/m);
    expect(status).toMatch(/^CapEff:\s+0{16}$/m);
    expect(status).toMatch(/^CapPrm:\s+0{16}$/m);
    expect(status).toMatch(/^NoNewPrivs:\s+1$/m);
    expect(status).toMatch(/^Seccomp:\s+2$/m);
    for (const ns of ['mnt', 'pid', 'net', 'ipc', 'uts']) expect(readlinkSync(`/proc/${pid}/ns/${ns}`)).not.toBe(readlinkSync(`/proc/self/ns/${ns}`));
    const limits = jailCgroupLimits('J1');
    expect(limits).toMatchObject({ memoryBytes: 160 * MiB, pids: 96, cpuQuotaUs: 150000, cpuPeriodUs: 100000 });
    // No swap beyond the limit (undefined: a v1 kernel that does not account swap, where there is none to limit).
    expect(limits.swapBytes ?? 0).toBe(0);

    // The control socket is the launcher's, relayed to the jail: the CLI and the SDK reach it.
    const handle = await VmHandle.connect('J1', { socketPath: join(dir, 'run', 'J1.sock') });
    expect((await handle.status()).state).toBe('running');
    const s = await pvisorOnce(env, ['suspend', 'J1', '--vm-offload']);
    expect(s.stderr).toBe('');
    expect(s.status).toBe(0);
    // Offload wrote guest RAM into the VM's own backing directory, which the jail's uid owns.
    const backing = join(dir, 'pvisor-jail-J1');
    expect(readdirSync(backing).some((f) => f.endsWith('.ram'))).toBe(true);
    const r = await pvisorOnce(env, ['resume', 'J1']);
    expect(r.stderr).toBe('');
    expect(r.status).toBe(0);
    await pvisorOnce(env, ['stop', 'J1']);
    await run.exited;
    // What the guest wrote came back intact (the second digest ran before or after the stop; if after, it was not printed).
    const digests = [...run.out().matchAll(/^digest: (\w+)/gm)].map((m) => m[1]);
    for (const d of digests) expect(d).toBe(before);
    // The jail is taken down: cgroup, private directory, backing directory.
    expect(jailCgroupExists('J1')).toBe(false);
    expect(existsSync(join(JAIL_RUN_DIR, 'J1'))).toBe(false);
    expect(existsSync(backing)).toBe(false);
  }, 240_000);

  it('runs a full cycle under the per-request ioctl filter and its rlimits: cold compression, suspend and resume with Offload, a snapshot, and a jailed restore of it', async () => {
    // Under the nested harness's emulation, the cold scan takes 10-50 times as long.
    const idle = process.env.PVISOR_NESTED === '1' ? '40s' : '4s';
    const run = start('--guest', 'probe', '--name', 'F1', '--memory', '64MiB', '--vcpus', '1', '--vm-cold-ram-compression', '--vm-cold-after', '500ms', '--', `fill 16MiB repetitive 3, sleep ${idle}, memory, digest, wait`);
    await run.waitFor(/^digest: /m);
    const before = /^digest: (\w+)/m.exec(run.out())![1];
    // Cold compression ran (its userfaultfd write-protects and copies) and the filter let it.
    const stored = /cold-compression: blocksStored (\d+)/.exec(run.out());
    expect(stored).not.toBeNull();
    expect(Number(stored![1])).toBeGreaterThanOrEqual(200); // of the 256 blocks of 64 KiB
    // The rlimits, soft and hard (src/jail/rlimits.ts).
    const limits = readFileSync(`/proc/${jailedVmmPid('F1')}/limits`, 'utf8');
    expect(limits).toMatch(/^Max core file size\s+0\s+0\s+bytes/m);
    expect(limits).toMatch(/^Max open files\s+2048\s+2048\s+files/m);

    const s = await pvisorOnce(env, ['suspend', 'F1', '--vm-offload']);
    expect(s.stderr).toBe('');
    expect(s.status).toBe(0);
    const r = await pvisorOnce(env, ['resume', 'F1']);
    expect(r.stderr).toBe('');
    expect(r.status).toBe(0);
    const snapshot = join(dir, 'F1-snapshot');
    const taken = await pvisorOnce(env, ['snapshot', 'F1', snapshot]);
    // Progress only past 2 s: none at native speed, some in the nested harness.
    expect(taken.stderr).toMatch(/^(pvisor: (still )?writing the snapshot of F1[^\n]*\n)*$/);
    expect(taken.status).toBe(0);
    const h = await VmHandle.connect('F1', { socketPath: join(dir, 'run', 'F1.sock') });
    expect((await h.exec('digest')).stdout).toContain(`digest: ${before}`);
    await h.stop();
    expect((await run.exited).code).toBe(0);

    // The snapshot restored in a jail of its own: KVM's state set back through the allowed requests.
    const restored = start('--name', 'F2', '--from', snapshot, '--', 'digest');
    const end = await restored.exited;
    expect(restored.err()).not.toMatch(/SIGSYS/);
    expect(restored.out()).toContain(`digest: ${before}`);
    expect(end.code).toBe(0);
  }, 300_000);

  it('cannot open a file outside its root: the host is not in its mount namespace, and what is bound is read-only', async () => {
    const secret = join(dir, 'host-secret');
    writeFileSync(secret, 'the host secret\n', { mode: 0o644 });
    const run = start('--guest', 'probe', '--name', 'J2', '--memory', '64MiB', '--vcpus', '1', '--', 'digest, wait');
    await run.waitFor(/^digest: /m);
    const pid = jailedVmmPid('J2');
    const root = `/proc/${pid}/root`;
    // The process's root, as the kernel resolves its paths: the test's file, /etc/passwd, /root,
    // the runtime directory holding every VM's control socket, and another VM's jail are not there.
    for (const p of [secret, '/etc/passwd', '/etc/shadow', '/root', join(dir, 'run'), JAIL_RUN_DIR, '/sys', '/var/lib']) expect(existsSync(join(root, p))).toBe(false);
    expect(readdirSync(join(root, 'etc'))).toEqual(['ld.so.cache']);
    expect(readdirSync(join(root, 'dev')).sort()).toEqual(expect.arrayContaining(['kvm', 'null', 'urandom']));
    // Every mount but its backing directory and /tmp is read-only.
    const mounts = readFileSync(`/proc/${pid}/mountinfo`, 'utf8').split('\n').filter(Boolean).map((l) => ({ point: l.split(' ')[4], opts: l.split(' ')[5] }));
    const writable = mounts.filter((m) => m.opts.split(',').includes('rw')).map((m) => m.point);
    expect(writable.sort()).toEqual(expect.arrayContaining(['/tmp', join(dir, 'pvisor-jail-J2')]));
    for (const w of writable) expect(['/tmp', join(dir, 'pvisor-jail-J2'), '/dev', '/dev/kvm', '/dev/userfaultfd', '/proc', '/dev/shm', '/dev/mqueue', '/dev/pts'].some((ok) => w === ok || w.startsWith(`${ok}/`))).toBe(true);
    await pvisorOnce(env, ['stop', 'J2']);
    await run.exited;
  }, 120_000);

  it('a guest filling past limits.memory ends only its own VM, with a VmLimitError; a bystander VM answers on', async () => {
    const bystander = start('--guest', 'probe', '--name', 'B1', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 16MiB random 3, digest, wait');
    await bystander.waitFor(/^digest: /m);
    const bystanderDigest = /^digest: (\w+)/m.exec(bystander.out())![1];

    // Through the CLI: the run ends with the error's message, naming the limit.
    const victim = start('--guest', 'probe', '--name', 'V1', '--memory', '256MiB', '--vcpus', '1', '--limit-memory', '128MiB', '--', 'fill 224MiB random 7, digest');
    const end = await victim.exited;
    expect(end.code).not.toBe(0);
    expect(victim.err()).toMatch(/V1: the VM's process reached its limits\.memory of 134217728 bytes \(128 MiB\) and the kernel ended it \(cgroup OOM kill\)/);
    expect(victim.out()).not.toMatch(/^digest: /m);
    expect(jailCgroupExists('V1')).toBe(false);

    // Through the launcher's API: the typed error.
    const vmm = await JailedVmm.start({ id: 'V2', limits: resolveLimits({ memory: '128MiB' }, { memoryBytes: 256 * MiB, vcpus: 1 }), runArgv: ['--guest', 'probe', '--memory', '256MiB', '--vcpus', '1', '--', 'fill 224MiB random 7, digest'], readOnly: [], readWrite: [], backingParent: dir });
    const outcome = await vmm.exited();
    expect('error' in outcome && outcome.error).toBeInstanceOf(VmLimitError);
    const e = (outcome as { error: VmLimitError }).error;
    expect(e.limit).toBe('memory');
    expect(e.limitBytes).toBe(128 * MiB);
    expect(e.code).toBe('PVISOR_VM_LIMIT');

    // The bystander lives on: it answers, with the memory it had.
    const h = await VmHandle.connect('B1', { socketPath: join(dir, 'run', 'B1.sock') });
    expect((await h.status()).state).toBe('running');
    const again = await h.exec('digest');
    expect(again.stdout).toContain(`digest: ${bystanderDigest}`);
    await h.stop();
    await bystander.exited;
  }, 300_000);

  it('a jailed VMM making a call outside its filter (a system call, a KVM ioctl request) is killed by SIGSYS, and the launcher says so with a JailViolationError', async () => {
    process.env.PVISOR_JAIL_TEST_FORBIDDEN_SYSCALL = '1';
    let vmm: JailedVmm;
    try {
      vmm = await JailedVmm.start({ id: 'S1', limits: resolveLimits(undefined, { memoryBytes: 64 * MiB, vcpus: 1 }), runArgv: ['--guest', 'probe', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 8MiB, digest, wait'], readOnly: [], readWrite: [], backingParent: dir });
    } finally {
      delete process.env.PVISOR_JAIL_TEST_FORBIDDEN_SYSCALL;
    }
    const outcome = await vmm.exited();
    expect('error' in outcome && outcome.error).toBeInstanceOf(JailViolationError);
    expect((outcome as { error: JailViolationError }).error.signal).toBe('SIGSYS');
    expect(jailCgroupExists('S1')).toBe(false);

    // A KVM ioctl request outside the list (KVM_SET_USER_MEMORY_REGION2, of KVM's type byte,
    // which the filter let through when it allowed requests by driver): killed the same way.
    process.env.PVISOR_JAIL_TEST_FORBIDDEN_SYSCALL = 'ioctl';
    let ioctlVmm: JailedVmm;
    try {
      ioctlVmm = await JailedVmm.start({ id: 'S3', limits: resolveLimits(undefined, { memoryBytes: 64 * MiB, vcpus: 1 }), runArgv: ['--guest', 'probe', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 8MiB, digest, wait'], readOnly: [], readWrite: [], backingParent: dir });
    } finally {
      delete process.env.PVISOR_JAIL_TEST_FORBIDDEN_SYSCALL;
    }
    const ioctlOutcome = await ioctlVmm.exited();
    expect('error' in ioctlOutcome && ioctlOutcome.error).toBeInstanceOf(JailViolationError);
    expect((ioctlOutcome as { error: JailViolationError }).error.signal).toBe('SIGSYS');
    expect(jailCgroupExists('S3')).toBe(false);

    // Through the CLI: the message.
    const run = startPvisor({ ...env, PVISOR_JAIL_TEST_FORBIDDEN_SYSCALL: '1' }, ['run', '--isolation', 'process', '--vm-backing-dir', dir, '--guest', 'probe', '--name', 'S2', '--memory', '64MiB', '--', 'fill 8MiB, digest, wait']);
    runs.push(run);
    const end = await run.exited;
    expect(end.code).not.toBe(0);
    expect(run.err()).toMatch(/S2: the jailed VM process was killed by SIGSYS: it made a system call its seccomp filter does not allow/);
  }, 240_000);

  it('a launcher killed outright leaves its jail; the next run of that id takes it down (its backing directory moved aside, not lost) and runs; a run of a live id is refused whatever its runtime directory', async () => {
    const first = start('--guest', 'probe', '--name', 'K1', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 4MiB random 1, digest, wait');
    await first.waitFor(/^digest: /m);
    first.child.kill('SIGKILL');
    await first.exited;
    // Nobody took it down: the jail's directory and its backing directory are still there.
    expect(existsSync(join(JAIL_RUN_DIR, 'K1'))).toBe(true);
    expect(existsSync(join(dir, 'pvisor-jail-K1'))).toBe(true);

    const second = start('--guest', 'probe', '--name', 'K1', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 4MiB random 1, digest, wait');
    await second.waitFor(/^digest: /m);
    expect(second.err()).toMatch(/^pvisor: a launcher of K1 was killed before it could take its jail down: .*\/run\/pvisor-jail\/K1, removed; its backing directory, moved to .*pvisor-jail-K1\.left-/m);
    const aside = readdirSync(dir).filter((f) => f.startsWith('pvisor-jail-K1.left-'));
    expect(aside).toHaveLength(1);
    expect(jailedVmmPid('K1')).toBeGreaterThan(0);

    // The id is held while it runs: a run of K1 from another runtime directory is refused, and harms nothing.
    const third = startPvisor({ ...env, PVISOR_RUNTIME_DIR: join(dir, 'run-other') }, ['run', '--isolation', 'process', '--vm-backing-dir', dir, '--guest', 'probe', '--name', 'K1', '--memory', '64MiB', '--vcpus', '1', '--', 'digest']);
    runs.push(third);
    expect((await third.exited).code).toBe(125);
    expect(third.err()).toMatch(new RegExp(`another jailed run of K1 is running \\(its launcher is pid ${second.child.pid}\\)`));
    expect((await pvisorOnce(env, ['stop', 'K1'])).status).toBe(0);
    expect((await second.exited).code).toBe(0);
    expect(jailCgroupExists('K1')).toBe(false);
    expect(existsSync(join(JAIL_RUN_DIR, 'K1'))).toBe(false);
    expect(existsSync(join(JAIL_RUN_DIR, 'K1.lock'))).toBe(false);
  }, 120_000);

  it('Vm.start({ isolation: "process" }) gives a VmHandle on the jailed child, which ends when the handle stops', async () => {
    const vm = await Vm.start({ isolation: 'process', guest: 'probe', memory: '64MiB', vcpus: 1, name: 'H1', labels: { team: 'jail' }, limits: { memory: '160MiB', pids: 64 }, backingDir: dir, bootTimeoutMs: 120_000 });
    expect(vm).toBeInstanceOf(VmHandle);
    const st = await vm.status();
    expect(st).toMatchObject({ id: 'H1', state: 'running', guest: 'probe', memoryBytes: 64 * MiB, vcpus: 1, labels: { team: 'jail' } });
    expect(jailCgroupLimits('H1').pids).toBe(64);
    expect(jailedVmmPid('H1')).toBeGreaterThan(0);
    const r = await vm.exec('fill 8MiB random 5, digest');
    expect(r.stdout).toMatch(/^digest: \w+/m);
    await vm.stop();
    const outcome = await vm.jail.exited();
    // The jailed probe run ends as `pvisor run` does when stopped at its `wait` step.
    expect(outcome).toEqual({ exitCode: 0 });
    expect(jailCgroupExists('H1')).toBe(false);
    // Options a jailed VM does not take yet are refused before anything starts.
    await expect(Vm.start({ isolation: 'process', guest: 'linux', rootfs: { path: '/x' } } as never)).rejects.toThrow(/^rootfs: not available with isolation: 'process' yet/);
    await expect(Vm.start({ isolation: 'process', guest: 'probe', network: 'nat' })).rejects.toThrow(/^network: only the Linux guest has a network device/);
  }, 180_000);
});
