// Clones of one snapshot in an object store, on one host, with SharedSnapshot: the first restore
// assembles the snapshot once into the host's chunk cache (snapshots/<key>/), and every clone, in
// any process that uses that cache, maps that same RAM file (the same inode in each process's
// /proc/PID/maps), so their RAM shares the page cache; the second fetches no chunk. Eviction (a
// cache bound of 0) keeps the file while a clone maps it and removes it once none does. Real KVM,
// real processes, a real store (scripts/object-store.sh, radosgw on loopback; inside the L1 under
// the nested harness). Skipped, saying why, only when this machine cannot have the store.
import { randomBytes } from 'node:crypto';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { Vm } from '../../src';
import { ChunkCache } from '../../src/store/chunk-cache';
import { SHARED_SNAPSHOTS_DIR } from '../../src/store/shared-entry';
import { objectStoreScript, objectStoreSkipReason, objectStoreSuite } from '../object-store-env';
import { hexOf } from '../probe-digest';
import { mappedFiles, startCloneProcess, type CloneProcess } from '../store-clone-process';

const ROOT = join(__dirname, '..', '..', '..');
const STATE_DIR = join(ROOT, '.cache', `store-clones-test-${process.pid}`);
// On a local disk: sockets and flocks, which the harness's 9p share of the repository lacks.
let WORK: string;
const MiB = 1024 * 1024;
const ws = { content: 'random' as const, seed: 27, sizeBytes: 16 * MiB, rewrites: [] };

const script = objectStoreScript(STATE_DIR, { timeoutMs: 600_000, env: { OBJECT_STORE_BACKEND: 'memstore', OBJECT_STORE_SIZE_MIB: '1024', OBJECT_STORE_TIMEOUT_S: '400' } });
const why = objectStoreSkipReason('SharedSnapshot clones through the object store');

(why ? describe.skip : describe)(`SharedSnapshot clones of a store snapshot on one host${why ? ` (skipped: ${why})` : ''}`, () => {
  const clones: CloneProcess[] = [];
  objectStoreSuite(script, 'pvisor-store-clones-', {
    onWork: (dir) => (WORK = dir),
    beforeStop: async () => {
      for (const c of clones) await c.end();
    },
  });

  it('two clones in two processes map the same cache file; eviction keeps it while mapped, removes it after', async () => {
    const url = `s3://pvisor/kvm-test-${randomBytes(4).toString('hex')}/template`;
    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1 });
    let written;
    try {
      await vm.probe.fill({ sizeMiB: 16, content: 'random', seed: 27 });
      written = await vm.snapshot(url, { store: { cacheDir: join(WORK, 'host-a', 'cache') } });
    } finally {
      await vm.stop();
    }
    const cacheDir = join(WORK, 'host-b', 'cache');
    const start = (n: number) => startCloneProcess(url, { runDir: join(WORK, 'host-b', `run-${n}`), cacheDir, readyTimeoutMs: 120_000 });
    const first = await start(1);
    clones.push(first);
    const second = await start(2);
    clones.push(second);

    expect(first.ready.restoreInfo.ramLoad).toBe('mapped');
    expect(first.ready.restoreInfo.store).toMatchObject({ sharedEntry: 'assembled', chunksTransferred: written.store!.chunksTransferred });
    // The second clone found the snapshot assembled: only the manifest came from the store.
    expect(second.ready.restoreInfo.store).toMatchObject({ sharedEntry: 'reused', chunksTransferred: 0, chunksPresent: written.store!.chunksTransferred });
    for (const c of [first, second]) expect((await c.ask({ op: 'digest' })).digest).toBe(hexOf(ws));

    const [key] = readdirSync(join(cacheDir, SHARED_SNAPSHOTS_DIR));
    const part = join(SHARED_SNAPSHOTS_DIR, key, 'ram');
    const mapped = [first, second].map((c) => mappedFiles(readFileSync(`/proc/${c.ready.pid}/maps`, 'utf8'), part));
    expect(mapped[0]).toHaveLength(1);
    expect(mapped[1]).toEqual(mapped[0]);
    expect(readdirSync(join(cacheDir, 'work'))).toEqual([]);

    // A bound of 0: every chunk goes, the mapped snapshot stays.
    const bounded = ChunkCache.open(cacheDir, 0);
    const kept = bounded.evict();
    expect(kept.sharedSnapshotsRemoved).toBe(0);
    expect(kept.chunksRemoved).toBeGreaterThan(0);
    expect(existsSync(join(cacheDir, part))).toBe(true);

    // One clone left: still mapped, still kept; its RAM still reads right.
    await first.end();
    expect(bounded.evict().sharedSnapshotsRemoved).toBe(0);
    expect((await second.ask({ op: 'digest' })).digest).toBe(hexOf(ws));
    await second.end();
    expect(bounded.evict().sharedSnapshotsRemoved).toBe(1);
    expect(readdirSync(join(cacheDir, SHARED_SNAPSHOTS_DIR))).toEqual([]);
  }, 600_000);
});
