// The jail's pure parts (limits, cgroup files, the seccomp allowlist, bwrap's arguments, the
// jailed run's arguments and report, the CLI's --isolation options), and, where this host lets
// root run bubblewrap, the real sandbox without KVM: node in it runs as the jail's uid with no
// capabilities, no_new_privs and the filter, sees none of the host's files, and is killed by
// SIGSYS for a call outside the filter.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, openSync, closeSync, realpathSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { parseRunArgs } from '../../src/cli/run-args';
import { jailedFlags, withAbsolutePaths, withFrom, withoutPublish } from '../../src/cli/run-jailed';
import { InvalidOptionError, NetworkSetupError } from '../../src/errors';
import { formatHandedNetwork, handedNetwork, HANDED_NETWORK_ENV } from '../../src/network/handed-network';
import { cgroup2MountOf, parseMemoryEvents } from '../../src/jail/cgroup';
import { jailedEntry, parseJailedReport } from '../../src/jail/jailed-entry';
import { withJailedRunArgs } from '../../src/jail/launcher';
import { cgroupFiles, DEFAULT_MEMORY_HEADROOM_BYTES, DEFAULT_PIDS, resolveLimits } from '../../src/jail/limits';
import { bwrapArgs, librariesOfLdd, nodeRuntimeFiles, parentDirs, usrMergeLinks } from '../../src/jail/sandbox';
import { ALLOWED_SYSCALLS, BPF_INSTRUCTION_BYTES, buildFilter, filterRules } from '../../src/jail/seccomp';
import { nativePrebuild, PACKAGE_ROOT } from '../../src/native';
import { Vm } from '../../src/vm';

const MiB = 1024 * 1024;

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
});

describe('jail cgroup', () => {
  it('finds the cgroup2 mount in mountinfo, and none on a v1-only host', () => {
    const v2 = '25 1 0:22 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n';
    const v1 = '30 25 0:26 / /sys/fs/cgroup/memory rw shared:11 - cgroup cgroup rw,memory\n';
    expect(cgroup2MountOf(v1 + v2)).toBe('/sys/fs/cgroup');
    expect(cgroup2MountOf(v1)).toBeUndefined();
    expect(cgroup2MountOf('40 1 0:30 / /mnt/my\\040cg rw - cgroup2 none rw\n')).toBe('/mnt/my cg');
  });

  it("reads memory.events' counts", () => {
    expect(parseMemoryEvents('low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 1\n')).toEqual({ low: 0, high: 0, max: 12, oom: 1, oom_kill: 1, oom_group_kill: 1 });
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
    expect(rules).toContain('ioctl-type 0xae\n');
    expect(rules).toContain('ioctl-type 0xaa\n');
    expect(rules).toContain('ioctl 0x5401\n');
    // The guest network: vhost's requests and TUNSETOFFLOAD on the handed TAP; never TUNSETIFF
    // (a TAP of its own) nor TUN's whole type byte, which is the terminal ioctls' too (TIOCSTI).
    expect(rules).toContain('ioctl-type 0xaf\n');
    expect(rules).toContain('ioctl 0x400454d0\n');
    expect(rules).not.toContain('ioctl 0x400454ca\n');
    expect(rules).not.toContain('ioctl-type 0x54\n');
    expect(rules).not.toContain('ioctl 0x5412\n');
    expect(rules.split('\n').filter(Boolean).every((l) => /^(allow [a-z0-9_]+|ioctl-type 0x[0-9a-f]{1,2}|ioctl 0x[0-9a-f]{1,8})$/.test(l))).toBe(true);
  });

  it('becomes a BPF program through libseccomp; the helper refuses an unknown name or rule', () => {
    const program = buildFilter();
    expect(program.length % BPF_INSTRUCTION_BYTES).toBe(0);
    expect(program.length / BPF_INSTRUCTION_BYTES).toBeGreaterThan(50);
    // One more allowed call is more program.
    expect(buildFilter(`${filterRules()}allow ptrace\n`).length).toBeGreaterThan(program.length);
    expect(() => buildFilter('allow no_such_call\n')).toThrow(/unknown syscall: no_such_call/);
    expect(() => buildFilter('permit read\n')).toThrow(/unknown rule/);
    expect(() => buildFilter('ioctl-type 0x1ff\n')).toThrow(/bad number/);
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
      const r = spawnSync('/usr/bin/bwrap', args, { stdio: ['ignore', 'pipe', 'pipe', 'ignore', 'ignore', fd], encoding: 'utf8', timeout: 60_000 });
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
      console.log(JSON.stringify({ uid: process.getuid(), gid: process.getgid(), groups: process.getgroups(), capEff: field('CapEff'), nnp: field('NoNewPrivs'), seccomp: field('Seccomp'), secret, passwd, write, pid: process.pid }));
    `);
    expect(r.stderr).toBe('');
    expect(r.status).toBe(0);
    const o = JSON.parse(r.stdout);
    // No supplementary group: node's getgroups() adds the effective gid itself.
    expect(o).toMatchObject({ uid: 65534, gid: 65534, groups: [65534], capEff: '0000000000000000', nnp: '1', seccomp: '2', secret: 'ENOENT', passwd: 'ENOENT', write: 'EROFS' });
    // Its own pid namespace: bwrap's init is 1.
    expect(o.pid).toBeLessThan(10);
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
});
