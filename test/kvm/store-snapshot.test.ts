// A probe VM snapshotted to a real object store (scripts/object-store.sh: Ceph radosgw on this
// machine's loopback) and restored in another process, a second "host" with its own runtime
// directory and chunk cache: same digest; a second restore on that host fetches no chunk again.
// Real KVM, real processes, a real store. Natively (CI, /dev/kvm) the store runs beside the test;
// under the nested harness it runs inside the L1, on the L1's loopback (the L1 has no network to
// the host's), from the host's Ceph programs. Skipped, saying why, only when this machine cannot
// have the store's Debian packages.
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { Vm } from '../../src';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { pvisorOnce, startPvisor } from '../cli-runs';
import { objectStoreScript, objectStoreSkipReason, startObjectStore } from '../object-store-env';
import { hexOf } from '../probe-digest';

const ROOT = join(__dirname, '..', '..', '..');
// The store's state in the repository: under the harness only the repository is the host's.
const STATE_DIR = join(ROOT, '.cache', `store-snapshot-test-${process.pid}`);
// The "hosts" (runtime directories with their control sockets, chunk caches) on a local disk:
// a socket cannot be made on the harness's 9p share of the repository.
let WORK: string;
const index = join(__dirname, '..', '..', 'src', 'index.js');
const MiB = 1024 * 1024;
const ws = { content: 'random' as const, seed: 27, sizeBytes: 16 * MiB, rewrites: [] };

// memstore: a small store that starts sooner, and needs no block file on the harness's 9p share.
const script = objectStoreScript(STATE_DIR, { timeoutMs: 600_000, env: { OBJECT_STORE_BACKEND: 'memstore', OBJECT_STORE_SIZE_MIB: '1024', OBJECT_STORE_TIMEOUT_S: '400' } });
const why = objectStoreSkipReason('probe snapshot through the object store');

/** Restores `url` in a new node process whose runtime directory and chunk cache are `host`'s; its digest and restore figures. */
function restoreElsewhere(url: string, host: string): { digest: string; restoreInfo: { ramLoad: string; readyMs: number; store: { chunksTransferred: number; chunksPresent: number; bytesTransferred: number } } } {
  const child = `
    const { Vm } = require(${JSON.stringify(index)});
    (async () => {
      const vm = await Vm.restore(${JSON.stringify(url)}, { store: { cacheDir: ${JSON.stringify(join(host, 'cache'))}, requestTimeoutMs: 60000 } });
      const digest = (await vm.probe.digest()).hex;
      await vm.stop();
      process.stdout.write(JSON.stringify({ digest, restoreInfo: vm.restoreInfo }));
    })().catch((e) => { console.error(e); process.exit(1); });`;
  const r = spawnSync(process.execPath, ['-e', child], { encoding: 'utf8', timeout: 300_000, env: { ...process.env, PVISOR_RUNTIME_DIR: join(host, 'run') } });
  if (r.status !== 0) throw new Error(`the restoring process exited ${r.status}: ${r.stderr}`);
  return JSON.parse(r.stdout);
}

