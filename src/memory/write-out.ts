/**
 * The background half of an offload: writes a suspended VM's own pages to its backing file and
 * drops them from RAM batch by batch, each batch only once it is durable (written and
 * fdatasync'd), so the VM counts as suspended long before its memory is all given back, and a
 * failure at any point loses nothing: a page leaves RAM only when the file holds it.
 *
 * What a crash leaves at each point: the VM's RAM and the table of what was written live in this
 * process, so if the process dies the VM is gone whatever the file holds; the file (0600, named
 * after the VM and the process id) stays behind and is removed by the next backing file created
 * in the same directory (see backing-file.ts). A failed write or sync (a full disk, an I/O error)
 * stops the write-out: what was dropped is in the file, the rest stays resident, the VM stays
 * suspended and resumes as usual.
 *
 * Writes go straight from guest RAM to the file: with O_DIRECT (no copy through the page cache,
 * and nothing left in it) when the filesystem takes it, else through the page cache, which the
 * caller may then drop. One write is in flight at a time, on libuv's pool where file I/O belongs;
 * the event loop only splits zero pages and checksums, piece by piece.
 */
import { close, fdatasync, write } from 'node:fs';
import { promisify } from 'node:util';
import { BackingFileError } from '../errors';
import { splitZeroPages, type PageRun } from '../guest-ram/pages';
import type { StrategyRam } from './strategy';

const writeAsync = promisify(write);
const fdatasyncAsync = promisify(fdatasync);

/** A run of non-zero pages the file holds, at the same offset as in guest RAM. */
export interface WrittenPiece {
  offset: number;
  length: number;
  /** The piece's checksum, by the function the caller gave. */
  checksum: number;
}

/** How to write. */
export interface WriteOutOptions {
  /** Bytes written between two fdatasyncs, after each of which that batch is dropped from RAM. */
  batchBytes: number;
  /** Checksum of the bytes at [offset, offset+length) of guest RAM. */
  checksum(offset: number, length: number): number;
}

/** Figures of one write-out, so far. */
export interface WriteOutFigures {
  bytesWritten: number;
  bytesDropped: number;
  zeroPages: number;
  batches: number;
}

/** One write-out of guest RAM pieces to an open backing file (which it closes when it ends). */
export class WriteOut {
  /** Settles when every piece is dropped, or the write-out was cancelled; rejects if it failed. */
  readonly done: Promise<void>;
  /** Written, durable and dropped from RAM: what a resume must bring back from the file. */
  readonly dropped: WrittenPiece[] = [];
  readonly figures: WriteOutFigures = { bytesWritten: 0, bytesDropped: 0, zeroPages: 0, batches: 0 };
  private stopping = false;
  private finished = false;

  /**
   * Starts writing `pieces` (runs of the VM's own pages, none crossing a 1 GiB view chunk) of
   * `ram` to `fd`: the first write is issued before this returns.
   */
  constructor(
    private readonly ram: StrategyRam,
    private readonly fd: number,
    private readonly path: string,
    private readonly pieces: readonly PageRun[],
    private readonly options: WriteOutOptions,
  ) {
    // The fd is closed before `done` settles: whoever waits for it finds nothing left open.
    this.done = this.run().finally(
      () =>
        new Promise<void>((resolve) =>
          close(this.fd, () => {
            this.finished = true;
            resolve();
          }),
        ),
    );
    this.done.catch(() => {}); // the owner observes it; an unobserved failure must not crash the process
  }

  /** True once nothing more will be written or dropped. */
  get ended(): boolean {
    return this.finished;
  }

  /**
   * Stops after the write in flight, dropping nothing more: what is still resident stays.
   * Resolves when the write-out has ended (whatever its outcome).
   */
  async cancel(): Promise<void> {
    this.stopping = true;
    await this.done.catch(() => {});
  }

  /** Stops at once without waiting (the VM is ending): the write-out touches RAM no more. */
  abandon(): void {
    this.stopping = true;
  }

  private async run(): Promise<void> {
    let batch: { written: WrittenPiece[]; zero: PageRun[]; bytes: number } = { written: [], zero: [], bytes: 0 };
    for (const piece of this.pieces) {
      if (this.stopping) return;
      const split = splitZeroPages(this.ram.view(piece.offset, piece.length), piece.offset);
      this.figures.zeroPages += split.zeroPages;
      let at = piece.offset;
      for (const run of split.nonZero) {
        if (run.offset > at) batch.zero.push({ offset: at, length: run.offset - at });
        const checksum = this.options.checksum(run.offset, run.length);
        await this.writeRun(run);
        if (this.stopping) return;
        batch.written.push({ offset: run.offset, length: run.length, checksum });
        batch.bytes += run.length;
        at = run.offset + run.length;
      }
      const end = piece.offset + piece.length;
      if (at < end) batch.zero.push({ offset: at, length: end - at });
      if (batch.bytes >= this.options.batchBytes) {
        await this.commit(batch);
        batch = { written: [], zero: [], bytes: 0 };
      }
    }
    if (!this.stopping) await this.commit(batch);
  }

  /** Writes one run straight from guest RAM; a short or failed write is a BackingFileError. */
  private async writeRun(run: PageRun): Promise<void> {
    let done = 0;
    while (done < run.length) {
      if (this.stopping) return;
      let n: number;
      try {
        // The view is taken anew after every await: the VM may have ended meanwhile.
        ({ bytesWritten: n } = await writeAsync(this.fd, this.ram.view(run.offset + done, run.length - done), 0, run.length - done, run.offset + done));
      } catch (e) {
        if (this.stopping) return;
        throw new BackingFileError(this.path, `write failed at offset ${run.offset + done} (${(e as Error).message}); what was not written stays in RAM`, { cause: e });
      }
      if (n <= 0) throw new BackingFileError(this.path, `write made no progress at offset ${run.offset + done}; what was not written stays in RAM`);
      done += n;
      this.figures.bytesWritten += n;
    }
  }

  /** Makes a batch durable, then drops it: written pages fall back to the backing, zero pages to zero. */
  private async commit(batch: { written: WrittenPiece[]; zero: PageRun[] }): Promise<void> {
    try {
      await fdatasyncAsync(this.fd);
    } catch (e) {
      if (this.stopping) return;
      throw new BackingFileError(this.path, `fdatasync failed (${(e as Error).message}); what was not made durable stays in RAM`, { cause: e });
    }
    // A resume that came meanwhile wants these pages where they are.
    if (this.stopping) return;
    for (const p of batch.written) this.ram.discardHost(p.offset, p.length, 'backing');
    for (const z of batch.zero) this.ram.discardHost(z.offset, z.length, 'zero');
    this.dropped.push(...batch.written);
    this.figures.bytesDropped += batch.written.reduce((n, p) => n + p.length, 0) + batch.zero.reduce((n, z) => n + z.length, 0);
    this.figures.batches++;
  }
}
