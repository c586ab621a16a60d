/**
 * The chunk fetcher of a lazy restore from an object store (lazy-ram.ts), in a worker thread: it
 * answers the userfaultfd server's requests on its fetch socket (a fault waits in a chunk not yet
 * here) and, once told to, prefetches the other chunks in the order given, with bounded
 * concurrency. Each chunk comes from the host's chunk cache or the store, its SHA-256 checked
 * before it is cached or written anywhere (chunk-fetch.ts); it is then written into the restore's
 * scratch file, and the server told READY, which loads it from there (checked against its CRC32C
 * once more) and wakes whoever waits. A chunk that fails, or a store that does not answer within
 * the request timeout, is told FAILED: the server never maps the range, and the VM ends.
 *
 * Why a worker, not Node's main thread: the main thread itself faults on guest RAM (a device model
 * reading a virtqueue), and would then wait for a fetch only it could make. The worker loads no
 * native code (fetch-protocol.ts holds the records' numbers); the fds it uses (its end of the
 * fetch socket, the scratch file) are the process's, given by number.
 */
import { writeSync } from 'node:fs';
import { parentPort, workerData } from 'node:worker_threads';
import { StoreError, type StoreErrorReason } from '../errors';
import { FetchFailure, FetchRecord } from '../memory/fetch-protocol';
import { RecordChannel, type NativeRecord } from '../native/record-channel';
import { ChunkCache } from './chunk-cache';
import { fetchCheckedChunk, type ChunkCounts } from './chunk-fetch';
import type { ObjectStore } from './object-io';
import { parseStoreUrl } from './store-url';

/** What the worker is started with. */
export interface FetcherData {
  /** Marks pvisor's fetcher: a program that runs pvisor in a worker of its own never starts one by importing this module. */
  role: 'pvisor-chunk-fetcher';
  location: string;
  requestTimeoutMs: number;
  cacheDir: string;
  cacheMaxBytes: number;
  /** BigInt64Array: bytes and chunks fetched, chunks found cached, chunks fetched for a fault ({@link FetcherCounter}). */
  counters: SharedArrayBuffer;
}

/** Indices into {@link FetcherData.counters}. */
export const FetcherCounter = { bytesTransferred: 0, chunksTransferred: 1, chunksPresent: 2, chunksForFaults: 3 } as const;

/** One range of the deferred source: the chunk that fills it. */
export interface FetcherChunk {
  sha256: string;
  sizeBytes: number;
  fileOffset: number;
}

/** Main thread to worker. */
export type FetcherCommand =
  | { kind: 'start'; fetchFd: number; sourceId: number; scratchFd: number; chunks: FetcherChunk[]; prefetchOrder: number[]; concurrency: number }
  | { kind: 'prefetch' }
  | { kind: 'stop' };

/** Worker to main thread: the first failure, as a StoreError's reason (null: this host's) and message. */
export interface FetcherFailure {
  kind: 'error';
  reason: StoreErrorReason | null;
  message: string;
}

const FAILURE_CODE: Partial<Record<StoreErrorReason, number>> = { corrupt: FetchFailure.corrupt, timeout: FetchFailure.timeout };

if (parentPort && (workerData as Partial<FetcherData> | null)?.role === 'pvisor-chunk-fetcher') run(parentPort, workerData as FetcherData);

