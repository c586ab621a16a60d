// A probe VM hibernated to a real object store (scripts/object-store.sh: Ceph radosgw on loopback)
// on one "host" and resumed on another (another process with its own runtime directory and chunk
// cache): same digest, same name and labels; a second resume is refused with the typed error that
// names who claimed it. Then the CLI's round trip: pvisor suspend ID --hibernate --store on host
// A, pvisor resume ID --store on host B (same id, a new socket there, digest equal), a resume on
// host C refused (exit 1). It prints the times of local and store hibernation and resume, and the
// bytes sent (docs/object-store.md, "Hibernated VMs in a store"). Real KVM, processes, store;
// under the nested harness the store runs inside the L1, as in store-snapshot.test.ts.
import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { StoreClaimedError, Vm } from '../../src';
import { controlRequest } from '../../src/control-socket';
import { readStoreManifest } from '../../src/store/chunk-fetch';
import { ObjectStore } from '../../src/store/object-io';
import { parseStoreUrl } from '../../src/store/store-url';
import { gone, pvisorOnce, startPvisor, type Run } from '../cli-runs';
import { objectStoreScript, objectStoreSkipReason, objectStoreSuite } from '../object-store-env';
import { hexOf } from '../probe-digest';

const ROOT = join(__dirname, '..', '..', '..');
const STATE_DIR = join(ROOT, '.cache', `store-hibernate-test-${process.pid}`);
let WORK: string;
const index = join(__dirname, '..', '..', 'src', 'index.js');
const MiB = 1024 * 1024;
const ws = hexOf({ content: 'random', seed: 31, sizeBytes: 16 * MiB, rewrites: [] });

const script = objectStoreScript(STATE_DIR, { timeoutMs: 600_000, env: { OBJECT_STORE_BACKEND: 'memstore', OBJECT_STORE_SIZE_MIB: '1024', OBJECT_STORE_TIMEOUT_S: '400' } });
const why = objectStoreSkipReason('hibernation through the object store');

interface Restored {
  digest?: string;
  name?: string;
  labels?: Record<string, string>;
  restoreInfo?: { hibernated: boolean; readyMs: number; ramLoad: string; storeRamLoad?: string; store?: { bytesTransferred: number; chunksTransferred: number } };
  error?: { name: string; reason?: string; claim?: StoreClaimedError['claim']; message: string };
  pid: number;
}

/** Restores `location` in a new node process of `host` (runtime dir and chunk cache); what it saw. */
function restoreElsewhere(location: string, host: string): Restored {
  const child = `
    const { Vm } = require(${JSON.stringify(index)});
    (async () => {
      let out;
      try {
        const vm = await Vm.restore(${JSON.stringify(location)}, { store: { cacheDir: ${JSON.stringify(join(host, 'cache'))}, requestTimeoutMs: 60000 } });
        const digest = (await vm.probe.digest()).hex;
        out = { digest, name: vm.name, labels: vm.labels, restoreInfo: vm.restoreInfo };
        await vm.stop();
      } catch (e) {
        out = { error: { name: e.constructor.name, reason: e.reason, claim: e.claim, message: e.message } };
      }
      process.stdout.write(JSON.stringify({ ...out, pid: process.pid }));
    })().catch((e) => { console.error(e); process.exit(1); });`;
  const r = spawnSync(process.execPath, ['-e', child], { encoding: 'utf8', timeout: 300_000, env: { ...process.env, PVISOR_RUNTIME_DIR: join(host, 'run') } });
  if (r.status !== 0) throw new Error(`the restoring process exited ${r.status}: ${r.stderr}`);
  return JSON.parse(r.stdout) as Restored;
}

