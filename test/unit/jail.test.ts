// The jail's pure parts (limits, cgroup files, the seccomp allowlist, bwrap's arguments, the
// jailed run's arguments and report, the CLI's --isolation options), and, where this host lets
// root run bubblewrap, the real sandbox without KVM: node in it runs as the jail's uid with no
// capabilities, no_new_privs and the filter, sees none of the host's files, and is killed by
// SIGSYS for a call outside the filter.
import { spawn, spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, openSync, closeSync, readdirSync, readFileSync, realpathSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseRunArgs } from '../../src/cli/run-args';
import { jailedFlags, withAbsolutePaths, withFrom, withoutPublish } from '../../src/cli/run-jailed';
import { InvalidOptionError, JailUnavailableError, NetworkSetupError } from '../../src/errors';
import { formatHandedNetwork, handedNetwork, HANDED_NETWORK_ENV } from '../../src/network/handed-network';
import { JailCgroup, parseMemoryEvents } from '../../src/jail/cgroup';
import { cgroup2MountOf, cgroupV1ParentsOf, checkCgroupHost } from '../../src/jail/cgroup-host';
import { JailIdLock } from '../../src/jail/jail-lock';
import { jailedEntry, parseJailedReport } from '../../src/jail/jailed-entry';
import { withJailedRunArgs } from '../../src/jail/launcher';
import { cgroupFiles, cgroupV1Files, DEFAULT_MEMORY_HEADROOM_BYTES, DEFAULT_PIDS, resolveLimits } from '../../src/jail/limits';
import { JAIL_OPEN_FILES, JAIL_RLIMITS, withJailRlimits } from '../../src/jail/rlimits';
import { bwrapArgs, librariesOfLdd, nodeRuntimeFiles, parentDirs, usrMergeLinks } from '../../src/jail/sandbox';
import { ALLOWED_IOCTLS, ALLOWED_SYSCALLS, BPF_INSTRUCTION_BYTES, buildFilter, filterRules, ioctlTableMarkdown } from '../../src/jail/seccomp';
import * as C from '../../src/sys/constants';
import { AUDIT_ARCH_I386, evaluateSeccomp, RET_ALLOW, RET_KILL_PROCESS } from '../seccomp-eval';
import { nativePrebuild, PACKAGE_ROOT } from '../../src/native';
import { Vm } from '../../src/vm';

const MiB = 1024 * 1024;

/** The .ts files under `dir`, recursively. */
function tsFiles(dir: string): string[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((e) => (e.isDirectory() ? tsFiles(join(dir, e.name)) : e.name.endsWith('.ts') ? [join(dir, e.name)] : []));
}

describe('jail limits', () => {
  const vm = { memoryBytes: 256 * MiB, vcpus: 2 };

  it('defaults: guest RAM + headroom, vCPUs + 1 CPUs, 128 tasks', () => {
    expect(resolveLimits(undefined, vm)).toEqual({ memoryBytes: 256 * MiB + DEFAULT_MEMORY_HEADROOM_BYTES, cpus: 3, pids: DEFAULT_PIDS });
    expect(resolveLimits({ memory: '128MiB', cpus: 0.5, pids: 64 }, vm)).toEqual({ memoryBytes: 128 * MiB, cpus: 0.5, pids: 64 });
  });

  it('refuses what cannot be a limit, naming it', () => {
    const bad: [unknown, RegExp][] = [
      [{ memory: '1MiB' }, /^limits\.memory: at least 64 MiB/],
      [{ memory: 64 * MiB + 1 }, /^limits\.memory: must be a multiple of 4 KiB/],
      [{ memory: 'lots' }, /^limits\.memory: cannot parse size/],
      [{ cpus: 0 }, /^limits\.cpus: expected a number of CPUs/],
      [{ cpus: Number.NaN }, /^limits\.cpus/],
      [{ cpus: '2' }, /^limits\.cpus/],
      [{ pids: 4 }, /^limits\.pids: expected a whole number from 16/],
      [{ pids: 20.5 }, /^limits\.pids/],
      [{ disk: 1 }, /^limits\.disk: unknown limit/],
      [[], /^limits: expected an object/],
    ];
    for (const [input, message] of bad) {
      const call = () => resolveLimits(input as never, vm);
      expect(call).toThrow(InvalidOptionError);
      expect(call).toThrow(message);
    }
  });

  it('become cgroup v2 files: memory.max in bytes, no swap, group OOM, pids.max, cpu.max as quota and period', () => {
    expect(cgroupFiles({ memoryBytes: 128 * MiB, cpus: 1.5, pids: 64 })).toEqual([
      ['memory.max', String(128 * MiB)],
      ['memory.swap.max', '0'],
      ['memory.oom.group', '1'],
      ['pids.max', '64'],
      ['cpu.max', '150000 100000'],
    ]);
    // The kernel refuses a quota under 1 ms.
    expect(cgroupFiles({ memoryBytes: 128 * MiB, cpus: 0.001, pids: 64 })[4][1]).toBe('1000 100000');
  });

  it('become cgroup v1 files on a v1 host: the same limits, memsw equal to memory (no swap) where swap is accounted, the period before the quota', () => {
    expect(cgroupV1Files({ memoryBytes: 128 * MiB, cpus: 1.5, pids: 64 })).toEqual([
      ['memory', 'memory.limit_in_bytes', String(128 * MiB)],
      ['memory', 'memory.memsw.limit_in_bytes', String(128 * MiB), true],
      ['pids', 'pids.max', '64'],
      ['cpu', 'cpu.cfs_period_us', '100000'],
      ['cpu', 'cpu.cfs_quota_us', '150000'],
    ]);
    expect(cgroupV1Files({ memoryBytes: 128 * MiB, cpus: 0.001, pids: 64 })[4][2]).toBe('1000');
  });
});

