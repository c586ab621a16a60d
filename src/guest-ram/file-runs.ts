/**
 * Runs of a file in one native call each (libpvisor-memory.so, native-prebuilds/helpers/map_runs.c):
 * mapping many runs of a file (or of fresh anonymous memory) over guest RAM, and finding a file's
 * data runs. A page pool's merge pass maps thousands of runs, one page each for a repetitive
 * working set; as one mmap and one madvise FFI call per run, the calls' garbage grew the VM
 * process by 40-90 MiB that Node kept. A restored clone walked its RAM file's data runs and
 * mapped its holes a call at a time, each a millisecond or more in the nested harness.
 *
 * The library is opened on first use (importing pvisor loads no native code), on the main thread
 * like every other binding (see ../sys/libc.ts), under a name of its own: opening it again only
 * takes another reference to what ../memory/uffd-server.ts may have opened.
 */
import type * as Ffi from 'ffi-rs';
import { SystemCallError } from '../errors';
import { nativePrebuild } from '../native';
import { openLibc } from '../sys/libc';

/** One run: [address, address + length) gets the file's bytes from `fileOffset`. All page-aligned. */
export interface FileRun {
  address: number;
  length: number;
  fileOffset: number;
}

/**
 * A run of a file to map over guest RAM: [offset, offset+length) of the RAM mapping gets the file's bytes from `fileOffset`.
 * @category Strategies
 */
export interface FileRunOver {
  /** Offset into the guest RAM mapping. */
  offset: number;
  length: number;
  fileOffset: number;
}

const LIB = 'pvisor-memory-runs';
type NativeCall = (args: unknown[]) => unknown;
let fns: { pv_map_file_runs: NativeCall; pv_file_data_runs: NativeCall } | undefined;

function binding(): { pv_map_file_runs: NativeCall; pv_file_data_runs: NativeCall } {
  if (!fns) {
    const ffi: typeof Ffi = openLibc();
    ffi.open({ library: LIB, path: nativePrebuild('libpvisor-memory.so') });
    const { DataType } = ffi;
    fns = ffi.define({
      pv_map_file_runs: { library: LIB, retType: DataType.U32, paramsType: [DataType.U8Array, DataType.U32, DataType.I32, DataType.U8Array, DataType.U32, DataType.U8Array] },
      pv_file_data_runs: { library: LIB, retType: DataType.I64, paramsType: [DataType.I32, DataType.U64, DataType.U8Array, DataType.U32] },
    }) as unknown as { pv_map_file_runs: NativeCall; pv_file_data_runs: NativeCall };
  }
  return fns;
}

/**
 * Maps each run of `fd` privately over its range (MAP_PRIVATE | MAP_FIXED: reads share the file's
 * pages, a write makes a private copy; `fd` -1: fresh anonymous memory, which reads zero), then
 * gives it each of `advice`. Returns how many runs were
 * mapped, and on a failure the error of the run that failed: the runs before it are mapped, and
 * the caller must account for them.
 */
export function mapFileRuns(fd: number, runs: readonly FileRun[], advice: readonly number[]): { mapped: number; error?: SystemCallError } {
  if (runs.length === 0) return { mapped: 0 };
  const triples = Buffer.allocUnsafe(runs.length * 24);
  runs.forEach((r, i) => {
    triples.writeBigUInt64LE(BigInt(r.address), 24 * i);
    triples.writeBigUInt64LE(BigInt(r.length), 24 * i + 8);
    triples.writeBigUInt64LE(BigInt(r.fileOffset), 24 * i + 16);
  });
  const adv = Buffer.alloc(Math.max(4, advice.length * 4));
  advice.forEach((a, i) => adv.writeInt32LE(a, 4 * i));
  const err = Buffer.alloc(8);
  const mapped = binding().pv_map_file_runs([triples, runs.length, fd, adv, advice.length, err]) as number;
  if (mapped >= runs.length) return { mapped };
  const failed = runs[mapped];
  const call = err.readInt32LE(4) === 2 ? 'madvise' : 'mmap';
  return { mapped, error: new SystemCallError(call, err.readInt32LE(0), `a file over 0x${failed.address.toString(16)}+0x${failed.length.toString(16)}, run ${mapped + 1} of ${runs.length}`) };
}

/**
 * The runs of `fd` that hold data, as [start, end) byte offsets in file order, within its first
 * `sizeBytes`: lseek(SEEK_DATA/SEEK_HOLE) in one native call (Node's fs has no lseek). A file
 * system without hole tracking reports one run over the whole file, which is still right. The
 * fd's offset moves; callers use positioned reads.
 */
export function fileDataRuns(fd: number, sizeBytes: number): [number, number][] {
  // A run and a hole each take a block at least: one run per two 4 KiB blocks, and one more, then
  // four times as many for a file system of smaller blocks.
  const E2BIG = 7;
  let max = Math.ceil(sizeBytes / 8192) + 1;
  let out: Buffer;
  let n: number;
  for (;;) {
    out = Buffer.alloc(max * 16);
    n = Number(binding().pv_file_data_runs([fd, sizeBytes, out, max]));
    if (n !== -E2BIG) break;
    max *= 4;
  }
  if (n < 0) throw new SystemCallError('lseek(SEEK_DATA/SEEK_HOLE)', -n);
  const runs: [number, number][] = [];
  for (let i = 0; i < n; i++) runs.push([Number(out.readBigUInt64LE(16 * i)), Number(out.readBigUInt64LE(16 * i + 8))]);
  return runs;
}
