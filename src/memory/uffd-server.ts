/**
 * Binding to native-prebuilds' libpvisor-memory.so: one native thread per VM serves userfaultfd
 * faults on guest RAM from sources that a memory strategy adds and removes (a backing file, zeros,
 * bytes kept in host memory), loads their ranges ahead of the guest in an order the strategy
 * chooses, and reports to Node as records on a socket read on the event loop. See
 * native-prebuilds/helpers/uffd_server.c for what the thread does and why it is native.
 *
 * Imported lazily by the strategies that use it, never by src/index.ts: importing pvisor loads no
 * native code. Its functions are resolved when this module loads, on the main thread (ffi-rs
 * lookups are not thread-safe), and their descriptors are built once.
 */
import { DataType, define, open } from 'ffi-rs';
import { InvalidOptionError, SystemCallError, VmStateError, errnoName } from '../errors';
import { nativePrebuild } from '../native';
import { RecordChannel, type NativeRecord } from '../native/record-channel';
import { fetchFailureWhy } from './fetch-protocol';

/**
 * A range of guest RAM in a backing file.
 * @category Strategies
 */
export interface FileRange {
  /** Byte offset into guest RAM; page-aligned. */
  offset: number;
  /** Bytes, a page multiple of at most 4 MiB. */
  length: number;
  /** Byte offset of the range's bytes in the file; page-aligned (the fd may be O_DIRECT). */
  fileOffset: number;
  /** CRC32C (Castagnoli; `crc32c` of ../native/crc32c.ts computes it) of the range's bytes; needed when the source checks them. */
  checksum?: number;
}

/**
 * A range of guest RAM that reads as zeros.
 * @category Strategies
 */
export interface ZeroRange {
  offset: number;
  length: number;
}

/**
 * A range of guest RAM whose bytes wait in host memory (outside guest RAM) at `srcAddr`.
 * @category Strategies
 */
export interface MemoryRange {
  offset: number;
  length: number;
  /** Host address of the bytes; the caller keeps them mapped until the source is done or removed. */
  srcAddr: number;
}

/**
 * What a source serves. Ranges go in address order, and overlap neither each other nor the
 * ranges of another source still loading.
 * @category Strategies
 */
export type UffdSourceSpec =
  | {
      kind: 'file';
      /** Read from a duplicate of it, so the caller may close its own. Read-write if `punch`. */
      fd: number;
      ranges: readonly FileRange[];
      /** Check each range's CRC32C before the guest sees it. Default false. */
      checksum?: boolean;
      /** Punch each loaded range out of the file (disk and page cache go back). Default false. */
      punch?: boolean;
      /**
       * The ranges' bytes are not in the file yet: a fault in one asks the server's fetcher
       * ({@link UffdServer.openFetchChannel}, opened first) for it and waits; the fetcher writes
       * the bytes into the file and says so (src/memory/fetch-protocol.ts). Default false.
       */
      deferred?: boolean;
    }
  | { kind: 'zero'; ranges: readonly ZeroRange[] }
  | { kind: 'memory'; ranges: readonly MemoryRange[] };

/**
 * What the server reports about a source.
 * @category Strategies
 */
export type UffdSourceEvent =
  /** Every range is loaded; the source no longer keeps guest RAM registered. */
  | { kind: 'done'; rangesLoaded: number }
  /**
   * A range cannot be loaded (reported once per source). Faults of vCPUs there stay pending until
   * the server is destroyed: the VM cannot go on.
   */
  | { kind: 'error'; why: string; offset: number; code: number };

/**
 * A range's state in {@link UffdSource.rangeStates}.
 * @category Strategies
 */
export const enum RangeState {
  Missing = 0,
  Loaded = 1,
  Bad = 2,
}

/**
 * What the thread has done for one source.
 * @category Strategies
 */
export interface UffdSourceFigures {
  faultsServed: number;
  rangesLoadedByFault: number;
  rangesPrefetched: number;
  bytesLoaded: number;
}

/**
 * What the thread has done in all.
 * @category Strategies
 */
export interface UffdServerFigures {
  faultsServed: number;
  /** Zero pages mapped outside a range's first load: holes, pages dropped since, bad ranges read by Node. */
  zeroPagesFilled: number;
}

