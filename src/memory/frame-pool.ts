/**
 * A small pool of compression workers for one suspend or resume: started for it and ended after
 * it, so an idle VM pays nothing for them (a worker costs about 8 MiB of PSS). Each worker owns
 * two slots (an input and an output shared buffer of a frame each), so while the main thread
 * copies one frame in or out of guest RAM and does the file I/O, the worker already works on the
 * next one. The slot buffers outlive their pool: the next pool of the process takes them.
 */
import { availableParallelism } from 'node:os';
import { join } from 'node:path';
import { Worker } from 'node:worker_threads';
import type { EncodedFrame, FrameKind } from './frame-file';
import { loadZstd } from './zstd-binding';
import type { FrameJob, FrameJobResult, FrameWorkerData } from './frame-worker';

/** A pair of shared buffers that one worker reads and writes for one frame at a time. */
export interface FrameSlot {
  readonly index: number;
  /** The frame (encode) or its stored bytes (decode). */
  readonly input: Buffer;
  /** The zstd output (encode) or the uncompressed frame (decode of a zstd frame). */
  readonly output: Buffer;
}

const SLOTS_PER_WORKER = 2;

/** The shared buffers of one pool's slots, in slot order. */
type SlotBuffers = { input: SharedArrayBuffer; output: SharedArrayBuffer }[];

/**
 * Slot buffers of pools that have ended, by frame size, for the next pools of this process. A
 * pool's buffers (about 8 MiB) that it let go would be reclaimed only when V8 collects garbage,
 * which a process that mostly waits on VMs rarely needs to do: `pvisor bench soak` measured a
 * process growing by 2.7 MiB per CompressedOffload suspend/resume cycle (600 MiB after 200), and
 * flat once they were reused. So the process keeps the buffers of as many pools as ever ran at
 * once, and makes new ones only beyond that.
 */
const spareBuffers = new Map<number, SlotBuffers[]>();

function takeBuffers(frameBytes: number, slots: number): SlotBuffers {
  const spare = spareBuffers.get(frameBytes)?.pop();
  if (spare && spare.length === slots) return spare;
  return Array.from({ length: slots }, () => ({
    input: new SharedArrayBuffer(frameBytes),
    output: new SharedArrayBuffer(Math.max(frameBytes, loadZstd().compressBound(frameBytes))),
  }));
}

/** Keeps a pool's buffers for the next pool; called once no worker can touch them any more. */
function giveBackBuffers(frameBytes: number, buffers: SlotBuffers): void {
  const list = spareBuffers.get(frameBytes) ?? [];
  list.push(buffers);
  spareBuffers.set(frameBytes, list);
}

/** A job without its slot number (the pool fills it in), kept a union. */
type JobBody<J = FrameJob> = J extends FrameJob ? Omit<J, 'slot'> : never;

interface Pending {
  resolve: (r: FrameJobResult) => void;
  reject: (e: Error) => void;
}

/** The workers of one suspend or resume. */
export class FramePool {
  /** Slots, interleaved across workers so consecutive frames go to different workers. */
  readonly slots: FrameSlot[] = [];
  private readonly owner: Worker[] = [];
  private readonly pending = new Map<number, Pending>();

  private constructor(
    private readonly workers: Worker[],
    /** Milliseconds from creating the workers until each had loaded zstd and was ready. */
    readonly startMs: number,
    private readonly frameBytes: number,
    private readonly buffers: SlotBuffers,
  ) {}

