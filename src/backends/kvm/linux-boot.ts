/**
 * Boots a Linux bzImage through the 64-bit boot protocol (the kernel's
 * Documentation/arch/x86/boot.rst): the protected-mode kernel is copied to 1 MiB, a zero page
 * (struct boot_params) carries the setup header, the e820 map, the command line and the initrd's
 * place. Only the boot vCPU starts, in 64-bit mode at the kernel's 64-bit entry with
 * identity-mapped page tables; the others wait for INIT/SIPI through the in-kernel local APICs,
 * and the kernel finds them in the MP table.
 */
import { InvalidOptionError } from '../../errors';
import type { GuestMemory } from './guest-memory';
import { HIGH_RAM_START, MMIO_HOLE_START } from './guest-memory';
import * as C from '../../sys/constants';
import type { Segment, Sregs, VcpuFd } from './ioctls';
import { MPTABLE_GPA, MPTABLE_MAX_BYTES, buildMpTable } from './mptable';

const GDT_GPA = 0x500;
const ZERO_PAGE_GPA = 0x7000;
const BOOT_STACK_GPA = 0x8ff0;
const PML4_GPA = 0x9000;
const PDPT_GPA = 0xa000;
const PD_GPA = 0xb000; // four page directories: identity map of the first 4 GiB
const CMDLINE_GPA = 0x20000;
const CMDLINE_MAX = MPTABLE_GPA - CMDLINE_GPA;
/** Where the protected-mode kernel is loaded (the decompressor relocates itself from there). */
const KERNEL_GPA = 0x100000;
const EBDA_END = 0x100000;

// Offsets in the setup header / boot_params (boot.rst, "The real-mode kernel header").
const HDR_SETUP_SECTS = 0x1f1;
const HDR_START = 0x1f1;
const HDR_JUMP = 0x200;
const HDR_MAGIC = 0x202;
const HDR_VERSION = 0x206;
const HDR_TYPE_OF_LOADER = 0x210;
const HDR_LOADFLAGS = 0x211;
const HDR_RAMDISK_IMAGE = 0x218;
const HDR_RAMDISK_SIZE = 0x21c;
const HDR_CMD_LINE_PTR = 0x228;
const HDR_INITRD_ADDR_MAX = 0x22c;
const HDR_XLOADFLAGS = 0x236;
const HDR_CMDLINE_SIZE = 0x238;
const HDR_INIT_SIZE = 0x260;
const BP_E820_ENTRIES = 0x1e8;
const BP_E820_TABLE = 0x2d0;
const E820_MAX = 128;
const E820_RAM = 1;
const E820_RESERVED = 2;
const LOADFLAGS_LOADED_HIGH = 0x01;
const XLF_KERNEL_64 = 0x01;
const MIN_BOOT_PROTOCOL = 0x020c; // 2.12: xloadflags, the 64-bit entry point

/** What the setup header of a bzImage says. */
export interface BzImageInfo {
  /** Boot protocol version, e.g. 0x020f. */
  protocol: number;
  /** Offset of the protected-mode kernel in the file. */
  kernelOffset: number;
  /** Bytes of setup header to copy into the zero page. */
  setupHeader: Buffer;
  /** Highest address the initrd may end at (inclusive). */
  initrdAddrMax: number;
  /** Longest command line the kernel accepts, bytes without the NUL. */
  cmdlineMax: number;
  /** Memory the kernel needs from its load address while it decompresses and starts. */
  initSize: number;
}

/** Reads and checks a bzImage's setup header; a file that is not one is an InvalidOptionError. */
export function parseBzImage(image: Buffer, what = 'kernel'): BzImageInfo {
  if (image.length < 0x400 || image.toString('latin1', HDR_MAGIC, HDR_MAGIC + 4) !== 'HdrS') {
    throw new InvalidOptionError(what, 'not a Linux bzImage (no "HdrS" setup header at 0x202)');
  }
  const protocol = image.readUInt16LE(HDR_VERSION);
  if (protocol < MIN_BOOT_PROTOCOL) throw new InvalidOptionError(what, `boot protocol ${protocol.toString(16)} is older than 2.12: no 64-bit entry point`);
  if (!(image.readUInt16LE(HDR_XLOADFLAGS) & XLF_KERNEL_64)) throw new InvalidOptionError(what, 'the kernel has no 64-bit entry point (XLF_KERNEL_64 unset)');
  if (!(image[HDR_LOADFLAGS] & LOADFLAGS_LOADED_HIGH)) throw new InvalidOptionError(what, 'not a bzImage (a zImage loads low)');
  const setupSects = image[HDR_SETUP_SECTS] || 4;
  const kernelOffset = (setupSects + 1) * 512;
  if (kernelOffset >= image.length) throw new InvalidOptionError(what, 'truncated: the setup code runs past the end of the file');
  const headerEnd = HDR_JUMP + 2 + image[HDR_JUMP + 1];
  return {
    protocol,
    kernelOffset,
    setupHeader: Buffer.from(image.subarray(HDR_START, headerEnd)),
    initrdAddrMax: image.readUInt32LE(HDR_INITRD_ADDR_MAX),
    cmdlineMax: image.readUInt32LE(HDR_CMDLINE_SIZE),
    initSize: image.readUInt32LE(HDR_INIT_SIZE),
  };
}