/** The server's own reasons (enum pv_load_error); other values are an errno of pread. */
const LOAD_ERRORS: Record<number, string> = {
  [-1]: 'CRC32C mismatch',
  [-2]: 'the file ends inside it',
  [-3]: 'userfaultfd refused to map it',
};

const KINDS = { file: 1, zero: 2, memory: 3 } as const;
const FLAG_CHECKSUM = 1;
const FLAG_PUNCH = 2;
const FLAG_DEFERRED = 4;
const RECORD_DONE = 1;
const RECORD_COLD_ERROR = 3;
const RANGE_BYTES = 32; // struct pv_range
const TWO_POW_32 = 0x1_0000_0000;

const LIB = 'pvisor-memory';
const U64 = DataType.U64;
const I32 = DataType.I32;
const U32 = DataType.U32;
const BYTES = DataType.U8Array;

open({ library: LIB, path: nativePrebuild('libpvisor-memory.so') });
const fns = define({
  pv_uffd_create: { library: LIB, retType: U64, paramsType: [U64, U64, I32], errno: true },
  pv_uffd_node_fd: { library: LIB, retType: I32, paramsType: [U64] },
  pv_uffd_fetch_fd: { library: LIB, retType: I32, paramsType: [U64] },
  pv_uffd_add_source: { library: LIB, retType: I32, paramsType: [U64, I32, I32, BYTES, I32, I32] },
  pv_uffd_prefetch: { library: LIB, retType: I32, paramsType: [U64, I32, BYTES, I32] },
  pv_uffd_load_all: { library: LIB, retType: I32, paramsType: [U64, I32] },
  pv_uffd_remove_source: { library: LIB, retType: I32, paramsType: [U64, I32] },
  pv_uffd_range_states: { library: LIB, retType: I32, paramsType: [U64, I32, BYTES, I32] },
  pv_uffd_touch_order: { library: LIB, retType: I32, paramsType: [U64, I32, BYTES, I32] },
  pv_uffd_figure: { library: LIB, retType: U64, paramsType: [U64, I32, I32] },
  pv_uffd_destroy: { library: LIB, retType: DataType.Void, paramsType: [U64] },
  pv_uffd_cold_attach: { library: LIB, retType: I32, paramsType: [U64, U64] },
  pv_uffd_cold_scan: { library: LIB, retType: I32, paramsType: [U64, U32, I32, BYTES] },
  pv_uffd_cold_begin: { library: LIB, retType: I32, paramsType: [U64, BYTES, I32, BYTES] },
  pv_uffd_cold_compress: { library: LIB, retType: I32, paramsType: [U64, BYTES, I32, I32] },
  pv_uffd_cold_finish: { library: LIB, retType: I32, paramsType: [U64, BYTES, I32, BYTES] },
  pv_uffd_cold_states: { library: LIB, retType: I32, paramsType: [U64, BYTES, BYTES, I32, I32] },
  pv_uffd_cold_forget: { library: LIB, retType: I32, paramsType: [U64, BYTES, I32] },
  pv_uffd_cold_figure: { library: LIB, retType: U64, paramsType: [U64, I32] },
  pv_uffd_cold_damage: { library: LIB, retType: I32, paramsType: [U64, U32] },
  pv_uffd_cold_save: { library: LIB, retType: I32, paramsType: [U64, I32] },
  pv_uffd_cold_load: { library: LIB, retType: I32, paramsType: [U64] },
});

function u64(table: Buffer, at: number, value: number, what: string): void {
  if (!Number.isSafeInteger(value) || value < 0) throw new InvalidOptionError('ranges', `${what} must be a non-negative integer, got ${value}`);
  table.writeUInt32LE(value % TWO_POW_32, at);
  table.writeUInt32LE(Math.floor(value / TWO_POW_32), at + 4);
}

/** struct pv_range[]: offset, length, where (file offset or host address), checksum, pad. */
function rangeTable(spec: UffdSourceSpec): Buffer {
  const table = Buffer.alloc(Math.max(1, spec.ranges.length) * RANGE_BYTES);
  spec.ranges.forEach((r, i) => {
    const at = i * RANGE_BYTES;
    u64(table, at, r.offset, 'offset');
    u64(table, at + 8, r.length, 'length');
    if (spec.kind === 'file') {
      const f = r as FileRange;
      if (spec.checksum && f.checksum === undefined) throw new InvalidOptionError('ranges', `range ${i} has no checksum to check`);
      u64(table, at + 16, f.fileOffset, 'fileOffset');
      table.writeUInt32LE((f.checksum ?? 0) >>> 0, at + 24);
    } else if (spec.kind === 'memory') {
      u64(table, at + 16, (r as MemoryRange).srcAddr, 'srcAddr');
    }
  });
  return table;
}