  /** Starts min(2, available CPUs) workers with buffers for frames of `frameBytes`. */
  static async start(frameBytes: number, level: number): Promise<FramePool> {
    const t0 = performance.now();
    const count = Math.min(2, availableParallelism());
    const buffers = takeBuffers(frameBytes, count * SLOTS_PER_WORKER);
    const workers: Worker[] = [];
    const ready: Promise<void>[] = [];
    for (let w = 0; w < count; w++) {
      const mine = buffers.filter((_, i) => i % count === w);
      // Found next to this module at run time: dist/src/memory/ in the repository and in the package.
      const worker = new Worker(join(__dirname, 'frame-worker.js'), { workerData: { level, slots: mine } satisfies FrameWorkerData });
      workers.push(worker);
      ready.push(
        new Promise<void>((resolve, reject) => {
          const onExit = (code: number) => reject(new Error(`compression worker exited (${code}) while starting`));
          worker.once('message', () => {
            // Only these two: removeAllListeners() would also drop the Worker's own internal ones.
            worker.off('error', reject);
            worker.off('exit', onExit);
            resolve();
          });
          worker.once('error', reject);
          worker.once('exit', onExit);
        }),
      );
    }
    try {
      await Promise.all(ready);
    } catch (e) {
      await Promise.all(workers.map((w) => w.terminate()));
      giveBackBuffers(frameBytes, buffers);
      throw e;
    }
    const pool = new FramePool(workers, performance.now() - t0, frameBytes, buffers);
    buffers.forEach((b, i) => {
      pool.slots.push({ index: i, input: Buffer.from(b.input), output: Buffer.from(b.output) });
      pool.owner.push(workers[i % count]);
    });
    for (const [w, worker] of workers.entries()) {
      // Slot i lives in worker i % count at index floor(i / count) of its own list.
      worker.on('message', (r: FrameJobResult) => pool.settle(r.slot * count + w, r));
      const fail = (e: Error) => {
        for (const [i, p] of pool.pending) {
          if (i % count === w) {
            pool.pending.delete(i);
            p.reject(e);
          }
        }
      };
      worker.on('error', fail);
      worker.on('exit', (code) => fail(new Error(`compression worker exited (${code})`)));
    }
    return pool;
  }

  private settle(slot: number, r: FrameJobResult): void {
    const p = this.pending.get(slot);
    this.pending.delete(slot);
    p?.resolve(r);
  }

  private post(slot: FrameSlot, job: JobBody): Promise<FrameJobResult> {
    const count = this.workers.length;
    return new Promise((resolve, reject) => {
      this.pending.set(slot.index, { resolve, reject });
      this.owner[slot.index].postMessage({ ...job, slot: Math.floor(slot.index / count) });
    });
  }

  /** Encodes the first `length` bytes of the slot's input; stored bytes: input (raw) or output (zstd). */
  async encode(slot: FrameSlot, length: number): Promise<EncodedFrame> {
    const r = await this.post(slot, { op: 'encode', length });
    if ('error' in r) throw new Error(r.error);
    if (!('kind' in r)) throw new Error('a compression worker answered an encode with a decode result');
    return { kind: r.kind, storedLength: r.storedLength, crc: r.crc };
  }

  /**
   * Decodes the stored bytes in the slot's input; returns the CRC32 of the uncompressed frame,
   * which is then in the input (raw) or the output (zstd). Rejects with zstd's message.
   */
  async decode(slot: FrameSlot, kind: FrameKind, storedLength: number, length: number): Promise<number> {
    const r = await this.post(slot, { op: 'decode', kind, storedLength, length });
    if ('error' in r) throw new Error(r.error);
    return r.crc;
  }

  /**
   * Runs `work` on every item with every slot busy. After the first failure it submits nothing
   * more, waits until the frames in flight have settled (so none touches guest RAM afterwards)
   * and rethrows that failure.
   */
  async each<T>(items: Iterable<T>, work: (item: T, slot: FrameSlot) => Promise<void>): Promise<void> {
    const free = [...this.slots];
    const inFlight = new Set<Promise<void>>();
    let failure: { error: unknown } | undefined;
    for (const item of items) {
      while (!free.length && !failure) await Promise.race(inFlight);
      if (failure) break;
      const slot = free.shift()!;
      const p: Promise<void> = work(item, slot).then(
        () => {
          inFlight.delete(p);
          free.push(slot);
        },
        (error: unknown) => {
          inFlight.delete(p);
          failure ??= { error };
        },
      );
      inFlight.add(p);
    }
    await Promise.all(inFlight);
    if (failure) throw failure.error;
  }

  /** Ends the workers; their buffers go to the next pool. Once only. */
  async close(): Promise<void> {
    if (this.closing) return this.closing;
    this.closing = Promise.all(this.workers.map((w) => w.terminate())).then(() => giveBackBuffers(this.frameBytes, this.buffers));
    return this.closing;
  }
  private closing: Promise<void> | undefined;
}
