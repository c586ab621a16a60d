/**
 * Boots the probe guest: writes the GDT, identity page tables and boot info into guest RAM, copies
 * the flat image, and puts every vCPU straight into 64-bit mode at CPL3 (no BIOS, no real mode).
 * CPL3 because on paravirtualised nested KVM (kvm_pvm) user-mode guest code runs at native speed
 * while kernel-mode code is instruction-emulated. docs/probe-guest.md is the layout's contract.
 */
import { InvalidOptionError } from '../../errors';
import * as C from '../../sys/constants';
import type { GuestMemory } from './guest-memory';
import { HIGH_RAM_START, MMIO_HOLE_START } from './guest-memory';
import type { Segment, Sregs, VcpuFd } from './ioctls';

const GDT_GPA = 0x1000;
const PML4_GPA = 0x2000;
const PDPT_GPA = 0x3000;
const PD_GPA = 0x4000;
const BOOT_INFO_GPA = 0xf000;
const MAX_PD_PAGES = (BOOT_INFO_GPA - PD_GPA) / 0x1000; // each maps 1 GiB with 2 MiB pages
/** Where the image is loaded and entered. */
export const PROBE_LOAD_GPA = 0x100000;
const STACK_TOP_GPA = 0x200000;
const STACK_BYTES_PER_VCPU = 0x10000;
const IMAGE_LIMIT_GPA = 0x180000;
/** Start of the working set area. */
export const PROBE_WS_BASE = 0x400000;
const BOOT_INFO_MAGIC = 0x50564249;

const SEL_USER_DATA = 0x18 | 3;
const SEL_USER_CODE = 0x20 | 3;
// IOPL 0: the probe uses no port I/O, and kvm_pvm would clear IOPL anyway, so a port access is a
// #GP (a triple fault) on every KVM, never a path that works on one host only.
const RFLAGS_RESERVED = 0x2;

/** Largest guest RAM the probe's page tables can map. */
export const PROBE_MAX_RAM_BYTES = MAX_PD_PAGES * 1024 ** 3 - (HIGH_RAM_START - MMIO_HOLE_START);

/** Addresses the VMM gives the probe. */
export interface ProbeBootInfo {
  consoleMmio: number;
  balloonMmio: number;
  vcpuCount: number;
}

/** End (exclusive) of usable working set: contiguous RAM from PROBE_WS_BASE. */
export function probeWorkingSetLimit(ramBytes: number): number {
  return Math.min(ramBytes, MMIO_HOLE_START);
}

/** Writes tables, boot info and image into guest RAM. */
export function loadProbe(mem: GuestMemory, image: Buffer, info: ProbeBootInfo): void {
  if (mem.sizeBytes > PROBE_MAX_RAM_BYTES) {
    throw new InvalidOptionError('memory', `the probe guest maps at most ${PROBE_MAX_RAM_BYTES / 1024 ** 3} GiB of RAM`);
  }
  if (mem.sizeBytes < PROBE_WS_BASE + 0x200000) throw new InvalidOptionError('memory', 'the probe guest needs at least 6 MiB of RAM');
  if (PROBE_LOAD_GPA + image.length > IMAGE_LIMIT_GPA) throw new Error(`probe image too large (${image.length} bytes)`);

  // GDT: null, kernel code64, kernel data, user data, user code64 (the layout sysret expects).
  const gdt = [0n, 0x00209a0000000000n, 0x0000920000000000n, 0x0000f20000000000n, 0x0020fa0000000000n];
  gdt.forEach((d, i) => mem.writeU64(GDT_GPA + 8 * i, d));

  const PRESENT_RW_USER = 0x7n;
  const PAGE_2M = 0x80n;
  const ramEnd = mem.regions.reduce((end, r) => Math.max(end, r.guestPhysAddr + r.sizeBytes), 0);
  const gibs = Math.max(4, Math.ceil(ramEnd / 1024 ** 3));
  mem.writeU64(PML4_GPA, BigInt(PDPT_GPA) | PRESENT_RW_USER);
  for (let g = 0; g < gibs; g++) {
    const pd = PD_GPA + g * 0x1000;
    mem.writeU64(PDPT_GPA + 8 * g, BigInt(pd) | PRESENT_RW_USER);
    for (let e = 0; e < 512; e++) {
      const addr = BigInt(g) * 2n ** 30n + BigInt(e) * 2n ** 21n;
      mem.writeU64(pd + 8 * e, addr | PRESENT_RW_USER | PAGE_2M);
    }
  }

  const bi = Buffer.alloc(56);
  bi.writeUInt32LE(BOOT_INFO_MAGIC, 0);
  bi.writeUInt32LE(1, 4);
  bi.writeBigUInt64LE(BigInt(mem.sizeBytes), 8);
  bi.writeBigUInt64LE(BigInt(PROBE_WS_BASE), 16);
  bi.writeBigUInt64LE(BigInt(probeWorkingSetLimit(mem.sizeBytes)), 24);
  bi.writeBigUInt64LE(BigInt(info.consoleMmio), 32);
  bi.writeBigUInt64LE(BigInt(info.balloonMmio), 40);
  bi.writeUInt32LE(info.vcpuCount, 48);
  mem.write(BOOT_INFO_GPA, bi);
  mem.write(PROBE_LOAD_GPA, image);
}

function segment(selector: number, code: boolean): Segment {
  return {
    base: 0, limit: 0xffffffff, selector, present: 1, dpl: selector & 3, s: 1, g: 1,
    type: code ? 0xb : 0x3, // execute/read or read/write, accessed
    l: code ? 1 : 0, db: code ? 0 : 1,
  };
}

/** Puts vCPU `index` at the probe's entry in 64-bit mode, CPL3. */
export function setupProbeVcpu(vcpu: VcpuFd, index: number): void {
  const data = segment(SEL_USER_DATA, false);
  const sregs: Sregs = {
    cs: segment(SEL_USER_CODE, true),
    ds: data, es: data, fs: data, gs: data, ss: data,
    // VM entry wants a usable busy 64-bit TSS even though nothing uses it.
    tr: { base: 0, limit: 0x67, selector: 0, type: 0xb, present: 1, dpl: 0, db: 0, s: 0, l: 0, g: 0 },
    ldt: { base: 0, limit: 0, selector: 0, type: 0x2, present: 0, dpl: 0, db: 0, s: 0, l: 0, g: 0 },
    gdt: { base: GDT_GPA, limit: 5 * 8 - 1 },
    // No IDT: any exception escalates to a triple fault, which the VMM sees as a shutdown exit.
    idt: { base: 0, limit: 0 },
    cr0: (C.X86_CR0_PE | C.X86_CR0_MP | C.X86_CR0_ET | C.X86_CR0_NE | C.X86_CR0_WP | C.X86_CR0_PG) >>> 0,
    cr3: PML4_GPA,
    cr4: C.X86_CR4_PAE | C.X86_CR4_OSFXSR | C.X86_CR4_OSXMMEXCPT,
    efer: C.EFER_LME | C.EFER_LMA | C.EFER_SCE,
  };
  vcpu.setSregs(sregs);
  vcpu.setRegs({
    rip: PROBE_LOAD_GPA,
    rsp: STACK_TOP_GPA - STACK_BYTES_PER_VCPU * index,
    rdi: index,
    rsi: BOOT_INFO_GPA,
    rflags: RFLAGS_RESERVED,
  });
}
