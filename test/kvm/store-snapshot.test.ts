// A probe VM snapshotted to a real object store (scripts/object-store.sh: Ceph radosgw on this
// machine's loopback) and restored in another process, a second "host" with its own runtime
// directory and chunk cache: same digest, guest RAM loaded lazily (well below the snapshot's data
// fetched before the VM was ready); a second restore on that host takes what it needs from its
// cache. A chunk corrupted in the store, and a store that stalls once the VM runs, each end that
// VM with a typed StoreError, in bounded time, while this process and another VM go on.
// Real KVM, real processes, a real store. Natively (CI, /dev/kvm) the store runs beside the test;
// under the nested harness it runs inside the L1, on the L1's loopback (the L1 has no network to
// the host's), from the host's Ceph programs. Skipped, saying why, only when this machine cannot
// have the store's Debian packages.
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { readdirSync } from 'node:fs';
import { join } from 'node:path';
import { connect, createServer, type Server, type Socket } from 'node:net';
import { StoreError, Vm } from '../../src';
import { chunkKey } from '../../src/store/store-url';
import { pvisorOnce, startPvisor } from '../cli-runs';
import { getObject, objectStoreScript, objectStoreSkipReason, objectStoreSuite, putObject } from '../object-store-env';
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
function restoreElsewhere(url: string, host: string): { digest: string; restoreInfo: { ramLoad: string; storeRamLoad: string; readyMs: number; store: { chunksTransferred: number; chunksPresent: number; bytesTransferred: number } } } {
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
  objectStoreSuite(script, 'pvisor-store-snapshot-', { onWork: (dir) => (WORK = dir) });

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
    // Lazy: the VM ran once the manifest and the two small files were here; its RAM came after.
    expect(first.restoreInfo.ramLoad).toBe('lazy');
    expect(first.restoreInfo.storeRamLoad).toBe('lazy');
    expect(first.restoreInfo.store.chunksPresent).toBe(0);
    // Before Vm.restore resolved: the small files, and the chunk or two the VMM's own reads touched
    // (a chunk of the probe's own pages, partly zero, is a page delta: smaller than 2 MiB).
    expect(first.restoreInfo.store.bytesTransferred).toBeLessThan(written.store!.bytesTransferred / 2);
    const second = restoreElsewhere(url, hostB);
    expect(second.digest).toBe(hexOf(ws));
    // The small files (and whatever was fetched before ready) came from host B's cache.
    expect(second.restoreInfo.store.chunksTransferred).toBe(0);
    expect(second.restoreInfo.store.chunksPresent).toBeGreaterThanOrEqual(2);
    expect(readdirSync(join(hostB, 'cache', 'work'))).toEqual([]);
    process.stdout.write(`store restore to ready: first ${first.restoreInfo.readyMs.toFixed(1)} ms (${(first.restoreInfo.store.bytesTransferred / MiB).toFixed(1)} MiB fetched), from the cache ${second.restoreInfo.readyMs.toFixed(1)} ms\n`);
  });

  it('pvisor snapshot ID s3://... from one host (jailed), pvisor run --from s3://... on another: lazy with --isolation none, fetched whole by the launcher of a jailed run; digest equal, progress said', async () => {
    const url = `s3://pvisor/kvm-test-${randomBytes(4).toString('hex')}/cli`;
    const host = (name: string): NodeJS.ProcessEnv => ({ ...process.env, PVISOR_RUNTIME_DIR: join(WORK, name, 'run'), PVISOR_CHUNK_CACHE: join(WORK, name, 'cache') });
    const run = startPvisor(host('cli-a'), ['run', '--guest', 'probe', '--name', 'C1', '--memory', '64MiB', '--vcpus', '1', '--', 'fill 16MiB random 27, digest, wait']);
    try {
      await run.waitFor(/^digest: /m);
      const s = await pvisorOnce(host('cli-a'), ['snapshot', 'C1', url]);
      expect(s.status).toBe(0);
      expect(s.stdout).toMatch(new RegExp(`^C1 snapshot: \\d+ RAM pages \\([\\d.]+ MiB\\) written to ${url.replace(/[/.]/g, '\\$&')} in [\\d.]+ ms; C1 is running$`, 'm'));
      const fetched = `^pvisor: ${url.replace(/[/.]/g, '\\$&')}: \\d+ chunks fetched \\([\\d.]+ MiB\\), \\d+ from the cache, \\d+ zero, in \\d+ ms`;
      // In this process: lazily, the VM ready before its RAM is all here.
      const r = await pvisorOnce(host('cli-b'), ['run', '--isolation', 'none', '--from', url, '--name', 'C2', '--', 'digest']);
      expect(r.status).toBe(0);
      expect(r.stderr).toMatch(new RegExp(`${fetched}, before the VM was ready`, 'm'));
      expect(r.stdout).toContain(`digest: ${hexOf(ws)}`);
      expect(readdirSync(join(WORK, 'cli-b', 'cache', 'work'))).toEqual([]);
      // Jailed (the default): the launcher fetches it whole (the jail has no network) and hands the copy in.
      const j = await pvisorOnce(host('cli-c'), ['run', '--from', url, '--name', 'C3', '--', 'digest']);
      expect(j.status).toBe(0);
      expect(j.stderr).toMatch(new RegExp(`${fetched}$`, 'm'));
      expect(j.stderr).toMatch(/^pvisor: C3 jailed /m);
      expect(j.stdout).toContain(`digest: ${hexOf(ws)}`);
      expect(readdirSync(join(WORK, 'cli-c', 'cache', 'work'))).toEqual([]);
    } finally {
      await pvisorOnce(host('cli-a'), ['stop', 'C1']);
      await run.exited;
    }
  }, 300_000);

  /** Snapshots a probe VM that filled 16 MiB with `seed` to a new prefix; the URL and its store manifest. */
  async function templateIn(name: string, seed: number): Promise<{ url: string; ramChunks: (string | null)[] }> {
    const url = `s3://pvisor/kvm-test-${randomBytes(4).toString('hex')}/${name}`;
    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1 });
    try {
      await vm.probe.fill({ sizeMiB: 16, content: 'random', seed });
      await vm.snapshot(url, { store: { cacheDir: join(WORK, 'host-a', 'cache') } });
    } finally {
      await vm.stop();
    }
    const manifest = JSON.parse((await getObject(`${url.slice('s3://pvisor/'.length)}/snapshot.json`)).toString('utf8'));
    return { url, ramChunks: manifest.ramChunks };
  }

  /** Waits for `vm` to end; its state and error. */
  function ended(vm: Vm): Promise<{ state: string; error?: Error }> {
    if (vm.state === 'crashed' || vm.state === 'stopped') return Promise.resolve({ state: vm.state, error: vm.error });
    return new Promise((resolve) => vm.once('exit', (info) => resolve({ state: info.state, error: info.error })));
  }

  it('a chunk corrupted in the store ends the lazily restored VM with StoreError corrupt before the guest reads it; the host process and another VM live on', async () => {
    const { url, ramChunks } = await templateIn('corrupt', 271);
    // The last chunk with data, within the 16 MiB the guest fills: its bytes with one flipped.
    const last = ramChunks.map((sha, i) => (sha ? i : -1)).filter((i) => i >= 0).pop()!;
    const key = chunkKey(ramChunks[last]!);
    const bytes = await getObject(key);
    bytes[bytes.length >> 1] ^= 0x5a;
    await putObject(key, bytes);
    const other = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1 });
    try {
      await other.probe.fill({ sizeMiB: 4, content: 'random', seed: 3 });
      const before = (await other.probe.digest()).hex;
      const vm = await Vm.restore(url, { store: { cacheDir: join(WORK, 'host-corrupt', 'cache'), requestTimeoutMs: 60000 } }).catch((e: unknown) => e);
      let error: unknown = vm;
      if (vm instanceof Vm) {
        expect(vm.restoreInfo!.storeRamLoad).toBe('lazy');
        // The digest reads every byte the guest filled: it reaches the bad chunk.
        await expect(vm.probe.digest()).rejects.toThrow();
        const end = await ended(vm);
        expect(end.state).toBe('crashed');
        error = end.error;
      }
      expect(error).toBeInstanceOf(StoreError);
      expect((error as StoreError).reason).toBe('corrupt');
      expect((error as StoreError).message).toMatch(/SHA-256/);
      // This process and the other VM go on.
      expect((await other.probe.digest()).hex).toBe(before);
      // The bad bytes were never cached.
      expect(readdirSync(join(WORK, 'host-corrupt', 'cache', 'chunks'))).not.toContain(ramChunks[last]);
    } finally {
      await other.stop();
    }
  }, 300_000);

  it('a store that stops answering mid-restore ends the lazily restored VM with StoreError timeout within the bound, no hang', async () => {
    const { url } = await templateIn('stall', 272);
    // A TCP relay to radosgw that passes everything until told to stall, then nothing more: the
    // store as seen by a host whose link to it died after the VM started. Every byte it passes is radosgw's.
    const upstream = new URL(process.env.AWS_ENDPOINT_URL!);
    let stalled = false;
    const sockets: Socket[] = [];
    const relay = await new Promise<Server>((resolve) => {
      const server = createServer((client) => {
        const up = connect(Number(upstream.port), upstream.hostname);
        sockets.push(client, up);
        client.on('data', (d) => up.write(d));
        up.on('data', (d) => stalled || client.write(d));
        client.on('error', () => undefined);
        up.on('error', () => undefined);
      });
      server.listen(0, '127.0.0.1', () => resolve(server));
    });
    const savedEndpoint = process.env.AWS_ENDPOINT_URL;
    process.env.AWS_ENDPOINT_URL = `http://127.0.0.1:${(relay.address() as { port: number }).port}`;
    const timeoutMs = 3000;
    try {
      const vm = await Vm.restore(url, { store: { cacheDir: join(WORK, 'host-stall', 'cache'), requestTimeoutMs: timeoutMs } });
      expect(vm.restoreInfo!.storeRamLoad).toBe('lazy');
      stalled = true;
      const t0 = performance.now();
      await expect(vm.probe.digest()).rejects.toThrow();
      const end = await ended(vm);
      const ms = performance.now() - t0;
      expect(end.state).toBe('crashed');
      expect(end.error).toBeInstanceOf(StoreError);
      expect((end.error as StoreError).reason).toBe('timeout');
      // One request's bound, and the time to end the VM (the harness is 10-50x slower than hardware).
      expect(ms).toBeLessThan(timeoutMs * 2 + 10_000);
      process.stdout.write(`store stalled after the lazy restore: the VM ended with StoreError timeout ${ms.toFixed(0)} ms after the digest was asked (requestTimeoutMs ${timeoutMs})\n`);
    } finally {
      process.env.AWS_ENDPOINT_URL = savedEndpoint;
      for (const s of sockets) s.destroy();
      await new Promise((r) => relay.close(r));
    }
  }, 300_000);
});
