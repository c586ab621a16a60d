// A Linux VM in a jailed process (pvisor run --isolation process, Vm.start({ isolation:
// 'process' })): its command's output and status through the CLI, and exec, spawn and files
// through the VmHandle, whose streams the launcher relays to the jailed VMM. In a file of its own
// because it boots the Linux guest (which kvm_pvm cannot run): it goes to the nested harness.
// Needs /dev/kvm, root, bwrap and cgroup v2 (the harness's L1 has them).
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { Vm } from '../../src/vm';
import { startPvisor, type Run } from '../cli-runs';

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
    } finally {
      await vm.stop();
    }
  }, 360_000);
});
