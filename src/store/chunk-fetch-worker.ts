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
 * One worker serves every lazy restore of the process (each a *job*, by id), so that only the
 * first restore pays for starting it (a Node worker costs hundreds of ms on a busy host, seconds
 * under emulation); one is started per distinct AWS environment, which its S3 clients read.
 *
 * Why a worker, not Node's main thread: the main thread itself faults on guest RAM (a device model
 * reading a virtqueue), and would then wait for a fetch only it could make. The worker loads no
 * native code (fetch-protocol.ts holds the records' numbers); the fds it uses (its end of the
 * fetch socket, the scratch file) are the process's, given by number.
 */
import { closeSync, writeSync } from 'node:fs';
import { parentPort, workerData } from 'node:worker_threads';
import { StoreError, type StoreErrorReason } from '../errors';
import { FetchFailure, FetchRecord } from '../memory/fetch-protocol';
import { RecordChannel, type NativeRecord } from '../native/record-channel';
import { ChunkCache } from './chunk-cache';
import { fetchCheckedChunk, type ChunkCounts } from './chunk-fetch';
import type { ObjectStore } from './object-io';
import type { ChunkRef } from './store-manifest';
import { parseStoreUrl } from './store-url';

/** What the worker is started with. */
export interface FetcherData {
  /** Marks pvisor's fetcher: a program that runs pvisor in a worker of its own never starts one by importing this module. */
  role: 'pvisor-chunk-fetcher';
}

/** Indices into a job's counters (a BigInt64Array): bytes and chunks fetched, chunks found cached, chunks fetched for a fault. */
export const FetcherCounter = { bytesTransferred: 0, chunksTransferred: 1, chunksPresent: 2, chunksForFaults: 3 } as const;

/** One range of the deferred source: the chunk that fills it (stored whole or as a page delta), and where in the scratch file it goes. */
export interface FetcherChunk extends ChunkRef {
  fileOffset: number;
}

/**
 * What a job is opened with, as soon as the snapshot's manifest is read: the worker makes its
 * S3 client and cache handle while the VM is built, so that the first fault finds it ready.
 */
export interface FetcherJob {
  id: number;
  location: string;
  requestTimeoutMs: number;
  cacheDir: string;
  cacheMaxBytes: number;
  /** The job's counters ({@link FetcherCounter}), read by the main thread at any time. */
  counters: SharedArrayBuffer;
  scratchFd: number;
  chunks: FetcherChunk[];
  prefetchOrder: number[];
  concurrency: number;
}

/** Main thread to worker: a job is opened, then attached to the server's fetch socket once guest RAM has its server. */
export type FetcherCommand = ({ kind: 'open' } & FetcherJob) | { kind: 'attach'; id: number; fetchFd: number; sourceId: number } | { kind: 'prefetch'; id: number } | { kind: 'stop'; id: number };

/** Worker to main thread: a job's first failure, as a StoreError's reason (null: this host's) and message; or that a job has let go of its files. */
export type FetcherMessage = { kind: 'error'; id: number; reason: StoreErrorReason | null; message: string } | { kind: 'stopped'; id: number };

const FAILURE_CODE: Partial<Record<StoreErrorReason, number>> = { corrupt: FetchFailure.corrupt, timeout: FetchFailure.timeout };

if (parentPort && (workerData as Partial<FetcherData> | null)?.role === 'pvisor-chunk-fetcher') serve(parentPort);

/**
 * The worker's buffer for chunks read from the cache: one for all its jobs, used between a
 * synchronous read and write (nothing else runs meanwhile), so that a chunk does not map and
 * fault in 2 MiB of new memory each time. Allocated at the first read, as large as a chunk (a
 * manifest's chunk sizes are checked against the RAM chunk size before any job opens).
 */
let chunkBufferOf: Buffer | undefined;
function chunkBuffer(sizeBytes: number): Buffer {
  if (!chunkBufferOf || chunkBufferOf.length < sizeBytes) chunkBufferOf = Buffer.allocUnsafeSlow(sizeBytes);
  return chunkBufferOf;
}

function serve(port: NonNullable<typeof parentPort>): void {
  // The S3 client's code loads in the background (a few hundred ms on a busy host): a chunk the
  // cache holds does not wait for it.
  const objectIo = import('./object-io');
  objectIo.catch(() => undefined);
  const jobs = new Map<number, OpenJob>();
  port.on('message', (cmd: FetcherCommand) => {
    if (cmd.kind === 'open' && !jobs.has(cmd.id)) {
      const job = openJob(cmd, objectIo, (m) => port.postMessage(m), () => jobs.delete(cmd.id));
      jobs.set(cmd.id, job);
    } else if (cmd.kind === 'attach') {
      const job = jobs.get(cmd.id);
      // The socket is the worker's from now on: a job that has ended closes it.
      if (job) job.attach(cmd.fetchFd, cmd.sourceId);
      else closeSync(cmd.fetchFd);
    } else if (cmd.kind === 'prefetch') {
      jobs.get(cmd.id)?.prefetch();
    } else if (cmd.kind === 'stop') {
      const job = jobs.get(cmd.id);
      if (job) job.stop();
      else port.postMessage({ kind: 'stopped', id: cmd.id } satisfies FetcherMessage);
    }
  });
}

