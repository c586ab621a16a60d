/**
 * Kernel ABI constants, each with the header it comes from (x86_64).
 */

// <asm-generic/fcntl.h>
export const O_RDWR = 0o2;
export const O_CLOEXEC = 0o2000000;

// <asm-generic/mman-common.h>, <linux/mman.h>
export const PROT_NONE = 0x0;
export const PROT_READ = 0x1;
export const PROT_WRITE = 0x2;
export const MAP_SHARED = 0x01;
export const MAP_PRIVATE = 0x02;
export const MAP_FIXED = 0x10;
export const MAP_ANONYMOUS = 0x20;
export const MAP_NORESERVE = 0x4000;
export const MADV_DONTNEED = 4;
export const MADV_REMOVE = 9;
export const MADV_DONTFORK = 10;
export const MADV_MERGEABLE = 12;
export const MADV_UNMERGEABLE = 13;
export const MADV_HUGEPAGE = 14;
export const MADV_NOHUGEPAGE = 15;
export const MADV_PAGEOUT = 21; // Linux 5.4+
export const MADV_POPULATE_WRITE = 23; // Linux 5.14+

// <linux/memfd.h>
export const MFD_CLOEXEC = 0x1;


// <asm-generic/errno-base.h>
export const EINTR = 4;
export const EAGAIN = 11;
export const EINVAL = 22;

// <linux/magic.h>: statfs f_type of the filesystems whose files live in RAM
export const TMPFS_MAGIC = 0x01021994;
export const RAMFS_MAGIC = 0x858458f6;

/** The host's page size; pvisor's guest RAM granule. */
export const PAGE_SIZE = 4096;

