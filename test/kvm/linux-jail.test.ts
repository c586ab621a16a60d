// A Linux VM in a jailed process (pvisor run --isolation process, Vm.start({ isolation:
// 'process' })): its command's output and status through the CLI, and exec, spawn and files
// through the VmHandle, whose streams the launcher relays to the jailed VMM; its network, whose
// host side the launcher makes and removes, and its forwarded ports. In a file of its own
// because it boots the Linux guest (which kvm_pvm cannot run): it goes to the nested harness.
// Needs /dev/kvm, root, bwrap and the cgroup controllers, v2 or v1 (the harness's L1 has them).
import { execFileSync, spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { chmodSync, copyFileSync, existsSync, lstatSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, readlinkSync, rmSync, symlinkSync } from 'node:fs';
import { get } from 'node:http';
import { join } from 'node:path';
import { JAIL_RUN_DIR } from '../../src/jail/launcher';
import type { JailedVmHandle } from '../../src/jail/jailed-vm';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { SnapshotReader } from '../../src/snapshot/snapshot-dir';
import { Vm } from '../../src/vm';
import { VmHandle } from '../../src/vm-handle';
import { PVISOR_MAIN, pvisorOnce, startPvisor, type Run } from '../cli-runs';
import { jailCgroupExists, jailedVmmPid } from '../jail-cgroups';

const sh = (cmd: string) => execFileSync('sh', ['-c', cmd], { encoding: 'utf8' });
/** pvisor's TAPs and nftables tables on this host (`FAMILY NAME`). */
const ourLinks = () => [...sh('ip -o link show').matchAll(/^[0-9]+: (pv[0-9]+n[0-9]+)[:@]/gm)].map((m) => m[1]);
const ourTables = () => [...sh('nft list tables').matchAll(/^table (ip|inet|netdev) (pvisor_[0-9]+_[0-9]+)$/gm)].map((m) => `${m[1]} ${m[2]}`);
/** "Outside": a network namespace behind a veth pair (198.18.1.0/30, kept for tests, never routed); linux-network.test.ts uses 198.18.0.0/29. */
const NS = 'pvjail-outside';
const OUTSIDE = '198.18.1.2';
const httpGet = (url: string) =>
  new Promise<string>((resolve, reject) => {
    get(url, (r) => {
      let body = '';
      r.setEncoding('utf8').on('data', (d: string) => (body += d));
      r.on('end', () => resolve(body));
      r.on('error', reject);
    }).on('error', reject);
  });


/** A snapshot copied out of a jail: this process's files, read-only, checked whole by the reader; nothing left staged in `backingDir`. */
function expectSnapshotOfOurs(snapshot: string, backingDir: string): void {
  expect(readdirSync(backingDir).filter((n) => n.startsWith('snapshot-'))).toEqual([]);
  expect(readdirSync(snapshot).sort()).toEqual(['manifest.json', 'ram', 'state.json']);
  for (const f of readdirSync(snapshot)) {
    const st = lstatSync(join(snapshot, f));
    expect(st.isFile() && st.uid === process.getuid!() && (st.mode & 0o777) === 0o444).toBe(true);
  }
  SnapshotReader.open(snapshot).close();
}

/** Nothing of jailed VM `id` and its network is left on the host: TAP, tables, cgroup, jail directory. */
function expectNothingLeft(id: string, tap: string, table: string): void {
  expect(ourLinks()).not.toContain(tap);
  expect(ourTables().filter((t) => t.endsWith(` ${table}`))).toEqual([]);
  expect(jailCgroupExists(id)).toBe(false);
  expect(existsSync(join(JAIL_RUN_DIR, id))).toBe(false);
}

describe('a Linux VM in a jailed process', () => {
  let dir: string;
  let env: NodeJS.ProcessEnv;
  let runs: Run[];

  beforeEach(() => {
    dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-jail-'));
    env = { ...process.env, PVISOR_RUNTIME_DIR: join(dir, 'run') };
    process.env.PVISOR_RUNTIME_DIR = env.PVISOR_RUNTIME_DIR;
    runs = [];
  });
  afterEach(() => {
    for (const r of runs) if (r.child.exitCode === null && r.child.signalCode === null) r.child.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  });

  it('runs a command (its output and status), and answers exec, spawn and files through its handle', async () => {
    const run = startPvisor(env, ['run', '--isolation', 'process', '--vm-backing-dir', dir, '--memory', '256MiB', '--', 'sh', '-c', 'echo jailed $(uname -s); exit 3']);
    runs.push(run);
    const end = await run.exited;
    expect(run.out()).toContain('jailed Linux');
    expect(end.code).toBe(3);

    // Through the SDK: exec, spawn and files are streams, relayed by the launcher to the jailed VMM.
    const vm = await Vm.start({ isolation: 'process', memory: '256MiB', vcpus: 1, name: 'LJ', backingDir: dir, bootTimeoutMs: 170_000 });
    try {
      expect(await vm.exec('echo "as $(id -u)"; echo err >&2; exit 4')).toEqual({ exitCode: 4, signal: null, stdout: 'as 0\n', stderr: 'err\n' });
      await vm.files.write('/tmp/in-the-jail', 'written through the launcher');
      expect((await vm.files.read('/tmp/in-the-jail')).toString()).toBe('written through the launcher');
      const p = vm.spawn(['cat'], { stdin: true });
      const out: Buffer[] = [];
      p.stdout.on('data', (b: Buffer) => out.push(b));
      await p.write('piped\n');
      await p.end();
      expect(await p.exited).toEqual({ exitCode: 0, signal: null });
      expect(Buffer.concat(out).toString()).toBe('piped\n');

      // A snapshot: the jailed VMM writes it into its own backing directory, this process copies it out.
      await vm.files.write('/tmp/mark', 'before the snapshot');
      const snapshot = join(dir, 'jailed-snapshot');
      expect((await vm.snapshot(snapshot)).dir).toBe(snapshot);
      expectSnapshotOfOurs(snapshot, join(dir, 'pvisor-jail-LJ'));
    } finally {
      await vm.stop();
    }
    // It restores (here, in this process) with what the jailed guest had.
    const restored = await Vm.restore(join(dir, 'jailed-snapshot'), { readyTimeoutMs: 170_000 });
    try {
      expect((await restored.exec('cat /tmp/mark')).stdout).toBe('before the snapshot');
    } finally {
      await restored.stop();
    }
  }, 480_000);

  it('a writable --rootfs: the launcher opens the image (root\'s, 0644, which nobody may write) and hands the fd in; what CMD wrote is in a clean image', () => {
    // An image only root may write, in a directory the jail's uid cannot even enter.
    const root = join(dir, 'root');
    for (const d of ['bin', 'dev', 'proc']) mkdirSync(join(root, d), { recursive: true });
    copyFileSync('/bin/busybox', join(root, 'bin', 'busybox'));
    chmodSync(join(root, 'bin', 'busybox'), 0o755);
    for (const applet of ['sh', 'echo', 'cat']) symlinkSync('busybox', join(root, 'bin', applet));
    const image = join(dir, 'private', 'rootfs.img');
    mkdirSync(join(dir, 'private'), { mode: 0o700 });
    execFileSync('mke2fs', ['-q', '-t', 'ext4', '-d', root, image, '32M']);
    chmodSync(image, 0o644);
    const text = `written in the jail ${process.pid}`;
    const r = spawnSync(process.execPath, [PVISOR_MAIN, 'run', '--isolation', 'process', '--name', 'LW', '--vm-backing-dir', dir, '--memory', '256MiB', '--vcpus', '1', '--rootfs', image, '--', 'sh', '-c', `echo ${text} > /from-jail; cat /from-jail`], { encoding: 'utf8', timeout: 250_000, env });
    expect({ status: r.status, stdout: r.stdout }).toEqual({ status: 0, stdout: `${text}\n` });
    expect(r.stderr).toMatch(/LW jailed/);
    // The guest shut down cleanly through the handed fd: the write is in the image, which is consistent.
    expect(execFileSync('dumpe2fs', ['-h', image], { encoding: 'utf8', stdio: 'pipe' })).not.toMatch(/needs_recovery/);
    expect(spawnSync('e2fsck', ['-fn', image], { encoding: 'utf8' }).status).toBe(0);
    expect(execFileSync('debugfs', ['-R', 'cat /from-jail', image], { encoding: 'utf8', stdio: 'pipe' })).toBe(`${text}\n`);
    expect(jailCgroupExists('LW')).toBe(false);
  }, 300_000);

  describe('with a network', () => {
    let outside: ChildProcess;
    beforeAll(async () => {
      spawnSync('ip', ['netns', 'delete', NS]);
      spawnSync('ip', ['link', 'delete', 'pvj-host']);
      sh(`ip netns add ${NS} && ip link add pvj-host type veth peer name pvj-out && ip link set pvj-out netns ${NS} &&
          ip addr add 198.18.1.1/30 dev pvj-host && ip link set pvj-host up &&
          ip netns exec ${NS} sh -c 'ip addr add ${OUTSIDE}/30 dev pvj-out && ip link set pvj-out up && ip link set lo up'`);
      // The outside's server says who connected: the NAT's address, not the guest's.
      const serve = `require('http').createServer((q, r) => r.end('hello from ' + q.socket.remoteAddress)).listen(8080, '${OUTSIDE}', () => console.log('up'))`;
      outside = spawn('ip', ['netns', 'exec', NS, process.execPath, '-e', serve], { stdio: ['ignore', 'pipe', 'inherit'] });
      await new Promise<void>((resolve, reject) => {
        outside.stdout!.on('data', (d: Buffer) => d.toString().includes('up') && resolve());
        outside.once('exit', (code) => reject(new Error(`the outside server exited (${code})`)));
      });
    }, 60_000);
    afterAll(() => {
      outside?.kill();
      spawnSync('ip', ['netns', 'delete', NS]);
      spawnSync('ip', ['link', 'delete', 'pvj-host']);
    });

    const wget = (vm: JailedVmHandle, url: string) => vm.exec(['timeout', '10', 'wget', '-q', '-O', '-', url]);

    it("'nat' through the SDK: the launcher makes the TAP and rules, the jailed VMM gets only its fd; they go when the VM stops and when the VMM is SIGKILLed", async () => {
      const vm = await Vm.start({ isolation: 'process', memory: '256MiB', vcpus: 1, name: 'LN', network: 'nat', backingDir: dir, bootTimeoutMs: 170_000 });
      const net = vm.network;
      try {
        expect(net).toMatchObject({ mode: 'nat', allow: 'all' });
        // Named after this process, the launcher: its tables are removed by the next start if it dies.
        expect(net.tap).toMatch(new RegExp(`^pv${process.pid}n[0-9]+$`));
        expect(ourLinks()).toContain(net.tap);
        expect(ourTables()).toEqual(expect.arrayContaining([`inet ${net.nftTable}`, `netdev ${net.nftTable}`]));
        // The jailed VMM holds the TAP as the fd it was handed, in a network namespace of its own, with no capability.
        const pid = jailedVmmPid('LN');
        expect(readlinkSync(`/proc/${pid}/fd/6`)).toBe('/dev/net/tun');
        expect(readlinkSync(`/proc/${pid}/ns/net`)).not.toBe(readlinkSync('/proc/self/ns/net'));
        expect(readFileSync(`/proc/${pid}/status`, 'utf8')).toMatch(/^CapEff:\s+0+$/m);
        // The guest's eth0 has the address the launcher chose, and reaches the outside through its NAT.
        expect((await vm.exec('ip -4 -o addr show eth0 2>/dev/null || ifconfig eth0')).stdout).toContain(net.guestAddress!.split('/')[0]);
        expect(await wget(vm, `http://${OUTSIDE}:8080/`)).toMatchObject({ exitCode: 0, stdout: 'hello from 198.18.1.1' });
        // The rules are the launcher's: an update there holds for the jailed guest.
        await net.update({ allow: [] });
        expect((await wget(vm, `http://${OUTSIDE}:8080/`)).exitCode).not.toBe(0);
        await net.update({ allow: ['198.18.1.0/30'] });
        expect(await wget(vm, `http://${OUTSIDE}:8080/`)).toMatchObject({ exitCode: 0 });
        // A forwarded port goes through the handle (the agent channel), not the network.
        expect((await vm.exec('mkdir -p /tmp/w && echo forwarded > /tmp/w/i && httpd -p 127.0.0.1:8000 -h /tmp/w')).exitCode).toBe(0);
        const f = await vm.forward(8000);
        expect(await httpGet(`http://127.0.0.1:${f.port}/i`)).toBe('forwarded\n');
        f.close();
      } finally {
        await vm.stop();
      }
      expect(await vm.jail.exited()).toHaveProperty('exitCode');
      expectNothingLeft('LN', net.tap!, net.nftTable!);

      // Killed: the VMM itself, not its launcher, which then removes everything.
      const killed = await Vm.start({ isolation: 'process', memory: '256MiB', vcpus: 1, name: 'LK', network: 'nat', backingDir: dir, bootTimeoutMs: 170_000 });
      const knet = killed.network;
      expect(ourLinks()).toContain(knet.tap);
      process.kill(jailedVmmPid('LK'), 'SIGKILL');
      expect(await killed.jail.exited()).toEqual({ signal: 'SIGKILL' });
      expectNothingLeft('LK', knet.tap!, knet.nftTable!);
    }, 420_000);

    it("'--net nat --publish --vm-socket' through the CLI: the guest reaches the outside, the launcher publishes the port and listens on the socket, and SIGTERM leaves nothing", async () => {
      const socketPath = join(dir, 'lc.sock');
      const run = startPvisor(env, ['run', '--isolation', 'process', '--name', 'LC', '--vm-socket', socketPath, '--vm-backing-dir', dir, '--memory', '256MiB', '--vcpus', '1', '--net', 'nat', '--publish', '18089:8000', '--',
        'sh', '-c', `timeout 10 wget -q -O - http://${OUTSIDE}:8080/; echo; mkdir -p /tmp/w; echo published > /tmp/w/i; exec httpd -f -p 8000 -h /tmp/w`]);
      runs.push(run);
      await run.waitFor(/^hello from 198\.18\.1\.1$/m);
      await run.waitFor(/127\.0\.0\.1:18089 reaches the guest's port 8000/, 'err');
      const launcher = run.child.pid!;
      const tap = /network nat: guest \S+ on (pv[0-9]+n[0-9]+)/.exec(run.err())?.[1];
      expect(tap).toMatch(new RegExp(`^pv${launcher}n0$`));
      // The server may still be starting when the port is published.
      let body = '';
      for (const end = Date.now() + 30_000; body !== 'published\n' && Date.now() < end; await new Promise((r) => setTimeout(r, 500))) body = await httpGet('http://127.0.0.1:18089/i').catch(() => '');
      expect(body).toBe('published\n');
      const h = await VmHandle.connect('LC', { socketPath });
      expect(await h.status()).toMatchObject({ id: 'LC', state: 'running' });
      // pvisor snapshot of a jailed VM: through the launcher's socket, copied out by the launcher.
      const snapshot = join(dir, 'cli-snapshot');
      const taken = await pvisorOnce(env, ['snapshot', 'LC', snapshot, '--vm-socket', socketPath]);
      expect(taken).toMatchObject({ status: 0 });
      expectSnapshotOfOurs(snapshot, join(dir, 'pvisor-jail-LC'));
      run.child.kill('SIGTERM');
      const end = await run.exited;
      expect(end.signal).toBeNull();
      expectNothingLeft('LC', tap!, `pvisor_${launcher}_0`);
      await expect(httpGet('http://127.0.0.1:18089/i')).rejects.toThrow(/ECONNREFUSED/);
      expect(existsSync(socketPath)).toBe(false);
    }, 300_000);

    it("'--from' a 'nat' snapshot through the CLI: the launcher makes the restored VM a network of its own with the snapshot's MAC", async () => {
      // Taken in-process (a jailed VM's snapshot is refused yet).
      const vm = await Vm.start({ memory: '256MiB', vcpus: 1, network: 'nat', bootTimeoutMs: 170_000 });
      const snapshot = join(dir, 'nat-snapshot');
      const mac = vm.network.mac!;
      try {
        await vm.snapshot(snapshot);
      } finally {
        await vm.stop();
      }
      const run = startPvisor(env, ['run', '--isolation', 'process', '--name', 'LR', '--vm-backing-dir', dir, '--from', snapshot, '--', 'sh', '-c', `cat /sys/class/net/eth0/address; timeout 10 wget -q -O - http://${OUTSIDE}:8080/`]);
      runs.push(run);
      const end = await run.exited;
      expect(run.out()).toContain(mac);
      expect(run.out()).toContain('hello from 198.18.1.1');
      expect(end.code).toBe(0);
      expectNothingLeft('LR', `pv${run.child.pid}n0`, `pvisor_${run.child.pid}_0`);
    }, 300_000);
  });
});
