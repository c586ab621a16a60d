/**
 * A restore from an object store with {@link SharedSnapshot}: the snapshot is assembled once per
 * host into a shared entry of the chunk cache (shared-entry.ts), keyed by its manifest's SHA-256,
 * and every later clone of it, in any process that uses the same cache, restores from that same
 * entry and maps that same RAM file: the clones share its page cache, as clones of a local
 * snapshot do, and no chunk is fetched again.
 */
import { sha256Hex, type ChunkCache } from './chunk-cache';
import { fetchManifestBody } from './chunk-fetch';
import { fetchSnapshot, type FetchedSnapshot } from './download';
import type { ObjectStore } from './object-io';
import { checkSharedDirs, holdSharedEntry, publishSharedEntry } from './shared-entry';
import type { ResolvedStoreOptions, StoreTransfer } from './store-options';
import { basesOf, parseStoreManifest } from './store-manifest';
import type { StoreUrl } from './store-url';

/**
 * The snapshot at `url` as a shared entry of `cache`, held until `remove` (which releases it and
 * leaves it in the cache): found there, or fetched (each chunk from the cache or the store) and
 * published. A hostile cache directory or entry is a {@link SnapshotError}.
 */
export async function fetchSharedSnapshot(url: StoreUrl, store: ObjectStore, cache: ChunkCache, options: Pick<ResolvedStoreOptions, 'concurrency' | 'onProgress'>): Promise<FetchedSnapshot> {
  const t0 = performance.now();
  checkSharedDirs(cache.dir);
  const body = await fetchManifestBody(url, store);
  const manifest = parseStoreManifest(body, `${url.url}/snapshot.json`);
  const key = sha256Hex(body);
  const found = holdSharedEntry(cache.dir, key, manifest.ramBytes);
  if (found) {
    const zeroChunks = manifest.ramChunks.filter((c) => c === null).length;
    const distinct = new Set(manifest.ramChunks.filter((c) => c !== null)).size;
    const transfer: StoreTransfer = {
      url: url.url,
      chunksTotal: manifest.ramChunks.length,
      zeroChunks,
      chunksTransferred: 0,
      // The RAM chunks and the two small files: the entry holds them all.
      chunksPresent: distinct + 2,
      bytesTransferred: body.length,
      ms: performance.now() - t0,
      sharedEntry: 'reused',
    };
    options.onProgress?.({ direction: 'download', url: url.url, chunksDone: transfer.chunksTotal, chunksTotal: transfer.chunksTotal, bytesTransferred: body.length });
    return { dir: found.dir, transfer, bases: basesOf(manifest), remove: found.release };
  }
  const fetched = await fetchSnapshot(url, store, cache, options, body);
  let held;
  try {
    held = publishSharedEntry(cache.dir, key, fetched.dir, manifest.ramBytes);
  } catch (e) {
    fetched.remove();
    throw e;
  }
  // Published, it counts in the cache's bound from now on.
  cache.evict();
  return { dir: held.dir, transfer: { ...fetched.transfer, ms: performance.now() - t0, sharedEntry: 'assembled' }, bases: fetched.bases, remove: held.release };
}
