/**
 * CompressedOffload: Offload with a zstd-compressed backing file. On suspend, every aligned unit
 * of guest RAM that holds one of the VM's own pages becomes one frame of a seekable frame file
 * (./frame-file.ts): all-zero frames as a flag, frames zstd cannot shrink stored raw, the rest
 * zstd, each with the CRC32 of its uncompressed bytes. Compression and decompression run in a
 * small worker pool (started for each operation, or kept with `keepWorkers`); the main thread
 * only copies frames between guest RAM and the workers' shared buffers and does the file I/O.
 *
 * Suspend returns as soon as the file is created and the plan made; the frames are compressed
 * and written in the background, and units leave RAM batch by batch once their frames are
 * durable (fdatasync), as in Offload: a failure loses nothing, a resume meanwhile stops the
 * write-out and brings back only the units already dropped.
 */
import { InvalidOptionError, type BackingFileError, type OptionalDependencyError } from '../../errors';
import { MADV_POPULATE_WRITE } from '../../sys/constants';
import { booleanOption } from '../../units';
import { backingDirOptions, backingFilePath, checkBackingDir, removeBackingFile, type BackingDirOptions } from '../backing-file';
import { checkFrame, FrameFileReader, FrameFileWriter, type FrameEntry, type FrameFileHeader } from '../frame-file';
import type { FramePool } from '../frame-pool';
import { releaseFileCache } from '../page-cache';
import { splitZeroPages, unitsTouched } from '../../guest-ram/pages';
import type { Offload } from './offload';
import { loadZstd } from '../zstd-binding';
import { roundMs, type MemoryStrategy, type StrategyContext, type StrategyRam, type StrategyStats, type SuspendWork } from '../strategy';

/**
 * Options of {@link CompressedOffload}.
 * @category Strategies
 */
export interface CompressedOffloadOptions extends BackingDirOptions {
  /**
   * zstd compression level: -7 to -1 (faster, larger) or 1 to 22 (slower, smaller). Default 1,
   * which compresses at several hundred MB/s per worker.
   */
  level?: number;
  /**
   * Size of a frame, the unit that is compressed, checksummed and skipped when it has no resident
   * page: a power of two from 64 KiB to 16 MiB. Default 1 MiB (see docs/compressed-offload.md).
   */
  frameSizeBytes?: number;
  /**
   * Keep the compression workers between operations (started with the VM) instead of starting
   * them for each suspend and resume: operations skip the workers' start (tens of milliseconds,
   * more on a loaded host), and the VM costs about 8 MiB of PSS more per worker all the time
   * (host-facts.md). Default false: an idle VM pays nothing for them.
   */
  keepWorkers?: boolean;
}

const DEFAULT_FRAME_BYTES = 1024 * 1024;
/** Frames are made durable and their units dropped every 16 MiB of guest RAM. */
const BATCH_BYTES = 16 * 1024 * 1024;

/**
 * What the last suspend wrote: kept in memory, the file is checked against it on resume. Only
 * the `dropped` entries' units left RAM; the others are still resident.
 */
interface Image {
  path: string;
  header: FrameFileHeader;
  entries: FrameEntry[];
  dropped: Set<FrameEntry>;
}

/** The background part of one suspend. */
interface WriteOut {
  writer: FrameFileWriter;
  header: FrameFileHeader;
  /** Appended to the file so far, in the order written. */
  written: FrameEntry[];
  /** Durable, and their units dropped from RAM. */
  dropped: Set<FrameEntry>;
  stopping: boolean;
  ended: boolean;
  done: Promise<void>;
}

/**
 * Suspends a VM's RAM to a zstd-compressed frame file and brings it back on resume. Resume checks
 * the file against the frame table kept in memory at suspend time and each frame's CRC32 before
 * its bytes reach guest RAM: a missing, truncated or corrupt file is a {@link BackingFileError},
 * the VM stays suspended and the file is left as it is. The file is created 0600 and removed on
 * resume or when the VM stops. Drives the `suspend-image`, so it cannot be combined with
 * {@link Offload}.
 *
 * Needs the optional dependency zstd-napi: without it the constructor throws an
 * {@link OptionalDependencyError} that says how to install it (see the README).
 * @category Strategies
 */