function check(call: string, rc: number, detail?: string): number {
  if (rc < 0) throw new SystemCallError(call, -rc, detail);
  return rc;
}

/**
 * One VM's userfaultfd server. Create it before the vCPUs touch RAM it should serve.
 * @category Strategies
 */
export class UffdServer {
  private handle: number;
  private readonly channel: RecordChannel;
  private readonly sources = new Map<number, UffdSource>();
  private cold: ColdStore | undefined;

  private constructor(handle: number) {
    this.handle = handle;
    this.channel = new RecordChannel(fns.pv_uffd_node_fd([handle]), (r) => this.onRecord(r));
  }

  /**
   * Starts a server of guest RAM [hostAddr, hostAddr+sizeBytes) (page-aligned). RAM is
   * registered with userfaultfd only while some source has ranges left to load. Throws
   * {@link SystemCallError} with nothing left behind if the host refuses a userfaultfd.
   */
  static create(hostAddr: number, sizeBytes: number): UffdServer {
    // The main thread's tid is the pid: its faults are never left pending (see the C file).
    const r = fns.pv_uffd_create([hostAddr, sizeBytes, process.pid]) as unknown as { value: number; errnoCode: number };
    if (!r.value) throw new SystemCallError('pv_uffd_create (userfaultfd)', r.errnoCode);
    return new UffdServer(r.value);
  }

  /** pv_record: tag = source id; done: value = ranges loaded; error: err = reason, value = offset. */
  private onRecord(r: NativeRecord): void {
    if (r.kind === RECORD_COLD_ERROR) {
      this.cold?.onError(r.err === -1 ? 'its lz4 data, its CRC32C or its saved copy does not match what was compressed' : LOAD_ERRORS[r.err] ?? `no memory to decompress it: ${errnoName(r.err)}`, r.value);
      return;
    }
    const source = this.sources.get(r.tag);
    if (!source) return; // removed since
    if (r.kind === RECORD_DONE) source.onEvent({ kind: 'done', rangesLoaded: r.value });
    else source.onEvent({ kind: 'error', why: LOAD_ERRORS[r.err] ?? fetchFailureWhy(r.err) ?? `read failed: ${errnoName(r.err)}`, offset: r.value, code: r.err });
  }

  /**
   * Adds a source; its ranges load when first touched, or ahead of that through
   * {@link UffdSource.prefetch}. Throws with nothing changed if a range is malformed (not
   * page-aligned, empty, over 4 MiB, outside RAM), out of order, or overlaps another source's.
   */
  addSource(spec: UffdSourceSpec, onEvent: (e: UffdSourceEvent) => void): UffdSource {
    const handle = this.live();
    const flags = spec.kind === 'file' ? (spec.checksum ? FLAG_CHECKSUM : 0) | (spec.punch ? FLAG_PUNCH : 0) | (spec.deferred ? FLAG_DEFERRED : 0) : 0;
    const fd = spec.kind === 'file' ? spec.fd : -1;
    const rc = fns.pv_uffd_add_source([handle, KINDS[spec.kind], fd, rangeTable(spec), spec.ranges.length, flags]) as number;
    check('pv_uffd_add_source', rc, rc === -22 ? 'a range is malformed, out of order, or overlaps another source' : rc === -107 ? 'a deferred source needs the fetch channel opened first' : undefined);
    const source = new UffdSource(this, rc, spec.ranges.length, onEvent);
    this.sources.set(rc, source);
    return source;
  }

  /**
   * Opens the server's fetch channel, for sources whose bytes arrive later (`deferred`): returns
   * the fetcher's end of a Unix socket, which the caller owns (and closes) from now on, and on
   * which the fetcher reads WANT records and writes READY or FAILED ones
   * (src/memory/fetch-protocol.ts). Once per server. When the fetcher closes its end, every range
   * still absent becomes bad (each source reports an error).
   */
  openFetchChannel(): number {
    return check('pv_uffd_fetch_fd', fns.pv_uffd_fetch_fd([this.live()]) as number, 'the fetch channel was opened already');
  }

