/**
 * A small native buffer for ioctl structs (kvm_regs, kvm_sregs, memory regions). ioctl takes the
 * struct's address; JS fills and reads it through a zero-copy view. Calls are synchronous on the
 * main thread, so one buffer per process is enough; each user takes it only between two lines.
 */
import { MAP_ANONYMOUS, MAP_PRIVATE, PAGE_SIZE, PROT_READ, PROT_WRITE } from './constants';
import { mmap, viewAt } from './libc';

/** Bytes available in the scratch buffer (room for kvm_cpuid2 with 256 entries). */
export const SCRATCH_BYTES = 4 * PAGE_SIZE;

let scratch: { addr: number; view: Buffer } | undefined;

/** The scratch buffer's address and a view over it, zeroed. */
export function scratchStruct(size: number): { addr: number; view: Buffer } {
  if (size > SCRATCH_BYTES) throw new RangeError(`struct of ${size} bytes exceeds the scratch buffer`);
  if (!scratch) {
    const addr = mmap(0, SCRATCH_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, 'ioctl scratch');
    scratch = { addr, view: viewAt(addr, SCRATCH_BYTES) };
  }
  scratch.view.fill(0, 0, size);
  return { addr: scratch.addr, view: scratch.view.subarray(0, size) };
}