export class CompressedOffload implements MemoryStrategy {
  readonly name = 'compressed-offload';
  /** A unit is dropped whole and its zero pages are not copied back: they must read zero. */
  readonly needs = ['zero-on-discard'] as const;
  readonly exclusive = ['suspend-image'] as const;
  private readonly backingDir: Required<BackingDirOptions>;
  private readonly level: number;
  private readonly frameBytes: number;
  /** Whether the workers stay between operations. */
  readonly keepWorkers: boolean;
  private path: string | undefined;
  private image: Image | undefined;
  private writeOut: WriteOut | undefined;
  /** The pool of the operation in progress, or the kept one. */
  private pool: Promise<FramePool> | undefined;
  private figures = {
    bytesOnDisk: 0,
    bytesWritten: 0,
    bytesUncompressed: 0,
    framesZero: 0,
    framesRaw: 0,
    framesZstd: 0,
    compressionRatio: 0,
    lastSuspendMs: 0,
    lastReleaseMs: 0,
    lastReleaseCancelled: 0,
    lastResumeMs: 0,
    lastWorkerStartMs: 0,
    workersKept: 0,
  };

  /** @throws {@link OptionalDependencyError} if zstd-napi is not installed. */
  constructor(options: CompressedOffloadOptions = {}) {
    // Now, not at the first suspend: a VM that could never suspend as asked must not start.
    loadZstd();
    this.backingDir = backingDirOptions(options);
    this.level = options.level ?? 1;
    if (!Number.isInteger(this.level) || this.level < -7 || this.level > 22 || this.level === 0) {
      throw new InvalidOptionError('level', `must be a whole number from -7 to -1 or 1 to 22, got ${options.level}`);
    }
    this.frameBytes = options.frameSizeBytes ?? DEFAULT_FRAME_BYTES;
    const f = this.frameBytes;
    if (!Number.isInteger(f) || f < 64 * 1024 || f > 16 * 1024 * 1024 || (f & (f - 1)) !== 0) {
      throw new InvalidOptionError('frameSizeBytes', `must be a power of two from 64 KiB to 16 MiB, got ${options.frameSizeBytes}`);
    }
    this.keepWorkers = booleanOption('keepWorkers', options.keepWorkers, false);
    this.figures.workersKept = this.keepWorkers ? 1 : 0;
  }

  /** Path of the backing file while the VM is suspended. */
  get backingPath(): string | undefined {
    return this.image || this.writeOut ? this.path : undefined;
  }

  map(): void {
    // Kept workers start with the VM, so that the first suspend is as quick as the others; a
    // failure to start shows at that suspend.
    if (this.keepWorkers) this.usePool().catch(() => {});
  }

  /**
   * Plans the frames (the units holding the VM's own pages), creates the file and returns; the
   * frames are compressed, written and dropped in the background ({@link SuspendWork.released}).
   */
  async suspend(ctx: StrategyContext): Promise<SuspendWork> {
    const t0 = performance.now();
    const ram = ctx.ram;
    checkBackingDir(this.backingDir);
    // A fresh path each time: nothing planted at a known path can get in the way. It is ours
    // (this.path, which close() removes) only once created: what was there is someone else's.
    const path = backingFilePath(this.backingDir.dir, ctx.vmName, 'zframes');
    const header: FrameFileHeader = { frameBytes: this.frameBytes, guestRamBytes: ram.sizeBytes };
    // The vCPUs are stopped and agent traffic is held: the VM's pages cannot change until resume.
    const units = unitsTouched(ram.ownPageRuns(), this.frameBytes);
    const writer = new FrameFileWriter(path, header);
    this.path = path;
    const w: WriteOut = { writer, header, written: [], dropped: new Set(), stopping: false, ended: false, done: Promise.resolve() };
    w.done = this.writeFrames(ram, w, units).finally(() => (w.ended = true));
    w.done.catch(() => {}); // observed through `released`
    this.writeOut = w;
    Object.assign(this.figures, { lastSuspendMs: roundMs(performance.now() - t0), lastReleaseMs: 0, lastReleaseCancelled: 0 });
    const released = w.done.then(() => {
      if (this.writeOut !== w) return;
      this.finishFile(w);
      this.figures.lastReleaseMs = roundMs(performance.now() - t0);
    });
    return { released };
  }