  /**
   * Attaches ColdCompression's block store: guest RAM in blocks of `blockBytes` (a power of two
   * from 4 KiB to 4 MiB that divides it), each of which may be compressed in place and dropped,
   * then brought back by the thread on first touch. Guest RAM stays registered with userfaultfd
   * from now on, also for write-protect faults. `onError` hears of a block that failed its check
   * (the vCPU that touched it stays in its fault until the VM ends). Throws
   * {@link SystemCallError} if the kernel cannot write-protect guest RAM.
   */
  attachColdStore(blockBytes: number, sizeBytes: number, onError: (why: string, offset: number) => void): ColdStore {
    if (this.cold) throw new VmStateError('a cold block store is attached already');
    check('pv_uffd_cold_attach', fns.pv_uffd_cold_attach([this.live(), blockBytes]) as number, 'userfaultfd write-protection of guest RAM');
    this.cold = new ColdStore(this, blockBytes, sizeBytes / blockBytes, onError);
    return this.cold;
  }

  /** What the thread has done in all. */
  figures(): UffdServerFigures {
    const handle = this.live();
    return { faultsServed: fns.pv_uffd_figure([handle, 0, 0]) as number, zeroPagesFilled: fns.pv_uffd_figure([handle, 0, 4]) as number };
  }

  /**
   * Joins the thread and closes the userfaultfd, which unregisters guest RAM and releases any
   * thread blocked in a fault there. Call before guest RAM is unmapped. Idempotent.
   */
  destroy(): void {
    if (!this.handle) return;
    fns.pv_uffd_destroy([this.handle]);
    this.handle = 0;
    this.channel.destroy();
    this.sources.clear();
  }

  /** @internal */
  live(): number {
    if (!this.handle) throw new VmStateError('the userfaultfd server was destroyed');
    return this.handle;
  }

  /** @internal */
  forget(id: number): void {
    this.sources.delete(id);
  }
}

/**
 * What {@link ColdStore.finish} did with a block.
 * @category Strategies
 */
export const enum ColdOutcome {
  /** Left resident: it did not compress enough. */
  Kept = 0,
  /** Dropped from guest RAM, its compressed bytes stored. */
  Stored = 1,
  /** All zero: dropped, nothing stored (it reads back as zero). */
  Zero = 2,
  /** Written (or faulted into) while it was compressed: left resident, the compressed bytes thrown away. */
  Written = 3,
  /** Not being compressed (never begun). */
  NotBegun = 4,
}

/**
 * A block's state in {@link ColdStore.states}.
 * @category Strategies
 */
export const enum ColdState {
  Resident = 0,
  Compressing = 1,
  Compressed = 2,
  Bad = 3,
  /** Dropped; its compressed bytes wait in a file while the VM is suspended. */
  Saved = 4,
}

/**
 * What the store holds and the thread has done for it.
 * @category Strategies
 */
export interface ColdStoreFigures {
  blocksStored: number;
  bytesStored: number;
  blocksFaultedBack: number;
  decompressNs: number;
  blocksBad: number;
  zeroBlocksDropped: number;
  /** Blocks whose compressed bytes wait in a file while the VM is suspended ({@link ColdStore.save}). */
  blocksSaved: number;
  bytesSaved: number;
}

/**
 * Readings of {@link ColdStore.scan}, two words per block: [2k] a checksum of the first 256 bytes
 * of each page of block k (it changed if the checksum did) when every page is present, else 0;
 * [2k+1] how many of its pages are present in guest RAM, or 0xffffffff if it is compressed (or
 * bad).
 * @category Strategies
 */
export type ColdScan = Uint32Array;

/**
 * ColdCompression's block store in the native server (native-prebuilds/helpers/cold_store.h):
 * blocks are compressed in place while write-protected ({@link begin}, {@link compress},
 * {@link finish}), and a fault in a dropped block is served by the thread (lz4, CRC32C check,
 * UFFDIO_COPY).
 * @category Strategies
 */
export class ColdStore {
  private readonly stateBytes: Buffer;
  private readonly faultedBytes: Buffer;

