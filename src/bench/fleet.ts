/**
 * `pvisor bench fleet`: snapshots in an object store (issue 27), on the probe guest, in one run so
 * that the ratios hold on a noisy host (the Linux guest's row: fleet-linux.ts, `--guest linux`). A
 * 128 MiB / 1 vCPU VM fills a random working set and is snapshotted twice, to a local directory
 * and to the store (the template); then it appends {@link CHILD_CHANGED_MIB} MiB to its working
 * set (the bytes before it rewritten as they were) and is snapshotted to the store again (the
 * child): what that upload sent. Each run then times, to the first answered request, a local lazy
 * restore (the RAM file's page cache dropped), a lazy restore from the store into an empty chunk
 * cache (what it had read from the store when the first request was answered is the "before
 * ready" figure: the manifest, the small files, the chunks the guest touched, and whatever the
 * background prefetch, started when Vm.restore resolved, had finished by then) and one from the
 * same, now warm, cache. Last, N SharedSnapshot clones of the template restored on one host (one
 * cache), all running: the chunks each fetched, and their guest RAM PSS per clone beside that of
 * N SharedSnapshot clones of the local snapshot (the cache's shared snapshot is one file that all
 * map, as the local RAM file is). Every restored VM's digest must be the template's.
 */
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { hostMemTotalBytes } from '../memory-usage';
import { ObjectStore } from '../store/object-io';
import { resolveStoreOptions } from '../store/store-options';
import { parseStoreManifest, storeManifestBytesLimit } from '../store/store-manifest';
import { parseStoreUrl } from '../store/store-url';
import { SharedSnapshot } from '../memory/strategies/shared-snapshot';
import { Vm } from '../vm';
import { openBenchStore } from './fleet-store';
import { changedChunkIndexes, CHILD_CHANGED_MIB, fleetGoals, fleetTableRows, type FleetFigures } from './fleet-table';
import { dropCache, toReady } from './probe-restore';
import { printTableBlock, progress, stats } from './report';

const SEED = 27;
const MEMORY = '128MiB';

/** `pvisor bench fleet`'s options, checked. */
export interface FleetBenchOptions {
  /** `probe` (the default) or `linux`: the Linux row (restore times only; fleet-linux.ts). */
  guest: 'probe' | 'linux';
  runs: number;
  /** Clones of the template restored on one host (0 skips them). */
  clones: number;
  workingSetMiB: number;
  /** Where the local snapshot and the chunk caches go. */
  dir: string;
  /** The bucket, in the store the AWS environment names (or the one the bench starts). */
  bucket: string;
}

/** The `ramChunks` of the store manifest at `location` (checked as a restore checks it). */
async function ramChunksAt(location: string): Promise<(string | null)[]> {
  const url = parseStoreUrl(location);
  const store = ObjectStore.open(url, resolveStoreOptions({}));
  try {
    return parseStoreManifest(await store.get(url.manifestKey, storeManifestBytesLimit(hostMemTotalBytes())), location).ramChunks;
  } finally {
    store.close();
  }
}

/**
 * Restores `count` clones with `restore`, all running at once, reads each one's working set (its
 * digest, which must be `expected`), and resolves with their mean guest RAM PSS; they are stopped.
 */
async function clonesPss(count: number, expected: string, restore: () => Promise<Vm>): Promise<number> {
  const vms: Vm[] = [];
  try {
    for (let i = 0; i < count; i++) vms.push(await restore());
    for (const [i, vm] of vms.entries()) if ((await vm.probe.digest()).hex !== expected) throw new Error(`clone ${i + 1}: digest differs from the template's`);
    return vms.reduce((sum, vm) => sum + vm.memoryUsage().guestRamPssBytes, 0) / count;
  } finally {
    for (const vm of vms) await vm.stop();
  }
}

