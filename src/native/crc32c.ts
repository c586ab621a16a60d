/**
 * CRC32C (Castagnoli) from libpvisor-memory.so (native-prebuilds/helpers/crc32c.c): the checksum
 * of snapshot RAM files and the checked ranges of the userfaultfd server, and the page pool's
 * content keys, which the daemon computes with the same C function. Below the memory layer and
 * the snapshot code alike, both of which use it.
 *
 * The library is opened on first use (importing pvisor loads no native code), on the main thread
 * like every other binding (see ../sys/libc.ts), under a name of its own: opening it again only
 * takes another reference to what ../memory/uffd-server.ts may have opened.
 */
import type * as Ffi from 'ffi-rs';
import { InvalidOptionError } from '../errors';
import { nativePrebuild } from '../native';
import { openLibc } from '../sys/libc';

const LIB = 'pvisor-memory-crc32c';
type NativeCall = (args: unknown[]) => unknown;
interface Binding {
  pv_crc32c: NativeCall;
  pv_crc32c_sw: NativeCall;
  pv_page_hashes: NativeCall;
  /** pv_crc32c over an address (guest RAM, read in place). */
  crc32cAt: NativeCall;
  /** pv_page_hashes over a Buffer's pages. */
  pageHashesOfBuffer: NativeCall;
}
let fns: Binding | undefined;

function binding(): Binding {
  if (!fns) {
    const ffi: typeof Ffi = openLibc();
    ffi.open({ library: LIB, path: nativePrebuild('libpvisor-memory.so') });
    const { DataType, define } = ffi;
    const { U64, U32, U8Array: BYTES } = DataType;
    const main = define({
      pv_crc32c: { library: LIB, retType: U32, paramsType: [BYTES, U64] },
      pv_crc32c_sw: { library: LIB, retType: U32, paramsType: [BYTES, U64] },
      pv_page_hashes: { library: LIB, retType: DataType.Void, paramsType: [U64, U64, BYTES] },
    }) as unknown as Record<'pv_crc32c' | 'pv_crc32c_sw' | 'pv_page_hashes', NativeCall>;
    // The same functions over other argument types: ffi-rs names a descriptor by its key.
    const atAddress = define({ pv_crc32c: { library: LIB, retType: U32, paramsType: [U64, U64] } }) as unknown as { pv_crc32c: NativeCall };
    const ofBuffer = define({ pv_page_hashes: { library: LIB, retType: DataType.Void, paramsType: [BYTES, U64, BYTES] } }) as unknown as { pv_page_hashes: NativeCall };
    fns = { ...main, crc32cAt: atAddress.pv_crc32c, pageHashesOfBuffer: ofBuffer.pv_page_hashes };
  }
  return fns;
}

/**
 * CRC32C (Castagnoli) of a buffer, or of native memory such as guest RAM without copying it (the
 * caller keeps it mapped). The SSE4.2 instruction when the CPU has it: 64 MiB in a few ms.
 */
export function crc32c(data: Buffer | { addr: number; length: number }): number {
  if (Buffer.isBuffer(data)) return binding().pv_crc32c([data, data.length]) as number;
  return binding().crc32cAt([data.addr, data.length]) as number;
}

/**
 * A 64-bit content key of each of `pages` 4 KiB pages at `addr` (native memory such as guest RAM,
 * read in place) into `out`: CRC32C of the first half in the low word, of the second in the high.
 * Pages with equal content have equal keys; pages with equal keys must still be compared.
 */
export function pageHashes(addr: number, pages: number, out: BigUint64Array): void {
  if (!Number.isSafeInteger(pages) || pages < 0 || out.length < pages) throw new InvalidOptionError('pages', `${pages} pages for ${out.length} keys`);
  if (pages === 0) return;
  binding().pv_page_hashes([addr, pages, Buffer.from(out.buffer, out.byteOffset, pages * 8)]);
}

/** {@link pageHashes} of the whole 4 KiB pages in `data`. */
export function pageHashesOf(data: Buffer, out: BigUint64Array): void {
  const pages = Math.floor(data.length / 4096);
  if (out.length < pages) throw new InvalidOptionError('out', `${pages} pages for ${out.length} keys`);
  if (pages === 0) return;
  binding().pageHashesOfBuffer([data, pages, Buffer.from(out.buffer, out.byteOffset, pages * 8)]);
}

/** The portable path of {@link crc32c} alone (slicing by 8), for tests that compare the two. */
export function crc32cPortable(data: Buffer): number {
  return binding().pv_crc32c_sw([data, data.length]) as number;
}
