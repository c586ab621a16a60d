/**
 * Offload: on suspend, writes the guest's resident pages (only those; zero pages are recorded,
 * not written) to a sparse backing file and drops them; on resume, reads them back and checks
 * each piece's CRC32 before any vCPU runs. Works on the default private anonymous RAM, so it
 * combines with KsmAdvice (the reference system could not offload KSM-advised RAM).
 */
import { randomBytes } from 'node:crypto';
import { closeSync, constants, fstatSync, openSync, readSync, rmSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { crc32 } from 'node:zlib';
import { BackingFileError } from '../errors';
import { PAGE_SIZE } from '../sys/constants';
import { residentRuns } from './resident-pages';
import type { MemoryStrategy, StrategyContext, StrategyStats } from './strategy';

/** Options of {@link Offload}. */
export interface OffloadOptions {
  /** Directory for the backing file. Default: the OS temp directory. */
  dir?: string;
}

/** A written piece of guest RAM: never crosses a 4 MiB boundary, so never a view chunk either. */
interface Piece {
  offset: number;
  length: number;
  crc: number;
}

const PIECE_BYTES = 4 * 1024 * 1024;
const ZERO_PAGE = Buffer.alloc(PAGE_SIZE);

/** Suspends a VM's RAM to a backing file and brings it back on resume. */
export class Offload implements MemoryStrategy {
  readonly name = 'offload';
  readonly ramBacking = 'any' as const;
  readonly exclusive = ['suspend-image'] as const;
  private readonly dir: string;
  private path: string | undefined;
  private pieces: Piece[] | undefined;
  private figures = { pagesWritten: 0, zeroPagesSkipped: 0, bytesOnDisk: 0, lastSuspendMs: 0, lastResumeMs: 0 };

  constructor(options: OffloadOptions = {}) {
    this.dir = options.dir ?? tmpdir();
  }

  /** Path of the backing file while the VM is suspended. */
  get backingPath(): string | undefined {
    return this.pieces ? this.path : undefined;
  }

  async suspend(ctx: StrategyContext): Promise<void> {
    const t0 = performance.now();
    this.path ??= join(this.dir, `pvisor-${ctx.vmName}-${process.pid}-${randomBytes(4).toString('hex')}.ram`);
    // 0600 and O_EXCL: the file holds the guest's memory; nobody else may read or pre-create it.
    const fd = openSync(this.path, constants.O_RDWR | constants.O_CREAT | constants.O_EXCL | constants.O_TRUNC, 0o600);
    const pieces: Piece[] = [];
    let zeroPages = 0;
    // The vCPUs are stopped and agent traffic is held: the resident set cannot change until resume.
    const runs = residentRuns(ctx.ram);
    try {
      for (const run of runs) {
        for (let off = run.offset; off < run.offset + run.length; ) {
          const end = Math.min(run.offset + run.length, (Math.floor(off / PIECE_BYTES) + 1) * PIECE_BYTES);
          // Split the piece around zero pages, which stay unwritten (holes read back as zeros).
          let start = -1;
          for (let p = off; p <= end; p += PAGE_SIZE) {
            const zero = p === end || ctx.ram.view(p, PAGE_SIZE).equals(ZERO_PAGE);
            if (zero && p < end) zeroPages++;
            if (!zero && start < 0) start = p;
            else if (zero && start >= 0) {
              const view = ctx.ram.view(start, p - start);
              writeAll(fd, view, start, this.path);
              pieces.push({ offset: start, length: p - start, crc: crc32(view) });
              start = -1;
            }
          }
          off = end;
        }
      }
      this.figures.bytesOnDisk = fstatSync(fd).blocks * 512;
    } catch (e) {
      closeSync(fd);
      rmSync(this.path, { force: true });
      throw e;
    }
    closeSync(fd);
    // Only now that every page is on disk: drop what was resident.
    for (const run of runs) ctx.ram.discardHost(run.offset, run.length);
    this.pieces = pieces;
    this.figures.pagesWritten = pieces.reduce((n, p) => n + p.length / PAGE_SIZE, 0);
    this.figures.zeroPagesSkipped = zeroPages;
    this.figures.lastSuspendMs = roundMs(performance.now() - t0);
  }

  async resume(ctx: StrategyContext): Promise<void> {
    const pieces = this.pieces;
    const path = this.path;
    if (!pieces || !path) return;
    const t0 = performance.now();
    let fd: number;
    try {
      fd = openSync(path, constants.O_RDONLY);
    } catch (e) {
      throw new BackingFileError(path, 'the backing file is missing; the VM stays suspended', { cause: e });
    }
    const loaded: Piece[] = [];
    try {
      const need = pieces.length ? pieces[pieces.length - 1].offset + pieces[pieces.length - 1].length : 0;
      const size = fstatSync(fd).size;
      if (size < need) throw new BackingFileError(path, `the backing file is truncated (${size} bytes, ${need} needed); the VM stays suspended`);
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

  stats(): StrategyStats {
    return { strategy: this.name, figures: { ...this.figures }, notes: [] };
  }

  close(): void {
    if (this.path) rmSync(this.path, { force: true });
  }
}

const roundMs = (ms: number) => Math.round(ms * 10) / 10;

function writeAll(fd: number, data: Buffer, position: number, path: string): void {
  let done = 0;
  while (done < data.length) {
    const n = writeSync(fd, data, done, data.length - done, position + done);
    if (n <= 0) throw new BackingFileError(path, `write failed at offset ${position + done}`);
    done += n;
  }
}