/** `pvisor bench fleet`: measures, prints the table, returns the JSON. */
export async function benchFleet(o: FleetBenchOptions): Promise<object> {
  const store = openBenchStore();
  const base = mkdtempSync(join(o.dir, 'pvisor-bench-fleet-'));
  try {
    const prefix = `s3://${o.bucket}/bench-fleet-${randomBytes(4).toString('hex')}`;
    const templateUrl = `${prefix}/template`;
    const localDir = join(base, 'template');
    const source = await Vm.start({ guest: 'probe', memory: MEMORY, vcpus: 1, name: 'bench-fleet-source' });
    let expected: string;
    let template, child;
    try {
      await source.probe.fill({ sizeMiB: o.workingSetMiB, content: 'random', seed: SEED });
      expected = (await source.probe.digest()).hex;
      await source.snapshot(localDir);
      template = (await source.snapshot(templateUrl, { store: { cacheDir: join(base, 'host-a') } })).store!;
      progress(`template sent: ${(template.bytesTransferred / 2 ** 20).toFixed(1)} MiB in ${template.chunksTransferred} objects, ${template.ms.toFixed(0)} ms`);
      // The same seed gives the same bytes per page: the first workingSetMiB are rewritten as they were.
      await source.probe.fill({ sizeMiB: o.workingSetMiB + CHILD_CHANGED_MIB, content: 'random', seed: SEED });
      child = (await source.snapshot(`${prefix}/child`, { store: { cacheDir: join(base, 'host-a') } })).store!;
      progress(`child sent: ${(child.bytesTransferred / 2 ** 20).toFixed(1)} MiB in ${child.chunksTransferred} objects, ${child.chunksPresent} present`);
    } finally {
      await source.stop();
    }
    // Which chunks the child changed: those of the appended MiB, and any of the probe's own pages.
    const childChangedChunks = changedChunkIndexes(await ramChunksAt(templateUrl), await ramChunksAt(`${prefix}/child`));

    const check = async (vm: Vm, what: string) => {
      const got = (await vm.probe.digest()).hex;
      await vm.stop();
      if (got !== expected) throw new Error(`${what}: digest ${got}, the template's guest had ${expected}`);
    };
    const local: number[] = [];
    const cold: number[] = [];
    const warm: number[] = [];
    let bytesBeforeReady = 0;
    for (let i = 0; i < o.runs; i++) {
      dropCache(join(localDir, 'ram'));
      const l = await toReady(() => Vm.restore(localDir));
      local.push(l.ms);
      await check(l.vm, 'local restore');
      const cacheDir = join(base, `host-b-${i}`);
      const c = await toReady(() => Vm.restore(templateUrl, { store: { cacheDir } }));
      cold.push(c.ms);
      // When Vm.restore resolved, as the Linux row counts it: what the VM needed to run. The
      // prefetch starts then, and how much of it lands before the first answer is a race.
      bytesBeforeReady = Math.max(bytesBeforeReady, c.vm.restoreInfo!.store!.bytesTransferred);
      if (c.vm.restoreInfo!.storeRamLoad !== 'lazy') throw new Error(`the restore from the store was not lazy (${c.vm.restoreInfo!.storeRamLoad})`);
      await check(c.vm, 'store restore, cold cache');
      const w = await toReady(() => Vm.restore(templateUrl, { store: { cacheDir } }));
      warm.push(w.ms);
      const warmFetched = w.vm.storeTransfer!.chunksTransferred;
      await check(w.vm, 'store restore, warm cache');
      if (warmFetched !== 0) throw new Error(`a restore from a warm cache fetched ${warmFetched} chunks from the store`);
      rmSync(cacheDir, { recursive: true, force: true });
      progress(`run ${i + 1}/${o.runs}: local ${l.ms.toFixed(0)} ms, store cold ${c.ms.toFixed(0)} ms (${(bytesBeforeReady / 2 ** 20).toFixed(1)} MiB read), store warm ${w.ms.toFixed(0)} ms`);
    }

    // The clones of one host: SharedSnapshot from the store (one cache), then as many of the local snapshot.
    const cloneChunksFetched: number[] = [];
    let clonePssBytes: FleetFigures['clonePssBytes'];
    if (o.clones) {
      const fromStore = await clonesPss(o.clones, expected, async () => {
        const vm = await Vm.restore(templateUrl, { strategies: [new SharedSnapshot()], store: { cacheDir: join(base, 'host-c') } });
        cloneChunksFetched.push(vm.restoreInfo!.store!.chunksTransferred);
        return vm;
      });
      progress(`${o.clones} SharedSnapshot clones from the store on one host fetched ${cloneChunksFetched.join(', ')} chunks; guest RAM PSS ${(fromStore / 2 ** 20).toFixed(1)} MiB per clone`);
      const local = await clonesPss(o.clones, expected, () => Vm.restore(localDir, { strategies: [new SharedSnapshot()] }));
      progress(`${o.clones} SharedSnapshot clones of the local snapshot: guest RAM PSS ${(local / 2 ** 20).toFixed(1)} MiB per clone`);
      clonePssBytes = { store: fromStore, local };
    }

    const figures: FleetFigures = {
      runs: o.runs,
      workingSetMiB: o.workingSetMiB,
      localMs: stats(local),
      storeColdMs: stats(cold),
      storeWarmMs: stats(warm),
      bytesBeforeReady,
      childSentBytes: child.bytesTransferred,
      childChunksSent: child.chunksTransferred,
      childChunksPresent: child.chunksPresent,
      childChangedChunks,
      cloneChunksFetched,
      ...(clonePssBytes && { clonePssBytes }),
    };
    process.stdout.write(`Fleet: probe guest (the Linux row: --guest linux), ${MEMORY} / 1 vCPU, ${o.workingSetMiB} MiB random working set, ${o.runs} runs (ms min / median / max; ready = first request answered; bytes before ready: when Vm.restore resolved, the most of the runs; local: RAM file's page cache dropped; store: ${store.origin === 'started' ? 'radosgw memstore on loopback, started by the bench' : store.endpoint}; a restore from the store is lazy: chunks on first touch, the rest prefetched once Vm.restore resolves; SharedSnapshot clones fetch the snapshot whole, once per host)\n`);
    printTableBlock(fleetTableRows(figures));
    return { ...figures, storeOrigin: store.origin, storeStartMs: store.startMs, templateUpload: template, childUpload: child, goals: fleetGoals(figures) };
  } finally {
    rmSync(base, { recursive: true, force: true });
    store.close();
  }
}
