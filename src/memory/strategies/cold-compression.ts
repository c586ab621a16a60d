/**
 * ColdCompression: while the VM runs, blocks of guest RAM that stay unchanged for a while are
 * compressed with lz4 into host memory and dropped; the guest's first touch of a dropped block
 * brings it back through the VM's userfaultfd server, in C, without waiting on the event loop.
 *
 * Finding cold blocks (docs/cold-compression.md says why this way): the hosts pvisor targets have
 * neither idle page tracking nor DAMON's virtual-address monitor, and KVM's guest accesses do not
 * reach the host's accessed bits, so a block counts as cold when a checksum of it (sampled: the
 * first 256 bytes of each page) has not changed for `coldAfterMs` (writes), and a block that a
 * read brings back soon after it was dropped (a refault), or that is written while it is being
 * compressed, waits four times as long each time before it is tried again (reads, and writes the
 * sample missed). A block lz4 cannot shrink enough stays resident and is not tried again until
 * its content changes.
 *
 * Compressing a block never loses a write: the native server write-protects it first, lz4
 * compresses it in place (in C, in batches of 1 MiB between which the event loop runs), and the
 * block is dropped only if nothing wrote into it meanwhile (native-prebuilds/helpers/
 * uffd_server.c). Every stored block carries the CRC32C of its bytes; one that fails it ends the
 * VM before the guest reads a wrong byte.
 */
import { closeSync, constants } from 'node:fs';
import { BackingFileError, InvalidOptionError, PvisorError, SystemCallError } from '../../errors';
import { backingDirOptions, backingFilePath, checkBackingDir, createBackingFile, removeBackingFile, type BackingDirOptions } from '../backing-file';
import { numberOption, parseTimeoutMs } from '../../units';
import type { ColdOutcome, ColdScan, ColdStore } from '../uffd-server';
/** COLD_BATCH_BYTES of ../uffd-server, which is not imported here: importing pvisor loads no native code. */
const COLD_BATCH_BYTES = 1024 * 1024;
import { roundMs, type MemoryStrategy, type PeriodicWork, type StrategyContext, type StrategyStats } from '../strategy';

/**
 * Options of {@link ColdCompression}. `dir` and `allowMemoryBackedDir` are for the file that holds
 * the compressed blocks while the VM is suspended (they are written there as they are, never
 * decompressed, and read back on resume).
 * @category Strategies
 */
export interface ColdCompressionOptions extends BackingDirOptions {
  /**
   * How long a block's content must stay unchanged before it is compressed. Default 10 s, an
   * agent's pause between tool calls. What bears on it (docs/cold-compression.md): a wrong guess
   * costs the guest one fault and doubles that block's wait, and a read-hot working set settles
   * after two such guesses per block, then stays resident; a shorter delay gives memory back
   * sooner for that price.
   */
  coldAfterMs?: number;
  /**
   * Bytes per block, the unit that is compressed, dropped and brought back by one fault: a power of
   * two from 16 KiB to 4 MiB. Default 64 KiB: lz4 finds most of what larger blocks would, and a
   * fault maps one block in one UFFDIO_COPY, which places pieces of that size much faster than
   * 4 KiB ones (docs/design-figures.md).
   */
  blockBytes?: number;
  /**
   * Most host memory the compressed blocks may take; beyond it, cold blocks stay resident.
   * Default a quarter of guest RAM: room for all of it at 4:1, which lz4 reaches on compressible
   * content (docs/design-figures.md), and never more than a quarter of what the VM could cost
   * without the strategy.
   */
  maxStoreBytes?: number;
  /**
   * Share of one CPU the scans and compression on the event loop may take, from 0.001 to 1.
   * Default 0.05: an idle VM's scans take far less, so the share binds only while a working set
   * is being compressed (docs/design-figures.md).
   */
  cpuShare?: number;
  /**
   * A block is stored only if lz4 shrinks it by at least this many percent (1-99): below that it
   * is left resident, so incompressible content never costs more than without the strategy.
   * Default 25.
   */
  minSavingPercent?: number;
}

