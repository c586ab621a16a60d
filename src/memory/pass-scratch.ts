/**
 * A PoolClient merge pass's working memory, in one anonymous mapping whose pages go back to the
 * kernel when the pass ends: the keys of the VM's pages, and the one request frame the pass builds
 * its Offers, Puts and Settles in.
 *
 * Held in ordinary buffers they stayed resident between passes (about 1.2 MiB per 512 MiB VM
 * touched, all of it charged to a VM that may share nothing at all), and malloc would have kept
 * them even if they were dropped: once a large block is freed, glibc serves the next ones from
 * its heap and keeps them.
 */
import { FRAME_HEADER_BYTES, MAX_PAYLOAD_BYTES } from '../protocol/frame';
import { MADV_DONTNEED, MAP_ANONYMOUS, MAP_PRIVATE, PAGE_SIZE, PROT_READ, PROT_WRITE } from '../sys/constants';
import { madvise, mmap, munmap, viewAt } from '../sys/libc';

/** A pass's arrays over one mapping. */
export class PassScratch {
  /** The content key of each guest page (only the VM's own pages' are written in a pass). */
  readonly keys: BigUint64Array;
  /** The request frame: header, then up to {@link MAX_PAYLOAD_BYTES} of payload. */
  readonly frame: Buffer;
  private readonly bytes: number;
  private addr: number | undefined;

  /** Maps the arrays for a VM of `pages` guest pages; nothing is resident until written. */
  constructor(pages: number) {
    const frameAt = roundUp(pages * 8, PAGE_SIZE);
    this.bytes = roundUp(frameAt + FRAME_HEADER_BYTES + MAX_PAYLOAD_BYTES, PAGE_SIZE);
    const addr = (this.addr = mmap(0, this.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, 'a merge pass\'s arrays'));
    const view = viewAt(addr, this.bytes);
    // The mapping is page-aligned, so the keys at its start are 8-byte aligned.
    this.keys = new BigUint64Array(view.buffer, view.byteOffset, pages);
    this.frame = view.subarray(frameAt, frameAt + FRAME_HEADER_BYTES + MAX_PAYLOAD_BYTES);
  }

  /** Gives every page back to the kernel; the arrays stay usable and read zero. */
  release(): void {
    if (this.addr !== undefined) madvise(this.addr, this.bytes, MADV_DONTNEED, 'MADV_DONTNEED');
  }

  /** Unmaps the arrays: only once nothing (a pass, a socket write) can touch them again. */
  free(): void {
    if (this.addr === undefined) return;
    munmap(this.addr, this.bytes);
    this.addr = undefined;
  }
}

function roundUp(n: number, to: number): number {
  return Math.ceil(n / to) * to;
}
