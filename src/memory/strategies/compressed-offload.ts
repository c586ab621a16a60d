/**
 * CompressedOffload: Offload with a zstd-compressed backing file. On suspend, every aligned unit
 * of guest RAM that has a resident page becomes one frame of a seekable frame file
 * (./frame-file.ts): all-zero frames as a flag, frames zstd cannot shrink stored raw, the rest
 * zstd, each with the CRC32 of its uncompressed bytes. Compression and decompression run in a
 * small worker pool started for the operation; the main thread only copies frames between guest
 * RAM and the workers' shared buffers and does the file I/O.
 */
import { rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { InvalidOptionError, type BackingFileError } from '../../errors';
import { backingFilePath } from '../backing-file';
import { checkFrame, FrameFileReader, FrameFileWriter, type FrameEntry, type FrameFileHeader } from '../frame-file';
import type { FramePool } from '../frame-pool';
import { releaseFileCache } from '../page-cache';
import { splitZeroPages, unitsTouched } from '../pages';
import type { Offload } from './offload';
import { roundMs, type MemoryStrategy, type StrategyContext, type StrategyRam, type StrategyStats } from '../strategy';

/** Options of {@link CompressedOffload}. */
export interface CompressedOffloadOptions {
  /** Directory for the backing file. Default: the OS temp directory. */
  dir?: string;
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
}

const DEFAULT_FRAME_BYTES = 1024 * 1024;

/** What the last suspend wrote: kept in memory, the file is checked against it on resume. */
interface Image {
  path: string;
  header: FrameFileHeader;
  entries: FrameEntry[];
}

/**
 * Suspends a VM's RAM to a zstd-compressed frame file and brings it back on resume. Resume checks
 * the file against the frame table kept in memory at suspend time and each frame's CRC32 before
 * its bytes reach guest RAM: a missing, truncated or corrupt file is a {@link BackingFileError},
 * the VM stays suspended and the file is left as it is. The file is created 0600 and removed on
 * resume or when the VM stops. Drives the `suspend-image`, so it cannot be combined with
 * {@link Offload}.
 */
export class CompressedOffload implements MemoryStrategy {
  readonly name = 'compressed-offload';
  /** A unit is dropped whole and its zero pages are not copied back: they must read zero. */
  readonly needs = ['zero-on-discard'] as const;
  readonly exclusive = ['suspend-image'] as const;
  private readonly dir: string;
  private readonly level: number;
  private readonly frameBytes: number;
  private path: string | undefined;
  private image: Image | undefined;
  private pool: FramePool | undefined;
  private figures = {
    bytesOnDisk: 0,
    bytesWritten: 0,
    bytesUncompressed: 0,
    framesZero: 0,
    framesRaw: 0,
    framesZstd: 0,
    compressionRatio: 0,
    lastSuspendMs: 0,
    lastResumeMs: 0,
    lastWorkerStartMs: 0,
  };

  constructor(options: CompressedOffloadOptions = {}) {
    this.dir = options.dir ?? tmpdir();
    this.level = options.level ?? 1;
    if (!Number.isInteger(this.level) || this.level < -7 || this.level > 22 || this.level === 0) {
      throw new InvalidOptionError('level', `must be a whole number from -7 to -1 or 1 to 22, got ${options.level}`);
    }
    this.frameBytes = options.frameSizeBytes ?? DEFAULT_FRAME_BYTES;
    const f = this.frameBytes;
    if (!Number.isInteger(f) || f < 64 * 1024 || f > 16 * 1024 * 1024 || (f & (f - 1)) !== 0) {
      throw new InvalidOptionError('frameSizeBytes', `must be a power of two from 64 KiB to 16 MiB, got ${options.frameSizeBytes}`);
    }
  }

  /** Path of the backing file while the VM is suspended. */
  get backingPath(): string | undefined {
    return this.image?.path;
  }

  async suspend(ctx: StrategyContext): Promise<void> {
    const t0 = performance.now();
    const ram = ctx.ram;
    this.path ??= backingFilePath(this.dir, ctx.vmName, 'zframes');
    const header: FrameFileHeader = { frameBytes: this.frameBytes, guestRamBytes: ram.sizeBytes };
    // The vCPUs are stopped and agent traffic is held: the resident set cannot change until resume.
    const units = unitsTouched(ram.ownPageRuns(), this.frameBytes);
    const writer = new FrameFileWriter(this.path, header);
    let written: ReturnType<FrameFileWriter['finish']>;
    try {
      const pool = await this.startPool();
      await pool.each(units, async (offset, slot) => {
        const length = Math.min(this.frameBytes, ram.sizeBytes - offset);
        ram.view(offset, length).copy(slot.input, 0);
        const frame = await pool.encode(slot, length);
        const stored = frame.kind === 'raw' ? slot.input : slot.output;
        writer.append(offset, length, frame, stored.subarray(0, frame.storedLength));
      });
      written = writer.finish();
    } catch (e) {
      writer.abort();
      throw e;
    } finally {
      await this.endPool();
    }
    // Only now that every frame is in the file: drop the units (a superset of what was resident).
    for (const e of written.entries) ram.discardHost(e.guestOffset, e.length);
    releaseFileCache(this.path);
    this.image = { path: this.path, header, entries: written.entries };
    const count = (kind: FrameEntry['kind']) => written.entries.filter((e) => e.kind === kind).length;
    const uncompressed = written.entries.reduce((n, e) => n + e.length, 0);
    Object.assign(this.figures, {
      bytesOnDisk: written.allocatedBytes,
      bytesWritten: written.fileBytes,
      bytesUncompressed: uncompressed,
      framesZero: count('zero'),
      framesRaw: count('raw'),
      framesZstd: count('zstd'),
      compressionRatio: Math.round((uncompressed / written.fileBytes) * 100) / 100,
      lastSuspendMs: roundMs(performance.now() - t0),
    });
  }

  async resume(ctx: StrategyContext): Promise<void> {
    const image = this.image;
    if (!image) return;
    const t0 = performance.now();
    const reader = FrameFileReader.open(image.path, image);
    const loaded: FrameEntry[] = [];
    try {
      const pool = await this.startPool();
      const stored = image.entries.map((_, i) => i).filter((i) => image.entries[i].kind !== 'zero');
      await pool.each(stored, async (i, slot) => {
        const e = image.entries[i];
        reader.readStored(i, slot.input);
        await checkFrame(image.path, i, e, () => pool.decode(slot, e.kind, e.storedLength, e.length));
        loaded.push(e);
        copyNonZeroPages((e.kind === 'raw' ? slot.input : slot.output).subarray(0, e.length), ctx.ram, e.guestOffset);
      });
    } catch (e) {
      // The guest must never see a wrong byte: drop whatever was loaded, RAM is as suspended.
      for (const l of loaded) ctx.ram.discardHost(l.guestOffset, l.length);
      throw e;
    } finally {
      reader.close();
      await this.endPool();
    }
    rmSync(image.path, { force: true });
    this.image = undefined;
    this.figures.bytesOnDisk = 0;
    this.figures.lastResumeMs = roundMs(performance.now() - t0);
  }

  stats(): StrategyStats {
    return { strategy: this.name, figures: { ...this.figures }, notes: [] };
  }

  close(): void {
    void this.endPool();
    if (this.path) rmSync(this.path, { force: true });
    this.image = undefined;
  }

  private async startPool(): Promise<FramePool> {
    // Loaded here, not at the top: importing pvisor must not load zstd's native addon.
    const { FramePool } = await import('../frame-pool');
    this.pool = await FramePool.start(this.frameBytes, this.level);
    this.figures.lastWorkerStartMs = roundMs(this.pool.startMs);
    return this.pool;
  }

  private async endPool(): Promise<void> {
    const pool = this.pool;
    this.pool = undefined;
    await pool?.close();
  }
}

/**
 * Copies a frame into guest RAM page by page, skipping zero pages: they read as zero already
 * (the unit was dropped at suspend), and writing them would make the host allocate them again.
 */
function copyNonZeroPages(frame: Buffer, ram: StrategyRam, guestOffset: number): void {
  for (const run of splitZeroPages(frame, 0).nonZero) ram.view(guestOffset + run.offset, run.length).set(frame.subarray(run.offset, run.offset + run.length));
}