const SCAN_INTERVAL_MS = 1000;
/**
 * Guest RAM looked at per tick: a 512 MiB VM in one tick. Only fully present blocks are
 * checksummed, a sixteenth of each page, so a tick costs well under a millisecond per 64 MiB
 * resident.
 */
const SCAN_BYTES_PER_TICK = 512 * 1024 * 1024;
/** At most this much is compressed per tick (a batch at a time); the rest waits for the next. */
const COMPRESS_BYTES_PER_TICK = 32 * 1024 * 1024;
/**
 * After a wrong guess a block waits coldAfter x 4^level before the next try, up to 4^6 (11 hours
 * at the default). A block back within coldAfter of its drop (needed again before it would even
 * have counted as cold: read-hot) goes up two levels at once, one back later goes up one. A
 * read-hot block thus comes back after 1, then 16, then 256 x coldAfter: measured in bench
 * memory's mix cell, doubling let a whole round of the hot part come back in each 30 s window.
 */
const BACKOFF_FACTOR = 4;
const MAX_BACKOFF = 6;
/** A refault within this many of its waits after the drop counts as a wrong guess. */
const SOON_PERIODS = 4;

/**
 * The guest read back, or wrote into, a block that failed its integrity check.
 * @category Errors
 */
export class ColdBlockError extends PvisorError {
  /** Offset of the block in guest RAM. */
  readonly offset: number;
  constructor(offset: number, why: string) {
    super('PVISOR_COLD_BLOCK_CORRUPT', `cold-compression: the compressed block at guest RAM offset 0x${offset.toString(16)} cannot be restored: ${why}; the VM is ended so that the guest never reads a wrong byte`);
    this.offset = offset;
  }
}

/**
 * Compresses cold guest RAM into host memory while the VM runs.
 * @category Strategies
 */
export class ColdCompression implements MemoryStrategy {
  readonly name = 'cold-compression';
  readonly needs = ['userfaultfd-missing', 'userfaultfd-write-protect'] as const;
  readonly exclusive = ['resident-pages'] as const;
  readonly periodic: PeriodicWork;
  private readonly coldAfterMs: number;
  private readonly blockBytes: number;
  private readonly maxStoreBytesOption: number | undefined;
  private readonly minSaving: number;
  private readonly backingDir: Required<BackingDirOptions>;
  /** The file holding the store while the VM is suspended. */
  private savedPath: string | undefined;
  private store: ColdStore | undefined;
  private ram: StrategyContext['ram'] | undefined;
  private vmName = 'vm';
  private storeReady: Promise<ColdStore> | undefined;
  private closed = false;
  private cursor = 0;
  // Per block, in the host process (a 512 MiB VM in 64 KiB blocks: 8192 entries).
  private crc = new Uint32Array(0);
  private seen = new Uint8Array(0);
  private changedAt = new Float64Array(0);
  private storedAt = new Float64Array(0);
  private notBefore = new Float64Array(0);
  private backoff = new Uint8Array(0);
  private incompressible = new Uint8Array(0);
  /** Where scans write their readings, allocated once (a scan allocates nothing). */
  private readings: ColdScan = new Uint32Array(0);
  /** Cold blocks found by the scan and not compressed yet, with the CRC32C they had then. */
  private pending = new Map<number, number>();
  private readonly counts = { blocksCompressed: 0, refaultsSoon: 0, refaults: 0, writtenWhileCompressing: 0, scanMs: 0, compressMs: 0, longestBatchMs: 0 };

  constructor(options: ColdCompressionOptions = {}) {
    this.coldAfterMs = options.coldAfterMs === undefined ? 10_000 : parseTimeoutMs('coldAfterMs', options.coldAfterMs);
    this.blockBytes = numberOption('blockBytes', options.blockBytes, 64 * 1024, (v) => Number.isInteger(v) && v >= 16 * 1024 && v <= 4 * 1024 * 1024 && (v & (v - 1)) === 0, 'a power of two from 16 KiB to 4 MiB');
    this.maxStoreBytesOption = options.maxStoreBytes === undefined ? undefined : numberOption('maxStoreBytes', options.maxStoreBytes, 0, (v) => Number.isSafeInteger(v) && v > 0, 'a positive whole number of bytes');
    const cpuShare = numberOption('cpuShare', options.cpuShare, 0.05, (v) => v >= 0.001 && v <= 1, 'from 0.001 to 1');
    this.minSaving = numberOption('minSavingPercent', options.minSavingPercent, 25, (v) => v >= 1 && v <= 99, 'from 1 to 99') / 100;
    this.periodic = { intervalMs: SCAN_INTERVAL_MS, cpuShare };
    this.backingDir = backingDirOptions(options);
  }

