// One interface, local or remote: the same suite against a Vm started in this process and a
// VmHandle to a `pvisor run` child, both through VmApi, on the Linux guest with real KVM. Each
// boots one VM for all of its cases (the nested harness boots slowly). Needs /dev/kvm.
import { createHash, randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { connect } from 'node:net';
import { join } from 'node:path';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { CommandNotFoundError, GuestRequestError, Offload, OutputLimitError, TimeoutError, Vm, VmHandle, type VmApi, type VmState } from '../../src';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { startPvisor, type Run } from '../cli-runs';

const KiB = 1024;
const MiB = 1024 * KiB;
const NESTED = process.env.PVISOR_NESTED === '1';
const SLOW = NESTED ? 10 : 1;

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const sha = (b: Buffer) => createHash('sha256').update(b).digest('hex');

/** A VM to test, and how to end what the factory started. */
interface Subject {
  vm: VmApi;
  cleanup(): Promise<void>;
}

const dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-vm-api-'));
// The Offload backing directories, on a disk.
for (const d of ['local', 'remote']) mkdirSync(join(dir, d));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const factories: [string, () => Promise<Subject>][] = [
  [
    'Vm (this process)',
    async () => {
      const vm = await Vm.start({ name: 'api-local', memory: '256MiB', vcpus: 1, strategies: [new Offload({ dir: join(dir, 'local') })], bootTimeoutMs: 180_000 });
      return { vm, cleanup: () => vm.stop() };
    },
  ],
  [
    'VmHandle (a pvisor run child)',
    async () => {
      const env = { ...process.env, PVISOR_RUNTIME_DIR: join(dir, 'run') };
      process.env.PVISOR_RUNTIME_DIR = env.PVISOR_RUNTIME_DIR;
      const run: Run = startPvisor(env, ['run', '--quiet', '--name', 'api-remote', '--memory', '256MiB', '--vcpus', '1', '--vm-backing-dir', join(dir, 'remote'), '--', 'sleep', '100000']);
      for (const t0 = Date.now(); ; await sleep(200)) {
        try {
          const h = await VmHandle.connect('api-remote');
          if ((await h.status()).state === 'running') return { vm: h, cleanup: async () => void (run.child.exitCode === null && run.child.kill('SIGKILL')) };
        } catch (e) {
          if (Date.now() - t0 > 240_000) throw new Error(`pvisor run never ran: ${(e as Error).message}; stderr ${run.err()}`);
        }
      }
    },
  ],
];

describe.each(factories)('VmApi on %s', (_kind, factory) => {
  let subject: Subject;
  let vm: VmApi;
  beforeAll(async () => {
    subject = await factory();
    vm = subject.vm;
  }, 300_000);
  afterAll(() => subject?.cleanup());

  it('exec: env, cwd, stdin, output callbacks, bytes, exit codes, a missing command, a timeout, maxBuffer', async () => {
    const r = await vm.exec('echo "$GREETING from $(pwd)"; cat; echo oops >&2; exit 3', { env: { GREETING: 'hello' }, cwd: '/tmp', stdin: 'piped in\n' });
    expect(r).toEqual({ exitCode: 3, signal: null, stdout: 'hello from /tmp\npiped in\n', stderr: 'oops\n' });
    const seen: string[] = [];
    await vm.exec(['sh', '-c', 'printf "\\303"; sleep 0.1; printf "\\251 done"'], { onStdout: (t) => seen.push(t) });
    expect(seen.join('')).toBe('é done'); // a character split across chunks is given whole
    const bytes = await vm.exec(['head', '-c', '300000', '/dev/urandom'], { encoding: 'buffer' });
    expect(Buffer.isBuffer(bytes.stdout) && bytes.stdout.length).toBe(300000);
    await expect(vm.exec(['no-such-command-here'])).rejects.toBeInstanceOf(CommandNotFoundError);
    await expect(vm.exec('sleep 30', { timeoutMs: 300 * SLOW })).rejects.toBeInstanceOf(TimeoutError);
    await expect(vm.exec('head -c 100000 /dev/zero', { maxBuffer: 1000 })).rejects.toBeInstanceOf(OutputLimitError);
  }, 300_000);

  it('spawn: stdout streams, stdin is a Writable, kill ends it; one unread stream holds only its process', async () => {
    const cat = vm.spawn(['cat'], { stdin: true });
    expect(await cat.pid).toBeGreaterThan(1);
    const input = randomBytes(3 * MiB);
    const out: Buffer[] = [];
    cat.stdout.on('data', (b: Buffer) => out.push(b));
    await pipeline(Readable.from([input.subarray(0, MiB), input.subarray(MiB)]), cat.stdin!);
    expect(await cat.exited).toEqual({ exitCode: 0, signal: null });
    expect(sha(Buffer.concat(out))).toBe(sha(input));

    // 4 MiB nobody reads: other calls answer meanwhile.
    const unread = vm.spawn(['head', '-c', String(4 * MiB), '/dev/zero']);
    await sleep(1000 * SLOW);
    const t0 = performance.now();
    expect((await vm.exec('echo hi', { timeoutMs: 8000 * SLOW })).stdout).toBe('hi\n');
    await vm.files.stat('/tmp');
    const heldMs = performance.now() - t0;
    console.log(`${_kind}: exec + files.stat while 4 MiB is held unread: ${heldMs.toFixed(0)} ms`);
    expect(heldMs).toBeLessThan(2000 * (NESTED ? 2 : 1));
    let total = 0;
    unread.stdout.on('data', (b: Buffer) => (total += b.length));
    expect(await unread.exited).toEqual({ exitCode: 0, signal: null });
    expect(total).toBe(4 * MiB);

    const sleeper = vm.spawn('sleep 100');
    await sleeper.pid;
    await sleeper.kill('SIGKILL');
    expect(await sleeper.exited).toEqual({ exitCode: null, signal: 'SIGKILL' });
  }, 300_000);

  it('files: write, read, stat, list, mkdir, rename, remove, streams; errors name the errno', async () => {
    const data = randomBytes(2 * MiB + 5);
    await vm.files.write('/tmp/api/a/blob', data, { mode: 0o600 });
    expect(sha(await vm.files.read('/tmp/api/a/blob'))).toBe(sha(data));
    expect(await vm.files.stat('/tmp/api/a/blob')).toMatchObject({ type: 'file', mode: 0o600, size: data.length });
    await vm.files.mkdir('/tmp/api/b');
    await vm.files.rename('/tmp/api/a/blob', '/tmp/api/b/moved');
    expect((await vm.files.list('/tmp/api/b')).map((e) => [e.name, e.type, e.size])).toEqual([['moved', 'file', data.length]]);
    const streamed: Buffer[] = [];
    for await (const chunk of vm.files.readStream('/tmp/api/b/moved')) streamed.push(chunk as Buffer);
    expect(sha(Buffer.concat(streamed))).toBe(sha(data));
    await pipeline(Readable.from([Buffer.from('one '), Buffer.from('two')]), vm.files.writeStream('/tmp/api/c.txt'));
    expect((await vm.files.read('/tmp/api/c.txt')).toString()).toBe('one two');
    await expect(vm.files.read('/tmp/api/b/moved', { maxBytes: 1000 })).rejects.toBeInstanceOf(OutputLimitError);
    await vm.files.remove('/tmp/api', { recursive: true });
    const missing = await vm.files.stat('/tmp/api').catch((e: unknown) => e);
    expect(missing).toBeInstanceOf(GuestRequestError);
    expect(missing).toMatchObject({ errno: 'ENOENT' });
    await expect(vm.files.read('/nope.txt')).rejects.toMatchObject({ errno: 'ENOENT' });
  }, 300_000);

  it('user: exec, spawn and the files calls run as the user; what it may not read is refused', async () => {
    expect((await vm.exec('id -u; id -g', { user: 'nobody' })).stdout).toBe('65534\n65534\n');
    expect((await vm.exec(['id', '-u'], { user: '1234:1234' })).stdout).toBe('1234\n');
    const p = vm.spawn(['id', '-un'], { user: 'nobody' });
    const out: Buffer[] = [];
    p.stdout.on('data', (b: Buffer) => out.push(b));
    await p.exited;
    expect(Buffer.concat(out).toString()).toBe('nobody\n');
    await vm.files.write('/tmp/by-nobody', 'mine', { user: 'nobody' });
    expect(await vm.files.stat('/tmp/by-nobody')).toMatchObject({ uid: 65534 });
    await vm.files.write('/root/only-root', 'secret');
    await expect(vm.files.read('/root/only-root', { user: 'nobody' })).rejects.toMatchObject({ errno: 'EACCES' });
    await expect(vm.files.stat('/root/only-root', { user: 'nobody' })).rejects.toBeInstanceOf(GuestRequestError);
    expect((await vm.files.read('/root/only-root')).toString()).toBe('secret');
  }, 300_000);

  it('forward: a host port reaches a guest server', async () => {
    await vm.files.write('/tmp/www/hello', 'hello through the forward\n');
    expect((await vm.exec('httpd -p 127.0.0.1:8000 -h /tmp/www')).exitCode).toBe(0);
    const f = await vm.forward(8000);
    try {
      const answer = await new Promise<string>((resolve, reject) => {
        const s = connect(f.port, '127.0.0.1');
        let got = '';
        s.setEncoding('utf8').on('data', (d: string) => (got += d));
        s.on('end', () => resolve(got));
        s.on('error', reject);
        s.write('GET /hello HTTP/1.0\r\n\r\n');
      });
      expect(answer).toMatch(/^HTTP\/1\.[01] 200 OK/);
      expect(answer).toMatch(/hello through the forward\n$/);
    } finally {
      await f.close();
    }
  }, 300_000);

  it('pause, suspend with Offload and resume: memory released and back, events seen, the guest unchanged', async () => {
    const states: [VmState, VmState][] = [];
    const onState = (s: VmState, p: VmState) => states.push([s, p]);
    vm.on('state', onState);
    await sleep(500); // a handle's watch is a connection of its own: let it be answered
    expect((await vm.exec('dd if=/dev/urandom of=/tmp/fill bs=1M count=48 2>/dev/null; sha256sum /tmp/fill')).exitCode).toBe(0);
    const digest = (await vm.exec('sha256sum /tmp/fill')).stdout;
    const before = await vm.memoryUsage();
    await vm.pause();
    await vm.resume();
    await vm.suspend();
    // Released: the suspend resolves at once, the release follows (Vm) or is waited for (handle).
    let after = await vm.memoryUsage();
    for (let i = 0; i < 100 && after.guestRamPssBytes > before.guestRamPssBytes / 4; i++) {
      await sleep(200);
      after = await vm.memoryUsage();
    }
    console.log(`${_kind}: guest RAM ${(before.guestRamPssBytes / MiB).toFixed(1)} MiB before the suspend, ${(after.guestRamPssBytes / MiB).toFixed(1)} MiB after`);
    expect(before.guestRamPssBytes).toBeGreaterThan(48 * MiB);
    expect(after.guestRamPssBytes).toBeLessThan(before.guestRamPssBytes / 4);
    expect(after.capacityBytes).toBe(256 * MiB);
    await vm.resume();
    expect((await vm.exec('sha256sum /tmp/fill')).stdout).toBe(digest);
    await sleep(300);
    vm.off('state', onState);
    expect(states).toEqual([
      ['paused', 'running'],
      ['running', 'paused'],
      ['suspended', 'running'],
      ['running', 'suspended'],
    ]);
  }, 300_000);

  it('snapshot: a sealed directory, the VM runs on', async () => {
    const snap = join(dir, `snap-${vm.name}`);
    const info = await vm.snapshot(snap);
    expect(info.dir).toBe(snap);
    expect(info.ramDataPageCount).toBeGreaterThan(0);
    expect(readdirSync(snap).length).toBeGreaterThan(0);
    expect((await vm.exec('echo after')).stdout).toBe('after\n');
  }, 300_000);

  it('stop: the exit event, then every call is refused', async () => {
    const exited = new Promise<{ state: string }>((resolve) => vm.once('exit', resolve));
    await sleep(300);
    await vm.stop();
    expect(await exited).toMatchObject({ state: 'stopped' });
    await expect(vm.exec('true')).rejects.toThrow();
    if (vm instanceof VmHandle) expect(existsSync(vm.socketPath)).toBe(false);
  }, 300_000);
});
