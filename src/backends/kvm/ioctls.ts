/**
 * The KVM ioctls pvisor uses, one class per kind of fd (as rust-vmm's kvm-ioctls): {@link Kvm}
 * for /dev/kvm, {@link VmFd} for a VM, {@link VcpuFd} for a vCPU. Nothing else in pvisor issues
 * a KVM ioctl.
 */
import * as C from '../../sys/constants';
import { closeFd, ioctl, mmap, munmap, openFile, viewAt } from '../../sys/libc';
import { scratchStruct } from '../../sys/scratch';

/** The system fd, /dev/kvm. */
export class Kvm {
  private constructor(readonly fd: number) {}

  /** Opens /dev/kvm; the caller has checked the host (see host-check.ts) first. */
  static open(path = '/dev/kvm'): Kvm {
    return new Kvm(openFile(path, C.O_RDWR | C.O_CLOEXEC));
  }

  apiVersion(): number {
    return ioctl(this.fd, C.KVM_GET_API_VERSION, 0, 'KVM_GET_API_VERSION');
  }

  checkExtension(cap: number): number {
    return ioctl(this.fd, C.KVM_CHECK_EXTENSION, cap, 'KVM_CHECK_EXTENSION');
  }

  vcpuMmapSize(): number {
    return ioctl(this.fd, C.KVM_GET_VCPU_MMAP_SIZE, 0, 'KVM_GET_VCPU_MMAP_SIZE');
  }

  /** KVM_GET_SUPPORTED_CPUID as raw kvm_cpuid2 bytes (header + entries), ready for KVM_SET_CPUID2. */
  supportedCpuid(maxEntries = 100): Buffer {
    const size = 8 + 40 * maxEntries;
    const s = scratchStruct(size);
    s.view.writeUInt32LE(maxEntries, 0);
    ioctl(this.fd, C.KVM_GET_SUPPORTED_CPUID, s.addr, 'KVM_GET_SUPPORTED_CPUID');
    const n = s.view.readUInt32LE(0);
    return Buffer.from(s.view.subarray(0, 8 + 40 * n));
  }

  /** KVM_GET_MSR_INDEX_LIST: the MSRs KVM saves and restores for a vCPU (kvm_msr_list). */
  msrIndexList(): number[] {
    return msrList(this.fd, C.KVM_GET_MSR_INDEX_LIST, 'KVM_GET_MSR_INDEX_LIST');
  }

  /**
   * KVM_GET_MSR_FEATURE_INDEX_LIST (KVM_CAP_GET_MSR_FEATURES): MSRs that describe CPU features
   * (e.g. IA32_ARCH_CAPABILITIES). A vCPU's values of those it accepts belong in its saved state
   * too, since userspace may have set them.
   */
  featureMsrIndexList(): number[] {
    return msrList(this.fd, C.KVM_GET_MSR_FEATURE_INDEX_LIST, 'KVM_GET_MSR_FEATURE_INDEX_LIST');
  }

  createVm(): VmFd {
    return new VmFd(ioctl(this.fd, C.KVM_CREATE_VM, 0, 'KVM_CREATE_VM'));
  }

  close(): void {
    closeFd(this.fd);
  }
}

/** A VM fd. */
export class VmFd {
  constructor(readonly fd: number) {}

  checkExtension(cap: number): number {
    return ioctl(this.fd, C.KVM_CHECK_EXTENSION, cap, 'KVM_CHECK_EXTENSION');
  }

  /** Registers (or with sizeBytes 0, removes) a memory slot backed by host memory at hostAddr. */
  setUserMemoryRegion(slot: number, guestPhysAddr: number, sizeBytes: number, hostAddr: number): void {
    const s = scratchStruct(C.KVM_MEMORY_REGION_SIZE);
    s.view.writeUInt32LE(slot, 0);
    s.view.writeUInt32LE(0, 4);
    s.view.writeBigUInt64LE(BigInt(guestPhysAddr), 8);
    s.view.writeBigUInt64LE(BigInt(sizeBytes), 16);
    s.view.writeBigUInt64LE(BigInt(hostAddr), 24);
    ioctl(this.fd, C.KVM_SET_USER_MEMORY_REGION, s.addr, 'KVM_SET_USER_MEMORY_REGION');
  }

  /** Intel needs a three-page TSS region inside the guest-physical space even for long mode. */
  setTssAddr(addr: number): void {
    ioctl(this.fd, C.KVM_SET_TSS_ADDR, addr, 'KVM_SET_TSS_ADDR');
  }

