// pvisor run's arguments: a fresh boot or --from a snapshot, the strategies, the command. No KVM needed.
import { checkCarriedFlags, parseRunArgs } from '../../src/cli/run-args';
import { InvalidOptionError } from '../../src/errors';

describe('pvisor run: argument parsing', () => {
  const cwd = '/home/u/work';

  it('boots a 512 MiB Linux VM with 2 vCPUs unless told otherwise, with Offload composed for pvisor suspend', () => {
    const a = parseRunArgs(['--', 'uname', '-a'], cwd);
    expect(a.source).toEqual({ kind: 'boot', memoryBytes: 512 * 2 ** 20, memoryText: '512MiB', vcpus: 2, guest: 'linux', kernel: undefined, initrd: undefined, rootfs: undefined, network: 'none' });
    expect(a.command).toEqual(['uname', '-a']);
    expect(a.strategies.map((s) => s.name)).toEqual(['offload']);
  });

  it('--from DIR restores instead, DIR made absolute against the cwd of the run', () => {
    const a = parseRunArgs(['--from', 'snaps/base', '--name', 'C1', '--vm-ram-dedup', '--', 'digest'], cwd);
    expect(a.source).toEqual({ kind: 'snapshot', dir: '/home/u/work/snaps/base', shared: false });
    expect(a.name).toBe('C1');
    expect(a.strategies.map((s) => s.name)).toEqual(['ksm-advice', 'offload']);
    expect(parseRunArgs(['--from', '/abs/snap', '--', 'digest'], cwd).source).toEqual({ kind: 'snapshot', dir: '/abs/snap', shared: false });
  });

  it('--from s3://bucket/prefix is kept as a location, checked now', () => {
    expect(parseRunArgs(['--from', 's3://pvisor/t/1/', '--', 'digest'], cwd).source).toEqual({ kind: 'snapshot', dir: 's3://pvisor/t/1/', shared: false });
    expect(() => parseRunArgs(['--from', 's3://pvisor/a/../b', '--', 'digest'], cwd)).toThrow(/^--from: .*\.\. segment/);
  });

  it('--shared maps the snapshot\'s RAM file (SharedSnapshot, first), and only goes with --from', () => {
    const a = parseRunArgs(['--from', 'snap', '--shared', '--vm-idle-release', '--', 'digest'], cwd);
    expect(a.source).toEqual({ kind: 'snapshot', dir: '/home/u/work/snap', shared: true });
    expect(a.strategies.map((s) => s.name)).toEqual(['shared-snapshot', 'idle-release', 'offload']);
    expect(() => parseRunArgs(['--guest', 'probe', '--shared', '--', 'digest'], cwd)).toThrow(/^--shared: only goes with --from DIR/);
  });

  it('--vm-pool SOCKET composes a PoolClient of the given scope; --vm-pool-scope only goes with it', () => {
    const a = parseRunArgs(['--guest', 'probe', '--vm-pool', '/run/pvisor/pool.sock', '--vm-pool-scope', 'tenant-a', '--', 'digest'], cwd);
    expect(a.strategies.map((s) => s.name)).toEqual(['pool-client', 'offload']);
    expect(() => parseRunArgs(['--guest', 'probe', '--vm-pool-scope', 'x', '--', 'digest'], cwd)).toThrow(/^--vm-pool-scope: only goes with --vm-pool/);
    expect(() => parseRunArgs(['--guest', 'probe', '--vm-pool', '/s', '--vm-pool-scope', 'bad\nscope', '--', 'digest'], cwd)).toThrow(InvalidOptionError);
    // A group's scope: gid:GID:NAME, nothing else that starts with gid:.
    expect(parseRunArgs(['--guest', 'probe', '--vm-pool', '/s', '--vm-pool-scope', 'gid:4242:web', '--', 'digest'], cwd).strategies[0].name).toBe('pool-client');
    for (const bad of ['gid:web:x', 'gid:4242', 'gid:4242:', 'gid:01:x', 'gid:4294967295:x']) {
      expect(() => parseRunArgs(['--guest', 'probe', '--vm-pool', '/s', '--vm-pool-scope', bad, '--', 'digest'], cwd)).toThrow(/^scope: scope: a group's scope is gid:GID:NAME/);
    }
  });

  it.each([
    ['--memory', '1GiB'],
    ['--vcpus', '4'],
    ['--guest', 'probe'],
    ['--kernel', 'bzImage'],
    ['--initrd', 'initrd.cpio'],
    ['--rootfs', 'rootfs.img'],
  ])('%s is refused beside --from, naming the flag: the snapshot says it', (flag, value) => {
    const parse = () => parseRunArgs(['--from', 'snap', flag, value, '--', 'digest'], cwd);
    expect(parse).toThrow(InvalidOptionError);
    expect(parse).toThrow(new RegExp(`^${flag}: does not go with --from`));
  });

  it('--rootfs-readonly is refused beside --from too', () => {
    expect(() => parseRunArgs(['--from', 'snap', '--rootfs-readonly', '--', 'digest'], cwd)).toThrow(/^--rootfs-readonly: does not go with --from/);
  });

  it('--from needs a directory and a command', () => {
    expect(() => parseRunArgs(['--from', '', '--', 'digest'], cwd)).toThrow(/^--from: expected a snapshot directory/);
    expect(() => parseRunArgs(['--from', 'snap'], cwd)).toThrow(/^command: nothing to run/);
  });

  it('keeps the checks of a fresh boot', () => {
    expect(() => parseRunArgs(['--guest', 'probe', '--kernel', 'k', '--', 'digest'], cwd)).toThrow(/^--kernel: --kernel and --initrd are for the Linux guest/);
    expect(() => parseRunArgs(['--memory', '12 parsecs', '--', 'digest'], cwd)).toThrow(/^memory: cannot parse size/);
    expect(() => parseRunArgs(['--vm-offload-reload', 'lazy', '--', 'digest'], cwd)).toThrow(/^--vm-offload-reload: only goes with --vm-offload/);
    expect(parseRunArgs(['--rootfs', 'r.img', '--rootfs-readonly', '--', 'true'], cwd).source).toMatchObject({ rootfs: { path: 'r.img', readOnly: true } });
  });

  it('--net and --net-allow become the network option, and are checked before anything starts', () => {
    expect(parseRunArgs(['--net', 'nat', '--', 'true'], cwd).source).toMatchObject({ network: 'nat' });
    expect(parseRunArgs(['--net', 'nat', '--net-allow', '10.0.0.0/8', '--net-allow', '192.0.2.7/32:443', '--', 'true'], cwd).source).toMatchObject({
      network: { mode: 'nat', allow: ['10.0.0.0/8', '192.0.2.7/32:443'] },
    });
    expect(parseRunArgs(['--net', 'tap:tap0', '--', 'true'], cwd).source).toMatchObject({ network: { tap: 'tap0' } });
    expect(() => parseRunArgs(['--net', 'bridge', '--', 'true'], cwd)).toThrow(/^--net: expected none, nat or tap:NAME/);
    expect(() => parseRunArgs(['--net-allow', '10.0.0.0/8', '--', 'true'], cwd)).toThrow(/^--net-allow: only goes with --net nat/);
    expect(() => parseRunArgs(['--net', 'nat', '--net-allow', '10.0.0.1/8', '--', 'true'], cwd)).toThrow(/^network.allow\[0\]: "10.0.0.1\/8" is not CIDR/);
    expect(() => parseRunArgs(['--net', 'nat', '--guest', 'probe', '--', 'digest'], cwd)).toThrow(/^--net: is for the Linux guest/);
    expect(() => parseRunArgs(['--from', 'snap', '--net', 'nat', '--', 'digest'], cwd)).toThrow(/^--net: does not go with --from/);
  });

  it('--net-allow takes hostnames too, and --net-deny (repeatable) what may never be reached', () => {
    expect(parseRunArgs(['--net', 'nat', '--net-allow', 'api.openai.com', '--net-allow', '*.pypi.org', '--net-deny', 'evil.pypi.org', '--net-deny', '10.9.0.0/16', '--', 'true'], cwd).source).toMatchObject({
      network: { mode: 'nat', allow: ['api.openai.com', '*.pypi.org'], deny: ['evil.pypi.org', '10.9.0.0/16'] },
    });
    expect(parseRunArgs(['--net', 'nat', '--net-deny', 'evil.test', '--', 'true'], cwd).source).toMatchObject({ network: { mode: 'nat', deny: ['evil.test'] } });
    expect(() => parseRunArgs(['--net-deny', 'evil.test', '--', 'true'], cwd)).toThrow(/^--net-deny: only goes with --net nat/);
    expect(() => parseRunArgs(['--net', 'nat', '--net-deny', 'a..b', '--', 'true'], cwd)).toThrow(/^network\.deny\[0\]: "a\.\.b"/);
    expect(() => parseRunArgs(['--from', 'snap', '--net-deny', 'evil.test', '--', 'digest'], cwd)).toThrow(/^--net-deny: does not go with --from/);
  });

  it('--publish HOSTPORT:GUESTPORT, repeatable, checked before anything starts', () => {
    expect(parseRunArgs(['--publish', '8080:80', '--publish', '2222:22', '--', 'true'], cwd).publish).toEqual([{ hostPort: 8080, guestPort: 80 }, { hostPort: 2222, guestPort: 22 }]);
    expect(parseRunArgs(['--', 'true'], cwd).publish).toEqual([]);
    for (const bad of ['80', '0:80', '8080:65536', 'a:b', '8080:80:1']) expect(() => parseRunArgs(['--publish', bad, '--', 'true'], cwd)).toThrow(/^--publish: expected HOSTPORT:GUESTPORT/);
    expect(() => parseRunArgs(['--guest', 'probe', '--publish', '8080:80', '--', 'digest'], cwd)).toThrow(/^--publish: is for the Linux guest/);
  });

  it('--executor vm, as the reference CLI gives it, is accepted and changes nothing', () => {
    const plain = parseRunArgs(['--memory', '512MiB', '--rootfs', 'agent.img', '--', 'node', '/opt/agent/agent.js'], cwd);
    const withExecutor = parseRunArgs(['--executor', 'vm', '--memory', '512MiB', '--rootfs', 'agent.img', '--', 'node', '/opt/agent/agent.js'], cwd);
    expect(withExecutor).toEqual(plain);
    expect(parseRunArgs(['--executor', 'vm', '--from', 'snap', '--', 'digest'], cwd).source).toEqual({ kind: 'snapshot', dir: '/home/u/work/snap', shared: false });
  });

  it.each(['docker', 'process', 'VM', ''])('--executor %j is refused, naming the one executor there is', (executor) => {
    const parse = () => parseRunArgs(['--executor', executor, '--', 'true'], cwd);
    expect(parse).toThrow(InvalidOptionError);
    expect(parse).toThrow(`--executor: expected vm (pvisor runs commands only in a VM), got ${JSON.stringify(executor)}`);
  });

  it('--label KEY=VALUE (repeatable) are the labels, checked before anything starts; --quiet or -q silences progress', () => {
    const a = parseRunArgs(['--guest', 'probe', '--label', 'team=search', '--label', 'task=a=b', '-q', '--', 'wait'], cwd);
    expect(a.labels).toEqual({ team: 'search', task: 'a=b' });
    expect(a.quiet).toBe(true);
    expect(parseRunArgs(['--', 'true'], cwd)).toMatchObject({ labels: {}, quiet: false });
    expect(() => parseRunArgs(['--label', 'team', '--', 'true'], cwd)).toThrow(/--label: expected KEY=VALUE/);
    expect(() => parseRunArgs(['--label', 'a=1', '--label', 'a=2', '--', 'true'], cwd)).toThrow(/a is given twice/);
    expect(() => parseRunArgs(['--label', `v=${'x'.repeat(300)}`, '--', 'true'], cwd)).toThrow(InvalidOptionError);
  });

  it('a chosen suspend-image strategy replaces the default Offload', () => {
    expect(parseRunArgs(['--from', 'snap', '--vm-ram-compression', '--', 'digest'], cwd).strategies.map((s) => s.name)).toEqual(['compressed-offload']);
  });
});

describe('pvisor run: the flags that go on with a hibernated VM', () => {
  const cwd = '/home/u/work';

  it('carries the strategies, the console and the forwarded ports, paths made absolute, and nothing the snapshot decides', () => {
    const a = parseRunArgs(['--guest', 'probe', '--memory', '256MiB', '--name', 'T1', '--vm-socket', '/x/T1.sock', '--console', '--vm-idle-release', '--vm-offload', '--vm-offload-reload', 'lazy', '--vm-backing-dir', 'back', '--vm-pool', 'pool.sock', '--vm-pool-scope', 'a', '--', 'digest'], cwd);
    expect(a.carriedFlags).toEqual(['--console', '--vm-idle-release', '--vm-offload', '--vm-offload-reload=lazy', '--vm-backing-dir=/home/u/work/back', '--vm-pool=/home/u/work/pool.sock', '--vm-pool-scope=a']);
    expect(a.backingDir).toBe('/home/u/work/back');
    expect(parseRunArgs(['--', 'true'], cwd)).toMatchObject({ carriedFlags: [], backingDir: '/var/tmp' });
    // Labels go on with the VM, as they were given.
    expect(parseRunArgs(['--label', 'team=a=b', '--', 'true'], cwd).carriedFlags).toEqual(['--label=team=a=b']);
    expect(parseRunArgs(['--from', '/b/h', ...checkCarriedFlags(['--label=team=a=b']), '--', 'true'], cwd).labels).toEqual({ team: 'a=b' });
    // Repeated flags go on as they were given.
    expect(parseRunArgs(['--publish', '8080:80', '--publish', '8443:443', '--', 'true'], cwd).carriedFlags).toEqual(['--publish=8080:80', '--publish=8443:443']);
  });

  it('carried flags read back through the parser give the same run, restored from the hibernation', () => {
    const a = parseRunArgs(['--guest', 'probe', '--vm-cold-ram-compression', '--vm-cold-after', '3s', '--vm-backing-dir', '/b', '--', 'wait'], cwd);
    const b = parseRunArgs(['--from', '/b/h', ...checkCarriedFlags(a.carriedFlags), '--', 'wait'], '/');
    expect(b.source).toEqual({ kind: 'snapshot', dir: '/b/h', shared: false });
    expect(b.strategies.map((s) => s.name)).toEqual(a.strategies.map((s) => s.name));
    expect(b.carriedFlags).toEqual(a.carriedFlags);
    expect(b.backingDir).toBe('/b');
  });

  it.each([
    ['--from=/elsewhere'],
    ['--name=T2'],
    ['--vm-socket=/tmp/x.sock'],
    ['--shared'],
    ['--memory=1GiB'],
    ['--constructor'],
    ['--__proto__'],
    ['digest'],
    ['--console=yes'],
    ['--vm-backing-dir'],
    ['-c'],
  ])('a record whose flags include %j is refused', (flag) => {
    expect(() => checkCarriedFlags(['--vm-idle-release', flag])).toThrow(InvalidOptionError);
  });
});
