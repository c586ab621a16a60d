// Sandboxes that run the same tools share one copy of their common pages through pvisor-daemon's
// page pool, across processes, and keep running if the daemon goes away.
// Run: node dist/examples/page-pool.js   (on a host with /dev/kvm)
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { PoolClient, Vm } from 'pvisor';

const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`;

async function main(): Promise<void> {
  // Usually started once per host: pvisor-daemon serve --memory-pool --socket PATH
  const dir = mkdtempSync(join(tmpdir(), 'pvisor-pool-'));
  const socket = join(dir, 'pool.sock');
  const daemon = spawn(process.execPath, [join(__dirname, '..', 'src', 'cli', 'daemon-main.js'), 'serve', '--memory-pool', '--socket', socket], { stdio: ['ignore', 'ignore', 'pipe'] });
  await new Promise((resolve) => daemon.stderr!.once('data', resolve));
  try {
    const clients = [1, 2].map(() => new PoolClient({ socket, scope: 'team-a', intervalMs: 2000 }));
    const vms = await Promise.all(clients.map((c) => Vm.start({ guest: 'probe', memory: '512MiB', strategies: [c] })));
    for (const vm of vms) await vm.probe.fill({ sizeMiB: 64, content: 'random', seed: 42 }); // the same tools
    console.log(`before: each VM's guest RAM costs ${mib(vms[0].memoryUsage().guestRamPssBytes)}`);
    for (let pass = 0; pass < 2; pass++) for (const c of clients) await c.mergeNow(); // or wait for the periodic passes
    const digests = await Promise.all(vms.map((vm) => vm.probe.digest()));
    const u = vms[0].memoryUsage();
    console.log(`after: each costs ${mib(u.guestRamPssBytes)}; ${u.strategies[0].figures.pagesShared} pages shared in ${u.strategies[0].figures.guestRamMappings} mappings`);
    daemon.kill('SIGKILL'); // the VMs keep what they map
    const again = await Promise.all(vms.map((vm) => vm.probe.digest()));
    console.log(`daemon gone: digests ${again.every((d, i) => d.hex === digests[i].hex) ? 'unchanged' : 'CHANGED'}`);
    if (!again.every((d, i) => d.hex === digests[i].hex)) process.exitCode = 1;
    for (const vm of vms) await vm.stop();
  } finally {
    daemon.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
