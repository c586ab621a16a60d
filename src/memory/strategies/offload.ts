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
import { backingFilePath, createBackingFile, writeFully } from '../backing-file';
import type { LazyLoader, LoaderEvent, LoaderFigures } from '../lazy-loader';
import { releaseFileCache } from '../page-cache';
import { cutRuns, splitZeroPages, type PageRun } from '../pages';
import { roundMs, type ExclusiveResource, type MemoryStrategy, type RamCapability, type StrategyContext, type StrategyStats } from '../strategy';

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
}

/** A written piece of guest RAM: never crosses a 4 MiB boundary, so never a view chunk either. */
interface Piece {
  offset: number;
  length: number;
  crc: number;
}

const PIECE_BYTES = 4 * 1024 * 1024;

/** Suspends a VM's RAM to a backing file and brings it back on resume. */
export class Offload implements MemoryStrategy {
  readonly name = 'offload';
  /** Zero pages are not written: dropped, they must read back as zero. Lazy reload serves faults. */
  readonly needs: readonly RamCapability[];
  readonly exclusive: readonly ExclusiveResource[] = ['suspend-image'];
  /** How resume brings RAM back. */
  readonly reload: OffloadReload;
  private readonly dir: string;
  private path: string | undefined;
  private pieces: Piece[] | undefined;
  private figures = { pagesWritten: 0, zeroPagesSkipped: 0, bytesOnDisk: 0, lastSuspendMs: 0, lastResumeMs: 0 };
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
    this.needs = reload === 'lazy' ? ['zero-on-discard', 'userfaultfd-missing'] : ['zero-on-discard'];
  }

  /** Path of the backing file while the VM is suspended. */
  get backingPath(): string | undefined {
    return this.pieces ? this.path : undefined;
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

  async suspend(ctx: StrategyContext): Promise<void> {
    // A lazy load still in progress: everything comes back first, then RAM goes out as usual.
    if (this.loader) await this.finishLoading();
    const t0 = performance.now();
    this.path ??= backingFilePath(this.dir, ctx.vmName, 'ram');
    const fd = createBackingFile(this.path, constants.O_RDWR);
    const pieces: Piece[] = [];
    const zeroRuns: PageRun[] = [];
    let zeroPages = 0;
    // The vCPUs are stopped and agent traffic is held: the VM's pages cannot change until resume.
    try {
      for (const cut of cutRuns(ctx.ram.ownPageRuns(), PIECE_BYTES)) {
        // Zero pages stay unwritten (holes read back as zeros) and are dropped to zero.
        const split = splitZeroPages(ctx.ram.view(cut.offset, cut.length), cut.offset);
        zeroPages += split.zeroPages;
        let at = cut.offset;
        for (const run of split.nonZero) {
          if (run.offset > at) zeroRuns.push({ offset: at, length: run.offset - at });
          const view = ctx.ram.view(run.offset, run.length);
          writeFully(fd, view, run.offset, this.path);
          pieces.push({ offset: run.offset, length: run.length, crc: crc32(view) });
          at = run.offset + run.length;
        }
        if (at < cut.offset + cut.length) zeroRuns.push({ offset: at, length: cut.offset + cut.length - at });
      }
      this.figures.bytesOnDisk = fstatSync(fd).blocks * 512;
    } catch (e) {
      closeSync(fd);
      rmSync(this.path, { force: true });
      throw e;
    }
    closeSync(fd);
    releaseFileCache(this.path);
    // Only now that every page is in the file: drop what was the VM's. A written page comes back
    // from the file (so it may fall back to the backing's page meanwhile); a zero page must read zero.
    for (const p of pieces) ctx.ram.discardHost(p.offset, p.length, 'backing');
    for (const z of zeroRuns) ctx.ram.discardHost(z.offset, z.length, 'zero');
    this.pieces = pieces;
    this.figures.pagesWritten = pieces.reduce((n, p) => n + p.length / PAGE_SIZE, 0);
    this.figures.zeroPagesSkipped = zeroPages;
    this.figures.lastSuspendMs = roundMs(performance.now() - t0);
  }

  async resume(ctx: StrategyContext): Promise<void> {
    const pieces = this.pieces;
    const path = this.path;
    if (!pieces || !path || this.loader) return;
    const t0 = performance.now();
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
    const lazy = this.loader?.figures() ?? this.lazyFigures;
    if (this.loader && this.path) {
      // Shrinks while pieces load: the loader punches each loaded piece out of the file.
      try {
        this.figures.bytesOnDisk = statSync(this.path).blocks * 512;
      } catch {
        // Removed under us: the next resume or suspend says so.
      }
    }
    const figures: Record<string, number> = { ...this.figures, reloadLazy: this.reload === 'lazy' ? 1 : 0, ...lazy };
    if (this.lastFullLoadMs !== undefined) figures.lastFullLoadMs = this.lastFullLoadMs;
    const notes = [`reload: ${this.reload}`];
    if (this.loader) notes.push('a lazy reload is in progress: pieces load when first touched');
    return { strategy: this.name, figures, notes };
  }

  close(): void {
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