/** A job of the worker: opened, then attached to its fetch socket (the server's requests come from then on). */
interface OpenJob {
  attach(fetchFd: number, sourceId: number): void;
  prefetch(): void;
  stop(): void;
}

function openJob(job: FetcherJob, objectIo: Promise<typeof import('./object-io')>, post: (m: FetcherMessage) => void, forget: () => void): OpenJob {
  const url = parseStoreUrl(job.location);
  const storeReady: Promise<ObjectStore> = objectIo.then(({ ObjectStore }) => ObjectStore.open(url, { requestTimeoutMs: job.requestTimeoutMs }));
  storeReady.catch(() => undefined);
  const cache = ChunkCache.open(job.cacheDir, job.cacheMaxBytes);
  const shared = new BigInt64Array(job.counters);
  const counter = (k: number) => ({
    get: () => Number(Atomics.load(shared, k)),
    set: (v: number) => void Atomics.store(shared, k, BigInt(v)),
  });
  const counts = {} as ChunkCounts;
  for (const [name, k] of [['bytesTransferred', FetcherCounter.bytesTransferred], ['chunksTransferred', FetcherCounter.chunksTransferred], ['chunksPresent', FetcherCounter.chunksPresent]] as const) {
    Object.defineProperty(counts, name, { ...counter(k), enumerable: true });
  }
  /** Per range: 0 not asked, 1 being fetched, 2 written and told. */
  const states = new Uint8Array(job.chunks.length);
  let prefetching = false;
  let nextPrefetch = 0;
  let prefetchesRunning = 0;
  let left = job.chunks.length;
  let failed = false;
  let stopped = false;
  /** The fetch socket and the source's id in the server, once attached. */
  let channel: RecordChannel | undefined;
  let sourceId = -1;

  const stop = (): void => {
    if (stopped) return;
    stopped = true;
    channel?.destroy();
    void storeReady.then((store) => store.close(), () => undefined);
    forget();
    // Nothing of this job touches the scratch file from now on (a fetch still under way drops its bytes).
    post({ kind: 'stopped', id: job.id });
  };

  const fetchRange = async (i: number, forFault: boolean): Promise<void> => {
    const c = job.chunks[i];
    states[i] = 1;
    if (!forFault) prefetchesRunning++;
    cache.pin(c.sha256);
    try {
      // From the cache without waiting for the S3 client's code to load; into the worker's one
      // chunk buffer, which is free again once the write below (synchronous, as the read is) is done.
      const cached = cache.read(c.sha256, c.sizeBytes, chunkBuffer(c.sizeBytes));
      if (cached) counts.chunksPresent++;
      const bytes = cached ?? (await fetchCheckedChunk(c, url, await storeReady, cache, counts));
      if (stopped) return;
      for (let done = 0; done < bytes.length;) done += writeSync(job.scratchFd, bytes, done, bytes.length - done, c.fileOffset + done);
      states[i] = 2;
      if (forFault) Atomics.add(shared, FetcherCounter.chunksForFaults, 1n);
      channel?.send({ kind: FetchRecord.ready, tag: sourceId, err: 0, value: i });
      if (--left === 0) cache.evict();
    } catch (e) {
      if (stopped) return;
      const reason = e instanceof StoreError ? e.reason : null;
      if (!failed) post({ kind: 'error', id: job.id, reason, message: (e as Error).message });
      failed = true;
      channel?.send({ kind: FetchRecord.failed, tag: sourceId, err: reason === null ? FetchFailure.local : FAILURE_CODE[reason] ?? FetchFailure.unreachable, value: i });
    } finally {
      cache.unpin(c.sha256);
      if (!forFault) prefetchesRunning--;
      pump();
    }
  };

  /** Starts prefetches while fewer than `concurrency` run; requests for faults do not wait for them. */
  const pump = (): void => {
    while (prefetching && !failed && !stopped && prefetchesRunning < job.concurrency && nextPrefetch < job.prefetchOrder.length) {
      const i = job.prefetchOrder[nextPrefetch++];
      if (states[i] === 0) void fetchRange(i, false);
    }
  };

  const onRecord = (rec: NativeRecord): void => {
    if (stopped || rec.kind !== FetchRecord.want || rec.tag !== sourceId || !Number.isInteger(rec.value) || rec.value >= job.chunks.length) return;
    const i = rec.value;
    // After a failure the VM is ending: a fault must not wait for a fetch that will not come.
    if (failed && states[i] !== 2) channel?.send({ kind: FetchRecord.failed, tag: sourceId, err: FetchFailure.gone, value: i });
    else if (states[i] === 0) void fetchRange(i, true);
  };

  return {
    attach: (fetchFd, id) => {
      if (stopped || channel) return closeSync(fetchFd);
      sourceId = id;
      // The server closing its end (the VM ended) ends the job.
      channel = new RecordChannel(fetchFd, onRecord, { writable: true, onClose: stop });
    },
    prefetch: () => {
      prefetching = true;
      pump();
    },
    stop,
  };
}
