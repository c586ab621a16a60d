// Vm.list() and labels across two processes: this process's VM and a `pvisor run` child's, with
// the probe guest on real KVM; `pvisor ps` shows the same labels. Kept short.
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { Vm, VmHandle, type VmListEntry } from '../../src';
import { pvisorOnce, startPvisor, type Run } from '../cli-runs';

const MiB = 2 ** 20;

describe('Vm.list across processes', () => {
  let dir: string;
  let run: Run | undefined;
  const saved = process.env.PVISOR_RUNTIME_DIR;
  beforeEach(() => {
    // On a disk: the run's Offload backing directory (a tmpfs one is refused at suspend).
    dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-vm-list-'));
    process.env.PVISOR_RUNTIME_DIR = join(dir, 'run');
  });
  afterEach(() => {
    if (run && run.child.exitCode === null && run.child.signalCode === null) run.child.kill('SIGKILL');
    if (saved === undefined) delete process.env.PVISOR_RUNTIME_DIR;
    else process.env.PVISOR_RUNTIME_DIR = saved;
    rmSync(dir, { recursive: true, force: true });
  });

  async function listedRunning(name: string): Promise<VmListEntry[]> {
    for (const t0 = Date.now(); Date.now() - t0 < 120_000; await new Promise((r) => setTimeout(r, 200))) {
      const list = await Vm.list({ labels: { suite: 'vm-list' } });
      if (list.some((e) => e.name === name && e.state === 'running')) return list;
    }
    throw new Error(`${name} never listed as running; its stderr: ${run?.err()}`);
  }

  it("lists this process's VM and a pvisor run child's, with their labels, state, pid, memory and age", async () => {
    const own = await Vm.start({ guest: 'probe', memory: '32MiB', vcpus: 1, name: 'parent-vm', labels: { suite: 'vm-list', role: 'parent' } });
    try {
      run = startPvisor(process.env, ['run', '--quiet', '--guest', 'probe', '--memory', '48MiB', '--vcpus', '1', '--vm-backing-dir', dir, '--name', 'child-vm', '--label', 'suite=vm-list', '--label', 'role=child', '--', 'fill 8MiB random 3, wait']);
      const list = await listedRunning('child-vm');
      const started = Date.now();
      expect(list.map((e) => e.name).sort()).toEqual(['child-vm', 'parent-vm']);
      const parent = list.find((e) => e.name === 'parent-vm')!;
      expect(parent).toMatchObject({ where: 'this-process', state: 'running', pid: process.pid, guest: 'probe', labels: { suite: 'vm-list', role: 'parent' }, memoryBytes: 32 * MiB });
      expect(parent.vm).toBe(own);
      expect(parent.ageMs).toBeGreaterThanOrEqual(0);
      expect(parent.startedAt).toEqual(own.startedAt);
      const child = list.find((e) => e.name === 'child-vm')!;
      expect(child).toMatchObject({ where: 'control-socket', state: 'running', pid: run.child.pid, guest: 'probe', labels: { suite: 'vm-list', role: 'child' }, memoryBytes: 48 * MiB });
      expect(child.startedAt!.getTime()).toBeLessThanOrEqual(started);
      expect(child.ageMs).toBeGreaterThanOrEqual(0);
      expect(child.residentBytes).toBeGreaterThan(0);
      // Selecting by a label: only the child.
      expect((await Vm.list({ labels: { role: 'child' } })).map((e) => e.name)).toEqual(['child-vm']);

      // The same labels in pvisor ps, --json and table.
      const ps = await pvisorOnce(process.env, ['ps', '--json']);
      expect(ps.status).toBe(0);
      expect(JSON.parse(ps.stdout)).toEqual([expect.objectContaining({ id: 'child-vm', state: 'running', labels: { suite: 'vm-list', role: 'child' } })]);
      const table = await pvisorOnce(process.env, ['ps']);
      expect(table.stdout).toMatch(/^ID\s+STATE.*LABELS$/m);
      expect(table.stdout).toMatch(/^child-vm\s+running\s.*suite=vm-list,role=child$/m);
      // And in the handle's status.
      await expect((await VmHandle.connect(child.name, { socketPath: child.socketPath })).status()).resolves.toMatchObject({ labels: { role: 'child' } });
      await (await VmHandle.connect('child-vm')).stop();
      expect((await run.exited).code).toBe(0);
      // --quiet: the run printed its steps' output and nothing else.
      expect(run.err()).toBe('');
      expect(run.out()).toMatch(/^fill: 8\.0 MiB random \(seed 3\) in [\d.]+ ms\nwait: child-vm was stopped after [\d.]+ ms\n$/);
      expect((await Vm.list({ labels: { suite: 'vm-list' } })).map((e) => e.name)).toEqual(['parent-vm']);
    } finally {
      await own.stop();
    }
    expect(await Vm.list({ labels: { suite: 'vm-list' } })).toEqual([]);
  });
});