  /** The in-kernel PIC, I/O APIC and local APICs (before any vCPU is created). */
  createIrqchip(): void {
    ioctl(this.fd, C.KVM_CREATE_IRQCHIP, 0, 'KVM_CREATE_IRQCHIP');
  }

  /** The in-kernel i8254 timer; the speaker port is left to userspace, which ignores it. */
  createPit2(): void {
    const s = scratchStruct(C.KVM_PIT_CONFIG_SIZE);
    s.view.writeUInt32LE(C.KVM_PIT_SPEAKER_DUMMY, 0);
    ioctl(this.fd, C.KVM_CREATE_PIT2, s.addr, 'KVM_CREATE_PIT2');
  }

  /** Drives interrupt line (GSI) `irq` of the in-kernel irqchip. */
  irqLine(irq: number, level: 0 | 1): void {
    const s = scratchStruct(8);
    s.view.writeUInt32LE(irq, 0);
    s.view.writeUInt32LE(level, 4);
    ioctl(this.fd, C.KVM_IRQ_LINE, s.addr, 'KVM_IRQ_LINE');
  }

  /**
   * KVM_IRQFD: a write to eventfd `fd` pulses GSI `gsi` (raise, then lower: an edge), inside the
   * kernel, instead of two KVM_IRQ_LINE calls.
   */
  irqfd(fd: number, gsi: number): void {
    const s = scratchStruct(C.KVM_IRQFD_SIZE);
    s.view.writeUInt32LE(fd, 0);
    s.view.writeUInt32LE(gsi, 4);
    ioctl(this.fd, C.KVM_IRQFD, s.addr, 'KVM_IRQFD');
  }

  /**
   * KVM_IOEVENTFD: a guest write of `value` (`len` bytes) to MMIO address `addr` signals eventfd
   * `fd` and completes inside the kernel, with no exit to the VMM.
   */
  ioeventfd(fd: number, addr: number, len: number, value: number): void {
    const s = scratchStruct(C.KVM_IOEVENTFD_SIZE);
    s.view.writeBigUInt64LE(BigInt(value), 0);
    s.view.writeBigUInt64LE(BigInt(addr), 8);
    s.view.writeUInt32LE(len, 16);
    s.view.writeInt32LE(fd, 20);
    s.view.writeUInt32LE(C.KVM_IOEVENTFD_FLAG_DATAMATCH, 24);
    ioctl(this.fd, C.KVM_IOEVENTFD, s.addr, 'KVM_IOEVENTFD');
  }

  /** KVM_GET_IRQCHIP: the 512-byte state of one in-kernel chip (KVM_IRQCHIP_PIC_MASTER, ...). */
  getIrqchip(chipId: number): Buffer {
    const s = scratchStruct(C.KVM_IRQCHIP_SIZE);
    s.view.writeUInt32LE(chipId, 0);
    ioctl(this.fd, C.KVM_GET_IRQCHIP, s.addr, 'KVM_GET_IRQCHIP');
    return Buffer.from(s.view.subarray(8, C.KVM_IRQCHIP_SIZE));
  }

  setIrqchip(chipId: number, data: Buffer): void {
    const s = scratchStruct(C.KVM_IRQCHIP_SIZE);
    s.view.writeUInt32LE(chipId, 0);
    data.copy(s.view, 8, 0, C.KVM_IRQCHIP_DATA_SIZE);
    ioctl(this.fd, C.KVM_SET_IRQCHIP, s.addr, 'KVM_SET_IRQCHIP');
  }

  /** KVM_GET_PIT2: the in-kernel PIT's channels and flags (struct kvm_pit_state2). */
  getPit2(): Buffer {
    return readStruct(this.fd, C.KVM_GET_PIT2, C.KVM_PIT_STATE2_SIZE, 'KVM_GET_PIT2');
  }

  setPit2(state: Buffer): void {
    writeStruct(this.fd, C.KVM_SET_PIT2, state, C.KVM_PIT_STATE2_SIZE, 'KVM_SET_PIT2');
  }

  /** KVM_GET_CLOCK: the kvm-clock the guest reads (struct kvm_clock_data). */
  getClock(): Buffer {
    return readStruct(this.fd, C.KVM_GET_CLOCK, C.KVM_CLOCK_DATA_SIZE, 'KVM_GET_CLOCK');
  }