function run(port: NonNullable<typeof parentPort>, data: FetcherData): void {
  const url = parseStoreUrl(data.location);
  // The S3 client loads in the background (a few hundred ms on a busy host): a chunk the cache
  // holds does not wait for it.
  const storeReady: Promise<ObjectStore> = import('./object-io').then(({ ObjectStore }) => ObjectStore.open(url, { requestTimeoutMs: data.requestTimeoutMs }));
  storeReady.catch(() => undefined);
  const cache = ChunkCache.open(data.cacheDir, data.cacheMaxBytes);
  const shared = new BigInt64Array(data.counters);
  const counts: ChunkCounts = {
    get bytesTransferred() {
      return Number(Atomics.load(shared, FetcherCounter.bytesTransferred));
    },
    set bytesTransferred(v: number) {
      Atomics.store(shared, FetcherCounter.bytesTransferred, BigInt(v));
    },
    get chunksTransferred() {
      return Number(Atomics.load(shared, FetcherCounter.chunksTransferred));
    },
    set chunksTransferred(v: number) {
      Atomics.store(shared, FetcherCounter.chunksTransferred, BigInt(v));
    },
    get chunksPresent() {
      return Number(Atomics.load(shared, FetcherCounter.chunksPresent));
    },
    set chunksPresent(v: number) {
      Atomics.store(shared, FetcherCounter.chunksPresent, BigInt(v));
    },
  };
  let job: Extract<FetcherCommand, { kind: 'start' }> | undefined;
  let channel: RecordChannel | undefined;
  /** Per range: 0 not asked, 1 being fetched, 2 written and told. */
  let states = new Uint8Array(0);
  let prefetching = false;
  let nextPrefetch = 0;
  let prefetchesRunning = 0;
  let left = 0;
  let failed = false;

  let stopped = false;
  const stop = (): void => {
    if (stopped) return;
    stopped = true;
    channel?.destroy();
    void storeReady.then((store) => store.close(), () => undefined);
    port.close();
  };

  const fetchRange = async (i: number, forFault: boolean): Promise<void> => {
    const j = job!;
    const c = j.chunks[i];
    states[i] = 1;
    if (!forFault) prefetchesRunning++;
    cache.pin(c.sha256);
    try {
      const ref = { sha256: c.sha256, sizeBytes: c.sizeBytes };
      const cached = cache.read(ref.sha256, ref.sizeBytes);
      if (cached) counts.chunksPresent++;
      const bytes = cached ?? (await fetchCheckedChunk(ref, url, await storeReady, cache, counts));
      for (let done = 0; done < bytes.length;) done += writeSync(j.scratchFd, bytes, done, bytes.length - done, c.fileOffset + done);
      states[i] = 2;
      if (forFault) Atomics.add(shared, FetcherCounter.chunksForFaults, 1n);
      channel?.send({ kind: FetchRecord.ready, tag: j.sourceId, err: 0, value: i });
      if (--left === 0) cache.evict();
    } catch (e) {
      const reason = e instanceof StoreError ? e.reason : null;
      if (!failed) port.postMessage({ kind: 'error', reason, message: (e as Error).message } satisfies FetcherFailure);
      failed = true;
      channel?.send({ kind: FetchRecord.failed, tag: j.sourceId, err: reason === null ? FetchFailure.local : FAILURE_CODE[reason] ?? FetchFailure.unreachable, value: i });
    } finally {
      cache.unpin(c.sha256);
      if (!forFault) prefetchesRunning--;
      pump();
    }
  };

  /** Starts prefetches while fewer than `concurrency` run; requests for faults do not wait for them. */
  const pump = (): void => {
    const j = job;
    while (j && prefetching && !failed && prefetchesRunning < j.concurrency && nextPrefetch < j.prefetchOrder.length) {
      const i = j.prefetchOrder[nextPrefetch++];
      if (states[i] === 0) void fetchRange(i, false);
    }
  };

  const onRecord = (rec: NativeRecord): void => {
    const j = job!;
    if (rec.kind !== FetchRecord.want || rec.tag !== j.sourceId || !Number.isInteger(rec.value) || rec.value >= j.chunks.length) return;
    const i = rec.value;
    // After a failure the VM is ending: a fault must not wait for a fetch that will not come.
    if (failed && states[i] !== 2) channel?.send({ kind: FetchRecord.failed, tag: j.sourceId, err: FetchFailure.gone, value: i });
    else if (states[i] === 0) void fetchRange(i, true);
  };

  port.on('message', (cmd: FetcherCommand) => {
    if (cmd.kind === 'start' && !job) {
      job = cmd;
      states = new Uint8Array(cmd.chunks.length);
      left = cmd.chunks.length;
      // The server closing its end (the VM ended) ends the worker.
      channel = new RecordChannel(cmd.fetchFd, onRecord, { writable: true, onClose: stop });
    } else if (cmd.kind === 'prefetch') {
      prefetching = true;
      pump();
    } else if (cmd.kind === 'stop') {
      stop();
    }
  });
}
