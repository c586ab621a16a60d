/**
 * Offload: on suspend, writes the VM's own pages (zero pages are recorded, not written) to a
 * sparse backing file in the background and drops them as they become durable (../write-out.ts);
 * on resume, brings back what was dropped through the VM's userfaultfd server
 * (../uffd-server.ts): each 2 MiB piece is read, its CRC32C checked and placed with UFFDIO_COPY,
 * never through the event loop.
 * - `reload: 'eager'` (default): every piece is back and checked before any vCPU runs; a missing,
 *   truncated or corrupt file is a BackingFileError and the VM stays suspended, losing nothing.
 * - `reload: 'lazy'`: resume returns once the file is checked; the vCPUs run at once, a piece
 *   comes back on its first touch, and the rest is prefetched in the background, the pieces the
 *   guest touched first after the previous resume first. A corrupt piece ends the VM as a crash
 *   before the guest reads a byte of it.
 * Works on the default private anonymous RAM, so it combines with KsmAdvice (the reference system
 * could not offload KSM-advised RAM); on a backing without userfaultfd's missing mode (a private
 * file mapping) an eager reload copies the pieces back instead.
 */
import { closeSync, constants, fstatSync, openSync, readSync, statSync } from 'node:fs';
import { BackingFileError, InvalidOptionError } from '../../errors';
import { PAGE_SIZE } from '../../sys/constants';
import { booleanOption } from '../../units';
import { backingDirOptions, backingFilePath, checkBackingDir, createBackingFile, createDirectBackingFile, removeBackingFile, type BackingDirOptions } from '../backing-file';
import { releaseFileCache } from '../page-cache';
import { cutRuns } from '../../guest-ram/pages';
import { roundMs, type ExclusiveResource, type MemoryStrategy, type RamCapability, type StrategyContext, type StrategyStats, type SuspendWork } from '../strategy';
import type { UffdSource, UffdSourceEvent } from '../uffd-server';
import { WriteOut, type WrittenPiece } from '../write-out';

/**
 * How {@link Offload} brings guest RAM back on resume.
 * - `eager`: every piece is back and verified before any vCPU runs; resume costs the whole load.
 * - `lazy`: resume returns at once; a piece is loaded (and verified) on its first touch and the
 *   rest in the background; a corrupt piece ends the VM as a crash with a {@link BackingFileError}.
 * @category Strategies
 */
export type OffloadReload = 'eager' | 'lazy';

/**
 * Options of {@link Offload}.
 * @category Strategies
 */
export interface OffloadOptions extends BackingDirOptions {
  /** How resume brings RAM back. Default `eager`. */
  reload?: OffloadReload;
  /**
   * What the backing file does to the page cache.
   * - `bypass` (default): written and read with O_DIRECT where the filesystem allows (else
   *   written and then dropped from the cache): RAM really goes to disk, and group memory drops
   *   with it.
   * - `keep`: written through the page cache and left there. The VM's pages become the kernel's
   *   clean, reclaimable cache: it gives them to whoever needs memory (a VM's anonymous RAM,
   *   without swap, it could not), and a resume while they are still cached costs a copy from
   *   memory rather than a read from disk.
   */
  pageCache?: 'bypass' | 'keep';
  /**
   * Lazy reload: also bring back, in the background, the pieces the guest does not touch, those
   * it touched first after the previous resume first, so that the file is soon gone and later
   * touches find their pages already there. False: only what the guest touches comes back (the
   * rest stays in the file until {@link Offload.finishReload} or the next suspend), which keeps
   * a VM whose working set after resume is small as small as it can be. Default true.
   */
  prefetch?: boolean;
}

/**
 * Pieces of at most 2 MiB, never crossing a 2 MiB boundary (so never a view chunk either): large
 * enough that loading one amortises a fault, small enough that a fault waits for little
 * (`pvisor bench floors`; docs/design-figures.md).
 */
const PIECE_BYTES = 2 * 1024 * 1024;
/** The write-out syncs and drops every 16 MiB, so memory comes back progressively. */
const BATCH_BYTES = 16 * 1024 * 1024;

/** What a suspend left in the file that must come back: the pieces dropped from RAM. */
interface Image {
  path: string;
  pieces: WrittenPiece[];
  /** Written with O_DIRECT: read it back the same way. */
  direct: boolean;
}