  /** @internal */
  constructor(
    private readonly server: UffdServer,
    readonly blockBytes: number,
    readonly blockCount: number,
    /** @internal */
    readonly onError: (why: string, offset: number) => void,
  ) {
    this.stateBytes = Buffer.alloc(blockCount);
    this.faultedBytes = Buffer.alloc(blockCount);
  }

  /**
   * Present pages and checksums of blocks [first, first+count) into `out` (at least 2 x count
   * words; reused from scan to scan, so that a scan allocates nothing).
   */
  scan(first: number, count: number, out: ColdScan): void {
    if (out.length < 2 * count) throw new InvalidOptionError('out', `needs ${2 * count} words, has ${out.length}`);
    const bytes = Buffer.from(out.buffer, out.byteOffset, out.byteLength);
    check('pv_uffd_cold_scan', fns.pv_uffd_cold_scan([this.server.live(), first, count, bytes]) as number);
  }

  /** Write-protects the blocks that are resident; returns which of `blocks` it did. */
  begin(blocks: readonly number[]): boolean[] {
    const began = Buffer.alloc(Math.max(1, blocks.length));
    check('pv_uffd_cold_begin', fns.pv_uffd_cold_begin([this.server.live(), blockList(blocks), blocks.length, began]) as number);
    return blocks.map((_, k) => began[k] === 1);
  }

  /**
   * Compresses `blocks` (begun; at most 1 MiB of them: COLD_BATCH_BYTES) with lz4 into the
   * store's scratch, in C on this thread, each kept only if it fits in `maxSize` bytes. The
   * compressed bytes never pass through JavaScript. Returns how many fitted.
   */
  compress(blocks: readonly number[], maxSize: number): number {
    return check('pv_uffd_cold_compress', fns.pv_uffd_cold_compress([this.server.live(), blockList(blocks), blocks.length, maxSize]) as number);
  }

  /**
   * Ends the compression of `blocks` (begun): those {@link compress} just compressed and that
   * fitted are stored and dropped, unless written meanwhile; any other list stays resident.
   * Returns what became of each.
   */
  finish(blocks: readonly number[]): ColdOutcome[] {
    const out = Buffer.alloc(Math.max(1, blocks.length));
    check('pv_uffd_cold_finish', fns.pv_uffd_cold_finish([this.server.live(), blockList(blocks), blocks.length, out]) as number);
    return blocks.map((_, k) => out[k] as ColdOutcome);
  }

  /**
   * Each block's {@link ColdState}, and which blocks a fault brought back since those marks were
   * last cleared (by a call with `clearFaulted`). The arrays are the store's own, overwritten by
   * the next call.
   */
  states(clearFaulted: boolean): { states: Uint8Array; faulted: Uint8Array } {
    check('pv_uffd_cold_states', fns.pv_uffd_cold_states([this.server.live(), this.stateBytes, this.faultedBytes, this.blockCount, clearFaulted ? 1 : 0]) as number);
    return { states: this.stateBytes, faulted: this.faultedBytes };
  }

  /** Forgets the stored bytes of these blocks (the guest freed them): they read as zero. Returns how many it forgot. */
  forget(blocks: readonly number[]): number {
    if (!blocks.length) return 0;
    return check('pv_uffd_cold_forget', fns.pv_uffd_cold_forget([this.server.live(), blockList(blocks), blocks.length]) as number);
  }

  figures(): ColdStoreFigures {
    const h = this.server.live();
    const f = (which: number) => fns.pv_uffd_cold_figure([h, which]) as number;
    return { blocksStored: f(0), bytesStored: f(1), blocksFaultedBack: f(2), decompressNs: f(3), blocksBad: f(4), zeroBlocksDropped: f(5), blocksSaved: f(6), bytesSaved: f(7) };
  }

  /**
   * While the VM is suspended: writes the stored blocks' compressed bytes to `fd` (a fresh file,
   * made durable) and frees them; until {@link load}, a touch of one reads it from that file
   * (the server keeps a duplicate of `fd`). Returns how many blocks; throws with nothing changed
   * if the file cannot take them.
   */
  save(fd: number): number {
    return check('pv_uffd_cold_save', fns.pv_uffd_cold_save([this.server.live(), fd]) as number);
  }

  /**
   * Reads every saved block back into the store, each checked against the CRC32C taken when it
   * was saved, and lets the file go. Throws with nothing changed (EBADMSG: a block's bytes
   * changed; ENODATA: the file is short) so that the VM can stay suspended.
   */
  load(): number {
    return check('pv_uffd_cold_load', fns.pv_uffd_cold_load([this.server.live()]) as number);
  }

