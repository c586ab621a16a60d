// A Linux VM snapshotted to a real object store with a file written; two clones restored from the
// store in two other node processes (each with its own runtime directory; one host's chunk cache,
// so the second maps the snapshot the first assembled, with SharedSnapshot) each read the file,
// and write a file of their own that the other does not see. Real KVM that runs guest kernel code
// (the nested harness: scripts/with-kvm.js --linux), real processes, a real store
// (scripts/object-store.sh, radosgw on the L1's loopback). Skipped, saying why, only when this
// machine cannot have the store.
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { Vm } from '../../src';
import { objectStoreScript, objectStoreSkipReason, objectStoreSuite } from '../object-store-env';
import { startCloneProcess, type CloneProcess } from '../store-clone-process';

/** Deadlines stretch under the nested harness, where every exit costs about 15 times more. */
const SLOW = process.env.PVISOR_NESTED === '1' ? 10 : 1;
const READY_TIMEOUT_MS = 60_000 * SLOW;
const ROOT = join(__dirname, '..', '..', '..');
const STATE_DIR = join(ROOT, '.cache', `linux-store-clones-test-${process.pid}`);
let WORK: string;
const TEXT = 'written before the snapshot\n';

const script = objectStoreScript(STATE_DIR, { timeoutMs: 600_000, env: { OBJECT_STORE_BACKEND: 'memstore', OBJECT_STORE_SIZE_MIB: '1024', OBJECT_STORE_TIMEOUT_S: '400' } });
const why = objectStoreSkipReason('Linux clones through the object store');

(why ? describe.skip : describe)(`Linux clones of a store snapshot in other processes${why ? ` (skipped: ${why})` : ''}`, () => {
  const clones: CloneProcess[] = [];
  objectStoreSuite(script, 'pvisor-linux-store-clones-', {
    onWork: (dir) => (WORK = dir),
    beforeStop: async () => {
      for (const c of clones) await c.end();
    },
    stopTimeoutMs: 300_000,
  });

  it('each clone reads the file written before the snapshot, and writes its own, unseen by the other', async () => {
    const url = `s3://pvisor/kvm-test-${randomBytes(4).toString('hex')}/linux`;
    const vm = await Vm.start({ memory: '256MiB', vcpus: 1, name: 'lstore-template', bootTimeoutMs: 180_000 });
    let written;
    try {
      await vm.files.write('/root/template.txt', TEXT);
      written = await vm.snapshot(url, { store: { cacheDir: join(WORK, 'host-a', 'cache') } });
    } finally {
      await vm.stop();
    }
    expect(written.store!.chunksTransferred).toBeGreaterThan(2);

    const cacheDir = join(WORK, 'host-b', 'cache');
    const start = async (n: number) => {
      const c = await startCloneProcess(url, { runDir: join(WORK, 'host-b', `run-${n}`), cacheDir, readyTimeoutMs: READY_TIMEOUT_MS });
      clones.push(c);
      return c;
    };
    const one = await start(1);
    const two = await start(2);
    expect(one.ready.restoreInfo.ramLoad).toBe('mapped');
    expect(one.ready.restoreInfo.store.sharedEntry).toBe('assembled');
    expect(two.ready.restoreInfo.store).toMatchObject({ sharedEntry: 'reused', chunksTransferred: 0 });

    for (const c of [one, two]) expect(await c.ask({ op: 'exec', argv: ['cat', '/root/template.txt'] })).toEqual({ stdout: TEXT, exitCode: 0 });
    await one.ask({ op: 'write', path: '/root/clone-1.txt', text: 'one\n' });
    await two.ask({ op: 'write', path: '/root/clone-2.txt', text: 'two\n' });
    const ls = async (c: CloneProcess) => String((await c.ask({ op: 'exec', argv: ['ls', '/root'] })).stdout).split(/\s+/).filter(Boolean).sort();
    const [seenByOne, seenByTwo] = [await ls(one), await ls(two)];
    expect(seenByOne).toEqual(expect.arrayContaining(['clone-1.txt', 'template.txt']));
    expect(seenByOne).not.toContain('clone-2.txt');
    expect(seenByTwo).toEqual(expect.arrayContaining(['clone-2.txt', 'template.txt']));
    expect(seenByTwo).not.toContain('clone-1.txt');
    expect(await one.ask({ op: 'exec', argv: ['cat', '/root/clone-1.txt'] })).toEqual({ stdout: 'one\n', exitCode: 0 });
    expect(await two.ask({ op: 'exec', argv: ['cat', '/root/clone-2.txt'] })).toEqual({ stdout: 'two\n', exitCode: 0 });
    for (const c of [one, two]) expect(await c.ask({ op: 'exec', argv: ['cat', '/root/clone-1.txt', '/root/clone-2.txt'] })).toMatchObject({ exitCode: 1 });
  }, 1_200_000);
});