/**
 * Suspends a VM's RAM to a backing file and brings it back on resume.
 * @category Strategies
 */
export class Offload implements MemoryStrategy {
  readonly name = 'offload';
  /** Zero pages are not written: dropped, they must read back as zero. Lazy reload serves faults. */
  readonly needs: readonly RamCapability[];
  readonly exclusive: readonly ExclusiveResource[] = ['suspend-image'];
  /** How resume brings RAM back. */
  readonly reload: OffloadReload;
  /** What the backing file does to the page cache. */
  readonly pageCache: 'bypass' | 'keep';
  /** Whether a lazy reload also loads, in the background, what the guest does not touch. */
  readonly prefetch: boolean;
  private readonly backingDir: Required<BackingDirOptions>;
  private path: string | undefined;
  /** The write-out of the last suspend, until it is cancelled by a resume. */
  private writeOut: WriteOut | undefined;
  private writeDirect = false;
  /** Dropped pieces that a resume must bring back (from the write-out, or after a failed resume). */
  private image: Image | undefined;
  /** A lazy reload in progress, until every piece is back (or the VM ends). */
  private source: UffdSource | undefined;
  private loadStartedAt = 0;
  private loadWaiters: { resolve(): void; reject(e: Error): void }[] = [];
  private loadError: BackingFileError | undefined;
  /**
   * Guest offsets of the pieces the guest touched first after the last lazy resume, in that
   * order: the next resume prefetches them first.
   */
  private hotOffsets: number[] = [];
  private figures = {
    pagesWritten: 0,
    zeroPagesSkipped: 0,
    bytesOnDisk: 0,
    directIo: 0,
    lastSuspendMs: 0,
    lastReleaseMs: 0,
    lastReleaseCancelled: 0,
    lastResumeMs: 0,
    faultsServed: 0,
    piecesLoadedLazily: 0,
    piecesPrefetched: 0,
  };
  private lastFullLoadMs: number | undefined;

  constructor(options: OffloadOptions = {}) {
    this.backingDir = backingDirOptions(options);
    const reload = options.reload ?? 'eager';
    if (reload !== 'eager' && reload !== 'lazy') throw new InvalidOptionError('reload', `expected "eager" or "lazy", got ${JSON.stringify(reload)}`);
    this.reload = reload;
    const pageCache = options.pageCache ?? 'bypass';
    if (pageCache !== 'bypass' && pageCache !== 'keep') throw new InvalidOptionError('pageCache', `expected "bypass" or "keep", got ${JSON.stringify(pageCache)}`);
    this.pageCache = pageCache;
    this.prefetch = booleanOption('prefetch', options.prefetch, true);
    this.needs = reload === 'lazy' ? ['zero-on-discard', 'userfaultfd-missing'] : ['zero-on-discard'];
  }

  /** Path of the backing file while the VM is suspended (or a lazy reload still needs it). */
  get backingPath(): string | undefined {
    return this.image || this.writeOut ? this.path : undefined;
  }

  /**
   * After a lazy resume: loads every piece the guest has not touched yet and removes the backing
   * file; resolves at once if nothing is pending. Rejects with {@link BackingFileError} if a piece
   * is corrupt (the VM then ends as a crash).
   */
  async finishReload(): Promise<void> {
    if (this.source) await this.finishLoading();
  }