  map(ctx: StrategyContext): void {
    this.ram = ctx.ram;
    this.vmName = ctx.vmName;
    const size = ctx.ram.sizeBytes;
    if (size % this.blockBytes) throw new InvalidOptionError('blockBytes', `${this.blockBytes} does not divide guest RAM (${size} bytes)`);
    const n = size / this.blockBytes;
    this.crc = new Uint32Array(n);
    this.seen = new Uint8Array(n);
    this.changedAt = new Float64Array(n);
    this.storedAt = new Float64Array(n);
    this.notBefore = new Float64Array(n);
    this.backoff = new Uint8Array(n);
    this.incompressible = new Uint8Array(n);
    this.readings = new Uint32Array(2 * Math.min(n, Math.max(1, SCAN_BYTES_PER_TICK / this.blockBytes)));
    this.storeReady = ctx.uffd().then((server) => {
      this.store = server.attachColdStore(this.blockBytes, size, (why, offset) => ctx.fail(new ColdBlockError(offset, why)));
      return this.store;
    });
    // A host that cannot write-protect guest RAM cannot run this strategy: say so at once.
    this.storeReady.catch((e: Error) => {
      if (!this.closed) ctx.fail(e instanceof PvisorError ? e : new PvisorError('PVISOR_COLD_COMPRESSION_UNAVAILABLE', `cold-compression: ${e.message}`));
    });
  }

  async tick(ctx: StrategyContext): Promise<void> {
    const store = await this.storeReady;
    if (this.closed || !store) return;
    const t0 = performance.now();
    this.noteRefaults(store, t0);
    this.scan(store, t0);
    this.counts.scanMs += performance.now() - t0;
    const maxStore = this.maxStoreBytesOption ?? ctx.ram.sizeBytes / 4;
    const perBatch = Math.max(1, COLD_BATCH_BYTES / this.blockBytes);
    for (let budget = COMPRESS_BYTES_PER_TICK; budget > 0 && this.pending.size && !this.closed; budget -= COLD_BATCH_BYTES) {
      if (store.figures().bytesStored >= maxStore) break;
      const batch: number[] = [];
      for (const b of this.pending.keys()) {
        if (batch.length === perBatch) break;
        batch.push(b);
      }
      this.compressBatch(store, batch);
      // The event loop gets its turn between two batches.
      await new Promise((r) => setImmediate(r));
    }
  }

  /** Blocks a fault brought back since the last tick: a refault soon after the drop backs off. */
  private noteRefaults(store: ColdStore, now: number): void {
    const { faulted } = store.states(true);
    for (let b = 0; b < faulted.length; b++) {
      if (!faulted[b]) continue;
      this.counts.refaults++;
      const away = now - this.storedAt[b];
      const soon = away < SOON_PERIODS * this.waitMs(b);
      if (soon) this.counts.refaultsSoon++;
      this.touched(b, now, soon ? (away < this.coldAfterMs ? 2 : 1) : 0);
    }
  }

  /**
   * Block b was in use after all. A wrong guess (`levels` > 0) makes it wait 4^levels times as
   * long as last time; none (it was cold a long while) starts it again from coldAfter.
   */
  private touched(b: number, now: number, levels: number): void {
    this.backoff[b] = levels > 0 ? Math.min(MAX_BACKOFF, this.backoff[b] + levels) : 0;
    this.changedAt[b] = now;
    this.notBefore[b] = now + this.waitMs(b);
  }

  /** How long block b waits before the next try: coldAfter, times 4 for each wrong guess in a row. */
  private waitMs(b: number): number {
    return this.coldAfterMs * BACKOFF_FACTOR ** this.backoff[b];
  }