  setClock(data: Buffer): void {
    writeStruct(this.fd, C.KVM_SET_CLOCK, data, C.KVM_CLOCK_DATA_SIZE, 'KVM_SET_CLOCK');
  }

  createVcpu(index: number, mmapSize: number): VcpuFd {
    const fd = ioctl(this.fd, C.KVM_CREATE_VCPU, index, 'KVM_CREATE_VCPU');
    try {
      const runAddr = mmap(0, mmapSize, C.PROT_READ | C.PROT_WRITE, C.MAP_SHARED, fd, 0, 'kvm_run');
      return new VcpuFd(fd, index, runAddr, mmapSize);
    } catch (e) {
      closeFd(fd);
      throw e;
    }
  }

  close(): void {
    closeFd(this.fd);
  }
}

/** The general-purpose registers of a vCPU (struct kvm_regs), as numbers. */
export type Regs = Record<keyof typeof C.KVM_REGS, number>;

/** One segment of struct kvm_sregs. */
export interface Segment {
  base: number;
  limit: number;
  selector: number;
  type: number;
  present: number;
  dpl: number;
  db: number;
  s: number;
  l: number;
  g: number;
}

/** The special registers pvisor sets (a subset of struct kvm_sregs). */
export interface Sregs {
  cs: Segment;
  ds: Segment;
  es: Segment;
  fs: Segment;
  gs: Segment;
  ss: Segment;
  tr: Segment;
  ldt: Segment;
  gdt: { base: number; limit: number };
  idt: { base: number; limit: number };
  cr0: number;
  cr3: number;
  cr4: number;
  efer: number;
}

/** A vCPU fd and its kvm_run page, mapped and viewed without copies. */
export class VcpuFd {
  /** A zero-copy view of the vCPU's kvm_run area. */
  readonly run: Buffer;

  constructor(readonly fd: number, readonly index: number, readonly runAddr: number, private readonly runSize: number) {
    this.run = viewAt(runAddr, runSize);
  }

  setRegs(regs: Partial<Regs>): void {
    const s = scratchStruct(C.KVM_REGS_SIZE);
    for (const [name, idx] of Object.entries(C.KVM_REGS)) {
      s.view.writeBigUInt64LE(BigInt(regs[name as keyof Regs] ?? 0), idx * 8);
    }
    ioctl(this.fd, C.KVM_SET_REGS, s.addr, 'KVM_SET_REGS');
  }

  /** Reads the current sregs, applies `sregs` on top, writes them back. */
  setSregs(sregs: Sregs): void {
    const s = scratchStruct(C.KVM_SREGS_SIZE);
    ioctl(this.fd, C.KVM_GET_SREGS, s.addr, 'KVM_GET_SREGS');
    const v = s.view;
    for (const [name, off] of Object.entries(C.KVM_SREGS_SEGMENTS)) {
      const seg = sregs[name as keyof typeof C.KVM_SREGS_SEGMENTS];
      v.writeBigUInt64LE(BigInt(seg.base), off);
      v.writeUInt32LE(seg.limit >>> 0, off + 8);
      v.writeUInt16LE(seg.selector, off + 12);
      v.writeUInt8(seg.type, off + 14);
      v.writeUInt8(seg.present, off + 15);
      v.writeUInt8(seg.dpl, off + 16);
      v.writeUInt8(seg.db, off + 17);
      v.writeUInt8(seg.s, off + 18);
      v.writeUInt8(seg.l, off + 19);
      v.writeUInt8(seg.g, off + 20);
      v.writeUInt8(0, off + 21);
      v.writeUInt8(seg.present ? 0 : 1, off + 22);
    }
    v.writeBigUInt64LE(BigInt(sregs.gdt.base), C.KVM_SREGS_GDT);
    v.writeUInt16LE(sregs.gdt.limit, C.KVM_SREGS_GDT + 8);
    v.writeBigUInt64LE(BigInt(sregs.idt.base), C.KVM_SREGS_IDT);
    v.writeUInt16LE(sregs.idt.limit, C.KVM_SREGS_IDT + 8);
    v.writeBigUInt64LE(BigInt(sregs.cr0), C.KVM_SREGS_CR0);
    v.writeBigUInt64LE(BigInt(sregs.cr3), C.KVM_SREGS_CR3);
    v.writeBigUInt64LE(BigInt(sregs.cr4), C.KVM_SREGS_CR4);
    v.writeBigUInt64LE(BigInt(sregs.efer), C.KVM_SREGS_EFER);
    ioctl(this.fd, C.KVM_SET_SREGS, s.addr, 'KVM_SET_SREGS');
  }

