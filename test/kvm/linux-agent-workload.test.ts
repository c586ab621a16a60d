// The agent workload on real KVM: the Linux guest with the root filesystem scripts/agent-rootfs.sh
// builds (Debian's nodejs and TypeScript, the agent program at /opt/agent), 512 MiB and 2 vCPUs as
// the memory study runs it. Needs a /dev/kvm that runs guest kernel code (scripts/with-kvm.js
// --linux) and the image: without it the tests are skipped and say how to build it (.ci/run does).
// Node in the nested harness's L2 runs 10-50 times slower than on hardware: the limits are generous
// and the times are printed.
import { spawn } from 'node:child_process';
import { copyFileSync, existsSync, mkdtempSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Vm } from '../../src';
import { AGENT_COMMAND, AGENT_ROOTFS_SCRIPT, AgentSession, agentRootfsImage } from '../../src/bench/agent-workload';

const MiB = 2 ** 20;
const image = agentRootfsImage();
const main = join(__dirname, '..', '..', 'src', 'cli', 'main.js');
const mib = (bytes: number) => `${(bytes / MiB).toFixed(1)} MiB`;

/** /proc/meminfo's lines in bytes. */
function parseMeminfo(text: string): Record<string, number> {
  const out: Record<string, number> = {};
  for (const m of text.matchAll(/^(\w+(?:\(\w+\))?):\s+(\d+) kB$/gm)) out[m[1]] = Number(m[2]) * 1024;
  return out;
}