  /** Reads the next window of blocks; those cold enough to compress join {@link pending}. */
  private scan(store: ColdStore, now: number): void {
    const n = this.crc.length;
    const count = Math.min(n - this.cursor, Math.max(1, SCAN_BYTES_PER_TICK / this.blockBytes));
    const first = this.cursor;
    this.cursor = first + count >= n ? 0 : first + count;
    const readings = this.readings;
    store.scan(first, count, readings);
    const pages = this.blockBytes / 4096;
    for (let k = 0; k < count; k++) {
      const b = first + k;
      const crc = readings[2 * k];
      const present = readings[2 * k + 1];
      // Compressed, or (partly) never touched or freed: nothing to gain from compressing it now.
      if (present !== pages) {
        this.pending.delete(b);
        continue;
      }
      if (!this.seen[b] || this.crc[b] !== crc) {
        this.pending.delete(b);
        this.seen[b] = 1;
        this.crc[b] = crc;
        this.changedAt[b] = now;
        this.incompressible[b] = 0;
        continue;
      }
      if (this.incompressible[b] || now - this.changedAt[b] < this.coldAfterMs || now < this.notBefore[b]) continue;
      this.pending.set(b, crc);
    }
  }

  /**
   * Compresses one batch in C on this thread (a few ms for 1 MiB): the store's bytes never pass
   * through JavaScript or the libuv pool, whose allocations stay behind in malloc arenas
   * (docs/design-figures.md has both figures).
   */
  private compressBatch(store: ColdStore, batch: number[]): void {
    const scanned = batch.map((b) => this.pending.get(b));
    for (const b of batch) this.pending.delete(b);
    const began = store.begin(batch);
    const blocks = batch.filter((_, k) => began[k]);
    const expected = scanned.filter((_, k) => began[k]);
    if (!blocks.length) return;
    // A block written since the scan found it cold is not cold: left resident, looked at again later.
    const unchanged = blocks.map((b, k) => this.sampleUnchanged(store, b, expected[k]));
    const now = performance.now();
    const changed = blocks.filter((_, k) => !unchanged[k]);
    if (changed.length) {
      store.finish(changed);
      for (const b of changed) this.changedAt[b] = now;
    }
    const cold = blocks.filter((_, k) => unchanged[k]);
    if (!cold.length) return;
    const t0 = performance.now();
    store.compress(cold, Math.floor(this.blockBytes * (1 - this.minSaving)));
    const outcomes = store.finish(cold);
    const took = performance.now() - t0;
    this.counts.compressMs += took;
    this.counts.longestBatchMs = Math.max(this.counts.longestBatchMs, took);
    cold.forEach((b, k) => this.account(b, outcomes[k], now));
  }

  /** Whether block b still has the checksum the scan found (it is write-protected by now). */
  private sampleUnchanged(store: ColdStore, b: number, scanned: number | undefined): boolean {
    const one = this.readings.subarray(0, 2);
    store.scan(b, 1, one);
    return one[1] === this.blockBytes / 4096 && one[0] === scanned;
  }

  private account(b: number, outcome: ColdOutcome, now: number): void {
    switch (outcome) {
      case 1 /* Stored */:
        this.counts.blocksCompressed++;
        this.storedAt[b] = now;
        break;
      case 0 /* Kept */:
        this.incompressible[b] = 1;
        break;
      case 3 /* Written */:
        this.counts.writtenWhileCompressing++;
        this.touched(b, now, 1);
        break;
      case 2 /* Zero */:
        // Dropped: it reads back as zero, as it was.
        this.seen[b] = 0;
        break;
    }
  }

  /**
   * The compressed blocks go to a file as they are (a suspended VM keeps nothing in memory), and
   * leave memory once it is durable; a block touched meanwhile (another strategy reading guest
   * RAM) is read back from the file. A file that cannot take them fails the suspend with nothing
   * changed.
   */
  async suspend(): Promise<void> {
    const store = this.store;
    if (!store || this.closed || store.figures().blocksStored === 0) return;
    checkBackingDir(this.backingDir);
    const path = backingFilePath(this.backingDir.dir, this.vmName, 'cold');
    let fd: number;
    try {
      fd = createBackingFile(path, constants.O_RDWR);
    } catch (e) {
      throw new BackingFileError(path, `cannot create the file for the compressed blocks: ${(e as Error).message}`, { cause: e });
    }
    try {
      store.save(fd);
      this.savedPath = path;
    } catch (e) {
      removeBackingFile(path);
      throw new BackingFileError(path, `cannot write the compressed blocks: ${(e as Error).message}`, { cause: e });
    } finally {
      closeSync(fd);
    }
  }