  /** @internal For tests of the integrity check: flips one stored byte of a compressed block. */
  damage(block: number): void {
    check('pv_uffd_cold_damage', fns.pv_uffd_cold_damage([this.server.live(), block]) as number, `block ${block} is not compressed`);
  }
}

function blockList(blocks: readonly number[]): Buffer {
  const list = Buffer.alloc(Math.max(1, blocks.length) * 4);
  blocks.forEach((b, k) => list.writeUInt32LE(b, k * 4));
  return list;
}

/**
 * A source added to a {@link UffdServer}.
 * @category Strategies
 */
export class UffdSource {
  private removed: { states: Uint8Array; touchOrder: number[]; figures: UffdSourceFigures } | undefined;

  /** @internal */
  constructor(
    private readonly server: UffdServer,
    /** The server's id of this source (1..65535). */
    readonly id: number,
    /** How many ranges it has. */
    readonly rangeCount: number,
    /** @internal */
    readonly onEvent: (e: UffdSourceEvent) => void,
  ) {}

  /**
   * Loads these ranges (indices into the source's ranges) in the background, in this order,
   * after any ranges already queued; faults are still served first. Ranges already loaded are
   * skipped. Returns how many were queued.
   */
  prefetch(order: readonly number[]): number {
    const list = Buffer.alloc(Math.max(1, order.length) * 4);
    order.forEach((index, k) => {
      if (!Number.isInteger(index) || index < 0 || index >= this.rangeCount) throw new InvalidOptionError('order', `range index ${index} is not one of the source's ${this.rangeCount}`);
      list.writeUInt32LE(index, k * 4);
    });
    return check('pv_uffd_prefetch', fns.pv_uffd_prefetch([this.handle(), this.id, list, order.length]) as number);
  }

  /** Queues every range not loaded yet, in address order. Returns how many were queued. */
  loadAll(): number {
    return check('pv_uffd_load_all', fns.pv_uffd_load_all([this.handle(), this.id]) as number);
  }

  /**
   * Stops serving this source, once a range load in progress has finished: ranges not loaded yet
   * never will be (a later fault there reads zeros). Returns how many ranges were loaded. The
   * source's states, touch order and figures stay readable as they were just before.
   */
  remove(): number {
    const states = this.rangeStates();
    const touchOrder = this.touchOrder();
    const figures = this.figures();
    const loaded = check('pv_uffd_remove_source', fns.pv_uffd_remove_source([this.handle(), this.id]) as number);
    this.removed = { states, touchOrder, figures };
    this.server.forget(this.id);
    return loaded;
  }

  /** Each range's {@link RangeState}, in the order the ranges were given. */
  rangeStates(): Uint8Array {
    if (this.removed) return this.removed.states;
    const out = Buffer.alloc(Math.max(1, this.rangeCount));
    check('pv_uffd_range_states', fns.pv_uffd_range_states([this.handle(), this.id, out, this.rangeCount]) as number);
    return new Uint8Array(out.buffer, out.byteOffset, this.rangeCount);
  }

  /**
   * Indices of the ranges that faults loaded, in the order they did (prefetched ranges are not
   * in it): the guest's hottest pieces first, to prefetch first next time.
   */
  touchOrder(): number[] {
    if (this.removed) return this.removed.touchOrder;
    const out = Buffer.alloc(Math.max(1, this.rangeCount) * 4);
    const n = check('pv_uffd_touch_order', fns.pv_uffd_touch_order([this.handle(), this.id, out, this.rangeCount]) as number);
    return Array.from({ length: n }, (_, k) => out.readUInt32LE(k * 4));
  }

  /** What the thread has done for this source. */
  figures(): UffdSourceFigures {
    if (this.removed) return this.removed.figures;
    const h = this.handle();
    const f = (which: number) => fns.pv_uffd_figure([h, this.id, which]) as number;
    return { faultsServed: f(0), rangesLoadedByFault: f(1), rangesPrefetched: f(2), bytesLoaded: f(3) };
  }

  private handle(): number {
    if (this.removed) throw new VmStateError(`source ${this.id} was removed`);
    return this.server.live();
  }
}
