/**
 * Guest RAM: one host mapping, registered as KVM memory slots, with bounds-checked access by
 * guest-physical address. Like rust-vmm's vm-memory, this module owns only guest memory.
 *
 * Layout (x86): RAM below 3 GiB sits at GPA 0; the rest, if any, at 4 GiB, leaving [3, 4) GiB for
 * device MMIO. Both slots come from the same host mapping, so the mapping is the unit that memory
 * strategies act on (madvise, backing files, userfaultfd).
 */
import { fstatSync } from 'node:fs';
import { GuestCrashError, type SystemCallError } from '../../errors';
import { mapFileRuns, type FileRunOver } from '../../guest-ram/file-runs';
import { guardRam, type RamGuard } from '../../guest-ram/ram-guard';
import { RunCollector, type PageRun } from '../../guest-ram/pages';
import type { DiscardTo, RamBacking } from '../../guest-ram/ram-backing';
import * as C from '../../sys/constants';
import { closeFd, madvise, mmap, mprotect, munmap, viewAt } from '../../sys/libc';
import type { VmFd } from './ioctls';

/** Start of the MMIO hole below 4 GiB. */
export const MMIO_HOLE_START = 3 * 1024 ** 3;
/** Where RAM continues above the hole. */
export const HIGH_RAM_START = 4 * 1024 ** 3;

// Guest RAM is seen through Node Buffers over windows of the mapping, each made when first used.
// V8 counts a Buffer's whole length as external memory and collects garbage when that count
// jumps: one view of all of a 512 MiB VM's RAM cost a full GC at every start and restore (about
// half of a probe clone's restore, measured with a CPU profile). A device model touches a few
// windows (its rings and buffers), so they stay few.
const WINDOW_BYTES = 2 * 1024 * 1024;

/** The longest {@link GuestMemory.hostView} (a Node Buffer's length is limited: 4 GiB on Node 20). */
export const MAX_VIEW_BYTES = 1024 ** 3;

/** One guest-physical range backed by part of the host mapping. */
export interface MemoryRegion {
  slot: number;
  guestPhysAddr: number;
  sizeBytes: number;
  /** Offset of this region inside the host mapping. */
  hostOffset: number;
}

/**
 * madvise values that hold for the whole mapping and must hold again for anonymous memory mapped
 * over part of it (see {@link GuestMemory.discardHost}): a new mapping starts without advice.
 */
const WHOLE_RANGE_ADVICES = new Set([C.MADV_DONTFORK, C.MADV_NOHUGEPAGE, C.MADV_HUGEPAGE, C.MADV_MERGEABLE]);

/** Guest RAM of one VM. */
export class GuestMemory {
  readonly regions: readonly MemoryRegion[];
  /** The views made so far, by window index. */
  private windows: (Buffer | undefined)[] = [];
  private mapped = true;
  /** Whole-range advices given so far, in order. */
  private readonly advices: number[] = [];
  /**
   * Pages of anonymous RAM that {@link mapFileRuns} covered with a file's pages (one byte per
   * page, made on first use): dropping one of them must map anonymous memory back to read zero.
   */
  private fileOver: Uint8Array | undefined;
  /** Turns a SIGBUS on a page of the mapping that is gone into a zero page and a report. */
  private guard: RamGuard | undefined;

  private constructor(readonly hostAddr: number, readonly sizeBytes: number, readonly backing: RamBacking) {
    const regions: MemoryRegion[] = [{ slot: 0, guestPhysAddr: 0, sizeBytes: Math.min(sizeBytes, MMIO_HOLE_START), hostOffset: 0 }];
    if (sizeBytes > MMIO_HOLE_START) {
      regions.push({ slot: 1, guestPhysAddr: HIGH_RAM_START, sizeBytes: sizeBytes - MMIO_HOLE_START, hostOffset: MMIO_HOLE_START });
    }
    this.regions = regions;
  }

  /** The view of window `i`, made on first use. */
  private window(i: number): Buffer {
    return (this.windows[i] ??= viewAt(this.hostAddr + i * WINDOW_BYTES, Math.min(WINDOW_BYTES, this.sizeBytes - i * WINDOW_BYTES)));
  }