  /** The local APIC's register page (struct kvm_lapic_state), a copy. */
  getLapic(): Buffer {
    return this.getStruct('lapic');
  }

  setLapic(state: Buffer): void {
    this.setStruct('lapic', state);
  }

  /**
   * Reads one of the vCPU's state structs whole, as a copy. `sizeBytes` only for `xsave2`, whose
   * size KVM_CHECK_EXTENSION(KVM_CAP_XSAVE2) gives.
   */
  getStruct(kind: VcpuStruct, sizeBytes: number = VCPU_STRUCTS[kind].sizeBytes): Buffer {
    const k = VCPU_STRUCTS[kind];
    return readStruct(this.fd, k.get, sizeBytes, k.getName);
  }

  /** Writes one of the vCPU's state structs whole (`bytes.length` bytes for `xsave2`). */
  setStruct(kind: VcpuStruct, bytes: Buffer): void {
    const k = VCPU_STRUCTS[kind];
    writeStruct(this.fd, k.set, bytes, kind === 'xsave2' ? bytes.length : k.sizeBytes, k.setName);
  }

  /**
   * KVM_GET_MSRS for `indices` (at most {@link MAX_MSRS_PER_CALL}). KVM stops at the first MSR it
   * cannot read and says how many it read: the result is that prefix.
   */
  getMsrs(indices: readonly number[]): MsrEntry[] {
    const s = msrsStruct(indices.map((index) => ({ index, value: 0n })));
    const n = ioctl(this.fd, C.KVM_GET_MSRS, s.addr, 'KVM_GET_MSRS');
    return indices.slice(0, n).map((index, i) => ({ index, value: s.view.readBigUInt64LE(8 + i * C.KVM_MSR_ENTRY_SIZE + 8) }));
  }

  /** KVM_SET_MSRS; returns how many KVM took (it stops at the first it refuses). */
  setMsrs(entries: readonly MsrEntry[]): number {
    return ioctl(this.fd, C.KVM_SET_MSRS, msrsStruct(entries).addr, 'KVM_SET_MSRS');
  }

  /** KVM_GET_TSC_KHZ: the guest's TSC frequency. */
  getTscKhz(): number {
    return ioctl(this.fd, C.KVM_GET_TSC_KHZ, 0, 'KVM_GET_TSC_KHZ');
  }

  setTscKhz(khz: number): void {
    ioctl(this.fd, C.KVM_SET_TSC_KHZ, khz, 'KVM_SET_TSC_KHZ');
  }

  /** Sets the CPUID the guest sees (raw kvm_cpuid2 bytes). */
  setCpuid(cpuid2: Buffer): void {
    const s = scratchStruct(cpuid2.length);
    cpuid2.copy(s.view);
    ioctl(this.fd, C.KVM_SET_CPUID2, s.addr, 'KVM_SET_CPUID2');
  }

  close(): void {
    munmap(this.runAddr, this.runSize);
    closeFd(this.fd);
  }
}

/** One model-specific register and its 64-bit value. */
export interface MsrEntry {
  index: number;
  value: bigint;
}

/** MSR entries one KVM_GET_MSRS / KVM_SET_MSRS call carries (what the scratch buffer holds). */
export const MAX_MSRS_PER_CALL = 512;

/**
 * The vCPU structs saved and restored whole, with their ioctls and sizes (<linux/kvm.h>). Their
 * contents stay opaque bytes: a snapshot keeps them as KVM gave them, so no field is lost to a
 * JS number's 53 bits or to a layout pvisor would have to keep in step with the kernel.
 */
