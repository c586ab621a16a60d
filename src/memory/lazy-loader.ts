/**
 * Binding to native-prebuilds' libpvisor-uffd.so: registers guest RAM with a userfaultfd and
 * serves its faults from a backing file on a native thread, which reports to Node as records on
 * a Unix socket read on the event loop. See native-prebuilds/helpers/uffd_loader.c for what the
 * thread does and why it is native.
 *
 * Loaded by Offload only when a lazy resume happens, so importing pvisor loads no native code;
 * its functions are resolved when this module loads, on the main thread.
 */
import { DataType, define, open } from 'ffi-rs';
import { SystemCallError, errnoName } from '../errors';
import { nativePrebuild } from '../native';
import { RecordChannel, type NativeRecord } from '../native/record-channel';

/** A piece of guest RAM in the backing file (same offset in both), with its zlib CRC32. */
export interface LoaderPiece {
  offset: number;
  length: number;
  crc: number;
}

/** The loader's own reasons (enum pv_load_error); other values are an errno of pread. */
const LOAD_ERRORS: Record<number, string> = {
  [-1]: 'CRC32 mismatch',
  [-2]: 'the file ends inside it',
  [-3]: 'userfaultfd refused to map it',
};

/** What the thread tells Node. */
export type LoaderEvent =
  /** Every piece is loaded; `unregisterErrno` is 0 unless UFFDIO_UNREGISTER failed. */
  | { kind: 'done'; unregisterErrno: number }
  /** A piece could not be loaded (reported once); `why` says why in plain words. */
  | { kind: 'error'; why: string; offset: number };

/** Figures the thread keeps. */
export interface LoaderFigures {
  faultsServed: number;
  piecesLoadedLazily: number;
  pagesZeroFilled: number;
}

const PIECE_BYTES = 24; // struct pv_piece
const LIB = 'pvisor-uffd';
const U64 = DataType.U64;
const I32 = DataType.I32;

open({ library: LIB, path: nativePrebuild('libpvisor-uffd.so') });
const fns = define({
  pv_loader_start: { library: LIB, retType: U64, paramsType: [U64, U64, I32, DataType.U8Array, I32, I32], errno: true },
  pv_loader_node_fd: { library: LIB, retType: I32, paramsType: [U64] },
  pv_loader_load_all: { library: LIB, retType: DataType.Void, paramsType: [U64] },
  pv_loader_figure: { library: LIB, retType: U64, paramsType: [U64, I32] },
  pv_loader_destroy: { library: LIB, retType: DataType.Void, paramsType: [U64] },
  pv_crc32: { library: LIB, retType: DataType.U32, paramsType: [DataType.U8Array, U64] },
});

/** The native CRC32 the loader checks pieces with (exported for its unit test). */
export function nativeCrc32(data: Buffer): number {
  return fns.pv_crc32([data, data.length]) as number;
}

/** One lazy load of guest RAM from a backing file. */
export class LazyLoader {
  private handle: number;
  private readonly channel: RecordChannel;
  private final: LoaderFigures | undefined;

  /**
   * Registers [hostAddr, hostAddr+sizeBytes) and starts serving it from `fd` (the loader takes
   * its own copy of the fd). Throws {@link SystemCallError} with nothing changed if the range
   * cannot be registered.
   */
  constructor(hostAddr: number, sizeBytes: number, fd: number, pieces: readonly LoaderPiece[], private readonly onEvent: (e: LoaderEvent) => void) {
    const table = Buffer.alloc(Math.max(1, pieces.length) * PIECE_BYTES);
    pieces.forEach((p, i) => {
      table.writeBigUInt64LE(BigInt(p.offset), i * PIECE_BYTES);
      table.writeBigUInt64LE(BigInt(p.length), i * PIECE_BYTES + 8);
      table.writeUInt32LE(p.crc >>> 0, i * PIECE_BYTES + 16);
    });
    // The main thread's tid is the pid: its faults must never be left pending (see the C file).
    const r = fns.pv_loader_start([hostAddr, sizeBytes, fd, table, pieces.length, process.pid]) as unknown as { value: number; errnoCode: number };
    if (!r.value) throw new SystemCallError('pv_loader_start (userfaultfd)', r.errnoCode);
    this.handle = r.value;
    this.channel = new RecordChannel(fns.pv_loader_node_fd([this.handle]), (r) => this.onRecord(r));
  }

  /** pv_record: kind 1 done (err = UFFDIO_UNREGISTER's errno), 2 error (value = the piece's offset). */
  private onRecord(r: NativeRecord): void {
    if (r.kind === 1) this.onEvent({ kind: 'done', unregisterErrno: r.err });
    else this.onEvent({ kind: 'error', why: LOAD_ERRORS[r.err] ?? `read failed: ${errnoName(r.err)}`, offset: r.value });
  }

  /** Asks the thread to load every remaining piece now (it then reports done or an error). */
  loadAll(): void {
    if (this.handle) fns.pv_loader_load_all([this.handle]);
  }

  /** What the thread has done so far (kept after {@link destroy}). */
  figures(): LoaderFigures {
    if (!this.handle) return this.final!;
    return {
      faultsServed: fns.pv_loader_figure([this.handle, 0]) as number,
      piecesLoadedLazily: fns.pv_loader_figure([this.handle, 1]) as number,
      pagesZeroFilled: fns.pv_loader_figure([this.handle, 2]) as number,
    };
  }

  /**
   * Joins the thread and closes the userfaultfd, which unregisters guest RAM and releases any
   * thread blocked in a fault there. Call before guest RAM is unmapped. Idempotent.
   */
  destroy(): void {
    if (!this.handle) return;
    this.final = this.figures();
    fns.pv_loader_destroy([this.handle]);
    this.handle = 0;
    this.channel.destroy();
  }
}
