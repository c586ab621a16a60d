/**
 * Maps many runs of one file over guest RAM in one native call (libpvisor-memory.so's
 * pv_map_file_runs, native-prebuilds/helpers/map_runs.c). A page pool's merge pass maps thousands
 * of runs, one page each for a repetitive working set; as one mmap and one madvise FFI call per
 * run, the calls' garbage grew the VM process by 40-90 MiB that Node kept.
 *
 * The library is opened on first use (importing pvisor loads no native code), on the main thread
 * like every other binding (see ../sys/libc.ts), under a name of its own: opening it again only
 * takes another reference to what ./uffd-server.ts may have opened.
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

const LIB = 'pvisor-memory-runs';
let mapRuns: ((args: unknown[]) => unknown) | undefined;

function binding(): (args: unknown[]) => unknown {
  if (!mapRuns) {
    const ffi: typeof Ffi = openLibc();
    ffi.open({ library: LIB, path: nativePrebuild('libpvisor-memory.so') });
    const { DataType } = ffi;
    mapRuns = ffi.define({
      pv_map_file_runs: { library: LIB, retType: DataType.U32, paramsType: [DataType.U8Array, DataType.U32, DataType.I32, DataType.U8Array, DataType.U32, DataType.U8Array] },
    }).pv_map_file_runs as (args: unknown[]) => unknown;
  }
  return mapRuns;
}

/**
 * Maps each run of `fd` privately over its range (MAP_PRIVATE | MAP_FIXED: reads share the file's
 * pages, a write makes a private copy), then gives it each of `advice`. Returns how many runs were
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
  const mapped = binding()([triples, runs.length, fd, adv, advice.length, err]) as number;
  if (mapped >= runs.length) return { mapped };
  const failed = runs[mapped];
  const call = err.readInt32LE(4) === 2 ? 'madvise' : 'mmap';
  return { mapped, error: new SystemCallError(call, err.readInt32LE(0), `a file over 0x${failed.address.toString(16)}+0x${failed.length.toString(16)}, run ${mapped + 1} of ${runs.length}`) };
}
