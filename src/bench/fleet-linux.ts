/**
 * `pvisor bench fleet --guest linux`: issue 27's Linux row, in one run so that the ratios hold on
 * a noisy host (the nested harness included). A 256 MiB / 1 vCPU Linux VM writes a file and is
 * snapshotted to a local directory and to the store; each run then times, to the agent's answer
 * (`Vm.restore` resolves once the agent is ready), a local lazy restore (the RAM file's page cache
 * dropped), a lazy restore from the store into an empty chunk cache, and one from the same, now
 * warm, cache. Every restored VM must read the file back.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { Vm } from '../vm';
import { openBenchStore } from './fleet-store';
import { fleetLinuxRows, fleetLinuxGoals, type FleetLinuxFigures } from './fleet-table';
import type { FleetBenchOptions } from './fleet';
import { dropCache } from './probe-restore';
import { printTableBlock, progress, stats } from './report';

const MEMORY = '256MiB';
/** Generous: under the nested harness a restored Linux guest's agent takes seconds to answer. */
const READY_TIMEOUT_MS = 300_000;
const MARK_PATH = '/root/fleet-bench.txt';

/** Time from `restore`'s call to its VM's agent answering (the restore resolves then), ms. */
async function toAgentReady(restore: () => Promise<Vm>): Promise<{ vm: Vm; ms: number }> {
  const t0 = performance.now();
  const vm = await restore();
  return { vm, ms: performance.now() - t0 };
}

/** `pvisor bench fleet --guest linux`: measures, prints the table, returns the JSON. */
export async function benchFleetLinux(o: FleetBenchOptions): Promise<object> {
  const store = openBenchStore();
  const base = mkdtempSync(join(o.dir, 'pvisor-bench-fleet-linux-'));
  try {
    const url = `s3://${o.bucket}/bench-fleet-${randomBytes(4).toString('hex')}/linux`;
    const localDir = join(base, 'template');
    const mark = `fleet ${randomBytes(8).toString('hex')}\n`;
    const source = await Vm.start({ memory: MEMORY, vcpus: 1, name: 'bench-fleet-linux', bootTimeoutMs: READY_TIMEOUT_MS });
    let template;
    try {
      await source.files.write(MARK_PATH, mark);
      await source.snapshot(localDir);
      template = (await source.snapshot(url, { store: { cacheDir: join(base, 'host-a') } })).store!;
      progress(`Linux template sent: ${(template.bytesTransferred / 2 ** 20).toFixed(1)} MiB in ${template.chunksTransferred} objects, ${template.ms.toFixed(0)} ms`);
    } finally {
      await source.stop();
    }
    const check = async (vm: Vm, what: string) => {
      const r = await vm.exec(['cat', MARK_PATH]);
      await vm.stop();
      if (r.stdout !== mark) throw new Error(`${what}: ${MARK_PATH} reads ${JSON.stringify(r.stdout)}, the template wrote ${JSON.stringify(mark)}`);
    };
    const local: number[] = [];
    const cold: number[] = [];
    const warm: number[] = [];
    let bytesBeforeReady = 0;
    for (let i = 0; i < o.runs; i++) {
      dropCache(join(localDir, 'ram'));
      const l = await toAgentReady(() => Vm.restore(localDir, { readyTimeoutMs: READY_TIMEOUT_MS }));
      local.push(l.ms);
      await check(l.vm, 'local restore');
      const cacheDir = join(base, `host-b-${i}`);
      const c = await toAgentReady(() => Vm.restore(url, { readyTimeoutMs: READY_TIMEOUT_MS, store: { cacheDir } }));
      cold.push(c.ms);
      bytesBeforeReady = Math.max(bytesBeforeReady, c.vm.restoreInfo!.store!.bytesTransferred);
      if (c.vm.restoreInfo!.storeRamLoad !== 'lazy') throw new Error(`the restore from the store was not lazy (${c.vm.restoreInfo!.storeRamLoad})`);
      await check(c.vm, 'store restore, cold cache');
      const w = await toAgentReady(() => Vm.restore(url, { readyTimeoutMs: READY_TIMEOUT_MS, store: { cacheDir } }));
      warm.push(w.ms);
      await check(w.vm, 'store restore, warm cache');
      rmSync(cacheDir, { recursive: true, force: true });
      progress(`Linux run ${i + 1}/${o.runs}: local ${l.ms.toFixed(0)} ms, store cold ${c.ms.toFixed(0)} ms (${(bytesBeforeReady / 2 ** 20).toFixed(1)} MiB read), store warm ${w.ms.toFixed(0)} ms`);
    }
    const figures: FleetLinuxFigures = { runs: o.runs, memory: MEMORY, localMs: stats(local), storeColdMs: stats(cold), storeWarmMs: stats(warm), bytesBeforeReady };
    process.stdout.write(`Fleet: Linux guest, ${MEMORY} / 1 vCPU, ${o.runs} runs (ms min / median / max; ready = Vm.restore resolved, the agent answered; local: lazy, the RAM file's page cache dropped; store: ${store.origin === 'started' ? 'radosgw memstore on loopback, started by the bench' : store.endpoint}; a restore from the store is lazy: chunks on the guest's first touch, the rest prefetched once Vm.restore resolves; read before ready: what the guest touched until its agent answered)\n`);
    printTableBlock(fleetLinuxRows(figures));
    return { guest: 'linux', ...figures, storeOrigin: store.origin, storeStartMs: store.startMs, templateUpload: template, goals: fleetLinuxGoals(figures) };
  } finally {
    rmSync(base, { recursive: true, force: true });
    store.close();
  }
}
