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

  /** Sets the CPUID the guest sees (raw kvm_cpuid2 bytes). */
  /** The local APIC's register page (struct kvm_lapic_state), a copy. */
  getLapic(): Buffer {
    const s = scratchStruct(C.KVM_LAPIC_STATE_SIZE);
    ioctl(this.fd, C.KVM_GET_LAPIC, s.addr, 'KVM_GET_LAPIC');
    return Buffer.from(s.view.subarray(0, C.KVM_LAPIC_STATE_SIZE));
  }

  setLapic(state: Buffer): void {
    const s = scratchStruct(C.KVM_LAPIC_STATE_SIZE);
    state.copy(s.view, 0, 0, C.KVM_LAPIC_STATE_SIZE);
    ioctl(this.fd, C.KVM_SET_LAPIC, s.addr, 'KVM_SET_LAPIC');
  }

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