  /** Compresses and appends every unit, dropping them batch by batch once durable. */
  private async writeFrames(ram: StrategyRam, w: WriteOut, units: number[]): Promise<void> {
    const pool = await this.usePool();
    try {
      let pending: FrameEntry[] = [];
      let pendingBytes = 0;
      let commits = Promise.resolve();
      const commit = (batch: FrameEntry[]) => {
        commits = commits.then(async () => {
          await w.writer.sync();
          if (w.stopping) return;
          for (const e of batch) ram.discardHost(e.guestOffset, e.length, 'zero');
          for (const e of batch) w.dropped.add(e);
        });
        return commits;
      };
      await pool.each(units, async (offset, slot) => {
        if (w.stopping) return;
        const length = Math.min(this.frameBytes, ram.sizeBytes - offset);
        ram.view(offset, length).copy(slot.input, 0);
        const frame = await pool.encode(slot, length);
        if (w.stopping) return;
        const stored = frame.kind === 'raw' ? slot.input : slot.output;
        const entry = w.writer.append(offset, length, frame, stored.subarray(0, frame.storedLength));
        w.written.push(entry);
        pending.push(entry);
        pendingBytes += length;
        if (pendingBytes >= BATCH_BYTES) {
          const batch = pending;
          pending = [];
          pendingBytes = 0;
          await commit(batch);
        }
      });
      if (!w.stopping) await commit(pending);
      await commits;
    } finally {
      await this.donePool();
    }
  }

  /**
   * Writes the table and footer of what was written (so a reader can check the file), drops the
   * file from the page cache and records the figures.
   */
  private finishFile(w: WriteOut): Image {
    const written = w.writer.finish();
    releaseFileCache(w.writer.path);
    const entries = written.entries;
    const count = (kind: FrameEntry['kind']) => entries.filter((e) => e.kind === kind).length;
    const uncompressed = entries.reduce((n, e) => n + e.length, 0);
    Object.assign(this.figures, {
      bytesOnDisk: written.allocatedBytes,
      bytesWritten: written.fileBytes,
      bytesUncompressed: uncompressed,
      framesZero: count('zero'),
      framesRaw: count('raw'),
      framesZstd: count('zstd'),
      compressionRatio: Math.round((uncompressed / written.fileBytes) * 100) / 100,
    });
    // finish() sorts the same entry objects the write-out appended, so `dropped` names them as is.
    this.image = { path: w.writer.path, header: w.header, entries, dropped: w.dropped };
    return this.image;
  }