// <linux/kvm.h>: ioctl numbers, _IO/_IOR/_IOW(KVMIO = 0xAE, nr, type)
export const KVM_API_VERSION = 12;
export const KVM_GET_API_VERSION = 0xae00;
export const KVM_CREATE_VM = 0xae01;
export const KVM_CHECK_EXTENSION = 0xae03;
export const KVM_GET_VCPU_MMAP_SIZE = 0xae04;
export const KVM_GET_SUPPORTED_CPUID = 0xc008ae05; // _IOWR(KVMIO, 0x05, struct kvm_cpuid2)
export const KVM_CREATE_VCPU = 0xae41;
export const KVM_SET_USER_MEMORY_REGION = 0x4020ae46; // _IOW(KVMIO, 0x46, struct kvm_userspace_memory_region)
export const KVM_SET_TSS_ADDR = 0xae47;
export const KVM_GET_REGS = 0x8090ae81; // _IOR(KVMIO, 0x81, struct kvm_regs)
export const KVM_SET_REGS = 0x4090ae82; // _IOW(KVMIO, 0x82, struct kvm_regs)
export const KVM_GET_SREGS = 0x8138ae83; // _IOR(KVMIO, 0x83, struct kvm_sregs)
export const KVM_SET_SREGS = 0x4138ae84; // _IOW(KVMIO, 0x84, struct kvm_sregs)
export const KVM_SET_CPUID2 = 0x4008ae90; // _IOW(KVMIO, 0x90, struct kvm_cpuid2)
export const KVM_CREATE_IRQCHIP = 0xae60;
export const KVM_IRQ_LINE = 0x4008ae61; // _IOW(KVMIO, 0x61, struct kvm_irq_level)
export const KVM_IRQFD = 0x4020ae76; // _IOW(KVMIO, 0x76, struct kvm_irqfd)
export const KVM_IRQFD_SIZE = 32;
export const KVM_IOEVENTFD = 0x4040ae79; // _IOW(KVMIO, 0x79, struct kvm_ioeventfd)
export const KVM_IOEVENTFD_SIZE = 64;
export const KVM_IOEVENTFD_FLAG_DATAMATCH = 1;
export const KVM_CREATE_PIT2 = 0x4040ae77; // _IOW(KVMIO, 0x77, struct kvm_pit_config)
export const KVM_GET_LAPIC = 0x8400ae8e; // _IOR(KVMIO, 0x8e, struct kvm_lapic_state)
export const KVM_SET_LAPIC = 0x4400ae8f; // _IOW(KVMIO, 0x8f, struct kvm_lapic_state)
// Machine state (vCPU and VM) for snapshots; docs/snapshot-state.md says which this host refuses.
export const KVM_GET_MSR_INDEX_LIST = 0xc004ae02; // _IOWR(KVMIO, 0x02, struct kvm_msr_list)
export const KVM_GET_MSR_FEATURE_INDEX_LIST = 0xc004ae0a; // _IOWR(KVMIO, 0x0a, struct kvm_msr_list)
export const KVM_GET_MSRS = 0xc008ae88; // _IOWR(KVMIO, 0x88, struct kvm_msrs)
export const KVM_SET_MSRS = 0x4008ae89; // _IOW(KVMIO, 0x89, struct kvm_msrs)
export const KVM_GET_FPU = 0x81a0ae8c; // _IOR(KVMIO, 0x8c, struct kvm_fpu)
export const KVM_SET_FPU = 0x41a0ae8d; // _IOW(KVMIO, 0x8d, struct kvm_fpu)
export const KVM_GET_MP_STATE = 0x8004ae98; // _IOR(KVMIO, 0x98, struct kvm_mp_state)
export const KVM_SET_MP_STATE = 0x4004ae99; // _IOW(KVMIO, 0x99, struct kvm_mp_state)
export const KVM_GET_VCPU_EVENTS = 0x8040ae9f; // _IOR(KVMIO, 0x9f, struct kvm_vcpu_events)
export const KVM_SET_VCPU_EVENTS = 0x4040aea0; // _IOW(KVMIO, 0xa0, struct kvm_vcpu_events)
export const KVM_GET_DEBUGREGS = 0x8080aea1; // _IOR(KVMIO, 0xa1, struct kvm_debugregs)
export const KVM_SET_DEBUGREGS = 0x4080aea2; // _IOW(KVMIO, 0xa2, struct kvm_debugregs)
export const KVM_SET_TSC_KHZ = 0xaea2; // _IO(KVMIO, 0xa2)
export const KVM_GET_TSC_KHZ = 0xaea3; // _IO(KVMIO, 0xa3)
export const KVM_GET_XSAVE = 0x9000aea4; // _IOR(KVMIO, 0xa4, struct kvm_xsave)
export const KVM_SET_XSAVE = 0x5000aea5; // _IOW(KVMIO, 0xa5, struct kvm_xsave)
// The number carries 4096 (struct kvm_xsave's size); with KVM_CAP_XSAVE2 the buffer is as large as
// KVM_CHECK_EXTENSION(KVM_CAP_XSAVE2) says, and KVM_SET_XSAVE takes that size too.
export const KVM_GET_XSAVE2 = 0x9000aecf; // _IOR(KVMIO, 0xcf, struct kvm_xsave)
export const KVM_GET_XCRS = 0x8188aea6; // _IOR(KVMIO, 0xa6, struct kvm_xcrs)
export const KVM_SET_XCRS = 0x4188aea7; // _IOW(KVMIO, 0xa7, struct kvm_xcrs)
export const KVM_GET_SREGS2 = 0x8140aecc; // _IOR(KVMIO, 0xcc, struct kvm_sregs2)
export const KVM_SET_SREGS2 = 0x4140aecd; // _IOW(KVMIO, 0xcd, struct kvm_sregs2)
export const KVM_GET_IRQCHIP = 0xc208ae62; // _IOWR(KVMIO, 0x62, struct kvm_irqchip)
export const KVM_SET_IRQCHIP = 0x8208ae63; // _IOR(KVMIO, 0x63, struct kvm_irqchip): _IOR, as the header has it
export const KVM_GET_PIT2 = 0x8070ae9f; // _IOR(KVMIO, 0x9f, struct kvm_pit_state2)
export const KVM_SET_PIT2 = 0x4070aea0; // _IOW(KVMIO, 0xa0, struct kvm_pit_state2)
export const KVM_GET_CLOCK = 0x8030ae7c; // _IOR(KVMIO, 0x7c, struct kvm_clock_data)
export const KVM_SET_CLOCK = 0x4030ae7b; // _IOW(KVMIO, 0x7b, struct kvm_clock_data)
/** _IO(KVMIO, 0x80): issued only by the vCPU threads of native-prebuilds/helpers/vcpu_runner.c (its KVM_RUN_IOCTL). */
export const KVM_RUN = 0xae80;
/**
 * _IOW(KVMIO, 0x49, struct kvm_userspace_memory_region2): never issued by pvisor. A jailed VMM's
 * filter refuses it; the jail's test hook (src/jail/jailed-entry.ts) makes it to show that.
 */
