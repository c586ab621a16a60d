/**
 * Hibernated VMs in an object store ({@link Vm.hibernate} and {@link Vm.restore} of an
 * `s3://bucket/prefix`): the VM is hibernated into a work directory of the chunk cache as a local
 * hibernation is, sent from there as a snapshot is (chunks deduplicated, the manifest last), and
 * only then ended; a restore claims it (./claim.ts) before any of its RAM is fetched, so that it
 * resumes at most once, on whichever host claims it first.
 */
import { rmSync } from 'node:fs';
import { StoreError } from '../errors';
import type { HibernateInfo } from '../vm-types';
import { ChunkCache } from './chunk-cache';
import { markClaimResumed, takeClaim, readClaim, withdrawHibernation, type HeldClaim } from './claim';
import { fetchSnapshot } from './download';
import { fetchSharedSnapshot } from './shared-ram';
import { ObjectStore } from './object-io';
import { resolveStoreOptions, type StoreOptions, type StoreTransfer } from './store-options';
import { parseStoreUrl, type StoreUrl } from './store-url';
import type { ChunkBases } from './store-manifest';
import { uploadSnapshotDir } from './upload';

/** Refuses a prefix that holds a snapshot or held a hibernated VM: a hibernation goes to a new prefix. */
async function refuseUsedPrefix(url: StoreUrl, store: ObjectStore): Promise<void> {
  if ((await store.sizeOf(url.manifestKey)) !== undefined) throw new StoreError('exists', `${url.url}: a snapshot or hibernated VM is there already; a hibernation goes to a new prefix`);
  if ((await readClaim(store, url)) !== undefined) throw new StoreError('exists', `${url.url}: a hibernated VM was there (its claim is); a hibernation goes to a new prefix`);
}

/**
 * Checks `location` before a VM is paused for a hibernation there: a store URL, reachable, and a
 * prefix that never held a snapshot or a hibernated VM.
 */
export async function checkHibernationPrefix(location: string, options: StoreOptions | undefined): Promise<void> {
  const url = parseStoreUrl(location);
  const store = ObjectStore.open(url, resolveStoreOptions(options));
  try {
    await refuseUsedPrefix(url, store);
  } finally {
    store.close();
  }
}

/**
 * Sends a hibernation already written whole in `dir` (a jailed VM's, taken out of its ended jail
 * by its launcher, which has the store's credentials and network) to `location` as
 * {@link hibernateToStore} does, then `afterSent` (the CLI's run record). If either fails, the
 * hibernation is withdrawn from the store (so that nobody resumes it there) and the error thrown:
 * `dir` stays the VM's one copy. Resolves with what was sent; also if a restore elsewhere claimed
 * the VM in the moment of a failure, when it has moved (`transfer` then missing if the upload's
 * own answer was what was lost).
 */
export async function sendHibernation(dir: string, location: string, options: StoreOptions | undefined, afterSent: (transfer: StoreTransfer) => Promise<void>): Promise<{ transfer?: StoreTransfer }> {
  const url = parseStoreUrl(location);
  const o = resolveStoreOptions(options);
  const store = ObjectStore.open(url, o);
  try {
    await refuseUsedPrefix(url, store);
    let transfer: StoreTransfer | undefined;
    try {
      ({ transfer } = await uploadSnapshotDir(dir, url, store, ChunkCache.open(o.cacheDir, o.cacheMaxBytes), o));
      await afterSent(transfer);
      return { transfer };
    } catch (e) {
      // As in hibernateToStore: an answer lost after the store took the manifest would leave the VM in two places.
      // Taken: a restore elsewhere claimed it, so the store's copy is whole and the VM has moved.
      if ((await withdrawHibernation(store, url)) === 'taken') return { transfer };
      throw e;
    }
  } finally {
    store.close();
  }
}

/**
 * Hibernates with `hibernateLocal` into a work directory of the chunk cache and, while the VM is
 * still paused (in its `beforeStop`), sends it to `location`; then the VM ends. The URL and the
 * prefix are checked before `hibernateLocal` runs (before the VM is paused).
 *
 * If the upload fails, or `userBeforeStop` throws, the VM goes on where it was; a hibernation
 * whose manifest may already be in the store is withdrawn first (./claim.ts), so that it is never
 * resumed elsewhere too. If a restore elsewhere claimed it in that moment, the VM has moved: it
 * ends here and the hibernation stands. `bases`: what the VM's RAM was last stored or restored as
 * (upload.ts), for page deltas.
 */