  async resume(ctx: StrategyContext): Promise<void> {
    const t0 = performance.now();
    const w = this.writeOut;
    if (w) {
      // What is still resident stays; what was dropped comes back from the file.
      if (!w.ended) this.figures.lastReleaseCancelled = 1;
      w.stopping = true;
      await w.done.catch(() => {});
      if (!this.image) {
        try {
          this.finishFile(w);
        } catch (e) {
          // Nothing was dropped unless it is in the file: a file that cannot be finished now is
          // only a problem if something must come back from it. Then the write-out is kept, so
          // that the next resume tries again (the table may not fit on a full disk until space
          // returns) instead of finding nothing to bring back.
          if (w.dropped.size) throw e;
          this.writeOut = undefined;
          w.writer.abort();
          return;
        }
      }
      this.writeOut = undefined;
    }
    const image = this.image;
    if (!image) return;
    if (!image.dropped.size) {
      removeBackingFile(image.path);
      this.image = undefined;
      this.figures.bytesOnDisk = 0;
      this.figures.lastResumeMs = roundMs(performance.now() - t0);
      return;
    }
    const reader = FrameFileReader.open(image.path, image);
    const loaded: FrameEntry[] = [];
    try {
      const pool = await this.usePool();
      const stored = image.entries.map((_, i) => i).filter((i) => image.entries[i].kind !== 'zero' && image.dropped.has(image.entries[i]));
      await pool.each(stored, async (i, slot) => {
        const e = image.entries[i];
        reader.readStored(i, slot.input);
        await checkFrame(image.path, i, e, () => pool.decode(slot, e.kind, e.storedLength, e.length));
        loaded.push(e);
        copyNonZeroPages((e.kind === 'raw' ? slot.input : slot.output).subarray(0, e.length), ctx.ram, e.guestOffset);
      });
    } catch (e) {
      // The guest must never see a wrong byte: drop whatever was loaded, RAM is as suspended.
      for (const l of loaded) ctx.ram.discardHost(l.guestOffset, l.length, 'zero');
      throw e;
    } finally {
      reader.close();
      await this.donePool();
    }
    removeBackingFile(image.path);
    this.image = undefined;
    this.figures.bytesOnDisk = 0;
    this.figures.lastResumeMs = roundMs(performance.now() - t0);
  }

  stats(): StrategyStats {
    const notes = [this.keepWorkers ? 'compression workers kept between operations' : 'compression workers started for each operation'];
    if (this.writeOut && !this.writeOut.ended) notes.push('the write-out is in progress');
    return { strategy: this.name, figures: { ...this.figures }, notes };
  }

  close(): void {
    // Only a file that still holds something: a path whose file is gone may be someone else's now.
    const path = this.backingPath;
    const w = this.writeOut;
    if (w) {
      // The write-out touches RAM no more; the frame in a worker ends by itself.
      w.stopping = true;
      w.writer.abort();
    }
    this.writeOut = undefined;
    const pool = this.pool;
    this.pool = undefined;
    void pool?.then((p) => p.close(), () => {});
    if (path) removeBackingFile(path);
    this.image = undefined;
  }

  /** The workers: the kept pool, or a pool started for this operation. */
  private usePool(): Promise<FramePool> {
    this.pool ??= (async () => {
      // Loaded here, not at the top: importing pvisor must not load zstd's native addon.
      const { FramePool } = await import('../frame-pool');
      const pool = await FramePool.start(this.frameBytes, this.level);
      this.figures.lastWorkerStartMs = roundMs(pool.startMs);
      return pool;
    })();
    const p = this.pool;
    p.catch(() => {
      if (this.pool === p) this.pool = undefined;
    });
    return p;
  }

  /** After an operation: ends its workers, unless they are kept. */
  private async donePool(): Promise<void> {
    if (this.keepWorkers) return;
    const pool = this.pool;
    this.pool = undefined;
    await pool?.then((p) => p.close(), () => {});
  }
}

/**
 * Copies a frame into guest RAM page by page, skipping zero pages: they read as zero already
 * (the unit was dropped at suspend), and writing them would make the host allocate them again.
 */
function copyNonZeroPages(frame: Buffer, ram: StrategyRam, guestOffset: number): void {
  for (const run of splitZeroPages(frame, 0).nonZero) {
    populate(ram, guestOffset + run.offset, run.length);
    ram.view(guestOffset + run.offset, run.length).set(frame.subarray(run.offset, run.offset + run.length));
  }
}

let canPopulate = true;
/**
 * Allocates the pages of a range before a copy writes them (MADV_POPULATE_WRITE, Linux 5.14+):
 * one system call instead of a page fault per 4 KiB, which shortens a resume of random content
 * (docs/design-figures.md). Skipped where the kernel does not know it.
 */
function populate(ram: StrategyRam, offset: number, length: number): void {
  if (!canPopulate) return;
  try {
    ram.advise(offset, length, MADV_POPULATE_WRITE, 'MADV_POPULATE_WRITE');
  } catch {
    canPopulate = false;
  }
}