export const KVM_SET_USER_MEMORY_REGION2 = 0x40a0ae49;
export const KVM_FPU_SIZE = 416;
export const KVM_XSAVE_SIZE = 4096;
export const KVM_XCRS_SIZE = 392;
export const KVM_SREGS2_SIZE = 320;
export const KVM_VCPU_EVENTS_SIZE = 64;
export const KVM_DEBUGREGS_SIZE = 128;
export const KVM_MP_STATE_SIZE = 4;
/** struct kvm_msr_entry: __u32 index; __u32 reserved; __u64 data (after an 8-byte kvm_msrs header). */
export const KVM_MSR_ENTRY_SIZE = 16;
/** struct kvm_irqchip: __u32 chip_id; __u32 pad; a 512-byte union (PIC state or IOAPIC state). */
export const KVM_IRQCHIP_SIZE = 520;
export const KVM_IRQCHIP_DATA_SIZE = 512;
/** kvm_irqchip.chip_id of each in-kernel chip (KVM_IRQCHIP_PIC_MASTER, _PIC_SLAVE, _IOAPIC). */
export const KVM_IRQCHIP_IDS = { picMaster: 0, picSlave: 1, ioapic: 2 } as const;
/** struct kvm_pit_state2: 3 kvm_pit_channel_state of 24 bytes, __u32 flags, __u32 reserved[9]. */
export const KVM_PIT_STATE2_SIZE = 112;
/** struct kvm_clock_data: __u64 clock; __u32 flags; __u32 pad0; __u64 realtime; __u64 host_tsc; __u32 pad[4]. */
export const KVM_CLOCK_DATA_SIZE = 48;
export const KVM_CLOCK_DATA_FLAGS = 8;
/** kvm_clock_data.flags: `realtime` is valid; on KVM_SET_CLOCK, advance the clock by the time since. */
export const KVM_CLOCK_REALTIME = 1 << 2;
export const KVM_PIT_SPEAKER_DUMMY = 1;
export const KVM_PIT_CONFIG_SIZE = 64;
export const KVM_LAPIC_STATE_SIZE = 1024;

// <linux/kvm.h>: capabilities
export const KVM_CAP_USER_MEMORY = 3;
export const KVM_CAP_NR_MEMSLOTS = 10;
export const KVM_CAP_IMMEDIATE_EXIT = 136;
export const KVM_CAP_IRQCHIP = 0;
export const KVM_CAP_MP_STATE = 14;
export const KVM_CAP_PIT_STATE2 = 35;
export const KVM_CAP_ADJUST_CLOCK = 39;
export const KVM_CAP_VCPU_EVENTS = 41;
export const KVM_CAP_DEBUGREGS = 50;
export const KVM_CAP_XSAVE = 55;
export const KVM_CAP_XCRS = 56;
export const KVM_CAP_GET_TSC_KHZ = 61;
export const KVM_CAP_GET_MSR_FEATURES = 153;
export const KVM_CAP_SREGS2 = 200;
export const KVM_CAP_XSAVE2 = 208;

// <linux/kvm.h>: exit reasons
export const KVM_EXIT_UNKNOWN = 0;
export const KVM_EXIT_EXCEPTION = 1;
export const KVM_EXIT_IO = 2;
export const KVM_EXIT_HLT = 5;
export const KVM_EXIT_MMIO = 6;
export const KVM_EXIT_SHUTDOWN = 8;
export const KVM_EXIT_FAIL_ENTRY = 9;
export const KVM_EXIT_INTERNAL_ERROR = 17;
export const KVM_EXIT_SYSTEM_EVENT = 24;
export const KVM_EXIT_IO_IN = 0;
export const KVM_EXIT_IO_OUT = 1;

/** Names of exit reasons, for error messages. */
export const KVM_EXIT_NAMES: Record<number, string> = {
  0: 'unknown', 1: 'exception', 2: 'io', 5: 'hlt', 6: 'mmio', 8: 'shutdown', 9: 'fail-entry',
  17: 'internal-error', 24: 'system-event',
};