  /** Reads the compressed blocks back, each checked; a bad file leaves the VM suspended and the file as it is. */
  async resume(): Promise<void> {
    const path = this.savedPath;
    if (!path || !this.store) return;
    try {
      this.store.load();
    } catch (e) {
      const why = e instanceof SystemCallError && e.errno === 74 /* EBADMSG */ ? 'a block no longer has the bytes written at suspend' : (e as Error).message;
      throw new BackingFileError(path, `cannot read the compressed blocks back: ${why}`, { cause: e });
    }
    this.savedPath = undefined;
    removeBackingFile(path);
  }

  /** The guest freed a range: blocks wholly inside it keep nothing (they read back as zero). */
  freePagesReported(_ctx: StrategyContext, gpa: number, length: number): void {
    if (!this.store || this.closed) return;
    const first = Math.ceil(gpa / this.blockBytes);
    const end = Math.floor((gpa + length) / this.blockBytes);
    const blocks: number[] = [];
    for (let b = first; b < end; b++) blocks.push(b);
    this.store.forget(blocks);
  }

  stats(): StrategyStats {
    const f = this.store && !this.closed ? this.store.figures() : undefined;
    const incompressible = this.incompressible.reduce((sum, v) => sum + v, 0);
    return {
      strategy: this.name,
      figures: {
        blocksStored: f?.blocksStored ?? 0,
        bytesCompressedFrom: (f?.blocksStored ?? 0) * this.blockBytes,
        storeBytes: f?.bytesStored ?? 0,
        blocksCompressed: this.counts.blocksCompressed,
        blocksIncompressible: incompressible,
        zeroBlocksDropped: f?.zeroBlocksDropped ?? 0,
        blocksSaved: f?.blocksSaved ?? 0,
        bytesOnDisk: f?.bytesSaved ?? 0,
        faultsServed: f?.blocksFaultedBack ?? 0,
        refaults: this.counts.refaults,
        refaultsSoon: this.counts.refaultsSoon,
        writtenWhileCompressing: this.counts.writtenWhileCompressing,
        blocksBad: f?.blocksBad ?? 0,
        scanMs: roundMs(this.counts.scanMs),
        compressMs: roundMs(this.counts.compressMs),
        longestBatchMs: roundMs(this.counts.longestBatchMs),
        decompressMs: roundMs((f?.decompressNs ?? 0) / 1e6),
      },
      notes: [],
    };
  }

  /** @internal For tests of the integrity check: damages the stored bytes of a compressed block. */
  damageStoredBlock(block: number): void {
    this.store?.damage(block);
  }

  /**
   * @internal For the bench: reads one byte of every stored block from this thread, as a vCPU
   * would touch it, so that the native server brings each back; returns how many and how long.
   */
  touchStoredBlocks(): { blocks: number; ms: number } {
    const states = this.blockStates();
    const ram = this.ram;
    if (!ram) return { blocks: 0, ms: 0 };
    let blocks = 0;
    let sum = 0;
    const t0 = performance.now();
    for (let b = 0; b < states.length; b++) {
      if (states[b] !== 2 /* Compressed */) continue;
      sum += ram.view(b * this.blockBytes, 1)[0];
      blocks++;
    }
    const ms = performance.now() - t0;
    // `sum & 0` keeps the reads from being optimised away.
    return { blocks: blocks + (sum & 0), ms };
  }

  /** @internal Each block's state (see ColdState in ../uffd-server). */
  blockStates(): Uint8Array {
    return this.store ? this.store.states(false).states : new Uint8Array(0);
  }

  close(): void {
    // The store lives in the VM's userfaultfd server, destroyed right after every close.
    this.closed = true;
    if (this.savedPath) removeBackingFile(this.savedPath);
    this.savedPath = undefined;
  }
}
