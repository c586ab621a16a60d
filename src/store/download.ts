/**
 * Brings a snapshot from an object store into a local snapshot directory that the local restore
 * (snapshot-dir.ts, Vm.restore) reads: the manifest is fetched, bounded and checked; each chunk it
 * names comes from the host's chunk cache or, when missing, from the store, its SHA-256 checked
 * before it is cached or written anywhere; guest RAM is assembled as a sparse RAM file. A chunk
 * that fails its check, a store that does not answer, or a manifest of the wrong shape fails the
 * whole fetch with a {@link StoreError}, and nothing of the directory is left.
 *
 * The whole snapshot is fetched before the VM runs: the restore takes this path where guest RAM
 * cannot be loaded lazily (see lazy-ram.ts, which fetches each chunk on the guest's first touch).
 */
import { closeSync, ftruncateSync, openSync, rmSync, writeSync } from 'node:fs';
import { join } from 'node:path';
import { StoreError } from '../errors';
import { RAM_CHUNK_BYTES } from '../snapshot/ram-file';
import type { ChunkCache } from './chunk-cache';
import { fetchCheckedChunk, fetchManifestBody } from './chunk-fetch';
import { eachBounded, type ObjectStore } from './object-io';
import type { ResolvedStoreOptions, StoreTransfer } from './store-options';
import { basesOf, chunkSizeBytes, parseStoreManifest, ramChunkRef, type ChunkBases, type ChunkRef, type StoreManifest } from './store-manifest';
import type { StoreUrl } from './store-url';

/** A snapshot fetched into a local directory: {@link fetchSnapshot}. */
export interface FetchedSnapshot {
  /** The local snapshot directory, for {@link Vm.restore}. */
  dir: string;
  transfer: StoreTransfer;
  /** What each RAM chunk was restored from, for the page deltas of this VM's next upload (upload.ts). */
  bases: ChunkBases;
  /**
   * Lets go of {@link dir}: removes it, or, for a snapshot shared in the chunk cache
   * (shared-ram.ts), releases this restore's hold on it. A restore that is done with its files
   * may call it (a lazy load reads through a descriptor of its own; a mapping holds its own lock).
   */
  remove(): void;
}

/**
 * Fetches the snapshot at `url` into a new directory of `cache`. A hibernated VM's snapshot is
 * refused unless `onHibernated` claims it (./hibernate-store.ts). `fetchedManifest`: the
 * manifest's bytes if the caller has fetched them already (shared-ram.ts keys by them).
 */
export async function fetchSnapshot(
  url: StoreUrl,
  store: ObjectStore,
  cache: ChunkCache,
  options: Pick<ResolvedStoreOptions, 'concurrency' | 'onProgress'> & {
    /** A hibernated VM's state was read: resolves once it is claimed (./claim.ts), before any RAM is fetched. Without it, such a VM is refused. */
    onHibernated?: () => Promise<void>;
  },
  fetchedManifest?: Buffer,
): Promise<FetchedSnapshot> {
  const t0 = performance.now();
  const manifestBody = fetchedManifest ?? (await fetchManifestBody(url, store));
  const manifest = parseStoreManifest(manifestBody, `${url.url}/snapshot.json`);
  const out: StoreTransfer = { url: url.url, chunksTotal: manifest.ramChunks.length, zeroChunks: 0, chunksTransferred: 0, chunksPresent: 0, bytesTransferred: manifestBody.length, ms: 0 };
  let chunksDone = 0;
  const progress = (): void => options.onProgress?.({ direction: 'download', url: url.url, chunksDone, chunksTotal: out.chunksTotal, bytesTransferred: out.bytesTransferred });

  const places = chunkPlaces(manifest, url);
  out.zeroChunks = manifest.ramChunks.filter((sha) => sha === null).length;
  chunksDone = out.zeroChunks;

  /** The chunk `ref`, from the cache or the store, checked. */
  const chunk = (ref: ChunkRef): Promise<Buffer> => fetchCheckedChunk(ref, url, store, cache, out);

  const dir = cache.newWorkDir();
  const pinned = [...places.keys(), manifest.files.manifest.sha256, manifest.files.state.sha256];
  for (const sha of pinned) cache.pin(sha);
  let ramFd: number | undefined;
  try {
    const stateBytes = await chunk(manifest.files.state);
    if (isHibernatedState(stateBytes)) {
      if (!options.onHibernated) throw new StoreError('malformed', `${url.url}: holds a hibernated VM, which this fetch does not continue (Vm.restore does, claiming it first so that it resumes at most once)`);
      await options.onHibernated();
    }
    writeNew(join(dir, 'state.json'), stateBytes);
    writeNew(join(dir, 'manifest.json'), await chunk(manifest.files.manifest));
    ramFd = openSync(join(dir, 'ram'), 'wx', 0o600);
    ftruncateSync(ramFd, manifest.ramBytes);
    const fd = ramFd;
    await eachBounded([...places.entries()], options.concurrency, async ([sha, at]) => {
      const bytes = await chunk(ramChunkRef(manifest, at[0]));
      for (const i of at) writeDataPages(fd, bytes, i * RAM_CHUNK_BYTES);
      chunksDone += at.length;
      progress();
    });
    closeSync(ramFd);
    ramFd = undefined;
  } catch (e) {
    if (ramFd !== undefined) closeSync(ramFd);
    rmSync(dir, { recursive: true, force: true });
    throw e;
  } finally {
    for (const sha of pinned) cache.unpin(sha);
  }
  cache.evict();
  out.ms = performance.now() - t0;
  progress();
  return { dir, transfer: out, bases: basesOf(manifest), remove: () => rmSync(dir, { recursive: true, force: true }) };
}