describe('jail rlimits', () => {
  it('wrap the jail in prlimit: no core dumps, open files bounded as Firecracker bounds them, hard and soft alike; nothing else', () => {
    expect(withJailRlimits(['/usr/bin/bwrap', '--x', '--', 'node'])).toEqual(['/usr/bin/prlimit', '--core=0:0', `--nofile=${JAIL_OPEN_FILES}:${JAIL_OPEN_FILES}`, '--', '/usr/bin/bwrap', '--x', '--', 'node']);
    expect(JAIL_OPEN_FILES).toBe(2048);
    // Guest-RAM-sized files (Offload, a snapshot) and pids (the cgroup's pids.max) are not rlimits' job.
    expect(Object.keys(JAIL_RLIMITS).sort()).toEqual(['core', 'nofile']);
  });
});

describe('jail id lock', () => {
  it('one launcher per id: a second is refused naming the first; a holder killed outright frees it at once; a release removes the file', async () => {
    const runDir = mkdtempSync(join(tmpdir(), 'pvisor-jail-lock-'));
    try {
      const a = JailIdLock.take(runDir, 'L1');
      expect(readFileSync(join(runDir, 'L1.lock'), 'utf8')).toBe(`${process.pid}\n`);
      expect(() => JailIdLock.take(runDir, 'L1')).toThrow(new RegExp(`^another jailed run of L1 is running \\(its launcher is pid ${process.pid}\\)`));
      a.release();
      a.release();
      expect(existsSync(join(runDir, 'L1.lock'))).toBe(false);
      JailIdLock.take(runDir, 'L1').release();

      // Another process holds L2 (flock(1), which execs sleep with the lock), then is killed outright: the kernel drops its lock.
      const holder = spawn('flock', ['--no-fork', '-x', join(runDir, 'L2.lock'), 'sleep', '60'], { stdio: 'ignore' });
      const held = () => {
        try {
          JailIdLock.take(runDir, 'L2').release();
          return false;
        } catch (e) {
          return e instanceof JailUnavailableError;
        }
      };
      for (const end = Date.now() + 10_000; !held() && Date.now() < end;) await new Promise((r) => setTimeout(r, 20));
      expect(held()).toBe(true);
      holder.kill('SIGKILL');
      await new Promise((r) => holder.once('exit', r));
      const b = JailIdLock.take(runDir, 'L2');
      b.release();
    } finally {
      rmSync(runDir, { recursive: true, force: true });
    }
  });
});

describe('jail cgroup', () => {
  it('finds the cgroup2 mount in mountinfo, and none on a v1-only host', () => {
    const v2 = '25 1 0:22 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n';
    const v1 = '30 25 0:26 / /sys/fs/cgroup/memory rw shared:11 - cgroup cgroup rw,memory\n';
    expect(cgroup2MountOf(v1 + v2)).toBe('/sys/fs/cgroup');
    expect(cgroup2MountOf(v1)).toBeUndefined();
    expect(cgroup2MountOf('40 1 0:30 / /mnt/my\\040cg rw - cgroup2 none rw\n')).toBe('/mnt/my cg');
  });

  it('finds the v1 hierarchies of memory, pids and cpu, under this process\'s own cgroup in each', () => {
    // A hybrid host as these machines have it: cpu and cpuacct apart, the process in a memory cgroup of its own.
    const mountinfo = [
      '32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct',
      '35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory',
      '39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids',
      '40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd',
      '41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw',
    ].join('\n');
    const self = '9:name=systemd:/\n8:pids:/\n4:memory:/process_api/ab12\n1:cpu,cpuacct:/\n0::/\n';
    expect(cgroupV1ParentsOf(mountinfo, self)).toEqual({ memory: '/sys/fs/cgroup/memory/process_api/ab12/pvisor', pids: '/sys/fs/cgroup/pids/pvisor', cpu: '/sys/fs/cgroup/cpu,cpuacct/pvisor' });
    // A container's hierarchy mounted from its subtree: the subtree is the mount's root.
    expect(cgroupV1ParentsOf('50 1 0:40 /docker/c1 /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory', '4:memory:/docker/c1/app\n').memory).toBe('/sys/fs/cgroup/memory/app/pvisor');
    // No pids hierarchy: the host cannot jail, and the error says which controller is missing.
    const noPids = mountinfo.split('\n').filter((l) => !l.includes('pids')).join('\n');
    expect(cgroupV1ParentsOf(noPids, self).pids).toBeUndefined();
    // (The v2 mount named there is read on this host: empty or missing, it offers the jail nothing.)
    expect(() => checkCgroupHost(noPids, self)).toThrow(/^cgroup v2 at \/sys\/fs\/cgroup\/unified does not offer the [a-z, ]+ controller\(s\), and no cgroup v1 hierarchy holds the pids controller\(s\); a jail needs memory, pids, cpu/);
    expect(() => checkCgroupHost('', '')).toThrow(/no cgroup v2 is mounted, and no cgroup v1 hierarchy holds the memory, pids, cpu controller\(s\)/);
  });

  it('enters each of its v1 directories before the command runs, and is removed as a whole', () => {
    const root = mkdtempSync(join(tmpdir(), 'pvisor-cg-'));
    try {
      const parents = { memory: join(root, 'memory', 'pvisor'), pids: join(root, 'pids', 'pvisor'), cpu: join(root, 'cpu', 'pvisor') };
      const cg = JailCgroup.create('T1', { memoryBytes: 64 * MiB, cpus: 1, pids: 32 }, { version: 1, parents });
      expect(cg.dirs).toEqual([join(parents.memory, 'T1'), join(parents.pids, 'T1'), join(parents.cpu, 'T1')]);
      // Plain directories stand in for the hierarchies: the files are written as the kernel would take them.
      expect(cg.limits()).toEqual({ memoryBytes: 64 * MiB, swapBytes: undefined, pids: 32, cpuQuotaUs: 100000, cpuPeriodUs: 100000 });
      expect(() => JailCgroup.create('T1', { memoryBytes: 64 * MiB, cpus: 1, pids: 32 }, { version: 1, parents })).toThrow(/already exists: another jailed run of T1/);
      const argv = cg.enterArgv(['/bin/sh', '-c', 'echo ran $$']);
      const r = spawnSync(argv[0], argv.slice(1), { encoding: 'utf8' });
      expect(r.status).toBe(0);
      const pid = /^ran (\d+)$/m.exec(r.stdout)![1];
      for (const d of cg.dirs) expect(readFileSync(join(d, 'cgroup.procs'), 'utf8').trim()).toBe(pid);
      for (const d of cg.dirs) for (const f of readdirSync(d)) rmSync(join(d, f));
      expect(cg.remove()).toBe(true);
      for (const d of cg.dirs) expect(existsSync(d)).toBe(false);
    } finally {
      rmSync(root, { recursive: true, force: true });
    }
  });

  it("reads memory.events' counts", () => {
    expect(parseMemoryEvents('low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 1\n')).toEqual({ low: 0, high: 0, max: 12, oom: 1, oom_kill: 1, oom_group_kill: 1 });
    // v1's memory.oom_control counts the same kill.
    expect(parseMemoryEvents('oom_kill_disable 0\nunder_oom 0\noom_kill 2\n').oom_kill).toBe(2);
  });
});