if (!existsSync(image)) {
  describe('the agent workload in the Linux guest', () => {
    console.warn(`linux-agent-workload: skipped: the agent rootfs ${image} is not built; bash ${AGENT_ROOTFS_SCRIPT} builds it (as root, about 5 minutes)`);
    it.skip(`needs the agent rootfs ${image} (bash ${AGENT_ROOTFS_SCRIPT} builds it)`, () => {});
  });
} else {
  describe('the agent workload in the Linux guest', () => {
    const figures: string[] = [];
    // The VMs boot a copy on /var/tmp, a disk in the nested harness's L1, as an image would be on a
    // host: there the repository, where the image is built, is a 9p share. The copy is also what
    // the writable run may change, leaving the built image clean for read-only use.
    let dir: string;
    let copy: string;
    beforeAll(() => {
      dir = mkdtempSync(join(existsSync('/var/tmp') ? '/var/tmp' : tmpdir(), 'pvisor-agent-rootfs-'));
      copy = join(dir, 'agent-rootfs.img');
      const t0 = performance.now();
      copyFileSync(image, copy);
      figures.push(`copying the ${mib(statSync(image).size)} image to ${dir} took ${(performance.now() - t0).toFixed(0)} ms`);
    }, 300_000);
    afterAll(() => {
      rmSync(dir, { recursive: true, force: true });
      if (figures.length) console.log(`agent workload (${image}):\n  ${figures.join('\n  ')}`);
    });

    it('boots from the agent rootfs read-only; the program says ready, answers status, idles and exits when asked', async () => {
      const t0 = performance.now();
      const vm = await Vm.start({ memory: '512MiB', vcpus: 2, rootfs: { path: copy, readOnly: true }, bootTimeoutMs: 300_000 });
      const bootMs = performance.now() - t0;
      try {
        const t1 = performance.now();
        const agent = await AgentSession.start(vm, { readyTimeoutMs: 1_200_000 });
        const readyMs = performance.now() - t1;
        figures.push(`Vm.start to agent ready ${bootMs.toFixed(0)} ms; spawn to the program's ready line ${readyMs.toFixed(0)} ms`);
        figures.push(`guest says: ${agent.ready.line}`);
        expect(agent.ready.files).toBe(6);

        const status = await agent.status({ timeoutMs: 120_000 });
        expect(status.heapUsedBytes).toBeGreaterThan(10 * MiB);
        expect(status.rssBytes).toBeGreaterThan(status.heapUsedBytes);

        // Idle as an agent waiting for its model: a timer tick (10 s) and then some.
        await new Promise((r) => setTimeout(r, 25_000));
        const idle = await agent.status({ timeoutMs: 120_000 });
        expect(idle.ticks).toBeGreaterThanOrEqual(1);
        const usage = vm.memoryUsage();
        const meminfo = parseMeminfo((await vm.exec(['cat', '/proc/meminfo'], { timeoutMs: 120_000 })).stdout);
        figures.push(
          `idle after ${idle.uptimeMs} ms: node heap ${mib(idle.heapUsedBytes)} of ${mib(idle.heapTotalBytes)}, rss ${mib(idle.rssBytes)}; ` +
            `guest RAM PSS on the host ${mib(usage.guestRamPssBytes)}, process PSS ${mib(usage.processPssBytes)}`,
        );
        figures.push(
          `guest /proc/meminfo: MemTotal ${mib(meminfo.MemTotal)}, MemFree ${mib(meminfo.MemFree)}, MemAvailable ${mib(meminfo.MemAvailable)}, ` +
            `Cached ${mib(meminfo.Cached)}, AnonPages ${mib(meminfo.AnonPages)}, Shmem ${mib(meminfo.Shmem)}`,
        );
        // Everything the guest's node holds is guest RAM the host has given it.
        expect(usage.guestRamPssBytes).toBeGreaterThanOrEqual(idle.rssBytes);
        expect(meminfo.AnonPages).toBeGreaterThanOrEqual(idle.heapUsedBytes);
        expect(meminfo.MemTotal).toBeGreaterThan(400 * MiB);

        expect(await agent.request('exit', { timeoutMs: 120_000 })).toEqual({ exit: 0 });
        expect(await agent.process.exited).toEqual({ exitCode: 0, signal: null });
      } finally {
        await vm.stop();
      }
    }, 1_800_000);

    // The reference CLI's line, with the program's path in the image: the image attached writable,
    // stdin /dev/null, and the program goes on idling until the run is stopped. Last: it may leave
    // the copy's journal to replay.
    it(`pvisor run --executor vm --memory 512MiB --rootfs IMAGE -- ${AGENT_COMMAND.join(' ')}`, async () => {
      const t1 = performance.now();
      const run = spawn(process.execPath, [main, 'run', '--executor', 'vm', '--memory', '512MiB', '--rootfs', copy, '--', ...AGENT_COMMAND], { stdio: ['ignore', 'pipe', 'pipe'] });
      let stdout = '';
      let stderr = '';
      run.stdout.setEncoding('utf8').on('data', (s: string) => (stdout += s));
      run.stderr.setEncoding('utf8').on('data', (s: string) => (stderr += s));
      const closed = new Promise<number | null>((resolve) => run.on('close', (code) => resolve(code)));
      try {
        const deadline = Date.now() + 1_500_000;
        // Ready, and its stdin has ended (pvisor run gives it /dev/null) without ending it.
        while (!(/^ready compiled 6 files/.test(stdout) && /agent: stdin ended; idling until killed/.test(stderr)) && run.exitCode === null && Date.now() < deadline) {
          await new Promise((r) => setTimeout(r, 500));
        }
        figures.push(`CLI: start to the program's ready line ${(performance.now() - t1).toFixed(0)} ms (pvisor says: ${/ready in \d+ ms/.exec(stderr)?.[0]})`);
        figures.push(`CLI: guest says: ${stdout.split('\n')[0]}`);
        const running = run.exitCode === null;
        expect({ stdout: stdout.split('\n')[0].replace(/ in \d+ ms.*/, ''), running, stderr: running ? '' : stderr }).toEqual({ stdout: 'ready compiled 6 files', running: true, stderr: '' });
        await new Promise((r) => setTimeout(r, 5_000));
        expect(run.exitCode).toBeNull();
        run.kill('SIGTERM');
        expect(await closed).toBe(128 + 15);
      } finally {
        if (run.exitCode === null && run.signalCode === null) run.kill('SIGKILL');
      }
    }, 1_800_000);
  });
}
