// The claim that makes a hibernated VM in an object store resume at most once (src/store/claim.ts),
// against a real radosgw (scripts/object-store.sh; never a fake S3 server): restores racing on
// one VM, each with a client of its own as another host would have, and exactly one wins; a
// resumed claim refuses the next; a released one is taken again; a take-over of a dead claimant's
// claim is won by one of several racing takers; a withdrawn hibernation is refused; a claim
// object that is not one is a typed error. No KVM: claims are all store.
import { randomBytes } from 'node:crypto';
import { join } from 'node:path';
import { PutObjectCommand } from '@aws-sdk/client-s3';
import { StoreClaimedError, StoreError } from '../../src';
import { claimKey, readClaim, takeClaim, withdrawHibernation, type HeldClaim } from '../../src/store/claim';
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
});
