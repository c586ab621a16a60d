/**
 * Offload: on suspend, writes the guest's resident pages (only those; zero pages are recorded,
 * not written) to a sparse backing file and drops them; on resume, reads them back and checks
 * each piece's CRC32 before any vCPU runs (`reload: 'eager'`), or lets the vCPUs run at once and
 * loads each piece when it is first touched, through userfaultfd (`reload: 'lazy'`, see
 * lazy-loader.ts). Works on the default private anonymous RAM, so it combines with KsmAdvice (the
 * reference system could not offload KSM-advised RAM).
 */
import { closeSync, constants, fstatSync, openSync, readSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { crc32 } from 'node:zlib';
import { BackingFileError, InvalidOptionError } from '../../errors';
import { PAGE_SIZE } from '../../sys/constants';
import { backingFilePath, createBackingFile, createDirectBackingFile } from '../backing-file';
import type { LazyLoader, LoaderEvent, LoaderFigures } from '../lazy-loader';
import { releaseFileCache } from '../page-cache';
import { cutRuns } from '../pages';
import { roundMs, type ExclusiveResource, type MemoryStrategy, type RamCapability, type StrategyContext, type StrategyStats, type SuspendWork } from '../strategy';
import { WriteOut } from '../write-out';

/**
 * How {@link Offload} brings guest RAM back on resume.
 * - `eager`: reads and verifies every piece before any vCPU runs; resume costs the whole copy.
 * - `lazy`: resume returns at once; a native thread loads (and verifies) each piece of at most
 *   4 MiB when the guest or the VMM first touches it (userfaultfd), and removes the file once
 *   all are back. A corrupt piece ends the VM as a crash with a {@link BackingFileError}.
 */
export type OffloadReload = 'eager' | 'lazy';

/** Options of {@link Offload}. */
export interface OffloadOptions {
  /** Directory for the backing file. Default: the OS temp directory. */
  dir?: string;
  /** How resume brings RAM back. Default `eager`. */
  reload?: OffloadReload;
  /**
   * What the backing file does to the page cache.
   * - `bypass` (default): written with O_DIRECT where the filesystem allows (else written and
   *   then dropped from the cache): RAM really goes to disk, and group memory drops with it.
   * - `keep`: written through the page cache and left there. The VM's pages become the kernel's
   *   clean, reclaimable cache: it gives them to whoever needs memory (a VM's anonymous RAM,
   *   without swap, it could not), and a resume while they are still cached costs a copy from
   *   memory rather than a read from disk.
   */
  pageCache?: 'bypass' | 'keep';
}

/** A written piece of guest RAM: never crosses a 4 MiB boundary, so never a view chunk either. */
interface Piece {
  offset: number;
  length: number;
  crc: number;
}

/**
 * Pieces of 2 MiB: large enough that loading one amortises a fault (UFFDIO_COPY of 64 MiB took
 * 27 ms in 2 MiB pieces against 54 ms in 4 KiB ones, host-facts.md), small enough that a fault
 * waits for little. Never crossing a 2 MiB boundary, a piece never crosses a view chunk either.
 */
const PIECE_BYTES = 2 * 1024 * 1024;
/** The write-out syncs and drops every 16 MiB, so memory comes back progressively. */
const BATCH_BYTES = 16 * 1024 * 1024;

/** Suspends a VM's RAM to a backing file and brings it back on resume. */
export class Offload implements MemoryStrategy {
  readonly name = 'offload';
  /** Zero pages are not written: dropped, they must read back as zero. Lazy reload serves faults. */
  readonly needs: readonly RamCapability[];
  readonly exclusive: readonly ExclusiveResource[] = ['suspend-image'];
  /** How resume brings RAM back. */
  readonly reload: OffloadReload;
  /** What the backing file does to the page cache. */
  readonly pageCache: 'bypass' | 'keep';
  private readonly dir: string;
  private path: string | undefined;
  private pieces: Piece[] | undefined;
  private figures = { pagesWritten: 0, zeroPagesSkipped: 0, bytesOnDisk: 0, directIo: 0, lastSuspendMs: 0, lastReleaseMs: 0, lastReleaseCancelled: 0, lastResumeMs: 0 };
  /** The write-out of the last suspend, until it is cancelled by a resume. */
  private writeOut: WriteOut | undefined;
  /** The lazy load in progress, until every piece is back (or the VM ends). */
  private loader: LazyLoader | undefined;
  private loadStartedAt = 0;
  /** Of the last lazy resume. */
  private lazyFigures: LoaderFigures = { faultsServed: 0, piecesLoadedLazily: 0, pagesZeroFilled: 0 };
  private lastFullLoadMs: number | undefined;
  private loadWaiters: { resolve(): void; reject(e: Error): void }[] = [];
  private loadError: BackingFileError | undefined;
  private loaderModule: Promise<typeof import('../lazy-loader')> | undefined;

  constructor(options: OffloadOptions = {}) {
    this.dir = options.dir ?? tmpdir();
    const reload = options.reload ?? 'eager';
    if (reload !== 'eager' && reload !== 'lazy') throw new InvalidOptionError('reload', `expected "eager" or "lazy", got ${JSON.stringify(reload)}`);
    this.reload = reload;
    const pageCache = options.pageCache ?? 'bypass';
    if (pageCache !== 'bypass' && pageCache !== 'keep') throw new InvalidOptionError('pageCache', `expected "bypass" or "keep", got ${JSON.stringify(pageCache)}`);
    this.pageCache = pageCache;
    this.needs = reload === 'lazy' ? ['zero-on-discard', 'userfaultfd-missing'] : ['zero-on-discard'];
  }

  /** Path of the backing file while the VM is suspended. */
  get backingPath(): string | undefined {
    return this.pieces || this.writeOut ? this.path : undefined;
  }

  map(): void {
    // Load the native loader while the VM starts (native code is loading anyway), so that the
    // first lazy resume does not pay for it; a failure shows at that resume.
    if (this.reload === 'lazy') (this.loaderModule ??= import('../lazy-loader')).catch(() => {});
  }

  /**
   * After a lazy resume: loads every piece the guest has not touched yet and removes the backing
   * file; resolves at once if nothing is pending. Rejects with {@link BackingFileError} if a piece
   * is corrupt (the VM then ends as a crash).
   */
  async finishReload(): Promise<void> {
    if (this.loader) await this.finishLoading();
  }

  /**
   * Plans the write-out (the VM's own pages, from the page tables), creates the file and starts
   * writing; resolves once the first write is under way. The pages leave RAM batch by batch as
   * they become durable ({@link SuspendWork.released}).
   */
  async suspend(ctx: StrategyContext): Promise<SuspendWork> {
    // A lazy load still in progress: everything comes back first, then RAM goes out as usual.
    if (this.loader) await this.finishLoading();
    const t0 = performance.now();
    this.path ??= backingFilePath(this.dir, ctx.vmName, 'ram');
    const path = this.path;
    const { fd, direct } = this.pageCache === 'keep' ? { fd: createBackingFile(path, constants.O_RDWR), direct: false } : createDirectBackingFile(path);
    // The vCPUs are stopped and agent traffic is held: the VM's pages cannot change until resume.
    const pieces = cutRuns(ctx.ram.ownPageRuns(), PIECE_BYTES);
    const writeOut = new WriteOut(ctx.ram, fd, path, pieces, { batchBytes: BATCH_BYTES, checksum: (offset, length) => crc32(ctx.ram.view(offset, length)) });
    this.writeOut = writeOut;
    this.figures.directIo = direct ? 1 : 0;
    this.figures.lastSuspendMs = roundMs(performance.now() - t0);
    this.figures.lastReleaseMs = 0;
    this.figures.lastReleaseCancelled = 0;
    const released = writeOut.done.then(() => {
      // Buffered writes leave the file in the page cache, charged to the VM's group: drop it,
      // unless the user wants the VM's pages there.
      if (!direct && this.pageCache === 'bypass') releaseFileCache(path);
      if (this.writeOut === writeOut) this.figures.lastReleaseMs = roundMs(performance.now() - t0);
    });
    return { released };
  }

  async resume(ctx: StrategyContext): Promise<void> {
    if (this.loader) return;
    const t0 = performance.now();
    const writeOut = this.writeOut;
    if (writeOut) {
      // What is still resident stays; what was dropped comes back from the file.
      if (!writeOut.ended) this.figures.lastReleaseCancelled = 1;
      await writeOut.cancel();
      this.writeOut = undefined;
      this.noteWriteOut(writeOut);
      this.pieces = writeOut.dropped.map((p) => ({ offset: p.offset, length: p.length, crc: p.checksum }));
    }
    const pieces = this.pieces;
    const path = this.path;
    if (!pieces || !path) return;
    if (!pieces.length) {
      rmSync(path, { force: true });
      this.pieces = undefined;
      this.figures.bytesOnDisk = 0;
      this.figures.lastResumeMs = roundMs(performance.now() - t0);
      return;
    }
    // Lazy: read-write, so that the loader can punch out each piece once it is back in RAM.
    const fd = openChecked(path, pieces, this.reload === 'lazy' ? constants.O_RDWR : constants.O_RDONLY);
    if (this.reload === 'lazy') {
      try {
        await this.startLazyLoad(ctx, fd, pieces, path);
      } finally {
        closeSync(fd); // the loader holds its own copy
      }
      this.figures.lastResumeMs = roundMs(performance.now() - t0);
      return;
    }
    const loaded: Piece[] = [];
    try {
      for (const piece of pieces) {
        const view = ctx.ram.view(piece.offset, piece.length);
        loaded.push(piece);
        const n = readSync(fd, view, 0, piece.length, piece.offset);
        if (n !== piece.length) throw new BackingFileError(path, `short read at offset ${piece.offset}; the VM stays suspended`);
        if (crc32(view) !== piece.crc) throw new BackingFileError(path, `corrupt data at offset ${piece.offset} (CRC32 mismatch); the VM stays suspended`);
      }
    } catch (e) {
      // The guest must never see a wrong byte: drop whatever was read back, RAM is as suspended.
      for (const p of loaded) ctx.ram.discardHost(p.offset, p.length);
      throw e;
    } finally {
      closeSync(fd);
    }
    rmSync(path, { force: true });
    this.pieces = undefined;
    this.figures.bytesOnDisk = 0;
    this.figures.lastResumeMs = roundMs(performance.now() - t0);
  }

  /**
   * Registers guest RAM with the lazy loader and returns: the vCPUs may run at once. Throws with
   * nothing changed if the range cannot be registered.
   */
  private async startLazyLoad(ctx: StrategyContext, fd: number, pieces: Piece[], path: string): Promise<void> {
    // Loaded on first use (or by map): importing pvisor loads no native code.
    const { LazyLoader } = await (this.loaderModule ??= import('../lazy-loader'));
    this.lazyFigures = { faultsServed: 0, piecesLoadedLazily: 0, pagesZeroFilled: 0 };
    this.lastFullLoadMs = undefined;
    this.loadError = undefined;
    this.loadStartedAt = performance.now();
    this.loader = new LazyLoader(ctx.ram.hostAddr, ctx.ram.sizeBytes, fd, pieces, (e) => this.onLoaderEvent(ctx, path, e));
  }

  private onLoaderEvent(ctx: StrategyContext, path: string, e: LoaderEvent): void {
    const loader = this.loader;
    if (!loader) return;
    if (e.kind === 'done') {
      // Every piece is back and the range unregistered: the file has nothing the guest needs.
      loader.destroy();
      this.lazyFigures = loader.figures();
      this.loader = undefined;
      this.lastFullLoadMs = roundMs(performance.now() - this.loadStartedAt);
      rmSync(path, { force: true });
      this.pieces = undefined;
      this.figures.bytesOnDisk = 0;
      for (const w of this.loadWaiters.splice(0)) w.resolve();
      return;
    }
    // The loader keeps the faulting vCPUs waiting; the VM ends before any of them sees a byte.
    this.loadError = new BackingFileError(path, `the piece at offset ${e.offset} cannot be loaded (${e.why}) during a lazy reload; the VM cannot go on`);
    for (const w of this.loadWaiters.splice(0)) w.reject(this.loadError);
    ctx.fail(this.loadError);
  }

  /** Loads every remaining piece now; resolves when the loader is done. */
  private finishLoading(): Promise<void> {
    if (this.loadError) return Promise.reject(this.loadError);
    return new Promise((resolve, reject) => {
      this.loadWaiters.push({ resolve, reject });
      this.loader!.loadAll();
    });
  }

  stats(): StrategyStats {
    if (this.writeOut) this.noteWriteOut(this.writeOut);
    const lazy = this.loader?.figures() ?? this.lazyFigures;
    if ((this.loader || this.writeOut) && this.path) {
      // Grows while the write-out runs; shrinks while pieces load (each loaded piece is punched out).
      try {
        this.figures.bytesOnDisk = statSync(this.path).blocks * 512;
      } catch {
        // Removed under us: the next resume or suspend says so.
      }
    }
    const figures: Record<string, number> = { ...this.figures, reloadLazy: this.reload === 'lazy' ? 1 : 0, ...lazy };
    if (this.lastFullLoadMs !== undefined) figures.lastFullLoadMs = this.lastFullLoadMs;
    const notes = [`reload: ${this.reload}`, `page cache: ${this.pageCache}`];
    if (this.loader) notes.push('a lazy reload is in progress: pieces load when first touched');
    return { strategy: this.name, figures, notes };
  }

  /** Keeps a write-out's figures once it is over. */
  private noteWriteOut(w: WriteOut): void {
    this.figures.pagesWritten = w.figures.bytesWritten / PAGE_SIZE;
    this.figures.zeroPagesSkipped = w.figures.zeroPages;
  }

  close(): void {
    // The write-out touches RAM no more; its write in flight ends by itself.
    this.writeOut?.abandon();
    this.writeOut = undefined;
    // Before guest RAM is unmapped: closing the userfaultfd releases vCPUs blocked in a fault.
    this.loader?.destroy();
    this.loader = undefined;
    for (const w of this.loadWaiters.splice(0)) w.reject(this.loadError ?? new BackingFileError(this.path ?? '', 'the VM stopped during a lazy reload'));
    if (this.path) rmSync(this.path, { force: true });
  }
}

/** Opens the backing file for reading, checking it is there and long enough for every piece. */
function openChecked(path: string, pieces: readonly Piece[], flags: number): number {
  let fd: number;
  try {
    fd = openSync(path, flags);
  } catch (e) {
    throw new BackingFileError(path, 'the backing file is missing; the VM stays suspended', { cause: e });
  }
  const need = pieces.length ? pieces[pieces.length - 1].offset + pieces[pieces.length - 1].length : 0;
  const size = fstatSync(fd).size;
  if (size < need) {
    closeSync(fd);
    throw new BackingFileError(path, `the backing file is truncated (${size} bytes, ${need} needed); the VM stays suspended`);
  }
  return fd;
}