  /**
   * Plans the write-out (the VM's own pages, from the page tables), creates the file and starts
   * writing; resolves once the first write is under way. The pages leave RAM batch by batch as
   * they become durable ({@link SuspendWork.released}).
   */
  async suspend(ctx: StrategyContext): Promise<SuspendWork> {
    // A lazy reload still in progress: everything comes back first, then RAM goes out as usual.
    if (this.source) await this.finishLoading();
    const t0 = performance.now();
    checkBackingDir(this.backingDir);
    // Before the file exists: a failure to load leaves nothing behind.
    const { crc32c } = await this.native();
    // A fresh path each time: nothing planted at a known path can get in the way. It is ours
    // (this.path, which close() removes) only once created: what was there is someone else's.
    const path = backingFilePath(this.backingDir.dir, ctx.vmName, 'ram');
    const { fd, direct } = this.pageCache === 'keep' ? { fd: createBackingFile(path, constants.O_RDWR), direct: false } : createDirectBackingFile(path);
    this.path = path;
    this.writeDirect = direct;
    // The vCPUs are stopped and agent traffic is held: the VM's pages cannot change until resume.
    const pieces = cutRuns(ctx.ram.ownPageRuns(), PIECE_BYTES);
    const checksum = (offset: number, length: number) => crc32c({ addr: ctx.ram.hostAddr + offset, length });
    const writeOut = new WriteOut(ctx.ram, fd, path, pieces, { batchBytes: BATCH_BYTES, checksum });
    this.writeOut = writeOut;
    Object.assign(this.figures, { directIo: direct ? 1 : 0, lastSuspendMs: roundMs(performance.now() - t0), lastReleaseMs: 0, lastReleaseCancelled: 0 });
    const released = writeOut.done.then(() => {
      // Buffered writes leave the file in the page cache, charged to the VM's group: drop it,
      // unless the user wants the VM's pages there.
      if (!direct && this.pageCache === 'bypass') releaseFileCache(path);
      if (this.writeOut === writeOut) this.figures.lastReleaseMs = roundMs(performance.now() - t0);
    });
    return { released };
  }

  async resume(ctx: StrategyContext): Promise<void> {
    if (this.source) return;
    const t0 = performance.now();
    const writeOut = this.writeOut;
    if (writeOut) {
      // What is still resident stays; what was dropped comes back from the file.
      if (!writeOut.ended) this.figures.lastReleaseCancelled = 1;
      await writeOut.cancel();
      this.writeOut = undefined;
      this.noteWriteOut(writeOut);
      this.image = { path: this.path!, pieces: writeOut.dropped, direct: this.writeDirect };
    }
    const image = this.image;
    if (!image) return;
    if (!image.pieces.length) this.forgetImage();
    else if (ctx.ram.capabilities.includes('userfaultfd-missing')) await this.reloadThroughServer(ctx, image);
    else await this.copyBack(ctx, image);
    this.figures.lastResumeMs = roundMs(performance.now() - t0);
  }

  /**
   * Registers the dropped pieces with the VM's userfaultfd server as one source and queues them
   * all, hottest first. Eager: waits until every piece is back, or undoes what came back and
   * throws. Lazy: returns at once.
   */
  private async reloadThroughServer(ctx: StrategyContext, image: Image): Promise<void> {
    const lazy = this.reload === 'lazy';
    // Lazy: read-write, so that the server can punch out each piece once it is back in RAM (an
    // eager reload keeps the file whole until it is through, for a retry after a failure).
    const fd = openChecked(image, lazy ? constants.O_RDWR : constants.O_RDONLY);
    let source: UffdSource;
    const events: UffdSourceEvent[] = [];
    let onEvent: (e: UffdSourceEvent) => void = (e) => void events.push(e);
    try {
      const server = await ctx.uffd();
      source = server.addSource(
        { kind: 'file', fd, checksum: true, punch: lazy, ranges: image.pieces.map((p) => ({ offset: p.offset, length: p.length, fileOffset: p.offset, checksum: p.checksum })) },
        (e) => onEvent(e),
      );
    } finally {
      closeSync(fd); // the server holds its own copy
    }
    // Eager: everything, now. Lazy: everything in the background, unless told not to.
    if (!lazy || this.prefetch) source.prefetch(hotFirst(image.pieces, this.hotOffsets));
    this.loadStartedAt = performance.now();
    this.lastFullLoadMs = undefined;
    if (lazy) {
      this.source = source;
      this.loadError = undefined;
      onEvent = (e) => this.onLazyEvent(ctx, image, source, e);
      for (const e of events.splice(0)) onEvent(e);
      return;
    }
    const outcome = await new Promise<UffdSourceEvent>((resolve) => {
      onEvent = resolve;
      if (events.length) resolve(events[0]);
    });
    source.remove();
    this.noteSource(source);
    if (outcome.kind === 'error') {
      // The guest must never see a wrong byte: drop whatever came back (the server may have
      // loaded more pieces until the removal), so RAM is as suspended.
      for (const p of image.pieces) ctx.ram.discardHost(p.offset, p.length, 'backing');
      throw new BackingFileError(image.path, `the piece at offset ${outcome.offset} cannot be loaded (${outcome.why}); the VM stays suspended`);
    }
    this.lastFullLoadMs = roundMs(performance.now() - this.loadStartedAt);
    this.forgetImage();
  }

