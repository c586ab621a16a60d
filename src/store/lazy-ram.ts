/**
 * A lazy restore from an object store: only the manifest and the two small files (state.json,
 * manifest.json) are fetched before the VM runs; guest RAM comes through the VM's userfaultfd
 * server as the guest touches it. Its ranges (one per non-zero 2 MiB chunk) are a *deferred*
 * source over a scratch file: a fault in a chunk not here yet asks the chunk fetcher, a worker
 * thread (chunk-fetch-worker.ts), which takes it from the host's chunk cache or range-reads it
 * from the store, checks its SHA-256 before it is cached or written, writes it into the scratch
 * file and tells the server, which checks it against the snapshot's CRC32C, maps it and wakes the
 * vCPU; faults elsewhere are served meanwhile. Once the VM is ready the fetcher prefetches the
 * rest, the chunks the guest touched first before the snapshot (its manifest's touch order)
 * first, then address order, a few at once. A chunk that fails its check, or a store that does
 * not answer within the request timeout, ends the VM with a {@link StoreError} (`corrupt`,
 * `timeout`, `unreachable`); the range is never mapped, so the guest never reads a wrong byte.
 *
 * Everything fetched is checked as the fetch-all restore (download.ts) checks it; that path stays
 * for restores that cannot load lazily (see {@link canRestoreLazily}).
 */