// struct kvm_run (<linux/kvm.h>): offsets of the fields pvisor reads
export const KVM_RUN_IMMEDIATE_EXIT = 1; // __u8
export const KVM_RUN_EXIT_REASON = 8; // __u32
export const KVM_RUN_UNION = 32; // the exit union starts here
// union member `io`: __u8 direction; __u8 size; __u16 port; __u32 count; __u64 data_offset
export const KVM_RUN_IO_DIRECTION = KVM_RUN_UNION + 0;
export const KVM_RUN_IO_SIZE = KVM_RUN_UNION + 1;
export const KVM_RUN_IO_PORT = KVM_RUN_UNION + 2;
export const KVM_RUN_IO_COUNT = KVM_RUN_UNION + 4;
export const KVM_RUN_IO_DATA_OFFSET = KVM_RUN_UNION + 8;
// union member `mmio`: __u64 phys_addr; __u8 data[8]; __u32 len; __u8 is_write
export const KVM_RUN_MMIO_PHYS_ADDR = KVM_RUN_UNION + 0;
export const KVM_RUN_MMIO_DATA = KVM_RUN_UNION + 8;
export const KVM_RUN_MMIO_LEN = KVM_RUN_UNION + 16;
export const KVM_RUN_MMIO_IS_WRITE = KVM_RUN_UNION + 20;
// union member `internal`: __u32 suberror; __u32 ndata; __u64 data[16]
export const KVM_RUN_INTERNAL_SUBERROR = KVM_RUN_UNION + 0;
// union member `fail_entry`: __u64 hardware_entry_failure_reason
export const KVM_RUN_FAIL_ENTRY_REASON = KVM_RUN_UNION + 0;

// struct kvm_regs: 18 __u64 in this order
export const KVM_REGS_SIZE = 144;
export const KVM_REGS = {
  rax: 0, rbx: 1, rcx: 2, rdx: 3, rsi: 4, rdi: 5, rsp: 6, rbp: 7,
  r8: 8, r9: 9, r10: 10, r11: 11, r12: 12, r13: 13, r14: 14, r15: 15, rip: 16, rflags: 17,
} as const;

// struct kvm_sregs: 8 kvm_segment (24 bytes each: base u64, limit u32, selector u16, type u8,
// present, dpl, db, s, l, g, avl, unusable, padding), 2 kvm_dtable (16 bytes: base u64, limit u16,
// padding), cr0, cr2, cr3, cr4, cr8, efer, apic_base u64, interrupt_bitmap[4] u64
export const KVM_SREGS_SIZE = 312;
export const KVM_SREGS_SEGMENTS = { cs: 0, ds: 24, es: 48, fs: 72, gs: 96, ss: 120, tr: 144, ldt: 168 } as const;
export const KVM_SREGS_GDT = 192;
export const KVM_SREGS_IDT = 208;
export const KVM_SREGS_CR0 = 224;
export const KVM_SREGS_CR2 = 232;
export const KVM_SREGS_CR3 = 240;
export const KVM_SREGS_CR4 = 248;
export const KVM_SREGS_CR8 = 256;
export const KVM_SREGS_EFER = 264;
export const KVM_SREGS_APIC_BASE = 272;

// struct kvm_userspace_memory_region: __u32 slot; __u32 flags; __u64 guest_phys_addr;
// __u64 memory_size; __u64 userspace_addr
export const KVM_MEMORY_REGION_SIZE = 32;

// <asm/processor-flags.h>, <asm/msr-index.h>
export const X86_CR0_PE = 1 << 0;
export const X86_CR0_MP = 1 << 1;
export const X86_CR0_ET = 1 << 4;
export const X86_CR0_NE = 1 << 5;
export const X86_CR0_WP = 1 << 16;
export const X86_CR0_AM = 1 << 18;
export const X86_CR0_PG = 2 ** 31;
export const X86_CR4_PAE = 1 << 5;
export const X86_CR4_OSFXSR = 1 << 9;
export const X86_CR4_OSXMMEXCPT = 1 << 10;
export const EFER_SCE = 1 << 0;
export const EFER_LME = 1 << 8;
export const EFER_LMA = 1 << 10;
export const EFER_NX = 1 << 11;

