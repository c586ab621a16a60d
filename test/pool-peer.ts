// A second VM process for the page pool's tests: VMs with PoolClient, driven by JSON lines on
// stdin ({op, ...}), each answered by one JSON line on stdout.
import { createInterface } from 'node:readline';
import { PoolClient, Vm } from '../src';

const vms: Vm[] = [];
const clients: PoolClient[] = [];

async function handle(m: { op: string; [k: string]: unknown }): Promise<unknown> {
  switch (m.op) {
    case 'start':
      for (let i = 0; i < (m.count as number); i++) {
        const client = new PoolClient({ socket: m.socket as string, intervalMs: 3_600_000 });
        const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 1, strategies: [client] });
        await vm.probe.fill({ sizeMiB: m.sizeMiB as number, content: 'random', seed: m.seed as number });
        vms.push(vm);
        clients.push(client);
      }
      return {};
    case 'merge':
      for (const c of clients) await c.mergeNow();
      return {};
    case 'digests':
      return { digests: await Promise.all(vms.map(async (vm) => (await vm.probe.digest()).hex)) };
    case 'usage':
      return { usage: vms.map((vm) => vm.memoryUsage()) };
    default:
      throw new Error(`unknown op ${m.op}`);
  }
}

const lines = createInterface({ input: process.stdin });
lines.on('line', (line) => {
  handle(JSON.parse(line)).then(
    (r) => process.stdout.write(`${JSON.stringify({ ok: true, ...(r as object) })}\n`),
    (e: Error) => process.stdout.write(`${JSON.stringify({ ok: false, error: e.message })}\n`),
  );
});
lines.on('close', async () => {
  for (const vm of vms) await vm.stop();
  process.exit(0);
});