import { closeSync, ftruncateSync, openSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { Worker } from 'node:worker_threads';
import type { GuestMemory } from '../backends/kvm/guest-memory';
import { SnapshotError, StoreError, type PvisorError, type StoreErrorReason } from '../errors';
import type { DeferredRamFetcher } from '../memory/composition';
import { FetchFailure } from '../memory/fetch-protocol';
import type { FileRange } from '../memory/uffd-server';
import type { SnapshotRamFile } from '../snapshot/ram-restore';
import { hex32, RAM_CHUNK_BYTES, zeroChunkCrc32c } from '../snapshot/ram-file';
import { readRamChecksums, SnapshotReader, type SnapshotState } from '../snapshot/snapshot-dir';
import { ChunkCache } from './chunk-cache';
import { markClaimResumed, takeClaim } from './claim';
import { fetchCheckedChunk, readStoreManifest, type ChunkCounts } from './chunk-fetch';
import { FetcherCounter, type FetcherChunk, type FetcherCommand, type FetcherData, type FetcherMessage } from './chunk-fetch-worker';
import { chunkPlaces, isHibernatedState, writeNew } from './download';
import { ObjectStore } from './object-io';
import { resolveStoreOptions, type StoreOptions, type StoreTransfer } from './store-options';
import { basesOf, chunkSizeBytes, prefetchOrder, ramChunkRef, type ChunkBases, type StoreManifest } from './store-manifest';
import { parseStoreUrl, type StoreUrl } from './store-url';

/**
 * The process's chunk fetcher threads (chunk-fetch-worker.ts), one per AWS environment, which its
 * S3 clients read: started by the first lazy restore and kept (unreferenced: it does not keep the
 * process alive), so that later restores do not pay for starting a worker. Each restore is a job
 * of it, by id.
 */
class FetcherThread {
  private static readonly byEnv = new Map<string, FetcherThread>();
  private static nextJobId = 1;
  private readonly jobs = new Map<number, { onMessage(m: FetcherMessage): void; onGone(e: Error): void }>();

  private constructor(private readonly worker: Worker, key: string) {
    worker.on('message', (m: FetcherMessage) => this.jobs.get(m.id)?.onMessage(m));
    const gone = (e: Error): void => {
      if (FetcherThread.byEnv.get(key) === this) FetcherThread.byEnv.delete(key);
      const jobs = [...this.jobs.values()];
      this.jobs.clear();
      for (const j of jobs) j.onGone(e);
    };
    worker.on('error', gone);
    worker.on('exit', (code) => gone(new Error(`the chunk fetcher thread exited with code ${code}`)));
    // After the listeners: adding a 'message' listener refs the worker's port again.
    worker.unref();
  }

  /** The thread for the AWS environment as this thread sees it now (a test runner's process.env is not the process's). */
  static forThisEnvironment(): FetcherThread {
    const env = { ...process.env };
    const key = JSON.stringify(Object.keys(env).filter((k) => k.startsWith('AWS_')).sort().map((k) => [k, env[k]]));
    let thread = FetcherThread.byEnv.get(key);
    if (!thread) {
      thread = new FetcherThread(new Worker(join(__dirname, 'chunk-fetch-worker.js'), { env, workerData: { role: 'pvisor-chunk-fetcher' } satisfies FetcherData }), key);
      FetcherThread.byEnv.set(key, thread);
    }
    return thread;
  }

  /** A new job's id; its messages go to `handlers` until {@link forget}. */
  register(handlers: { onMessage(m: FetcherMessage): void; onGone(e: Error): void }): number {
    const id = FetcherThread.nextJobId++;
    this.jobs.set(id, handlers);
    return id;
  }

  forget(id: number): void {
    this.jobs.delete(id);
  }

  post(cmd: FetcherCommand): void {
    this.worker.postMessage(cmd);
  }
}

/**
 * Whether a restore from a store can be lazy: guest RAM loaded through userfaultfd (not `verify`,
 * not a SharedSnapshot clone, a composition that can load lazily), and the client made from the
 * AWS environment (a client given as `store.client` cannot be handed to the fetcher thread).
 */
export function canRestoreLazily(options: { verify: boolean; sharedSnapshot: boolean; compositionLoadsLazily: boolean; store?: StoreOptions }): boolean {
  return !options.verify && !options.sharedSnapshot && options.compositionLoadsLazily && !options.store?.client;
}

/** A snapshot in a store, opened for a lazy restore: {@link LazyStoreSnapshot.open}. */
export class LazyStoreSnapshot {
  private closed = false;
  /** The fetcher has let go of the scratch file (the job stopped, or its thread is gone). */
  private released = false;
  private scratchClosed = false;
  private failure: PvisorError | undefined;
  private readonly counters: BigInt64Array;
  private readonly jobId: number;

  private constructor(
    private readonly url: StoreUrl,
    /** The snapshot's small files and an empty scratch RAM file, checked: what `Vm` restores from. */
    readonly reader: SnapshotReader,
    private readonly thread: FetcherThread,
    options: { requestTimeoutMs: number; cacheDir: string; cacheMaxBytes: number },
    countersBuffer: SharedArrayBuffer,
    private readonly scratchFd: number,
    private readonly ranges: FileRange[],
    chunks: FetcherChunk[],
    order: number[],
    concurrency: number,
    private readonly base: StoreTransfer,
    private readonly t0: number,
    /** What each RAM chunk is restored from, for the page deltas of this VM's next upload (upload.ts). */
    readonly bases: ChunkBases,
    /** A hibernated VM's claim in the store, held by this restore (see {@link open}). */
    readonly claim?: StoreClaim,
  ) {
    this.counters = new BigInt64Array(countersBuffer);
    this.jobId = thread.register({
      onMessage: (m) => {
        if (m.kind === 'error') this.failure ??= this.errorOf(m.reason, m.message);
        else this.release();
      },
      onGone: (e) => {
        this.failure ??= new SnapshotError(`${url.url}: the chunk fetcher failed: ${e.message}`, { cause: e });
        this.release();
      },
    });
    // Opened now, while the VM is built: by the first fault the worker has its S3 client and cache.
    thread.post({ kind: 'open', id: this.jobId, location: url.url, requestTimeoutMs: options.requestTimeoutMs, cacheDir: options.cacheDir, cacheMaxBytes: options.cacheMaxBytes, counters: countersBuffer, scratchFd, chunks, prefetchOrder: order, concurrency } satisfies FetcherCommand);
  }

  /** The fetcher will not write the scratch file again: it closes once this restore is done with it too. */
  private release(): void {
    this.released = true;
    this.thread.forget(this.jobId);
    if (this.closed && !this.scratchClosed) {
      this.scratchClosed = true;
      closeSync(this.scratchFd);
    }
  }

  /**
   * Fetches and checks the manifest at `location` and the two small files it names (from the
   * chunk cache or the store), writes them into a new work directory of the cache beside an
   * empty (sparse) scratch RAM file, and opens it as a snapshot directory; starts the fetcher
   * thread meanwhile. Nothing of guest RAM is fetched yet. Each failure is a {@link StoreError}
   * or {@link SnapshotError}, with nothing left (no directory, no thread). A hibernated VM is
   * `'hibernated'`, nothing fetched but its state, unless `claimHibernated`: then it is claimed
   * (./claim.ts) before any of its RAM is fetched, so that it resumes at most once (another
   * claim is a {@link StoreClaimedError}), and {@link claim} is that claim, which the restore
   * marks resumed once the VM runs, or releases if it fails before.
   */
  static async open(location: string, options: StoreOptions | undefined, { claimHibernated = false } = {}): Promise<LazyStoreSnapshot | 'hibernated'> {
    const t0 = performance.now();
    const url = parseStoreUrl(location);
    const o = resolveStoreOptions(options);
    const cache = ChunkCache.open(o.cacheDir, o.cacheMaxBytes);
    const counters = new SharedArrayBuffer(8 * 4);
    // First: a thread that is new starts (and loads the S3 client) while the small files come.
    const thread = FetcherThread.forThisEnvironment();
    const store = ObjectStore.open(url, o);
    let opened: SmallFiles | undefined;
    // A claim keeps the store open until it is marked resumed or released.
    let claim: StoreClaim | undefined;
    try {
      const counts: ChunkCounts = { chunksTransferred: 0, chunksPresent: 0, bytesTransferred: 0 };
      opened = await openSmallFiles(url, store, cache, counts);
      if (opened.hibernated) {
        if (!claimHibernated) {
          opened.discard();
          return 'hibernated';
        }
        const held = await takeClaim(store, url, { takeOver: o.takeOverClaim });
        claim = {
          claimId: held.claimId,
          markResumed: () => markClaimResumed(held, url).finally(() => store.close()),
          release: () => held.release().finally(() => store.close()),
        };
      }
      const { manifest, reader, scratchFd } = opened;
      const { ramBytes, chunkCrc32c } = readRamChecksums(reader.dir);
      if (ramBytes !== manifest.ramBytes) throw new StoreError('malformed', `${url.url}: its manifest.json says ${ramBytes} bytes of RAM, snapshot.json ${manifest.ramBytes}`);
      const ranges: FileRange[] = [];
      const chunks: FetcherChunk[] = [];
      const rangeOfChunk = new Map<number, number>();
      manifest.ramChunks.forEach((sha, i) => {
        const length = chunkSizeBytes(ramBytes, i);
        const offset = i * RAM_CHUNK_BYTES;
        if (sha === null) {
          // Served as zeros, never fetched: the snapshot's own checksum must say zeros too.
          if (chunkCrc32c[i] !== zeroChunkCrc32c(length)) throw new StoreError('malformed', `${url.url}: RAM chunk ${i} is all zero in snapshot.json, but manifest.json gives it CRC32C ${hex32(chunkCrc32c[i])}`);
          return;
        }
        rangeOfChunk.set(i, ranges.length);
        ranges.push({ offset, length, fileOffset: offset, checksum: chunkCrc32c[i] });
        chunks.push({ ...ramChunkRef(manifest, i), fileOffset: offset });
      });
      const order = prefetchOrder(manifest).map((i) => rangeOfChunk.get(i)!);
      const base: StoreTransfer = { url: url.url, chunksTotal: manifest.ramChunks.length, zeroChunks: manifest.ramChunks.length - ranges.length, chunksTransferred: counts.chunksTransferred, chunksPresent: counts.chunksPresent, bytesTransferred: counts.bytesTransferred, ms: 0 };
      const jobOptions = { requestTimeoutMs: o.requestTimeoutMs, cacheDir: o.cacheDir, cacheMaxBytes: o.cacheMaxBytes };
      return new LazyStoreSnapshot(url, reader, thread, jobOptions, counters, scratchFd, ranges, chunks, order, o.concurrency, base, t0, basesOf(manifest), claim);
    } catch (e) {
      opened?.discard();
      await claim?.release().catch(() => false);
      throw e;
    } finally {
      if (!claim) store.close();
    }
  }

  /** Guest RAM's source for the restore (planSnapshotRam): lazy only, through the fetcher. */
  get ramFile(): SnapshotRamFile<GuestMemory> {
    const notLazy = (): never => {
      throw new SnapshotError(`${this.url.url}: guest RAM of a lazy restore from a store loads through userfaultfd only`);
    };
    const fetcher: DeferredRamFetcher = {
      start: (fetchFd, sourceId) => {
        if (this.closed) return closeSync(fetchFd);
        if (this.released) {
          // The thread is gone: the server finds every chunk absent for good, and the VM ends with the failure.
          closeSync(fetchFd);
          return;
        }
        this.thread.post({ kind: 'attach', id: this.jobId, fetchFd, sourceId } satisfies FetcherCommand);
      },
      close: () => this.close(),
    };
    return {
      ramPath: `${this.url.url} (RAM)`,
      ramFd: this.reader.ramFd,
      readRam: notLazy,
      checkMappedRam: notLazy,
      openRamForLazyLoad: () => ({ fd: this.scratchFd, ranges: this.ranges, deferred: fetcher, failure: (why, offset, code) => this.failureAt(why, offset, code) }),
    };
  }

  /** What was moved so far (the manifest, the small files, and the chunks the fetcher took). */
  transfer(): StoreTransfer {
    const at = (k: number): number => Number(Atomics.load(this.counters, k));
    return {
      ...this.base,
      chunksTransferred: this.base.chunksTransferred + at(FetcherCounter.chunksTransferred),
      chunksPresent: this.base.chunksPresent + at(FetcherCounter.chunksPresent),
      bytesTransferred: this.base.bytesTransferred + at(FetcherCounter.bytesTransferred),
      ms: performance.now() - this.t0,
    };
  }

  /** The VM is ready: fetch the chunks nobody asked for yet, in the prefetch order, in the background. */
  startPrefetch(): void {
    if (!this.closed && !this.released) this.thread.post({ kind: 'prefetch', id: this.jobId } satisfies FetcherCommand);
  }

  /** The restore has its descriptors: closes the reader and removes the work directory (the server and the fetcher hold the scratch file open). */
  removeDir(): void {
    this.reader.close();
    rmSync(this.reader.dir, { recursive: true, force: true });
  }

  /** Stops the fetcher and lets go of the scratch file (the VM ended, or every chunk is loaded). Idempotent. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    this.reader.close();
    // The scratch file is the fetcher's until it says it has stopped (release closes it then).
    if (this.released) this.release();
    else this.thread.post({ kind: 'stop', id: this.jobId } satisfies FetcherCommand);
  }

  /** The error a VM ends with when range `offset` failed: the fetcher's own, else one from the server's reason. */
  private failureAt(why: string, offset: number, code: number): PvisorError {
    if (this.failure) return this.failure;
    const reason = code === FetchFailure.corrupt ? 'corrupt' : code === FetchFailure.timeout ? 'timeout' : code === FetchFailure.unreachable ? 'unreachable' : null;
    const message = `${this.url.url}: the RAM chunk at byte ${offset} cannot be loaded (${why}); the guest never saw it, and the VM ends`;
    return reason ? new StoreError(reason, message) : new SnapshotError(message);
  }

  private errorOf(reason: StoreErrorReason | null, message: string): PvisorError {
    const m = `${message}; the VM ends (the guest never saw the chunk)`;
    return reason ? new StoreError(reason, m) : new SnapshotError(`${this.url.url}: a chunk could not be kept on this host: ${m}`);
  }
}

/** A hibernated VM's claim, held by a lazy restore of it; each call ends the claim's use of the store. */
export interface StoreClaim {
  readonly claimId: string;
  /** Undefined once marked, else the warning to give (./claim.ts, markClaimResumed). */
  markResumed(): Promise<string | undefined>;
  /** Gives the VM back: the restore failed before it ran. */
  release(): Promise<boolean>;
}

/** What {@link openSmallFiles} made: a snapshot directory whose RAM file is empty. */
interface SmallFiles {
  manifest: StoreManifest;
  reader: SnapshotReader;
  /** The RAM file, read-write, sparse: every chunk a hole until the fetcher writes it. */
  scratchFd: number;
  /** The state is a hibernated VM's (Vm.hibernate): not for a lazy restore, which claims nothing. */
  hibernated: boolean;
  /** Closes the reader and the RAM file and removes the directory. */
  discard(): void;
}

/**
 * Fetches and checks the manifest at `url` and the two small files it names (from `cache` or the
 * store), and writes them into a new work directory of the cache beside an empty, sparse RAM
 * file; opens it as a snapshot directory (which checks the state against manifest.json). A
 * hibernated VM's says so (`hibernated`): it is claimed before its RAM is fetched
 * (./hibernate-store.ts). Adds what it moved to `counts`; on failure leaves nothing.
 */
async function openSmallFiles(url: StoreUrl, store: ObjectStore, cache: ChunkCache, counts: ChunkCounts): Promise<SmallFiles> {
  const { manifest, sizeBytes } = await readStoreManifest(url, store);
  counts.bytesTransferred += sizeBytes;
  chunkPlaces(manifest, url); // a hash at places of different sizes is refused now
  // Both at once: each is a round trip to the store before the VM can run.
  const [stateBytes, manifestBytes] = await Promise.all([fetchCheckedChunk(manifest.files.state, url, store, cache, counts), fetchCheckedChunk(manifest.files.manifest, url, store, cache, counts)]);
  const hibernated = isHibernatedState(stateBytes);
  const dir = cache.newWorkDir();
  let scratchFd: number | undefined;
  try {
    writeNew(join(dir, 'state.json'), stateBytes);
    writeNew(join(dir, 'manifest.json'), manifestBytes);
    // Read-write: the fetcher writes chunks into it, the server punches them out once loaded.
    scratchFd = openSync(join(dir, 'ram'), 'wx+', 0o600);
    ftruncateSync(scratchFd, manifest.ramBytes);
    const reader = SnapshotReader.open(dir);
    const fd = scratchFd;
    return {
      manifest,
      reader,
      scratchFd: fd,
      hibernated,
      discard: () => {
        reader.close();
        closeSync(fd);
        rmSync(dir, { recursive: true, force: true });
      },
    };
  } catch (e) {
    if (scratchFd !== undefined) closeSync(scratchFd);
    rmSync(dir, { recursive: true, force: true });
    throw e;
  }
}

/**
 * The checked state of the snapshot at `location` (its manifest and small files only, as a lazy
 * restore reads them first): what `pvisor run --from s3://...` needs before it restores.
 */
export async function readStoreSnapshotState(location: string, options?: StoreOptions): Promise<SnapshotState> {
  const url = parseStoreUrl(location);
  const o = resolveStoreOptions(options);
  const store = ObjectStore.open(url, o);
  try {
    const opened = await openSmallFiles(url, store, ChunkCache.open(o.cacheDir, o.cacheMaxBytes), { chunksTransferred: 0, chunksPresent: 0, bytesTransferred: 0 });
    opened.discard();
    return opened.reader.state;
  } finally {
    store.close();
  }
}