// <linux/vhost.h>: ioctls on /dev/vhost-net, _IO/_IOR/_IOW(VHOST_VIRTIO = 0xAF, nr, type)
export const VHOST_GET_FEATURES = 0x8008af00; // _IOR(0xAF, 0x00, __u64)
export const VHOST_SET_FEATURES = 0x4008af00; // _IOW(0xAF, 0x00, __u64)
export const VHOST_SET_OWNER = 0xaf01; // _IO(0xAF, 0x01)
export const VHOST_SET_MEM_TABLE = 0x4008af03; // _IOW(0xAF, 0x03, struct vhost_memory)
export const VHOST_SET_VRING_NUM = 0x4008af10; // _IOW(0xAF, 0x10, struct vhost_vring_state)
export const VHOST_SET_VRING_ADDR = 0x4028af11; // _IOW(0xAF, 0x11, struct vhost_vring_addr)
export const VHOST_SET_VRING_BASE = 0x4008af12; // _IOW(0xAF, 0x12, struct vhost_vring_state)
export const VHOST_GET_VRING_BASE = 0xc008af12; // _IOWR(0xAF, 0x12, struct vhost_vring_state)
export const VHOST_SET_VRING_KICK = 0x4008af20; // _IOW(0xAF, 0x20, struct vhost_vring_file)
export const VHOST_SET_VRING_CALL = 0x4008af21; // _IOW(0xAF, 0x21, struct vhost_vring_file)
export const VHOST_NET_SET_BACKEND = 0x4008af30; // _IOW(0xAF, 0x30, struct vhost_vring_file)
// struct vhost_memory { __u32 nregions; __u32 padding; struct vhost_memory_region regions[]; },
// region { __u64 guest_phys_addr; __u64 memory_size; __u64 userspace_addr; __u64 flags_padding; }
export const VHOST_MEMORY_HEADER_SIZE = 8;
export const VHOST_MEMORY_REGION_SIZE = 32;
// struct vhost_vring_addr { __u32 index; __u32 flags; __u64 desc_user_addr; __u64 used_user_addr;
// __u64 avail_user_addr; __u64 log_guest_addr; }
export const VHOST_VRING_ADDR_SIZE = 40;

// <linux/userfaultfd.h>: ioctls on /dev/userfaultfd and on a userfaultfd (0xAA), issued only by
// native-prebuilds/helpers/uffd_server.c (which takes them from the header; these are its values on x86-64)
export const USERFAULTFD_IOC_NEW = 0xaa00; // _IO(0xAA, 0x00), Linux 6.1+
export const UFFDIO_API = 0xc018aa3f; // _IOWR(0xAA, 0x3F, struct uffdio_api)
export const UFFDIO_REGISTER = 0xc020aa00; // _IOWR(0xAA, 0x00, struct uffdio_register)
export const UFFDIO_UNREGISTER = 0x8010aa01; // _IOR(0xAA, 0x01, struct uffdio_range)
export const UFFDIO_WAKE = 0x8010aa02; // _IOR(0xAA, 0x02, struct uffdio_range)
export const UFFDIO_COPY = 0xc028aa03; // _IOWR(0xAA, 0x03, struct uffdio_copy)
export const UFFDIO_ZEROPAGE = 0xc020aa04; // _IOWR(0xAA, 0x04, struct uffdio_zeropage)
export const UFFDIO_WRITEPROTECT = 0xc018aa06; // _IOWR(0xAA, 0x06, struct uffdio_writeprotect)

// <asm-generic/ioctls.h>: the terminal and file ioctls node (libuv) makes on its stdio and pipes
export const TCGETS = 0x5401;
export const TCSETS = 0x5402;
export const TIOCGWINSZ = 0x5413;
export const FIONREAD = 0x541b;
export const FIONBIO = 0x5421;
export const FIONCLEX = 0x5450;
export const FIOCLEX = 0x5451;
export const TIOCGPTN = 0x80045430; // _IOR('T', 0x30, unsigned int)

// <linux/if_tun.h>: ioctls on /dev/net/tun, _IOW('T', nr, int)
export const TUNSETIFF = 0x400454ca;
export const TUNSETOFFLOAD = 0x400454d0;
export const TUNSETVNETHDRSZ = 0x400454d8;
export const IFF_TAP = 0x0002;
export const IFF_NO_PI = 0x1000;
export const IFF_VNET_HDR = 0x4000;
export const TUN_F_CSUM = 0x01;
export const TUN_F_TSO4 = 0x02;
// struct ifreq: char ifr_name[IFNAMSIZ = 16]; then a 24-byte union (ifr_flags is a short)
export const IFREQ_SIZE = 40;
export const IFNAMSIZ = 16;