/** One e820 entry. */
export interface E820Entry {
  addr: number;
  size: number;
  type: typeof E820_RAM | typeof E820_RESERVED;
}

/**
 * The memory map the guest sees: low RAM below the EBDA, the EBDA and legacy ROM area reserved,
 * RAM from 1 MiB up to the MMIO hole, and RAM above 4 GiB for what does not fit below it.
 */
export function e820Map(ramBytes: number): E820Entry[] {
  const map: E820Entry[] = [
    { addr: 0, size: MPTABLE_GPA, type: E820_RAM },
    { addr: MPTABLE_GPA, size: EBDA_END - MPTABLE_GPA, type: E820_RESERVED },
  ];
  const low = Math.min(ramBytes, MMIO_HOLE_START);
  map.push({ addr: EBDA_END, size: low - EBDA_END, type: E820_RAM });
  if (ramBytes > MMIO_HOLE_START) map.push({ addr: HIGH_RAM_START, size: ramBytes - MMIO_HOLE_START, type: E820_RAM });
  return map;
}

/** What {@link loadLinux} needs. */
export interface LinuxBootConfig {
  kernel: Buffer;
  initrd?: Buffer;
  cmdline: string;
  vcpus: number;
}

/** Where the boot vCPU enters. */
export interface LinuxEntry {
  rip: number;
  zeroPage: number;
}

/** Writes kernel, initrd, command line, zero page, MP table and boot page tables into guest RAM. */
export function loadLinux(mem: GuestMemory, config: LinuxBootConfig): LinuxEntry {
  const info = parseBzImage(config.kernel);
  const ramBytes = mem.sizeBytes;
  const lowEnd = Math.min(ramBytes, MMIO_HOLE_START);
  const kernel = config.kernel.subarray(info.kernelOffset);
  const kernelNeeds = Math.max(kernel.length, info.initSize);
  if (KERNEL_GPA + kernelNeeds > lowEnd) throw new InvalidOptionError('memory', `too small for this kernel (it needs ${Math.ceil((KERNEL_GPA + kernelNeeds) / 2 ** 20)} MiB to start)`);
  mem.write(KERNEL_GPA, kernel);

  const cmdline = Buffer.from(`${config.cmdline}\0`, 'utf8');
  if (cmdline.length - 1 > Math.min(info.cmdlineMax, CMDLINE_MAX - 1)) throw new InvalidOptionError('cmdline', `longer than the kernel accepts (${info.cmdlineMax} bytes)`);
  mem.write(CMDLINE_GPA, cmdline);

  const zp = Buffer.alloc(4096);
  info.setupHeader.copy(zp, HDR_START);
  zp[HDR_TYPE_OF_LOADER] = 0xff; // "undefined" boot loader
  zp.writeUInt32LE(CMDLINE_GPA, HDR_CMD_LINE_PTR);
  if (config.initrd?.length) {
    // Highest page-aligned place below both the kernel's limit and low RAM's end, clear of the kernel.
    const limit = Math.min(info.initrdAddrMax + 1, lowEnd);
    const at = Math.floor((limit - config.initrd.length) / 4096) * 4096;
    if (at < KERNEL_GPA + kernelNeeds) throw new InvalidOptionError('memory', `too small for this kernel and initrd (${(config.initrd.length / 2 ** 20).toFixed(1)} MiB)`);
    mem.write(at, config.initrd);
    zp.writeUInt32LE(at, HDR_RAMDISK_IMAGE);
    zp.writeUInt32LE(config.initrd.length, HDR_RAMDISK_SIZE);
  }
  const map = e820Map(ramBytes);
  if (map.length > E820_MAX) throw new Error('e820 map too long');
  zp[BP_E820_ENTRIES] = map.length;
  map.forEach((e, i) => {
    const off = BP_E820_TABLE + 20 * i;
    zp.writeBigUInt64LE(BigInt(e.addr), off);
    zp.writeBigUInt64LE(BigInt(e.size), off + 8);
    zp.writeUInt32LE(e.type, off + 16);
  });
  mem.write(ZERO_PAGE_GPA, zp);

  const mp = buildMpTable(config.vcpus);
  if (mp.length > MPTABLE_MAX_BYTES) throw new Error('MP table too large');
  mem.write(MPTABLE_GPA, mp);

  // GDT: null, null, __BOOT_CS (0x10, 64-bit code), __BOOT_DS (0x18), as the 64-bit entry expects.
  [0n, 0n, 0x00af9b000000ffffn, 0x00cf93000000ffffn].forEach((d, i) => mem.writeU64(GDT_GPA + 8 * i, d));
  // Identity map of the first 4 GiB with 2 MiB pages: the kernel, zero page, command line and initrd.
  mem.writeU64(PML4_GPA, BigInt(PDPT_GPA) | 3n);
  for (let g = 0; g < 4; g++) {
    mem.writeU64(PDPT_GPA + 8 * g, BigInt(PD_GPA + 0x1000 * g) | 3n);
    for (let e = 0; e < 512; e++) mem.writeU64(PD_GPA + 0x1000 * g + 8 * e, (BigInt(g) << 30n) | (BigInt(e) << 21n) | 0x83n);
  }
  return { rip: KERNEL_GPA + 0x200, zeroPage: ZERO_PAGE_GPA };
}