describe('jail seccomp filter', () => {
  it('names each syscall once, and none of the calls a VMM never makes', () => {
    const names = Object.values(ALLOWED_SYSCALLS).flat();
    expect(new Set(names).size).toBe(names.length);
    for (const never of ['ptrace', 'mount', 'umount2', 'pivot_root', 'chroot', 'setns', 'unshare', 'bpf', 'perf_event_open', 'keyctl', 'kexec_load', 'init_module', 'finit_module', 'reboot', 'setuid', 'setresuid', 'process_vm_readv', 'process_vm_writev', 'io_uring_setup', 'acct', 'open_by_handle_at', 'personality']) {
      expect(names).not.toContain(never);
    }
    const rules = filterRules();
    expect(rules.split('\n').filter(Boolean).every((l) => /^(allow [a-z0-9_]+|ioctl 0x[0-9a-f]{1,8})$/.test(l))).toBe(true);
    // ioctl request by request: no driver's whole type byte any more.
    expect(rules).not.toMatch(/ioctl-type/);
    expect(rules).toContain(`ioctl 0x${C.KVM_RUN.toString(16)}\n`);
    expect(rules).toContain('ioctl 0x5401\n');
    // The guest network: vhost's requests and TUNSETOFFLOAD on the handed TAP; never TUNSETIFF
    // (a TAP of its own), nor a terminal ioctl that types into the user's terminal (TIOCSTI).
    expect(rules).toContain(`ioctl 0x${C.VHOST_NET_SET_BACKEND.toString(16)}\n`);
    expect(rules).toContain('ioctl 0x400454d0\n');
    expect(rules).not.toContain('ioctl 0x400454ca\n');
    expect(rules).not.toContain('ioctl 0x5412\n');
    // Requests of the same drivers the VMM never makes.
    for (const never of [C.KVM_SET_USER_MEMORY_REGION2, 0xc008ae09 /* KVM_GET_EMULATED_CPUID */, 0x4010ae42 /* KVM_GET_DIRTY_LOG */, 0xc00caee0 /* KVM_CREATE_DEVICE */, 0x4008af04 /* VHOST_SET_LOG_BASE */, 0xc020aa3f /* UFFDIO_POISON */]) {
      expect(rules).not.toContain(`ioctl 0x${never.toString(16)}\n`);
    }
  });

  it('allows exactly the ioctl requests the VMM issues: every one in src/ and in the native helpers it loads, and none it does not', () => {
    const requests = Object.values(ALLOWED_IOCTLS).map((a) => a.request);
    expect(new Set(requests).size).toBe(requests.length);
    // Each entry is the constant of its name (src/sys/constants.ts), and of its driver's type byte.
    const typeOf: Record<string, number> = { '/dev/kvm': 0xae, 'VM fd': 0xae, 'vCPU fd': 0xae, '/dev/userfaultfd': 0xaa, userfaultfd: 0xaa, '/dev/vhost-net': 0xaf, 'TAP fd': 0x54, 'stdio and pipes': 0x54 };
    for (const [name, { request, target, why }] of Object.entries(ALLOWED_IOCTLS)) {
      expect([name, request]).toEqual([name, (C as Record<string, unknown>)[name]]);
      expect([name, (request >>> 8) & 0xff]).toEqual([name, typeOf[target]]);
      expect(why.length).toBeGreaterThan(3);
    }

    // Every ioctl request constant the TypeScript source names (outside the constants and this
    // allowlist) is allowed, but for the TAP's creation, which the launcher makes, outside the jail.
    const madeByLauncher = ['TUNSETIFF', 'TUNSETVNETHDRSZ'];
    const ioctlDrivers = new Set([0xae, 0xaa, 0xaf, 0x54]);
    const isRequest = (v: unknown) => typeof v === 'number' && v >= 0x100 && ioctlDrivers.has((v >>> 8) & 0xff);
    const requestNames = Object.entries(C).filter(([n, v]) => /^(KVM|VHOST|TUN|UFFDIO|USERFAULTFD)[A-Z0-9_]*$/.test(n) && isRequest(v)).map(([n]) => n);
    const srcText = tsFiles(join(PACKAGE_ROOT, 'src')).filter((f) => !/src\/(sys\/constants|jail\/seccomp)\.ts$/.test(f)).map((f) => readFileSync(f, 'utf8')).join('\n');
    const usedInTs = requestNames.filter((n) => new RegExp(`\\bC\\.${n}\\b`).test(srcText));
    expect(usedInTs.length).toBeGreaterThan(50);
    for (const n of usedInTs) if (!madeByLauncher.includes(n)) expect([n, ALLOWED_IOCTLS[n] !== undefined]).toEqual([n, true]);
    for (const n of madeByLauncher) expect(ALLOWED_IOCTLS[n]).toBeUndefined();

    // Every ioctl the native libraries the VMM loads make (their sources, as build.sh lists them).
    const helpers = join(PACKAGE_ROOT, 'native-prebuilds', 'helpers');
    const sources = [...readFileSync(join(helpers, 'build.sh'), 'utf8').matchAll(/^build libpvisor-[a-z]+\.so (.*)$/gm)].flatMap((m) => m[1].split(/\s+/).filter((w) => /^[a-z_]+\.c$/.test(w)));
    expect(sources).toEqual(expect.arrayContaining(['vcpu_runner.c', 'uffd_server.c']));
    const inC = sources.flatMap((f) => [...readFileSync(join(helpers, f), 'utf8').matchAll(/\bioctl\([^,]+,\s*([A-Z_0-9]+)/g)].map((m) => m[1].replace(/_IOCTL$/, '')));
    expect(new Set(inC)).toEqual(new Set(['KVM_RUN', 'USERFAULTFD_IOC_NEW', 'UFFDIO_API', 'UFFDIO_REGISTER', 'UFFDIO_UNREGISTER', 'UFFDIO_WAKE', 'UFFDIO_COPY', 'UFFDIO_ZEROPAGE', 'UFFDIO_WRITEPROTECT']));
    for (const n of inC) expect([n, ALLOWED_IOCTLS[n] !== undefined]).toEqual([n, true]);

    // And nothing else: each allowed request is issued by that code, or by node on its stdio.
    const byNode = Object.entries(ALLOWED_IOCTLS).filter(([, a]) => a.target === 'stdio and pipes').map(([n]) => n);
    expect(Object.keys(ALLOWED_IOCTLS).sort()).toEqual([...new Set([...usedInTs.filter((n) => !madeByLauncher.includes(n)), ...inC, ...byNode])].sort());
  });

  it('the BPF program, run on each call as the kernel runs it: every listed request allowed, any other request killed, 32-bit calls killed, each call judged in few instructions', () => {
    const program = buildFilter();
    const SYS_read = 0, SYS_ioctl = 16, SYS_ptrace = 101, SYS_futex = 202;
    const ioctlOf = (request: number) => evaluateSeccomp(program, SYS_ioctl, [3, request, 0]);
    for (const [name, { request }] of Object.entries(ALLOWED_IOCTLS)) {
      expect([name, ioctlOf(request).action]).toEqual([name, RET_ALLOW]);
      // The kernel reads 32 bits of the request: the upper half of the register does not matter.
      expect([name, ioctlOf(request + 2 ** 32).action]).toEqual([name, RET_ALLOW]);
    }
    const listed = new Set(Object.values(ALLOWED_IOCTLS).map((a) => a.request));
    // Every other request of KVM's, userfaultfd's and vhost's type bytes (all 256 numbers in each
    // direction and a few sizes), and the terminals' TIOCSTI, is killed.
    let refused = 0;
    for (const type of [0xae, 0xaa, 0xaf]) {
      for (let nr = 0; nr < 256; nr++) {
        for (const dirSize of [0, 0x4008, 0x8008, 0xc008, 0x4040, 0x40a0]) {
          const request = ((dirSize << 16) | (type << 8) | nr) >>> 0;
          if (listed.has(request)) continue;
          expect([request.toString(16), ioctlOf(request).action]).toEqual([request.toString(16), RET_KILL_PROCESS]);
          refused++;
        }
      }
    }
    expect(refused).toBeGreaterThan(4000);
    expect(ioctlOf(0x5412 /* TIOCSTI */).action).toBe(RET_KILL_PROCESS);
    expect(evaluateSeccomp(program, SYS_read).action).toBe(RET_ALLOW);
    expect(evaluateSeccomp(program, SYS_ptrace).action).toBe(RET_KILL_PROCESS);
    // A 32-bit call (int 0x80: i386's numbers, 54 is its ioctl) is killed, not judged as x86-64's.
    // The whole process, not only the calling thread (libseccomp's default for another architecture).
    expect(evaluateSeccomp(program, 54, [3, C.KVM_RUN, 0], AUDIT_ARCH_I386).action).toBe(RET_KILL_PROCESS);
    // An x32 call (x86-64's arch, the x32 bit in its number) too.
    expect(evaluateSeccomp(program, 0x40000000 + SYS_ioctl, [3, C.KVM_RUN, 0]).action).toBe(RET_KILL_PROCESS);
    // The cost per call (a binary tree over syscall numbers, then the request chain): futex, on
    // every wake-up, and KVM_RUN, on every vCPU entry.
    expect(evaluateSeccomp(program, SYS_futex).executed).toBeLessThan(25);
    expect(ioctlOf(C.KVM_RUN).executed).toBeLessThan(100);
  });

  it("docs/security.md holds the allowlist's ioctl table as the code has it", () => {
    expect(readFileSync(join(PACKAGE_ROOT, 'docs', 'security.md'), 'utf8')).toContain(ioctlTableMarkdown());
  });

  it('becomes a BPF program through libseccomp; the helper refuses an unknown name or rule', () => {
    const program = buildFilter();
    expect(program.length % BPF_INSTRUCTION_BYTES).toBe(0);
    expect(program.length / BPF_INSTRUCTION_BYTES).toBeGreaterThan(50);
    // One more allowed call is more program.
    expect(buildFilter(`${filterRules()}allow ptrace\n`).length).toBeGreaterThan(program.length);
    expect(() => buildFilter('allow no_such_call\n')).toThrow(/unknown syscall: no_such_call/);
    expect(() => buildFilter('permit read\n')).toThrow(/unknown rule/);
    expect(() => buildFilter('ioctl 0x1ffffffff\n')).toThrow(/bad number/);
  });
});

describe('jail sandbox arguments', () => {
  it("reads ldd's output: resolved libraries and the loader, not the vdso", () => {
    const out = '\tlinux-vdso.so.1 (0x00007ffd)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n\tlibgone.so => not found\n';
    expect(librariesOfLdd(out)).toEqual(['/lib/x86_64-linux-gnu/libc.so.6', '/lib64/ld-linux-x86-64.so.2']);
  });

  it('makes every directory above a mount 0755, parents first', () => {
    expect(parentDirs(['/usr/lib/x/libc.so.6', '/usr/bin/node', '/work/wt/dist'])).toEqual(['/usr', '/work', '/usr/bin', '/usr/lib', '/work/wt', '/usr/lib/x']);
  });

  it('unshares every namespace but the user one, binds read-only what it is given, and execs the jail step last', () => {
    const a = bwrapArgs({ readOnly: ['/usr/bin/node'], readWrite: ['/var/tmp/b'], devices: [{ node: '/run/j/kvm', path: '/dev/kvm' }], links: [{ path: '/lib', target: 'usr/lib' }], uid: 65534, gid: 65533, jailExec: '/p/jail-exec', seccompFd: 5, env: { A: '1' }, command: ['/usr/bin/node', 'main.js'] });
    for (const ns of ['--unshare-pid', '--unshare-ipc', '--unshare-uts', '--unshare-net', '--unshare-cgroup']) expect(a).toContain(ns);
    expect(a).toContain('--die-with-parent');
    expect(a).toContain('--clearenv');
    const at = (flag: string, value: string) => a.findIndex((x, i) => x === flag && a[i + 1] === value);
    expect(at('--tmpfs', '/')).toBeGreaterThanOrEqual(0);
    expect(at('--ro-bind', '/usr/bin/node')).toBeGreaterThan(at('--tmpfs', '/'));
    expect(at('--bind', '/var/tmp/b')).toBeGreaterThan(0);
    expect(at('--dev-bind', '/run/j/kvm')).toBeGreaterThan(0);
    expect(at('--remount-ro', '/')).toBeGreaterThan(at('--dev-bind', '/run/j/kvm'));
    expect(a.slice(a.indexOf('--'))).toEqual(['--', '/p/jail-exec', '65534', '65533', '5', '/usr/bin/node', 'main.js']);
  });

  it('keeps --publish for the launcher (it listens in the host\'s namespace), and CMD whole', () => {
    expect(withoutPublish(['--publish', '8080:80', '--net', 'nat', '--publish=9090:90', '--', 'sh', '--publish', '1:1'])).toEqual(['--net', 'nat', '--', 'sh', '--publish', '1:1']);
    expect(withoutPublish(['--quiet'])).toEqual(['--quiet']);
  });

  it("hands the jailed VMM its network as the launcher made it, checked whole", () => {
    const info = { mode: 'nat' as const, tap: 'pv123n0', mac: '52:54:00:12:34:56', guestAddress: '10.200.0.2/30', hostAddress: '10.200.0.1', allow: 'all' as const, nftTable: 'pvisor_123_0' };
    const handed = { tapFd: 6, kernelArg: 'pvisor.net=10.200.0.2/30,10.200.0.1', info };
    expect(handedNetwork({ [HANDED_NETWORK_ENV]: formatHandedNetwork(handed) })).toEqual(handed);
    // Not a jailed VMM; a jailed one whose launcher made no network.
    expect(handedNetwork({})).toBeUndefined();
    expect(handedNetwork({ [HANDED_NETWORK_ENV]: formatHandedNetwork(undefined) })).toBeNull();
    const bad: [unknown, RegExp][] = [
      [{ ...handed, tapFd: 2 }, /tapFd: expected a file descriptor/],
      [{ ...handed, tapFd: '6' }, /tapFd/],
      [{ ...handed, kernelArg: 'pvisor.net=1.2.3.4/30 init=/bin/sh' }, /kernelArg: expected/],
      [{ ...handed, info: { ...info, mode: 'none' } }, /info\.mode/],
      [{ ...handed, info: { ...info, tap: 'a/b' } }, /info\.tap/],
      [{ ...handed, info: { ...info, mac: '01:00:00:00:00:00' } }, /info\.mac/],
      [null, /expected an object/],
    ];
    for (const [v, message] of bad) {
      const call = () => handedNetwork({ [HANDED_NETWORK_ENV]: JSON.stringify(v) });
      expect(call).toThrow(NetworkSetupError);
      expect(call).toThrow(message);
    }
    expect(() => handedNetwork({ [HANDED_NETWORK_ENV]: '{' })).toThrow(/not JSON/);
  });

  it("passes the jailed run its id and own backing directory before CMD, and reads its report", () => {
    expect(withJailedRunArgs(['--guest', 'probe', '--', 'fill', '8MiB'], 'J1', '/var/tmp/pvisor-jail-J1')).toEqual(['--guest', 'probe', '--name=J1', '--vm-backing-dir=/var/tmp/pvisor-jail-J1', '--', 'fill', '8MiB']);
    // The launcher's socket path is the name the jailed run says (its socket is the fd it is handed).
    expect(withJailedRunArgs(['--', 'x'], 'J1', '/b', '/run/J1.sock')).toEqual(['--name=J1', '--vm-backing-dir=/b', '--vm-socket=/run/J1.sock', '--', 'x']);
    expect(parseJailedReport('exit 3\n')).toBe(3);
    expect(parseJailedReport('')).toBeUndefined();
    expect(parseJailedReport('exit x\n')).toBeUndefined();
    expect(jailedEntry({})).toBeUndefined();
    expect(jailedEntry({ PVISOR_JAIL_CONTROL_FD: '3', PVISOR_JAIL_STATUS_FD: '4' })).toEqual({ controlFd: 3, statusFd: 4, forbiddenSyscallHook: false, resumed: false });
    expect(jailedEntry({ PVISOR_JAIL_CONTROL_FD: '3', PVISOR_JAIL_STATUS_FD: '4', PVISOR_JAIL_RESUMED: '1' })?.resumed).toBe(true);
    expect(jailedEntry({ PVISOR_JAIL_CONTROL_FD: '3; rm', PVISOR_JAIL_STATUS_FD: '4' })).toBeUndefined();
    // The test hook: a system call, or a KVM ioctl outside the list; nothing else turns it on.
    const hook = (v: string) => jailedEntry({ PVISOR_JAIL_CONTROL_FD: '3', PVISOR_JAIL_STATUS_FD: '4', PVISOR_JAIL_TEST_FORBIDDEN_SYSCALL: v })?.forbiddenSyscallHook;
    expect([hook('1'), hook('ioctl'), hook('0'), hook('yes')]).toEqual(['syscall', 'ioctl', false, false]);
  });
});

describe('pvisor run --isolation', () => {
  it('takes process or none and the --limit-* options, which only go with process', () => {
    const a = parseRunArgs(['--isolation', 'process', '--guest', 'probe', '--limit-memory', '128MiB', '--limit-cpus', '1.5', '--limit-pids', '64', '--', 'digest']);
    expect(a.isolation).toBe('process');
    expect(a.limits).toEqual({ memory: '128MiB', cpus: 1.5, pids: 64 });
    // The default: jailed, its limits taken without saying --isolation.
    expect(parseRunArgs(['--guest', 'probe', '--', 'digest'])).toMatchObject({ isolation: 'process', isolationGiven: false });
    expect(parseRunArgs(['--guest', 'probe', '--limit-pids', '64', '--', 'digest']).limits).toEqual({ pids: 64 });
    expect(parseRunArgs(['--isolation', 'none', '--guest', 'probe', '--', 'digest'])).toMatchObject({ isolation: 'none', isolationGiven: true });
    expect(() => parseRunArgs(['--isolation', 'vm', '--', 'x'])).toThrow(/^--isolation: expected process or none/);
    expect(() => parseRunArgs(['--isolation', 'none', '--limit-memory', '128MiB', '--', 'x'])).toThrow(/^--limit-memory: only goes with --isolation process/);
    expect(() => parseRunArgs(['--isolation', 'process', '--limit-pids', 'many', '--', 'x'])).toThrow(/^--limit-pids: expected a number/);
    expect(() => parseRunArgs(['--isolation', 'process', '--limit-memory', '1MiB', '--', 'x'])).toThrow(/^limits\.memory: at least 64 MiB/);
  });

  it('takes a network, a page pool and a socket path; a hibernated jailed VM carries its isolation and limits', () => {
    expect(parseRunArgs(['--isolation', 'process', '--net', 'nat', '--net-allow', '10.0.0.0/8', '--', 'x'])).toMatchObject({ isolation: 'process', source: { network: { mode: 'nat', allow: ['10.0.0.0/8'] } } });
    expect(parseRunArgs(['--isolation', 'process', '--vm-pool', '/s', '--', 'x']).carriedFlags).toEqual(['--vm-pool=/s', '--isolation=process']);
    expect(parseRunArgs(['--isolation', 'process', '--limit-pids', '64', '--', 'x']).carriedFlags).toEqual(['--isolation=process', '--limit-pids=64']);
    expect(jailedFlags(['--vm-offload', '--isolation=none'])).toEqual(['--vm-offload', '--isolation=process']);
    // The jailed VMM's cwd is not the user's: path options are made absolute, CMD is left alone.
    expect(withAbsolutePaths(['--kernel', 'bz', '--rootfs=img', '--from', 's3://b/p', '--vm-pool', '../p.sock', '--', 'cat', 'x'], '/home/u')).toEqual(['--kernel', '/home/u/bz', '--rootfs=/home/u/img', '--from', 's3://b/p', '--vm-pool', '/home/p.sock', '--', 'cat', 'x']);
    expect(withFrom('/j/h', ['--from', '/h', '--isolation=process', '--', 'wait'])).toEqual(['--from', '/j/h', '--isolation=process', '--', 'wait']);
    expect(withFrom('/cache/work-1', ['--from=s3://b/p', '--shared', '--', 'digest'])).toEqual(['--from', '/cache/work-1', '--shared', '--', 'digest']);
    expect(parseRunArgs(['--isolation', 'process', '--vm-socket', '/tmp/a.sock', '--', 'x'])).toMatchObject({ isolation: 'process', socketPath: '/tmp/a.sock' });
  });
});

describe('Vm.start({ isolation })', () => {
  it("refuses, before anything starts, what a jailed VM does not take yet, an unknown key, and isolation values that are not one", async () => {
    await expect(Vm.start({ isolation: 'process', rootfs: { path: '/x' } } as never)).rejects.toThrow(/^rootfs: not available with isolation: 'process' yet/);
    await expect(Vm.start({ isolation: 'process', guest: 'probe', network: 'nat' })).rejects.toThrow(/^network: only the Linux guest has a network device/);
    await expect(Vm.start({ isolation: 'process', network: 'bridge' } as never)).rejects.toThrow(/^network: expected/);
    await expect(Vm.start({ isolation: 'process', strategies: [] } as never)).rejects.toThrow(/^strategies: not available/);
    await expect(Vm.start({ isolation: 'process', memroy: '1GiB' } as never)).rejects.toThrow(/^memroy: not an option of Vm.start with isolation: 'process'/);
    await expect(Vm.start({ isolation: 'process', limits: { memory: '1MiB' } })).rejects.toThrow(/^limits\.memory: at least 64 MiB/);
    await expect(Vm.start({ isolation: 'vm' } as never)).rejects.toThrow(/^isolation: expected 'none' or 'process'/);
  });
});

// The real sandbox, without KVM: bwrap as root, the jail step, node.
// Root and bubblewrap, on a host that lets root make namespaces (a container without
// CAP_SYS_ADMIN does not): test/kvm/jail.test.ts holds the same in the harness in any case.
const canSandbox =
  process.getuid?.() === 0 &&
  existsSync('/usr/bin/bwrap') &&
  spawnSync('/usr/bin/bwrap', ['--unshare-pid', '--unshare-net', '--ro-bind', '/', '/', '/bin/true'], { stdio: 'ignore' }).status === 0;
(canSandbox ? describe : describe.skip)('the jail sandbox on this host (root, bubblewrap)', () => {
  let dir: string;
  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-jail-unit-'));
    writeFileSync(join(dir, 'secret'), 'host secret\n');
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  function inJail(script: string): { status: number | null; signal: NodeJS.Signals | null; stdout: string; stderr: string } {
    const filterPath = join(dir, 'filter.bpf');
    writeFileSync(filterPath, buildFilter());
    const files = nodeRuntimeFiles(realpathSync(join(PACKAGE_ROOT, 'node_modules')));
    const args = bwrapArgs({ readOnly: [...files, join(PACKAGE_ROOT, 'native-prebuilds'), realpathSync(join(PACKAGE_ROOT, 'node_modules'))], readWrite: [], devices: [], links: usrMergeLinks(), uid: 65534, gid: 65534, jailExec: nativePrebuild('pvisor-jail-exec'), seccompFd: 5, env: { PATH: '/usr/bin' }, command: [realpathSync(process.execPath), '-e', script] });
    const fd = openSync(filterPath, 'r');
    try {
      // As the launcher starts it: with the jail's rlimits.
      const [cmd, ...rest] = withJailRlimits(['/usr/bin/bwrap', ...args]);
      const r = spawnSync(cmd, rest, { stdio: ['ignore', 'pipe', 'pipe', 'ignore', 'ignore', fd], encoding: 'utf8', timeout: 60_000 });
      return { status: r.status, signal: r.signal, stdout: r.stdout, stderr: r.stderr };
    } finally {
      closeSync(fd);
    }
  }

  it('runs node as the jail uid, no capabilities, no_new_privs, filtered, seeing none of the host', () => {
    const r = inJail(`
      const fs = require('fs');
      const st = fs.readFileSync('/proc/self/status', 'utf8');
      const field = (n) => new RegExp('^' + n + ':\\\\s*(.*)$', 'm').exec(st)[1];
      let secret; try { fs.readFileSync(${JSON.stringify(join(dir, 'secret'))}); secret = 'read'; } catch (e) { secret = e.code; }
      let passwd; try { fs.readFileSync('/etc/passwd'); passwd = 'read'; } catch (e) { passwd = e.code; }
      let write; try { fs.writeFileSync('/usr/x', ''); write = 'wrote'; } catch (e) { write = e.code; }
      const limits = fs.readFileSync('/proc/self/limits', 'utf8');
      const limit = (n) => new RegExp('^' + n + '\\\\s+(\\\\S+)\\\\s+(\\\\S+)', 'm').exec(limits).slice(1).join(' ');
      console.log(JSON.stringify({ uid: process.getuid(), gid: process.getgid(), groups: process.getgroups(), capEff: field('CapEff'), nnp: field('NoNewPrivs'), seccomp: field('Seccomp'), secret, passwd, write, pid: process.pid, core: limit('Max core file size'), nofile: limit('Max open files') }));
    `);
    expect(r.stderr).toBe('');
    expect(r.status).toBe(0);
    const o = JSON.parse(r.stdout);
    // No supplementary group: node's getgroups() adds the effective gid itself.
    expect(o).toMatchObject({ uid: 65534, gid: 65534, groups: [65534], capEff: '0000000000000000', nnp: '1', seccomp: '2', secret: 'ENOENT', passwd: 'ENOENT', write: 'EROFS' });
    // The rlimits, soft and hard: no core dump of guest RAM, open files bounded.
    expect(o).toMatchObject({ core: '0 0', nofile: `${JAIL_OPEN_FILES} ${JAIL_OPEN_FILES}` });
    // Its own pid namespace: bwrap's init is 1.
    expect(o.pid).toBeLessThan(10);
  });

  it('lets node write to a terminal: libuv asks it TIOCGPTN (a `pvisor run` in a shell has its stdout on one)', () => {
    if (!existsSync('/usr/bin/script')) return; // util-linux's script gives the jail a pty; Debian's bsdutils is essential
    const filterPath = join(dir, 'filter-tty.bpf');
    writeFileSync(filterPath, buildFilter());
    const files = nodeRuntimeFiles(realpathSync(join(PACKAGE_ROOT, 'node_modules')));
    const args = bwrapArgs({ readOnly: [...files, join(PACKAGE_ROOT, 'native-prebuilds')], readWrite: [], devices: [], links: usrMergeLinks(), uid: 65534, gid: 65534, jailExec: nativePrebuild('pvisor-jail-exec'), seccompFd: 5, env: {}, command: [realpathSync(process.execPath), '-e', "console.log('stdout a terminal: ' + process.stdout.isTTY); console.error('stderr too: ' + process.stderr.isTTY)"] });
    const quoted = withJailRlimits(['/usr/bin/bwrap', ...args]).map((a) => `'${a.replace(/'/g, "'\\''")}'`).join(' ');
    const r = spawnSync('/usr/bin/script', ['-qec', `${quoted} 5<'${filterPath}'; echo "status $?"`, '/dev/null'], { encoding: 'utf8', timeout: 60_000 });
    expect(r.stdout).toContain('stdout a terminal: true');
    expect(r.stdout).toContain('stderr too: true');
    expect(r.stdout).toMatch(/status 0\r?$/m);
  });

  it('kills node with SIGSYS for a call outside the filter (acct), and lets an allowed one through', () => {
    const call = (nr: number) => `const { define, DataType, open } = require(${JSON.stringify(realpathSync(require.resolve('ffi-rs')))}); open({ library: 'libc', path: 'libc.so.6' });
      const f = define({ syscall: { library: 'libc', retType: DataType.I64, paramsType: [DataType.I64, DataType.I64] } });
      console.log('returned', f.syscall([${nr}, 0]));`;
    const allowed = inJail(call(39 /* getpid */));
    expect(allowed.stdout).toMatch(/^returned \d+$/m);
    expect(allowed.status).toBe(0);
    const killed = inJail(call(163 /* acct */));
    expect(killed.stdout).not.toContain('returned');
    // bwrap reports its child's death by a signal as 128 + the signal.
    expect(killed.status).toBe(128 + 31);
  });

  it('filters ioctl by request: an allowed KVM request reaches the kernel, one of the same driver outside the list kills', () => {
    // On fd -1: the kernel answers EBADF to a request the filter let through, and touches nothing.
    const call = (request: number) => `const { define, DataType, open } = require(${JSON.stringify(realpathSync(require.resolve('ffi-rs')))}); open({ library: 'libc', path: 'libc.so.6' });
      const f = define({ ioctl: { library: 'libc', retType: DataType.I32, paramsType: [DataType.I32, DataType.U64, DataType.U64], errno: true } });
      const r = f.ioctl([-1, ${request}, 0]); console.log('returned', r.value, r.errnoCode);`;
    for (const request of [C.KVM_RUN, C.KVM_CREATE_VM, C.UFFDIO_COPY, C.VHOST_SET_OWNER]) {
      const allowed = inJail(call(request));
      expect(allowed.stdout).toMatch(/^returned -1 9$/m);
      expect(allowed.status).toBe(0);
    }
    // The old filter let every request of KVM's type byte through; these are killed now.
    for (const request of [C.KVM_SET_USER_MEMORY_REGION2, 0xc008ae09 /* KVM_GET_EMULATED_CPUID */, 0x5412 /* TIOCSTI */]) {
      const killed = inJail(call(request));
      expect(killed.stdout).not.toContain('returned');
      expect(killed.status).toBe(128 + 31);
    }
  });
});