export async function hibernateToStore(
  location: string,
  options: StoreOptions | undefined,
  userBeforeStop: ((info: HibernateInfo) => void | Promise<void>) | undefined,
  hibernateLocal: (dir: string, beforeStop: (info: HibernateInfo) => Promise<void>) => Promise<HibernateInfo>,
  bases?: ChunkBases,
): Promise<HibernateInfo> {
  const url = parseStoreUrl(location);
  const o = resolveStoreOptions(options);
  const store = ObjectStore.open(url, o);
  try {
    await refuseUsedPrefix(url, store);
    const cache = ChunkCache.open(o.cacheDir, o.cacheMaxBytes);
    const dir = cache.newWorkDir();
    let transfer: StoreTransfer | undefined;
    let info: HibernateInfo | undefined;
    try {
      await hibernateLocal(dir, async (local) => {
        try {
          ({ transfer } = await uploadSnapshotDir(dir, url, store, cache, o, { bases }));
          info = { ...local, dir: url.url, store: transfer };
          await userBeforeStop?.(info);
        } catch (e) {
          // Nothing was sent of the manifest if the prefix has none, but an answer lost after
          // the store took it would leave a VM both here and there: withdrawn either way.
          if ((await withdrawHibernation(store, url)) === 'taken') return;
          throw e;
        }
      });
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
    return info!;
  } finally {
    store.close();
  }
}

/** What {@link restoreFromStore} restored. */
export interface StoreRestore<T> {
  restored: T;
  transfer: StoreTransfer;
  /** What each RAM chunk was restored from, for the page deltas of the VM's next upload (upload.ts). */
  bases: ChunkBases;
  /** The snapshot was a hibernated VM, claimed by this restore. */
  hibernated: boolean;
  /** Said when the VM runs but its claim could not be marked resumed (taken over meanwhile, or the store failed). */
  claimWarning?: string;
}

/**
 * Fetches the snapshot at `location` into the chunk cache (`shared`: the host's one assembled copy
 * that SharedSnapshot clones map) and restores it with `restoreLocal`.
 * A hibernated VM is claimed first (a {@link StoreClaimedError} if another restore has it, before
 * any of its RAM is fetched); a restore that fails then gives the claim back (`released`), one
 * that succeeds marks it `resumed`.
 */
export async function restoreFromStore<T>(location: string, options: StoreOptions | undefined, restoreLocal: (dir: string) => Promise<T>, shared = false): Promise<StoreRestore<T>> {
  const url = parseStoreUrl(location);
  const o = resolveStoreOptions(options);
  const cache = ChunkCache.open(o.cacheDir, o.cacheMaxBytes);
  const store = ObjectStore.open(url, o);
  let claim: HeldClaim | undefined;
  try {
    let restored: T;
    // A SharedSnapshot clone maps the host's one assembled copy (./shared-ram.ts); a hibernated
    // VM is never one (its fetch refuses it: nothing claims it there).
    const fetching = shared
      ? fetchSharedSnapshot(url, store, cache, o)
      : fetchSnapshot(url, store, cache, {
          ...o,
          onHibernated: async () => {
            claim = await takeClaim(store, url, { takeOver: o.takeOverClaim });
          },
        });
    const fetched = await fetching.catch(async (e: unknown) => {
      await claim?.release();
      throw e;
    });
    try {
      restored = await restoreLocal(fetched.dir);
    } catch (e) {
      await claim?.release();
      throw e;
    } finally {
      // Read, loaded from a descriptor of its own, or mapped by now.
      fetched.remove();
    }
    const out: StoreRestore<T> = { restored, transfer: fetched.transfer, bases: fetched.bases, hibernated: claim !== undefined };
    if (claim) out.claimWarning = await markClaimResumed(claim, url);
    return out;
  } finally {
    store.close();
  }
}