  /**
   * The one function that maps guest RAM, with the backing the memory layer chose; it takes over
   * the backing's fd (closed when RAM is unmapped). Everything else about guest RAM goes through
   * the returned object.
   *
   * The mapping is guarded against SIGBUS (see ../../guest-ram/ram-guard.ts): a page of a file mapped
   * as guest RAM that is gone when the host touches it (the file truncated, a read error) reads
   * zero instead of ending the process, and `onLost` is told, on the event loop, why (see
   * {@link lostBacking}); the VM must then end.
   */
  static map(sizeBytes: number, backing: RamBacking = { kind: 'anonymous' }, onLost?: (why: string) => void): GuestMemory {
    const prot = C.PROT_READ | C.PROT_WRITE;
    // One inaccessible guard page after guest RAM: two VMs' RAM mappings have the same flags, and
    // the kernel would merge adjacent ones into one VMA, mixing their per-mapping smaps figures.
    const span = sizeBytes + C.PAGE_SIZE;
    let addr: number | undefined;
    try {
      switch (backing.kind) {
        case 'anonymous':
          // NORESERVE: guest RAM is capacity, not a commitment; pages are allocated on first touch.
          addr = mmap(0, span, prot, C.MAP_PRIVATE | C.MAP_ANONYMOUS | C.MAP_NORESERVE, -1, 0, `guest RAM (${sizeBytes} bytes)`);
          break;
        case 'memfd':
          addr = mmap(0, span, prot, C.MAP_SHARED | C.MAP_NORESERVE, backing.fd, 0, 'guest RAM (memfd)');
          break;
        case 'private-file':
          addr = mmap(0, span, prot, C.MAP_PRIVATE | C.MAP_NORESERVE, backing.fd, 0, `guest RAM (private mapping of ${backing.path})`);
          break;
      }
      mprotect(addr + sizeBytes, C.PAGE_SIZE, C.PROT_NONE);
    } catch (e) {
      if (addr !== undefined) munmap(addr, span);
      if (backing.kind !== 'anonymous') closeFd(backing.fd);
      throw e;
    }
    const mem = new GuestMemory(addr, sizeBytes, backing);
    try {
      mem.guard = guardRam(addr, sizeBytes, () => onLost?.(mem.lostBacking() ?? 'guest RAM lost a page'));
    } catch (e) {
      mem.unmap();
      throw e;
    }
    // A fork (e.g. child_process) must not copy-on-write guest RAM.
    mem.advise(0, sizeBytes, C.MADV_DONTFORK, 'MADV_DONTFORK');
    // 4 KiB pages: the host takes memory back page by page (free page reporting, offload, KSM),
    // and a transparent huge page would keep 2 MiB resident for one touched byte. Measured with
    // huge pages (PVISOR_GUEST_RAM_HUGEPAGES=1, docs/memory-layer.md): first touch is faster, but
    // the guest's work on resident RAM and after an offload is not, so they stay off.
    if (backing.kind === 'anonymous') {
      const huge = process.env.PVISOR_GUEST_RAM_HUGEPAGES === '1';
      mem.advise(0, sizeBytes, huge ? C.MADV_HUGEPAGE : C.MADV_NOHUGEPAGE, huge ? 'MADV_HUGEPAGE' : 'MADV_NOHUGEPAGE');
    }
    return mem;
  }

  /** Registers every region as a KVM memory slot. */
  register(vm: VmFd): void {
    for (const r of this.regions) vm.setUserMemoryRegion(r.slot, r.guestPhysAddr, r.sizeBytes, this.hostAddr + r.hostOffset);
  }

  /** The offset into the host mapping of [gpa, gpa+len), or -1 if any of it is not RAM. */
  hostOffset(gpa: number, len: number): number {
    for (const r of this.regions) {
      if (gpa >= r.guestPhysAddr && gpa + len <= r.guestPhysAddr + r.sizeBytes && len >= 0) return r.hostOffset + (gpa - r.guestPhysAddr);
    }
    return -1;
  }

  /** True if [gpa, gpa+len) is guest RAM. */
  contains(gpa: number, len: number): boolean {
    return this.hostOffset(gpa, len) >= 0;
  }

  private offsetOrThrow(gpa: number, len: number): number {
    if (!this.mapped) throw new GuestCrashError('memory-unmapped', 'guest RAM is no longer mapped');
    const off = this.hostOffset(gpa, len);
    if (off < 0) throw new GuestAddressError(gpa, len);
    return off;
  }