  private onLazyEvent(ctx: StrategyContext, image: Image, source: UffdSource, e: UffdSourceEvent): void {
    if (this.source !== source) return;
    if (e.kind === 'done') {
      // Every piece is back: the file has nothing the guest needs.
      this.hotOffsets = source.touchOrder().map((i) => image.pieces[i].offset);
      source.remove();
      this.noteSource(source);
      this.source = undefined;
      this.lastFullLoadMs = roundMs(performance.now() - this.loadStartedAt);
      this.forgetImage();
      for (const w of this.loadWaiters.splice(0)) w.resolve();
      return;
    }
    // The server keeps the faulting vCPUs waiting; the VM ends before any of them sees a byte.
    this.loadError = new BackingFileError(image.path, `the piece at offset ${e.offset} cannot be loaded (${e.why}) during a lazy reload; the VM cannot go on`);
    for (const w of this.loadWaiters.splice(0)) w.reject(this.loadError);
    ctx.fail(this.loadError);
  }

  /** Loads every remaining piece of a lazy reload now; resolves when all are back. */
  private finishLoading(): Promise<void> {
    if (this.loadError) return Promise.reject(this.loadError);
    return new Promise((resolve, reject) => {
      this.loadWaiters.push({ resolve, reject });
      this.source!.loadAll();
    });
  }

  /**
   * Without userfaultfd (a private file mapping): reads every piece into guest RAM and checks it
   * before any vCPU runs; a failure drops what was read and leaves the VM suspended.
   */
  private async copyBack(ctx: StrategyContext, image: Image): Promise<void> {
    const { crc32c } = await this.native();
    const fd = openChecked(image, constants.O_RDONLY);
    const loaded: WrittenPiece[] = [];
    try {
      for (const piece of image.pieces) {
        const view = ctx.ram.view(piece.offset, piece.length);
        loaded.push(piece);
        for (let got = 0; got < piece.length; ) {
          const n = readSync(fd, view, got, piece.length - got, piece.offset + got);
          if (n <= 0) throw new BackingFileError(image.path, `short read at offset ${piece.offset + got}; the VM stays suspended`);
          got += n;
        }
        if (crc32c({ addr: ctx.ram.hostAddr + piece.offset, length: piece.length }) !== piece.checksum) {
          throw new BackingFileError(image.path, `the piece at offset ${piece.offset} cannot be loaded (CRC32C mismatch); the VM stays suspended`);
        }
      }
    } catch (e) {
      // The guest must never see a wrong byte: drop whatever was read back, RAM is as suspended.
      for (const p of loaded) ctx.ram.discardHost(p.offset, p.length, 'backing');
      throw e;
    } finally {
      closeSync(fd);
    }
    this.lastFullLoadMs = undefined;
    this.forgetImage();
  }

  /**
   * The native side (CRC32C), imported while the VM starts, when native code loads anyway:
   * importing pvisor loads none, and the first suspend does not wait for the import.
   */
  private nativeModule: Promise<typeof import('../../native/crc32c')> | undefined;
  private native(): Promise<typeof import('../../native/crc32c')> {
    return (this.nativeModule ??= import('../../native/crc32c'));
  }

  map(): void {
    this.native().catch(() => {}); // a failure shows at the first suspend
  }

  private forgetImage(): void {
    if (this.image) removeBackingFile(this.image.path);
    this.image = undefined;
    this.figures.bytesOnDisk = 0;
  }

  /** Keeps a write-out's figures once it is over. */
  private noteWriteOut(w: WriteOut): void {
    this.figures.pagesWritten = w.figures.bytesWritten / PAGE_SIZE;
    this.figures.zeroPagesSkipped = w.figures.zeroPages;
  }

  private noteSource(s: UffdSource): void {
    const f = s.figures();
    this.figures.faultsServed = f.faultsServed;
    this.figures.piecesLoadedLazily = f.rangesLoadedByFault;
    this.figures.piecesPrefetched = f.rangesPrefetched;
  }