/** The bytes of the manifest at `url`, bounded (not parsed yet); a missing one is a {@link StoreError} `not-found`. */
const PAGE_BYTES = 4096;
const ZERO_PAGE = Buffer.alloc(PAGE_BYTES);

/** Writes `chunk` at `offset`, skipping all-zero pages: they stay holes, as the local format keeps them. */
function writeDataPages(fd: number, chunk: Buffer, offset: number): void {
  let runStart = -1;
  for (let p = 0; p <= chunk.length; p += PAGE_BYTES) {
    const zero = p >= chunk.length || chunk.subarray(p, p + PAGE_BYTES).equals(ZERO_PAGE.subarray(0, Math.min(PAGE_BYTES, chunk.length - p)));
    if (!zero && runStart < 0) runStart = p;
    if (zero && runStart >= 0) {
      const run = chunk.subarray(runStart, Math.min(p, chunk.length));
      for (let done = 0; done < run.length;) done += writeSync(fd, run, done, run.length - done, offset + runStart + done);
      runStart = -1;
    }
  }
}

/**
 * Where each distinct non-zero chunk of `manifest` goes (RAM chunk indices). Every chunk's size
 * follows from its place, so a hash named at places of different sizes is a {@link StoreError}
 * `malformed`.
 */
export function chunkPlaces(manifest: StoreManifest, url: StoreUrl): Map<string, number[]> {
  const places = new Map<string, number[]>();
  manifest.ramChunks.forEach((sha, i) => {
    if (sha === null) return;
    const at = places.get(sha);
    if (at) at.push(i);
    else places.set(sha, [i]);
  });
  for (const [sha, at] of places) {
    const sizes = new Set(at.map((i) => chunkSizeBytes(manifest.ramBytes, i)));
    if (sizes.size > 1) throw new StoreError('malformed', `${url.url}/snapshot.json: chunk ${sha} is named at places of different sizes (${[...sizes].join(', ')} bytes)`);
  }
  return places;
}

/** Writes `bytes` to the new file `path` (0600). */
export function writeNew(path: string, bytes: Buffer): void {
  const fd = openSync(path, 'wx', 0o600);
  try {
    for (let done = 0; done < bytes.length;) done += writeSync(fd, bytes, done);
  } finally {
    closeSync(fd);
  }
}

/** Whether a snapshot's state is a hibernated VM's (Vm.hibernate). */
export function isHibernatedState(stateBytes: Buffer): boolean {
  let state: unknown;
  try {
    state = JSON.parse(stateBytes.toString('utf8'));
  } catch {
    // Not JSON: the local restore says so, with its own words.
    return false;
  }
  return typeof state === 'object' && state !== null && 'hibernated' in state;
}