  /**
   * A zero-copy view of [gpa, gpa+len) when it lies in one window, else a copy. Use for reads;
   * writes go through {@link write}.
   */
  read(gpa: number, len: number): Buffer {
    const off = this.offsetOrThrow(gpa, len);
    const w = Math.floor(off / WINDOW_BYTES);
    const inWindow = off - w * WINDOW_BYTES;
    if (inWindow + len <= WINDOW_BYTES) return this.window(w).subarray(inWindow, inWindow + len);
    const out = Buffer.allocUnsafe(len);
    this.copyOut(off, out);
    return out;
  }

  /** Copies `data` into guest RAM at gpa. */
  write(gpa: number, data: Uint8Array): void {
    let off = this.offsetOrThrow(gpa, data.length);
    let done = 0;
    while (done < data.length) {
      const w = Math.floor(off / WINDOW_BYTES);
      const inWindow = off - w * WINDOW_BYTES;
      const n = Math.min(data.length - done, WINDOW_BYTES - inWindow);
      this.window(w).set(data.subarray(done, done + n), inWindow);
      done += n;
      off += n;
    }
  }

  private copyOut(off: number, out: Buffer): void {
    let done = 0;
    while (done < out.length) {
      const w = Math.floor(off / WINDOW_BYTES);
      const inWindow = off - w * WINDOW_BYTES;
      const n = Math.min(out.length - done, WINDOW_BYTES - inWindow);
      this.window(w).copy(out, done, inWindow, inWindow + n);
      done += n;
      off += n;
    }
  }

  readU16(gpa: number): number {
    return this.read(gpa, 2).readUInt16LE(0);
  }

  readU32(gpa: number): number {
    return this.read(gpa, 4).readUInt32LE(0);
  }

  readU64(gpa: number): number {
    return Number(this.read(gpa, 8).readBigUInt64LE(0));
  }

  writeU16(gpa: number, value: number): void {
    this.writeScalar(gpa, 2, (b, at) => b.writeUInt16LE(value & 0xffff, at));
  }

  writeU32(gpa: number, value: number): void {
    this.writeScalar(gpa, 4, (b, at) => b.writeUInt32LE(value >>> 0, at));
  }

  writeU64(gpa: number, value: number | bigint): void {
    this.writeScalar(gpa, 8, (b, at) => b.writeBigUInt64LE(BigInt(value), at));
  }

  /**
   * A little-endian field written in place, or through {@link write} when it straddles the seam
   * between two windows: a guest may place any field there, and Buffer's own bounds check
   * would otherwise end the device's work with a RangeError instead of a write.
   */
  private writeScalar(gpa: number, len: number, put: (b: Buffer, at: number) => void): void {
    const off = this.offsetOrThrow(gpa, len);
    const w = Math.floor(off / WINDOW_BYTES);
    const inWindow = off - w * WINDOW_BYTES;
    if (inWindow + len <= WINDOW_BYTES) {
      put(this.window(w), inWindow);
      return;
    }
    const b = Buffer.allocUnsafe(len);
    put(b, 0);
    this.write(gpa, b);
  }

  /**
   * madvise over a range of the host mapping (offsets, not GPAs). Advice over the whole mapping
   * is remembered, so that it holds for memory later mapped over part of it.
   */
  advise(hostOffset: number, len: number, advice: number, name: string): void {
    this.checkMapped();
    madvise(this.hostAddr + hostOffset, len, advice, name);
    if (hostOffset === 0 && len === this.sizeBytes && WHOLE_RANGE_ADVICES.has(advice)) this.advices.push(advice);
  }

  /**
   * Drops the host pages behind [gpa, gpa+len), so the host gets the memory back; the guest then
   * reads what `to` says (see {@link DiscardTo}; the same on anonymous RAM and memfds). Page-aligned
   * ranges only.
   */
  discard(gpa: number, len: number, to: DiscardTo = 'zero'): void {
    this.discardHost(this.offsetOrThrow(gpa, len), len, to);
  }