export const VCPU_STRUCTS = {
  regs: { get: C.KVM_GET_REGS, set: C.KVM_SET_REGS, sizeBytes: C.KVM_REGS_SIZE, getName: 'KVM_GET_REGS', setName: 'KVM_SET_REGS' },
  sregs: { get: C.KVM_GET_SREGS, set: C.KVM_SET_SREGS, sizeBytes: C.KVM_SREGS_SIZE, getName: 'KVM_GET_SREGS', setName: 'KVM_SET_SREGS' },
  sregs2: { get: C.KVM_GET_SREGS2, set: C.KVM_SET_SREGS2, sizeBytes: C.KVM_SREGS2_SIZE, getName: 'KVM_GET_SREGS2', setName: 'KVM_SET_SREGS2' },
  fpu: { get: C.KVM_GET_FPU, set: C.KVM_SET_FPU, sizeBytes: C.KVM_FPU_SIZE, getName: 'KVM_GET_FPU', setName: 'KVM_SET_FPU' },
  xsave: { get: C.KVM_GET_XSAVE, set: C.KVM_SET_XSAVE, sizeBytes: C.KVM_XSAVE_SIZE, getName: 'KVM_GET_XSAVE', setName: 'KVM_SET_XSAVE' },
  xsave2: { get: C.KVM_GET_XSAVE2, set: C.KVM_SET_XSAVE, sizeBytes: C.KVM_XSAVE_SIZE, getName: 'KVM_GET_XSAVE2', setName: 'KVM_SET_XSAVE' },
  xcrs: { get: C.KVM_GET_XCRS, set: C.KVM_SET_XCRS, sizeBytes: C.KVM_XCRS_SIZE, getName: 'KVM_GET_XCRS', setName: 'KVM_SET_XCRS' },
  lapic: { get: C.KVM_GET_LAPIC, set: C.KVM_SET_LAPIC, sizeBytes: C.KVM_LAPIC_STATE_SIZE, getName: 'KVM_GET_LAPIC', setName: 'KVM_SET_LAPIC' },
  vcpuEvents: { get: C.KVM_GET_VCPU_EVENTS, set: C.KVM_SET_VCPU_EVENTS, sizeBytes: C.KVM_VCPU_EVENTS_SIZE, getName: 'KVM_GET_VCPU_EVENTS', setName: 'KVM_SET_VCPU_EVENTS' },
  debugregs: { get: C.KVM_GET_DEBUGREGS, set: C.KVM_SET_DEBUGREGS, sizeBytes: C.KVM_DEBUGREGS_SIZE, getName: 'KVM_GET_DEBUGREGS', setName: 'KVM_SET_DEBUGREGS' },
  mpState: { get: C.KVM_GET_MP_STATE, set: C.KVM_SET_MP_STATE, sizeBytes: C.KVM_MP_STATE_SIZE, getName: 'KVM_GET_MP_STATE', setName: 'KVM_SET_MP_STATE' },
} as const;

/** A vCPU struct {@link VcpuFd.getStruct} reads whole. */
export type VcpuStruct = keyof typeof VCPU_STRUCTS;

function readStruct(fd: number, request: number, sizeBytes: number, name: string): Buffer {
  const s = scratchStruct(sizeBytes);
  ioctl(fd, request, s.addr, name);
  return Buffer.from(s.view);
}

function writeStruct(fd: number, request: number, bytes: Buffer, sizeBytes: number, name: string): void {
  if (bytes.length !== sizeBytes) throw new RangeError(`${name} takes ${sizeBytes} bytes, not ${bytes.length}`);
  const s = scratchStruct(sizeBytes);
  bytes.copy(s.view);
  ioctl(fd, request, s.addr, name);
}

/** struct kvm_msrs (header, then entries) in the scratch buffer. */
function msrsStruct(entries: readonly MsrEntry[]): { addr: number; view: Buffer } {
  if (entries.length > MAX_MSRS_PER_CALL) throw new RangeError(`at most ${MAX_MSRS_PER_CALL} MSRs per call, not ${entries.length}`);
  const s = scratchStruct(8 + entries.length * C.KVM_MSR_ENTRY_SIZE);
  s.view.writeUInt32LE(entries.length, 0);
  entries.forEach((e, i) => {
    s.view.writeUInt32LE(e.index >>> 0, 8 + i * C.KVM_MSR_ENTRY_SIZE);
    s.view.writeBigUInt64LE(e.value, 8 + i * C.KVM_MSR_ENTRY_SIZE + 8);
  });
  return s;
}

/** struct kvm_msr_list from a system ioctl: __u32 nmsrs, then that many __u32 indices. */
function msrList(fd: number, request: number, name: string): number[] {
  const max = 1024;
  const s = scratchStruct(4 + 4 * max);
  s.view.writeUInt32LE(max, 0);
  ioctl(fd, request, s.addr, name);
  const n = s.view.readUInt32LE(0);
  return Array.from({ length: n }, (_, i) => s.view.readUInt32LE(4 + 4 * i));
}