  stats(): StrategyStats {
    if (this.writeOut) this.noteWriteOut(this.writeOut);
    if (this.source) this.noteSource(this.source);
    if ((this.source || this.writeOut) && this.path) {
      // Grows while the write-out runs; shrinks while pieces load lazily (each is punched out).
      try {
        this.figures.bytesOnDisk = statSync(this.path).blocks * 512;
      } catch {
        // Removed under us: the next resume or suspend says so.
      }
    }
    const figures: Record<string, number> = { ...this.figures, reloadLazy: this.reload === 'lazy' ? 1 : 0, prefetch: this.reload === 'lazy' && this.prefetch ? 1 : 0 };
    if (this.lastFullLoadMs !== undefined) figures.lastFullLoadMs = this.lastFullLoadMs;
    const notes = [`reload: ${this.reload}`, `page cache: ${this.pageCache}`];
    if (this.reload === 'lazy') notes.push(this.prefetch ? 'prefetch: what the guest does not touch comes back in the background' : 'prefetch: off');
    if (this.source) notes.push('a lazy reload is in progress: pieces load when first touched, the rest in the background');
    return { strategy: this.name, figures, notes };
  }

  close(): void {
    // Only a file that still holds something: a path whose file is gone may be someone else's now.
    const path = this.backingPath;
    // The write-out touches RAM no more; its write in flight ends by itself.
    this.writeOut?.abandon();
    this.writeOut = undefined;
    // The composition destroys the userfaultfd server next, which releases any vCPU in a fault.
    this.source = undefined;
    for (const w of this.loadWaiters.splice(0)) w.reject(this.loadError ?? new BackingFileError(this.path ?? '', 'the VM stopped during a lazy reload'));
    if (path) removeBackingFile(path);
    this.image = undefined;
  }
}

/**
 * The order to load pieces in: those holding the offsets the guest touched first last time, in
 * that order, then the rest in address order.
 */
export function hotFirst(pieces: readonly { offset: number; length: number }[], hotOffsets: readonly number[]): number[] {
  const order: number[] = [];
  const taken = new Uint8Array(pieces.length);
  for (const off of hotOffsets) {
    const i = pieceAt(pieces, off);
    if (i >= 0 && !taken[i]) {
      taken[i] = 1;
      order.push(i);
    }
  }
  for (let i = 0; i < pieces.length; i++) if (!taken[i]) order.push(i);
  return order;
}

/** Index of the piece holding `offset` (pieces in address order), or -1. */
function pieceAt(pieces: readonly { offset: number; length: number }[], offset: number): number {
  let lo = 0;
  let hi = pieces.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (pieces[mid].offset + pieces[mid].length <= offset) lo = mid + 1;
    else hi = mid;
  }
  return lo < pieces.length && pieces[lo].offset <= offset ? lo : -1;
}

/**
 * Opens the backing file (O_DIRECT if it was written so), checking it is there and long enough
 * for every piece: a BackingFileError otherwise, and the VM stays suspended.
 */
function openChecked(image: Image, flags: number): number {
  let fd: number;
  try {
    fd = openSync(image.path, flags | (image.direct ? constants.O_DIRECT : 0));
  } catch (e) {
    // Missing is one thing; a disk that fails (EIO) or refuses (EACCES) is another, and says so.
    const why = (e as NodeJS.ErrnoException).code === 'ENOENT' ? 'the backing file is missing' : `the backing file cannot be opened (${(e as Error).message})`;
    throw new BackingFileError(image.path, `${why}; the VM stays suspended`, { cause: e });
  }
  const last = image.pieces[image.pieces.length - 1];
  const need = last ? last.offset + last.length : 0;
  let size: number;
  try {
    size = fstatSync(fd).size;
  } catch (e) {
    closeSync(fd);
    throw new BackingFileError(image.path, `the backing file cannot be examined (${(e as Error).message}); the VM stays suspended`, { cause: e });
  }
  if (size < need) {
    closeSync(fd);
    throw new BackingFileError(image.path, `the backing file is truncated (${size} bytes, ${need} needed); the VM stays suspended`);
  }
  return fd;
}