  /**
   * {@link discard} by offset into the host mapping: the one place where "drop a page" is given
   * its meaning for each backing.
   */
  discardHost(offset: number, len: number, to: DiscardTo = 'zero'): void {
    this.checkMapped();
    this.checkHostRange(offset, len);
    if (len === 0) return;
    switch (this.backing.kind) {
      case 'anonymous':
        if (to === 'zero') this.unmapFileOver(offset, len);
        madvise(this.hostAddr + offset, len, C.MADV_DONTNEED, 'MADV_DONTNEED');
        break;
      case 'memfd':
        // DONTNEED would only unmap the pages; REMOVE punches them out of the memfd.
        madvise(this.hostAddr + offset, len, C.MADV_REMOVE, 'MADV_REMOVE');
        break;
      case 'private-file':
        if (to === 'backing') madvise(this.hostAddr + offset, len, C.MADV_DONTNEED, 'MADV_DONTNEED');
        else this.zeroOver([{ offset, length: len }]);
        break;
    }
  }

  /**
   * {@link discardHost} of many runs (offsets into the host mapping): on RAM mapped from a file
   * and dropped to read zero, one native call maps fresh anonymous memory over all of them (a
   * restored clone's RAM file holes: one call each cost a millisecond or more in the nested
   * harness).
   */
  discardHostRuns(runs: readonly PageRun[], to: DiscardTo = 'zero'): void {
    if (this.backing.kind !== 'private-file' || to !== 'zero') {
      for (const r of runs) this.discardHost(r.offset, r.length, to);
      return;
    }
    this.checkMapped();
    for (const r of runs) this.checkHostRange(r.offset, r.length);
    this.zeroOver(runs.filter((r) => r.length > 0));
  }

  /**
   * Maps runs of `fd` privately over guest RAM, each [offset, offset+length) from its
   * `fileOffset`, in one native call: reads share the file's page cache pages with every other
   * mapping of them, a write makes a private copy; what a range held before is dropped. What a
   * page pool hands a VM. Whole-range advice is applied again; KVM follows through its MMU
   * notifier. Returns how many runs were mapped, and the error that stopped it, if one did.
   */
  mapFileRuns(fd: number, runs: readonly FileRunOver[]): { mapped: number; error?: SystemCallError } {
    this.checkMapped();
    // -1 would map anonymous memory (what discardHostRuns asks of the same native call), not fail.
    if (!Number.isInteger(fd) || fd < 0) throw new RangeError(`${fd} is not a file descriptor`);
    for (const { offset, length, fileOffset } of runs) {
      if (length === 0) throw new RangeError(`an empty run at host offset 0x${offset.toString(16)}`);
      this.checkHostRange(offset, length, fileOffset);
    }
    const result = mapFileRuns(fd, runs.map((r) => ({ address: this.hostAddr + r.offset, length: r.length, fileOffset: r.fileOffset })), this.advices);
    if (this.backing.kind === 'anonymous') {
      const over = (this.fileOver ??= new Uint8Array(this.sizeBytes / C.PAGE_SIZE));
      // A run that failed in madvise is mapped too.
      const touched = result.error ? Math.min(runs.length, result.mapped + 1) : result.mapped;
      for (const r of runs.slice(0, touched)) over.fill(1, r.offset / C.PAGE_SIZE, (r.offset + r.length) / C.PAGE_SIZE);
    }
    return result;
  }

  /**
   * Maps fresh anonymous memory over the pages of [offset, offset+len) that a file covers (on
   * anonymous RAM a MADV_DONTNEED there would bring the file's page back, not zero).
   */
  private unmapFileOver(offset: number, len: number): void {
    const over = this.fileOver;
    if (!over) return;
    const first = offset / C.PAGE_SIZE;
    const pages = len / C.PAGE_SIZE;
    const collect = new RunCollector(offset);
    for (let p = 0; p < pages; p++) collect.page(p, over[first + p] === 1);
    const runs = collect.end(pages);
    this.zeroOver(runs);
    for (const r of runs) over.fill(0, r.offset / C.PAGE_SIZE, (r.offset + r.length) / C.PAGE_SIZE);
  }

  /**
   * Maps fresh anonymous memory over runs of the host mapping (checked, non-empty) in one native
   * call, with the whole-range advice again: they read zero and cost nothing until written. KVM
   * follows the change through its MMU notifier; the slot still covers the same addresses.
   */
  private zeroOver(runs: readonly PageRun[]): void {
    const { error } = mapFileRuns(-1, runs.map((r) => ({ address: this.hostAddr + r.offset, length: r.length, fileOffset: 0 })), this.advices);
    if (error) throw error;
  }