(why ? describe.skip : describe)(`a probe VM through the object store${why ? ` (skipped: ${why})` : ''}`, () => {
  let restoreEnv = () => {};

  beforeAll(() => {
    WORK = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-store-snapshot-'));
    ({ restoreEnv } = startObjectStore(script));
  }, 620_000);

  afterAll(() => {
    restoreEnv();
    const r = script('stop');
    if (WORK) rmSync(WORK, { recursive: true, force: true });
    expect(r.status).toBe(0);
  }, 120_000);

  it('snapshotted to s3:// in this process, restored in another with its own runtime dir and cache: digest equal', async () => {
    const url = `s3://pvisor/kvm-test-${randomBytes(4).toString('hex')}/probe`;
    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1 });
    let written;
    try {
      await vm.probe.fill({ sizeMiB: 16, content: 'random', seed: 27 });
      expect((await vm.probe.digest()).hex).toBe(hexOf(ws));
      written = await vm.snapshot(url, { store: { cacheDir: join(WORK, 'host-a', 'cache') } });
      // The VM ran on after the snapshot was sent.
      expect(vm.state).toBe('running');
    } finally {
      await vm.stop();
    }
    expect(written.dir).toBe(url);
    // 32 chunks of 2 MiB; 16 MiB of random data fill 8, the probe's own pages a few more.
    expect(written.store).toMatchObject({ chunksTotal: 32 });
    expect(written.store!.chunksTransferred).toBeGreaterThanOrEqual(8 + 2);
    expect(written.store!.zeroChunks).toBeGreaterThan(10);
    // Host A's work directory is gone once the snapshot is sent.
    expect(readdirSync(join(WORK, 'host-a', 'cache', 'work'))).toEqual([]);

    const hostB = join(WORK, 'host-b');
    const first = restoreElsewhere(url, hostB);
    expect(first.digest).toBe(hexOf(ws));
    expect(first.restoreInfo.ramLoad).toBe('lazy');
    expect(first.restoreInfo.store.chunksTransferred).toBe(written.store!.chunksTransferred);
    expect(first.restoreInfo.store.chunksPresent).toBe(0);
    const second = restoreElsewhere(url, hostB);
    expect(second.digest).toBe(hexOf(ws));
    expect(second.restoreInfo.store.chunksTransferred).toBe(0);
    expect(second.restoreInfo.store.chunksPresent).toBe(written.store!.chunksTransferred);
    expect(readdirSync(join(hostB, 'cache', 'work'))).toEqual([]);
    process.stdout.write(`store restore to ready: first ${first.restoreInfo.readyMs.toFixed(1)} ms (${(first.restoreInfo.store.bytesTransferred / MiB).toFixed(1)} MiB fetched), from the cache ${second.restoreInfo.readyMs.toFixed(1)} ms\n`);
  });

  it('pvisor snapshot ID s3://... from one host, pvisor run --from s3://... on another: digest equal, progress said', async () => {
    const url = `s3://pvisor/kvm-test-${randomBytes(4).toString('hex')}/cli`;
    const host = (name: string): NodeJS.ProcessEnv => ({ ...process.env, PVISOR_RUNTIME_DIR: join(WORK, name, 'run'), PVISOR_CHUNK_CACHE: join(WORK, name, 'cache') });
    const run = startPvisor(host('cli-a'), ['run', '--guest', 'probe', '--name', 'C1', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 16MiB random 27, digest, wait']);
    try {
      await run.waitFor(/^digest: /m);
      const s = await pvisorOnce(host('cli-a'), ['snapshot', 'C1', url]);
      expect(s.status).toBe(0);
      expect(s.stdout).toMatch(new RegExp(`^C1 snapshot: \\d+ RAM pages \\([\\d.]+ MiB\\) written to ${url.replace(/[/.]/g, '\\$&')} in [\\d.]+ ms; C1 is running$`, 'm'));
      const r = await pvisorOnce(host('cli-b'), ['run', '--from', url, '--name', 'C2', '--', 'digest']);
      expect(r.status).toBe(0);
      expect(r.stderr).toMatch(new RegExp(`^pvisor: fetching the snapshot ${url.replace(/[/.]/g, '\\$&')}\\.\\.\\.$`, 'm'));
      expect(r.stderr).toMatch(/: 1\d chunks fetched \([\d.]+ MiB\), 0 from the cache, \d+ zero, in \d+ ms$/m);
      expect(r.stdout).toContain(`digest: ${hexOf(ws)}`);
      expect(readdirSync(join(WORK, 'cli-b', 'cache', 'work'))).toEqual([]);
    } finally {
      await pvisorOnce(host('cli-a'), ['stop', 'C1']);
      await run.exited;
    }
  }, 300_000);
});