/** Puts the boot vCPU at the 64-bit entry: long mode, flat ring-0 segments, interrupts off. */
export function setupLinuxBootVcpu(vcpu: VcpuFd, entry: LinuxEntry): void {
  const seg = (selector: number, code: boolean): Segment => ({
    base: 0, limit: 0xffffffff, selector, present: 1, dpl: 0, s: 1, g: 1,
    type: code ? 0xb : 0x3, l: code ? 1 : 0, db: code ? 0 : 1,
  });
  const data = seg(0x18, false);
  const sregs: Sregs = {
    cs: seg(0x10, true),
    ds: data, es: data, fs: data, gs: data, ss: data,
    tr: { base: 0, limit: 0x67, selector: 0, type: 0xb, present: 1, dpl: 0, db: 0, s: 0, l: 0, g: 0 },
    ldt: { base: 0, limit: 0, selector: 0, type: 0x2, present: 0, dpl: 0, db: 0, s: 0, l: 0, g: 0 },
    gdt: { base: GDT_GPA, limit: 4 * 8 - 1 },
    idt: { base: 0, limit: 0 },
    cr0: (C.X86_CR0_PE | C.X86_CR0_ET | C.X86_CR0_PG) >>> 0,
    cr3: PML4_GPA,
    cr4: C.X86_CR4_PAE,
    efer: C.EFER_LME | C.EFER_LMA,
  };
  vcpu.setSregs(sregs);
  vcpu.setRegs({ rip: entry.rip, rsi: entry.zeroPage, rsp: BOOT_STACK_GPA, rbp: BOOT_STACK_GPA, rflags: 0x2 });
}

const CPUID_ENTRY_BYTES = 40;
const LAPIC_LVT0 = 0x350;
const LAPIC_LVT1 = 0x360;
const APIC_MODE_NMI = 0x4;
const APIC_MODE_EXTINT = 0x7;

/**
 * A copy of KVM's supported CPUID with vCPU `index`'s APIC id in leaf 1 (EBX[31:24]) and leaves
 * 0xB and 0x1F (EDX, the x2APIC id), so that the ids Linux reads match the MP table.
 *
 * The hypervisor bit (leaf 1 ECX[31]) stays clear, as KVM gives it: with it set the guest found
 * KVM's leaves and ran on kvm-clock, and in the nested harness (the only KVM here that runs this
 * guest) its timers then never fired: `sleep 1` did not return, which hung every test that
 * waited on one.
 */
export function cpuidForVcpu(supported: Buffer, index: number): Buffer {
  const out = Buffer.from(supported);
  const n = out.readUInt32LE(0);
  for (let i = 0; i < n; i++) {
    const e = 8 + i * CPUID_ENTRY_BYTES;
    const fn = out.readUInt32LE(e);
    if (fn === 1) out.writeUInt32LE(((out.readUInt32LE(e + 16) & 0x00ffffff) | (index << 24)) >>> 0, e + 16);
    // struct kvm_cpuid_entry2: function, index, flags, eax, ebx, ecx, edx (+24), padding.
    if (fn === 0xb || fn === 0x1f) out.writeUInt32LE(index, e + 24);
  }
  return out;
}

/** Wires LINT0 as ExtINT (the PIC) and LINT1 as NMI, as firmware leaves them for Linux. */
export function setupLapic(vcpu: VcpuFd): void {
  const lapic = vcpu.getLapic();
  const lvt = (off: number, mode: number) => lapic.writeUInt32LE(((lapic.readUInt32LE(off) & ~0x700) | (mode << 8)) >>> 0, off);
  lvt(LAPIC_LVT0, APIC_MODE_EXTINT);
  lvt(LAPIC_LVT1, APIC_MODE_NMI);
  vcpu.setLapic(lapic);
}