  /** Throws unless [offset, offset+length) is whole pages inside guest RAM, and `fileOffset` whole pages. */
  private checkHostRange(offset: number, length: number, fileOffset = 0): void {
    if (offset % C.PAGE_SIZE !== 0 || length % C.PAGE_SIZE !== 0 || fileOffset % C.PAGE_SIZE !== 0 || offset < 0 || length < 0 || fileOffset < 0 || offset + length > this.sizeBytes) {
      throw new RangeError(`host range +0x${offset.toString(16)}+0x${length.toString(16)}${fileOffset ? ` (file offset 0x${fileOffset.toString(16)})` : ''} is not page-aligned inside guest RAM`);
    }
  }

  private checkMapped(): void {
    if (!this.mapped) throw new GuestCrashError('memory-unmapped', 'guest RAM is no longer mapped');
  }

  /**
   * A zero-copy view of [offset, offset+len) of the host mapping, at most {@link MAX_VIEW_BYTES}:
   * of its window's view, or one of its own for a range across windows.
   */
  hostView(offset: number, len: number): Buffer {
    if (!this.mapped) throw new GuestCrashError('memory-unmapped', 'guest RAM is no longer mapped');
    if (offset < 0 || len < 0 || offset + len > this.sizeBytes || len > MAX_VIEW_BYTES) {
      throw new RangeError(`host range +0x${offset.toString(16)}+0x${len.toString(16)} is not inside guest RAM, or longer than a view may be`);
    }
    const w = Math.floor(offset / WINDOW_BYTES);
    const inWindow = offset - w * WINDOW_BYTES;
    if (inWindow + len <= WINDOW_BYTES) return this.window(w).subarray(inWindow, inWindow + len);
    return viewAt(this.hostAddr + offset, len);
  }

  /**
   * Why guest RAM lost pages under the VMM, if it did: a page the host touched was gone (the
   * guard mapped a zero page over it), or the backing file is now shorter than guest RAM (what a
   * vCPU whose KVM_RUN failed with EFAULT ran into: the kernel's own accesses raise no SIGBUS).
   * A sentence for the VM's error; undefined while all of guest RAM is there.
   */
  lostBacking(): string | undefined {
    const at = this.guard?.lostAt;
    const file = this.backing.kind === 'private-file' ? this.backing : undefined;
    let shorter = '';
    if (file && this.mapped) {
      try {
        const size = fstatSync(file.fd).size;
        if (size < this.sizeBytes) shorter = `${file.path} is now ${size} bytes, guest RAM ${this.sizeBytes}: the file was truncated under the VM`;
      } catch {
        // The descriptor is the mapping's own; if even fstat fails, the lost page says enough.
      }
    }
    if (at === undefined) return shorter ? `guest RAM's backing file ${shorter}, and a vCPU found a page of it gone; the VM ends` : undefined;
    const where = `guest RAM lost its page at offset 0x${at.toString(16)} when the host read it`;
    if (file) return `${where}: ${shorter || `its backing file ${file.path} could not give it (truncated, or a read error)`}; the page read zero, and the VM ends`;
    return `${where}: a file mapped into it (a page pool's) was truncated or could not be read; the page read zero, and the VM ends`;
  }

  /** Whether the guard found a page of guest RAM gone: one memory read, so a VM checks it before each vCPU runs on. */
  get pagesLost(): boolean {
    return this.guard?.lostAt !== undefined;
  }

  /** Unmaps guest RAM and closes its backing's fd. Views become invalid: the VM must be stopped first. */
  unmap(): void {
    if (!this.mapped) return;
    this.guard?.release();
    this.mapped = false;
    this.windows = [];
    munmap(this.hostAddr, this.sizeBytes + C.PAGE_SIZE);
    if (this.backing.kind !== 'anonymous') closeFd(this.backing.fd);
  }
}

/** A guest-physical range that is not RAM (raised to the device model, which ends the request). */
export class GuestAddressError extends Error {
  constructor(readonly gpa: number, readonly len: number, why = 'outside guest RAM') {
    super(`guest range 0x${gpa.toString(16)}+0x${len.toString(16)} is ${why}`);
  }
}