(why ? describe.skip : describe)(`a probe VM hibernated through the object store${why ? ` (skipped: ${why})` : ''}`, () => {
  objectStoreSuite(script, 'pvisor-store-hibernate-', { onWork: (dir) => (WORK = dir) });

  const start = async (name: string): Promise<Vm> => {
    const vm = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1, name, labels: { team: 'blue' } });
    await vm.probe.fill({ sizeMiB: 16, content: 'random', seed: 31 });
    expect((await vm.probe.digest()).hex).toBe(ws);
    return vm;
  };

  it('vm.hibernate(s3://) here, Vm.restore(s3://) in another process with its own runtime dir and cache: same VM, digest equal; a second resume is refused', async () => {
    // The local hibernation first, for the figures to compare with.
    const local = await start('local-h');
    const localDir = join(WORK, 'local-h');
    const localInfo = await local.hibernate(localDir);
    const localResume = restoreElsewhere(localDir, join(WORK, 'host-l'));
    expect(localResume.digest).toBe(ws);

    const url = `s3://pvisor/kvm-test-${randomBytes(4).toString('hex')}/vm`;
    const vm = await start('store-h');
    const hostA = join(WORK, 'host-a');
    const exit = new Promise<{ hibernatedTo?: string }>((resolve) => vm.once('exit', resolve));
    const info = await vm.hibernate(url, { store: { cacheDir: join(hostA, 'cache') } });
    expect(vm.state).toBe('stopped');
    expect((await exit).hibernatedTo).toBe(url);
    expect(info.dir).toBe(url);
    expect(info.store).toMatchObject({ url, chunksTotal: 32 });
    expect(info.store!.chunksTransferred).toBeGreaterThanOrEqual(8 + 2);
    expect(readdirSync(join(hostA, 'cache', 'work'))).toEqual([]);
    // The same prefix twice is refused before the VM is paused.
    const again = await start('store-h2');
    await expect(again.hibernate(url, { store: { cacheDir: join(hostA, 'cache') } })).rejects.toMatchObject({ reason: 'exists' });
    expect(again.state).toBe('running');
    await again.stop();

    const b = restoreElsewhere(url, join(WORK, 'host-b'));
    expect(b.error).toBeUndefined();
    expect(b.digest).toBe(ws);
    expect(b.name).toBe('store-h');
    expect(b.labels).toEqual({ team: 'blue' });
    // Claimed, then lazy: it ran before most of its RAM was fetched.
    expect(b.restoreInfo).toMatchObject({ hibernated: true, ramLoad: 'lazy', storeRamLoad: 'lazy' });
    expect(b.restoreInfo!.store!.bytesTransferred).toBeLessThan(info.store!.bytesTransferred / 2);
    expect(readdirSync(join(WORK, 'host-b', 'cache', 'work'))).toEqual([]);

    const c = restoreElsewhere(url, join(WORK, 'host-c'));
    expect(c.digest).toBeUndefined();
    expect(c.error).toMatchObject({ name: 'StoreClaimedError', reason: 'claimed', claim: { state: 'resumed', pid: b.pid } });
    expect(c.error!.message).toMatch(/was resumed by .* pid \d+ at /);
    // Refused before any of its RAM was fetched: the cache holds the state (which says the VM is
    // hibernated) and manifest.json, fetched with it, and no chunk of guest RAM.
    const url0 = parseStoreUrl(url);
    const store = ObjectStore.open(url0, { requestTimeoutMs: 60_000 });
    const { manifest } = await readStoreManifest(url0, store).finally(() => store.close());
    expect(readdirSync(join(WORK, 'host-c', 'cache', 'chunks')).sort()).toEqual([manifest.files.state.sha256, manifest.files.manifest.sha256].sort());
    expect(manifest.ramChunks.filter((sha) => sha !== null).length).toBeGreaterThan(0);

    const mib = (n: number) => (n / MiB).toFixed(1);
    process.stdout.write(
      `hibernate: local ${localInfo.ms.toFixed(1)} ms (${mib(localInfo.bytesOnDisk)} MiB on disk), to the store ${info.ms.toFixed(1)} ms (${mib(info.store!.bytesTransferred)} MiB sent in ${info.store!.chunksTransferred} objects)\n` +
        `resume to ready in another process: local ${localResume.restoreInfo!.readyMs.toFixed(1)} ms, from the store ${b.restoreInfo!.readyMs.toFixed(1)} ms (${mib(b.restoreInfo!.store!.bytesTransferred)} MiB fetched); refused second resume ok\n`,
    );
  }, 600_000);

  it('pvisor suspend ID --hibernate --store on host A, pvisor resume ID --store on host B: same id and digest; a resume on host C is refused', async () => {
    const url = `s3://pvisor/kvm-test-${randomBytes(4).toString('hex')}/cli`;
    const host = (name: string): NodeJS.ProcessEnv => ({ ...process.env, PVISOR_RUNTIME_DIR: join(WORK, name, 'run'), PVISOR_CHUNK_CACHE: join(WORK, name, 'cache') });
    const run: Run = startPvisor(host('cli-a'), ['run', '--isolation', 'none', '--vm-backing-dir', WORK, '--guest', 'probe', '--name', 'S1', '--memory', '64MiB', '--vcpus', '1', '--label', 'team=red', '--', 'fill 16MiB random 31, digest, wait']);
    let pid: number | undefined;
    try {
      await run.waitFor(/^digest: /m);
      const h = await pvisorOnce(host('cli-a'), ['suspend', 'S1', '--vm-offload', '--hibernate', '--store', url]);
      expect(h.stderr).toBe('');
      expect(h.status).toBe(0);
      expect(h.stdout).toMatch(new RegExp(`^S1 hibernated to ${url.replace(/[/.]/g, '\\$&')} in [\\d.]+ ms: .* -> 0; [\\d.]+ [KM]iB sent in \\d+ objects .*; its process \\(pid ${run.child.pid}\\) has ended \\(pvisor run exits 148\\)\\. pvisor resume S1 --store .* continues it, on this host or another$`, 'm'));
      expect((await run.exited).code).toBe(148);
      // Nothing of it stays on host A.
      expect(readdirSync(join(WORK, 'cli-a', 'run')).filter((f) => f.startsWith('S1'))).toEqual([]);
      expect(readdirSync(join(WORK, 'cli-a', 'cache', 'work'))).toEqual([]);

      const r = await pvisorOnce(host('cli-b'), ['resume', 'S1', '--store', url, '--json']);
      expect(r.stderr).toBe('');
      expect(r.status).toBe(0);
      const report = JSON.parse(r.stdout) as { id: string; pid: number; ramLoad: string; store: string };
      pid = report.pid;
      expect(report).toMatchObject({ id: 'S1', ramLoad: 'lazy', store: url });
      const socket = join(WORK, 'cli-b', 'run', 'S1.sock');
      expect(existsSync(socket)).toBe(true);
      const d = await controlRequest(socket, 'S1', { op: 'exec', command: 'digest' }, 120_000);
      if (!d.ok) throw new Error(d.error.message);
      expect(/^digest: ([0-9a-f]{16})/m.exec(d.exec!.stdout)?.[1]).toBe(ws);
      expect(d.vm.labels).toEqual({ team: 'red' });

      const c = await pvisorOnce(host('cli-c'), ['resume', 'S1', '--store', url]);
      expect(c.status).toBe(1);
      expect(c.stderr).toMatch(/^pvisor: resume S1 refused: .*the hibernated VM was (resumed|claimed) by .* pid \d+ at .*A hibernated VM is resumed at most once/m);
      expect(existsSync(join(WORK, 'cli-c', 'run', 'S1.sock'))).toBe(false);

      const s = await pvisorOnce(host('cli-b'), ['stop', 'S1']);
      expect(s.status).toBe(0);
    } finally {
      if (run.child.exitCode === null && run.child.signalCode === null) run.child.kill('SIGKILL');
      if (pid !== undefined) for (let i = 0; i < 100 && !gone(pid); i++) await new Promise((res) => setTimeout(res, 100));
      if (pid !== undefined && !gone(pid)) process.kill(pid, 'SIGKILL');
    }
  }, 600_000);
  it('jailed: pvisor suspend ID --hibernate --store sends what the launcher takes out of the jail (a used prefix refused first, the VM going on); pvisor resume ID --store on host B continues it in a new jail: digest equal; a resume on host C is refused', async () => {
    const url = `s3://pvisor/kvm-test-${randomBytes(4).toString('hex')}/jailed`;
    const host = (name: string): NodeJS.ProcessEnv => ({ ...process.env, PVISOR_RUNTIME_DIR: join(WORK, name, 'run'), PVISOR_CHUNK_CACHE: join(WORK, name, 'cache') });
    const hostA = host('jail-a');
    const start = (name: string) => startPvisor(hostA, ['run', '--isolation', 'process', '--vm-backing-dir', WORK, '--guest', 'probe', '--name', name, '--memory', '64MiB', '--vcpus', '1', '--', 'fill 16MiB random 31, digest, wait']);
    const run = start('J1');
    const other = start('J2');
    let pid: number | undefined;
    try {
      await Promise.all([run.waitFor(/^digest: /m), other.waitFor(/^digest: /m)]);
      expect(run.err()).toMatch(/^pvisor: J1 jailed /m);
      const h = await pvisorOnce(hostA, ['suspend', 'J1', '--vm-offload', '--hibernate', '--store', url]);
      expect(h.stderr).toBe('');
      expect(h.status).toBe(0);
      expect(h.stdout).toMatch(new RegExp(`^J1 hibernated to ${url.replace(/[/.]/g, '\\$&')} in [\\d.]+ ms: .*; [\\d.]+ [KM]iB sent in \\d+ objects .*pvisor resume J1 --store .* continues it, on this host or another$`, 'm'));
      expect((await run.exited).code).toBe(148);
      expect(run.err()).toMatch(new RegExp(`^pvisor: J1 hibernated to ${url.replace(/[/.]/g, '\\$&')} \\([\\d.]+ [KM]iB sent\\), out of its jail`, 'm'));
      // Nothing of it stays on host A: no record, no hibernation, no work files.
      expect(readdirSync(join(WORK, 'jail-a', 'run')).filter((f) => f.startsWith('J1'))).toEqual([]);
      expect(readdirSync(WORK).filter((f) => f.startsWith('pvisor-hibernated-J1'))).toEqual([]);
      expect(readdirSync(join(WORK, 'jail-a', 'cache', 'work'))).toEqual([]);
      // The same prefix again is refused before the VM is paused: J2 runs on.
      const again = await pvisorOnce(hostA, ['suspend', 'J2', '--vm-offload', '--hibernate', '--store', url]);
      expect(again.status).not.toBe(0);
      expect(again.stderr).toMatch(/a snapshot or hibernated VM is there already/);
      const d2 = await controlRequest(join(WORK, 'jail-a', 'run', 'J2.sock'), 'J2', { op: 'exec', command: 'digest' }, 120_000);
      expect(d2.ok && d2.vm.state).toBe('running');

      const r = await pvisorOnce(host('jail-b'), ['resume', 'J1', '--store', url, '--json']);
      expect(r.stderr).toBe('');
      expect(r.status).toBe(0);
      const report = JSON.parse(r.stdout) as { id: string; pid: number; store: string; log: string };
      pid = report.pid;
      expect(report).toMatchObject({ id: 'J1', store: url });
      const socket = join(WORK, 'jail-b', 'run', 'J1.sock');
      const d = await controlRequest(socket, 'J1', { op: 'exec', command: 'digest' }, 120_000);
      if (!d.ok) throw new Error(d.error.message);
      expect(/^digest: ([0-9a-f]{16})/m.exec(d.exec!.stdout)?.[1]).toBe(ws);
      // In a new jail, its launcher the process that resumed it; the fetched copy consumed.
      expect(d.vm.pid).toBe(pid);
      expect(readFileSync(join(WORK, 'jail-b', 'run', 'J1.log'), 'utf8')).toMatch(/^pvisor: J1 jailed /m);
      expect(readdirSync(WORK).filter((f) => f.startsWith('pvisor-hibernated-J1'))).toEqual([]);
      expect(readdirSync(join(WORK, 'jail-b', 'cache', 'work'))).toEqual([]);

      const c = await pvisorOnce(host('jail-c'), ['resume', 'J1', '--store', url]);
      expect(c.status).toBe(1);
      expect(c.stderr).toMatch(/^pvisor: resume J1 refused: .*the hibernated VM was (resumed|claimed) by .* pid \d+ at /m);

      expect((await pvisorOnce(host('jail-b'), ['stop', 'J1'])).status).toBe(0);
    } finally {
      await pvisorOnce(hostA, ['stop', 'J2']);
      // The launcher takes its jail down after the VM has stopped: killed meanwhile, it would leave
      // J2's cgroup and jail directory behind for the next run of that id (jail.test.ts's J2).
      await Promise.race([other.exited, new Promise((res) => setTimeout(res, 10_000))]);
      for (const x of [run, other]) if (x.child.exitCode === null && x.child.signalCode === null) x.child.kill('SIGKILL');
      if (pid !== undefined) for (let i = 0; i < 100 && !gone(pid); i++) await new Promise((res) => setTimeout(res, 100));
      if (pid !== undefined && !gone(pid)) process.kill(pid, 'SIGKILL');
    }
  }, 600_000);
});
