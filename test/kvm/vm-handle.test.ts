// VmHandle: the SDK reaching a VM that `pvisor run` runs in another process, over its control
// socket. Real KVM (the probe guest), a real pvisor run child process. Needs /dev/kvm.
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { Vm, VmHandle, VmNotFoundError, VmStateError } from '../../src/index';

const main = join(__dirname, '..', '..', 'src', 'cli', 'main.js');
const MiB = 2 ** 20;

describe('VmHandle on a VM started by pvisor run', () => {
  let dir: string;
  let child: ChildProcess | undefined;
  const saved = process.env.PVISOR_RUNTIME_DIR;

  beforeEach(() => {
    // On a disk: the run's Offload backing file (the temp directory may be tmpfs, which it refuses).
    dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-vm-handle-'));
    process.env.PVISOR_RUNTIME_DIR = join(dir, 'run');
  });
  afterEach(() => {
    if (child && child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
    if (saved === undefined) delete process.env.PVISOR_RUNTIME_DIR;
    else process.env.PVISOR_RUNTIME_DIR = saved;
    rmSync(dir, { recursive: true, force: true });
  });

  /** Starts `pvisor run ARGS` and resolves once its steps have printed `until`. */
  function run(until: RegExp, ...args: string[]): Promise<{ exited: Promise<number | null>; out: () => string }> {
    const c = spawn(process.execPath, [main, 'run', '--vm-backing-dir', dir, ...args], { env: process.env, stdio: ['ignore', 'pipe', 'pipe'] });
    child = c;
    let out = '';
    let err = '';
    c.stderr!.setEncoding('utf8').on('data', (d: string) => (err += d));
    const exited = new Promise<number | null>((resolve) => c.on('exit', (code) => resolve(code)));
    return new Promise((resolve, reject) => {
      c.stdout!.setEncoding('utf8').on('data', (d: string) => {
        out += d;
        if (until.test(out)) resolve({ exited, out: () => out });
      });
      void exited.then((code) => reject(new Error(`pvisor run ended (${code}) before ${until}: ${out} ${err}`)));
    });
  }

  it('status, exec, memoryUsage, pause, suspend, resume and stop from this process', async () => {
    const r = await run(/^digest: /m, '--guest', 'probe', '--name', 'H1', '--memory', '128MiB', '--vcpus', '1', '--', 'fill 16MiB random 7, digest, wait');
    const runDigest = /^digest: (\w+)/m.exec(r.out())![1];

    const vm = await Vm.connect('H1'); // the alias of VmHandle.connect
    expect(vm).toBeInstanceOf(VmHandle);
    expect(await vm.status()).toMatchObject({ id: 'H1', state: 'running', guest: 'probe', memoryBytes: 128 * MiB, vcpus: 1, pid: child!.pid });

    // exec on the probe guest runs probe steps; the digest is the one the run's own step printed.
    const digest = await vm.exec('digest');
    expect(digest).toMatchObject({ exitCode: 0, signal: null, stderr: '' });
    expect(digest.stdout).toMatch(new RegExp(`^digest: ${runDigest} over 16.0 MiB`));
    const used = await vm.memoryUsage();
    expect(used.guestRamResidentBytes).toBeGreaterThanOrEqual(16 * MiB);
    expect(used.processPssBytes).toBeGreaterThan(used.guestRamResidentBytes);

    await vm.pause();
    expect((await vm.status()).state).toBe('paused');
    await expect(vm.pause()).rejects.toBeInstanceOf(VmStateError); // paused already: refused, typed
    await vm.resume();
    expect((await vm.status()).state).toBe('running');

    await vm.suspend(); // resolves once the memory is released
    const suspended = await vm.memoryUsage();
    expect((await vm.status()).state).toBe('suspended');
    expect(suspended.guestRamResidentBytes).toBeLessThan(used.guestRamResidentBytes / 4);
    expect(suspended.bytesOnDisk).toBeGreaterThanOrEqual(16 * MiB);
    await vm.resume();
    expect((await vm.exec(['digest'])).stdout).toMatch(new RegExp(`^digest: ${runDigest} `));

    await vm.stop();
    expect(await r.exited).toBe(0); // a stop is how the wait step ends
    expect(existsSync(vm.socketPath)).toBe(false);
    await expect(vm.status()).rejects.toBeInstanceOf(VmNotFoundError);
    await expect(VmHandle.connect('H1')).rejects.toBeInstanceOf(VmNotFoundError);
  });
});
