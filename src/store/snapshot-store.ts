/**
 * Snapshots in an object store, as {@link Vm.snapshot} and {@link Vm.restore} use them: a snapshot
 * is written locally as ever (the VM is paused only for that), then sent from its files while the
 * VM runs on; a restore fetches into a local directory and restores from it.
 */
import { rmSync } from 'node:fs';
import { StoreError } from '../errors';
import { ChunkCache } from './chunk-cache';
import { fetchSnapshot, type FetchedSnapshot } from './download';
import { ObjectStore } from './object-io';
import { fetchSharedSnapshot } from './shared-ram';
import { resolveStoreOptions, type StoreOptions, type StoreTransfer } from './store-options';
import { parseStoreUrl } from './store-url';
import type { ChunkBases } from './store-manifest';
import { uploadSnapshotDir } from './upload';

/**
 * Writes a snapshot with `writeLocal` into a work directory of the chunk cache, sends it to
 * `location`, and removes the work directory. The URL and options are checked, and the location
 * is checked to hold no snapshot yet, before `writeLocal` runs (before the VM is paused).
 * `touchedOffsets`: the guest RAM offsets the VM's faults loaded, in order (a lazily restored
 * VM), recorded in the manifest as the order a restore prefetches in. `bases`: what the VM's RAM
 * was last stored or restored as, for page deltas (upload.ts); resolves with the new ones.
 */
export async function snapshotToStore<T>(
  location: string,
  options: StoreOptions | undefined,
  writeLocal: (dir: string) => Promise<T>,
  touchedOffsets?: () => readonly number[] | undefined,
  bases?: ChunkBases,
): Promise<{ written: T; transfer: StoreTransfer; bases: ChunkBases }> {
  const url = parseStoreUrl(location);
  const o = resolveStoreOptions(options);
  const store = ObjectStore.open(url, o);
  try {
    if ((await store.sizeOf(url.manifestKey)) !== undefined) throw new StoreError('exists', `${url.url}: a snapshot is there already; a snapshot goes to a new prefix`);
    const cache = ChunkCache.open(o.cacheDir, o.cacheMaxBytes);
    const dir = cache.newWorkDir();
    try {
      const written = await writeLocal(dir);
      // Read when the snapshot was taken, not after the upload: the VM runs on meanwhile.
      const touched = touchedOffsets?.();
      const sent = await uploadSnapshotDir(dir, url, store, cache, o, { touchedOffsets: touched, bases });
      return { written, ...sent };
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  } finally {
    store.close();
  }
}

/**
 * Fetches the snapshot at `location` into a new directory of the chunk cache (see
 * {@link StoreOptions.cacheDir}); the caller restores from it and then calls `remove`. `shared`
 * (a restore with SharedSnapshot): into the cache's shared snapshot of it instead, found there if
 * another restore on this host assembled it (shared-ram.ts).
 */
export async function fetchFromStore(location: string, options: StoreOptions | undefined, shared = false): Promise<FetchedSnapshot> {
  const url = parseStoreUrl(location);
  const o = resolveStoreOptions(options);
  const cache = ChunkCache.open(o.cacheDir, o.cacheMaxBytes);
  const store = ObjectStore.open(url, o);
  try {
    return await (shared ? fetchSharedSnapshot : fetchSnapshot)(url, store, cache, o);
  } finally {
    store.close();
  }
}
