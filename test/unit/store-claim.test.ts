// The claim that makes a hibernated VM in an object store resume at most once (src/store/claim.ts),
// against a real radosgw (scripts/object-store.sh; never a fake S3 server): restores racing on
// one VM, each with a client of its own as another host would have, and exactly one wins; a
// resumed claim refuses the next; a released one is taken again; a take-over of a dead claimant's
// claim is won by one of several racing takers; a withdrawn hibernation is refused; a claim
// object that is not one is a typed error. Then hibernations through the store around a
// snapshot directory written over real guest memory (no KVM: the VM's part is Vm.hibernate's and
// Vm.restore's, tested in test/kvm/store-hibernate.test.ts): uploaded before the VM would end,
// restored once; a restore that fails gives the claim back; a hibernation that fails after its
// upload is withdrawn and never restored.
import { randomBytes } from 'node:crypto';
import { mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { PutObjectCommand } from '@aws-sdk/client-s3';
import { StoreClaimedError, StoreError } from '../../src';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { SnapshotReader, writeSnapshot, type SnapshotState } from '../../src/snapshot/snapshot-dir';
import { claimKey, readClaim, takeClaim, withdrawHibernation, type HeldClaim } from '../../src/store/claim';
import { hibernateToStore, restoreFromStore, sendHibernation } from '../../src/store/hibernate-store';
import type { HibernateInfo } from '../../src/vm-types';
import { ObjectStore } from '../../src/store/object-io';
import { parseStoreUrl } from '../../src/store/store-url';
import { objectStoreScript, objectStoreSkipReason, startObjectStore } from '../object-store-env';

const ROOT = join(__dirname, '..', '..', '..');
const STATE_DIR = join(ROOT, '.cache', `object-store-claim-test-${process.pid}`);
const script = objectStoreScript(STATE_DIR, { env: { OBJECT_STORE_BACKEND: 'memstore' } });
const why = objectStoreSkipReason('hibernated VM claims');
const RACERS = 12;

(why ? describe.skip : describe)(`claims of hibernated VMs in the object store (radosgw)${why ? ` (skipped: ${why})` : ''}`, () => {
  let restoreEnv = () => {};
  const run = randomBytes(4).toString('hex');
  const stores: ObjectStore[] = [];
  let n = 0;
  /** A location of its own per test. */
  const location = () => parseStoreUrl(`s3://pvisor/claim-${run}/vm-${++n}`);
  /** A store with a client of its own: another "host". */
  const host = (url = location()): ObjectStore => {
    const s = ObjectStore.open(url, { requestTimeoutMs: 20_000 });
    stores.push(s);
    return s;
  };
  /** Races `count` claims of `url`, each from its own client; the settled outcomes. */
  const race = (url: ReturnType<typeof parseStoreUrl>, count: number, takeOver?: string) =>
    Promise.allSettled(Array.from({ length: count }, () => takeClaim(host(url), url, { takeOver })));
  const winners = (r: PromiseSettledResult<HeldClaim>[]) => r.filter((x): x is PromiseFulfilledResult<HeldClaim> => x.status === 'fulfilled').map((x) => x.value);
  const losers = (r: PromiseSettledResult<HeldClaim>[]) => r.filter((x): x is PromiseRejectedResult => x.status === 'rejected').map((x) => x.reason as unknown);

  beforeAll(() => {
    ({ restoreEnv } = startObjectStore(script));
  }, 320_000);

  afterAll(() => {
    for (const s of stores) s.close();
    restoreEnv();
    const r = script('stop');
    expect(r.status).toBe(0);
  }, 60_000);

  it(`of ${RACERS} restores racing on one VM exactly one claims it; the others are refused naming the winner`, async () => {
    const url = location();
    const results = await race(url, RACERS);
    const won = winners(results);
    expect(won).toHaveLength(1);
    const lost = losers(results);
    expect(lost).toHaveLength(RACERS - 1);
    for (const e of lost) {
      expect(e).toBeInstanceOf(StoreClaimedError);
      const c = e as StoreClaimedError;
      expect(c.reason).toBe('claimed');
      expect(c.claim).toMatchObject({ claimId: won[0].claimId, state: 'claimed', pid: process.pid });
      expect(Date.parse(c.claim.claimedAt)).toBeLessThanOrEqual(Date.now());
      expect(c.message).toContain(won[0].claimId);
      expect(c.message).toContain('takeOverClaim');
    }
    const stored = await readClaim(host(url), url);
    expect(stored?.body).toMatchObject({ claimId: won[0].claimId, state: 'claimed' });
  }, 60_000);

  it('a resumed claim refuses every later restore; a released one is claimed again', async () => {
    const url = location();
    const first = await takeClaim(host(url), url);
    expect(await first.markResumed()).toBe(true);
    const e = await takeClaim(host(url), url).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(StoreClaimedError);
    expect((e as StoreClaimedError).claim).toMatchObject({ claimId: first.claimId, state: 'resumed' });
    expect((e as StoreClaimedError).claim.resumedAt).toBeDefined();
    expect((e as Error).message).not.toContain('takeOverClaim');

    const url2 = location();
    const failed = await takeClaim(host(url2), url2);
    expect(await failed.release()).toBe(true);
    // Given back: of several racing for it again, one wins, by compare-and-swap.
    const again = await race(url2, 6);
    expect(winners(again)).toHaveLength(1);
    expect(losers(again).every((x) => x instanceof StoreClaimedError)).toBe(true);
    expect((await readClaim(host(url2), url2))?.body).toMatchObject({ claimId: winners(again)[0].claimId, state: 'claimed' });
  }, 60_000);

  it("a take-over of a dead claimant's claim is won by exactly one of several racing takers; the old claimant then cannot mark it resumed", async () => {
    const url = location();
    const dead = await takeClaim(host(url), url);
    const results = await race(url, 8, dead.claimId);
    const won = winners(results);
    expect(won).toHaveLength(1);
    expect(won[0].claimId).not.toBe(dead.claimId);
    for (const e of losers(results)) expect((e as StoreClaimedError).claim?.claimId).toBe(won[0].claimId);
    expect(await dead.markResumed()).toBe(false);
    expect(await won[0].markResumed()).toBe(true);
    // A take-over naming a claim that is not the current one is refused.
    const stale = await takeClaim(host(url), url, { takeOver: dead.claimId }).catch((x: unknown) => x);
    expect(stale).toBeInstanceOf(StoreClaimedError);
    expect((stale as Error).message).toContain('names another claim');
  }, 60_000);

  it('a withdrawn hibernation is never claimed; withdrawing one already claimed says it was taken', async () => {
    const url = location();
    expect(await withdrawHibernation(host(url), url)).toBe('withdrawn');
    const e = await takeClaim(host(url), url).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(StoreClaimedError);
    expect((e as StoreClaimedError).claim.state).toBe('withdrawn');

    const url2 = location();
    await takeClaim(host(url2), url2);
    expect(await withdrawHibernation(host(url2), url2)).toBe('taken');
  }, 60_000);

  it('a claim object that is not a claim is a typed error, and a bad take-over id is refused before any call', async () => {
    const url = location();
    const s = host(url);
    await s.client.send(new PutObjectCommand({ Bucket: 'pvisor', Key: claimKey(url), Body: '{"format":"pvisor-store-claim","version":1,"claimId":"zz"}' }));
    const e = await takeClaim(s, url).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(StoreError);
    expect((e as StoreError).reason).toBe('malformed');
    const big = location();
    await s.client.send(new PutObjectCommand({ Bucket: 'pvisor', Key: claimKey(big), Body: Buffer.alloc(8192, 0x20) }));
    expect(((await takeClaim(host(big), big).catch((x: unknown) => x)) as StoreError).reason).toBe('malformed');
    expect(((await takeClaim(s, location(), { takeOver: '../x' }).catch((x: unknown) => x)) as StoreError).reason).toBe('malformed');
  }, 60_000);

  describe('hibernations through the store', () => {
    const RAM_BYTES = 8 * 1024 * 1024;
    const state: SnapshotState = { version: 1, guest: 'probe', memoryBytes: RAM_BYTES, vcpus: 1, machine: { m: 1 }, devices: {}, agent: {}, guestClient: null, hibernated: { name: 'h1', labels: { team: 'blue' } } };
    let base: string;
    let mem: GuestMemory;
    const cache = () => mkdtempSync(join(base, 'cache-'));
    /** What Vm.hibernate does locally, over real guest memory: the snapshot, then beforeStop. */
    const hibernateLocal = async (dir: string, beforeStop: (info: HibernateInfo) => Promise<void>): Promise<HibernateInfo> => {
      const w = writeSnapshot(dir, mem, state, { fileMode: 0o400 });
      const info = { dir, ramDataPageCount: w.ramDataPageCount, bytesOnDisk: 0, ms: 0 };
      await beforeStop(info);
      return info;
    };
    /** What Vm.restore does locally: the directory's RAM, read and checked. */
    const readRam = async (dir: string): Promise<Buffer> => {
      const r = SnapshotReader.open(dir);
      try {
        expect(r.state.hibernated).toEqual({ name: 'h1', labels: { team: 'blue' } });
        const into = GuestMemory.map(RAM_BYTES);
        try {
          r.readRam(into);
          return Buffer.from(into.hostView(0, RAM_BYTES));
        } finally {
          into.unmap();
        }
      } finally {
        r.close();
      }
    };

    beforeAll(() => {
      base = mkdtempSync(join(tmpdir(), 'pvisor-claim-test-'));
      mem = GuestMemory.map(RAM_BYTES);
      randomBytes(3 * 1024 * 1024).copy(mem.hostView(0, RAM_BYTES), 0);
    });
    afterAll(() => {
      mem?.unmap();
      if (base) rmSync(base, { recursive: true, force: true });
    });

    it('is sent before the VM would end, restored once on another host, refused the second time, and a failed restore gives it back', async () => {
      const url = location();
      const hostA = cache();
      let sentBeforeStop = false;
      const info = await hibernateToStore(url.url, { cacheDir: hostA }, (i) => void (sentBeforeStop = i.store !== undefined && i.dir === url.url), hibernateLocal);
      expect(sentBeforeStop).toBe(true);
      expect(info.store).toMatchObject({ chunksTotal: 4, zeroChunks: 2 });
      expect(readdirSync(join(hostA, 'work'))).toEqual([]);
      // The same prefix again is refused before anything is written.
      let wrote = false;
      await expect(hibernateToStore(url.url, { cacheDir: hostA }, undefined, async (d, b) => ((wrote = true), hibernateLocal(d, b)))).rejects.toMatchObject({ reason: 'exists' });
      expect(wrote).toBe(false);

      // A restore that fails before the VM runs: the claim is given back.
      await expect(restoreFromStore(url.url, { cacheDir: cache() }, async () => {
        throw new Error('the VM did not start');
      })).rejects.toThrow('the VM did not start');
      expect((await readClaim(host(url), url))?.body.state).toBe('released');

      const hostB = cache();
      const r = await restoreFromStore(url.url, { cacheDir: hostB }, readRam);
      expect(r.hibernated).toBe(true);
      expect(r.claimWarning).toBeUndefined();
      expect(r.restored.equals(mem.hostView(0, RAM_BYTES))).toBe(true);
      expect(readdirSync(join(hostB, 'work'))).toEqual([]);
      expect((await readClaim(host(url), url))?.body).toMatchObject({ state: 'resumed', pid: process.pid });

      let ran = false;
      const e = await restoreFromStore(url.url, { cacheDir: cache() }, async () => (ran = true)).catch((x: unknown) => x);
      expect(e).toBeInstanceOf(StoreClaimedError);
      expect((e as StoreClaimedError).claim.state).toBe('resumed');
      expect(ran).toBe(false);
    }, 60_000);

    it('a hibernation whose beforeStop fails after the upload is withdrawn: the VM goes on where it was, and no restore continues it', async () => {
      const url = location();
      await expect(hibernateToStore(url.url, { cacheDir: cache() }, () => {
        throw new Error('the record could not be written');
      }, hibernateLocal)).rejects.toThrow('the record could not be written');
      expect((await readClaim(host(url), url))?.body.state).toBe('withdrawn');
      const e = await restoreFromStore(url.url, { cacheDir: cache() }, readRam).catch((x: unknown) => x);
      expect(e).toBeInstanceOf(StoreClaimedError);
      expect((e as Error).message).toMatch(/was withdrawn by .*: its hibernation failed after the upload and the VM went on there/);
    }, 60_000);

    it("a jailed VM's hibernation, sent from its launcher's copy: restored once; a failed record withdraws it and leaves the copy; a used prefix is refused untouched", async () => {
      const written = (): string => {
        const dir = join(mkdtempSync(join(base, 'jailed-')), 'h');
        writeSnapshot(dir, mem, state, { fileMode: 0o400 });
        return dir;
      };
      const url = location();
      const dir = written();
      let recordFor: number | undefined;
      const { transfer } = await sendHibernation(dir, url.url, { cacheDir: cache() }, async (t) => void (recordFor = t.chunksTotal));
      expect(transfer).toMatchObject({ url: url.url, chunksTotal: 4, zeroChunks: 2 });
      expect(recordFor).toBe(4);
      const r = await restoreFromStore(url.url, { cacheDir: cache() }, readRam);
      expect(r.hibernated).toBe(true);
      expect(r.restored.equals(mem.hostView(0, RAM_BYTES))).toBe(true);
      // The prefix is used: refused before anything is sent, its claim left as it was.
      const again = written();
      await expect(sendHibernation(again, url.url, { cacheDir: cache() }, async () => {})).rejects.toMatchObject({ reason: 'exists' });
      expect((await readClaim(host(url), url))?.body.state).toBe('resumed');

      const failed = location();
      await expect(sendHibernation(again, failed.url, { cacheDir: cache() }, async () => {
        throw new Error('the run record could not be written');
      })).rejects.toThrow('the run record could not be written');
      expect((await readClaim(host(failed), failed))?.body.state).toBe('withdrawn');
      // The launcher's copy stays the VM's one copy, whole.
      expect((await readRam(again)).equals(mem.hostView(0, RAM_BYTES))).toBe(true);
      await expect(restoreFromStore(failed.url, { cacheDir: cache() }, readRam)).rejects.toBeInstanceOf(StoreClaimedError);
    }, 60_000);
  });
});
