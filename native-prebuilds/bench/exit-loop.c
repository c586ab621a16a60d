/*
 * The bench's native baseline: the smallest VMM loop that KVM allows, for comparing pvisor's
 * exits per second against. It runs the same kind of guest as the probe (64-bit, CPL3, identity
 * 2 MiB pages, IOPL 0) storing to the probe's doorbell register that the VMM ignores (GPA
 * 0xD000F010, in no memory slot) in a loop, and counts the MMIO exits handled by a plain KVM_RUN
 * loop on the main thread. MMIO, not port I/O, because kvm_pvm clears IOPL (as the probe does). `pvisor bench vmm` compiles and runs it in the same run.
 *
 * Usage: exit-loop COUNT   -> prints {"exits":N,"seconds":S}
 */
#include <fcntl.h>
#include <linux/kvm.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MEM (4u << 20)
#define die(what) do { perror(what); exit(1); } while (0)

static void seg(struct kvm_segment *s, uint16_t sel, int code) {
  memset(s, 0, sizeof *s);
  s->limit = 0xffffffff; s->selector = sel; s->present = 1; s->dpl = sel & 3; s->s = 1; s->g = 1;
  s->type = code ? 0xb : 0x3; s->l = code; s->db = !code;
}

int main(int argc, char **argv) {
  long count = argc > 1 ? atol(argv[1]) : 100000;
  int kvm = open("/dev/kvm", O_RDWR | O_CLOEXEC);
  if (kvm < 0) die("/dev/kvm");
  int vm = ioctl(kvm, KVM_CREATE_VM, 0);
  if (vm < 0) die("KVM_CREATE_VM");
  uint8_t *mem = mmap(NULL, MEM, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) die("mmap");
  struct kvm_userspace_memory_region region = {.slot = 0, .guest_phys_addr = 0, .memory_size = MEM, .userspace_addr = (uintptr_t)mem};
  if (ioctl(vm, KVM_SET_USER_MEMORY_REGION, &region) < 0) die("KVM_SET_USER_MEMORY_REGION");
  ioctl(vm, KVM_SET_TSS_ADDR, 0xfffbd000);

  uint64_t *gdt = (uint64_t *)(mem + 0x1000), *pml4 = (uint64_t *)(mem + 0x2000);
  uint64_t *pdpt = (uint64_t *)(mem + 0x3000), *pd = (uint64_t *)(mem + 0x4000);
  gdt[1] = 0x00209a0000000000ull; gdt[2] = 0x0000920000000000ull;
  gdt[3] = 0x0000f20000000000ull; gdt[4] = 0x0020fa0000000000ull;
  /* Identity map of [0, 4 GiB) in 2 MiB pages: the doorbell lives at 3.25 GiB. */
  pml4[0] = 0x3000 | 7;
  for (int g = 0; g < 4; g++) {
    pdpt[g] = (0x4000 + 0x1000 * g) | 7;
    for (int e = 0; e < 512; e++) pd[512 * g + e] = ((uint64_t)g << 30 | (uint64_t)e << 21) | 0x87;
  }
  const uint8_t code[] = {0xba, 0x10, 0xf0, 0x00, 0xd0, /* mov $0xD000F010, %edx */
                          0x89, 0x02,                   /* mov %eax, (%rdx) */
                          0xeb, 0xfc};                  /* jmp back to the store */
  memcpy(mem + 0x100000, code, sizeof code);

  int vcpu = ioctl(vm, KVM_CREATE_VCPU, 0);
  if (vcpu < 0) die("KVM_CREATE_VCPU");
  int run_size = ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE, 0);
  struct kvm_run *run = mmap(NULL, run_size, PROT_READ | PROT_WRITE, MAP_SHARED, vcpu, 0);
  if (run == MAP_FAILED) die("mmap kvm_run");
  struct kvm_sregs sregs;
  if (ioctl(vcpu, KVM_GET_SREGS, &sregs) < 0) die("KVM_GET_SREGS");
  seg(&sregs.cs, 0x23, 1); seg(&sregs.ds, 0x1b, 0);
  sregs.es = sregs.fs = sregs.gs = sregs.ss = sregs.ds;
  memset(&sregs.tr, 0, sizeof sregs.tr);
  sregs.tr.limit = 0x67; sregs.tr.type = 0xb; sregs.tr.present = 1;
  sregs.gdt.base = 0x1000; sregs.gdt.limit = 39; sregs.idt.base = 0; sregs.idt.limit = 0;
  sregs.cr0 = 0x80050033; sregs.cr3 = 0x2000; sregs.cr4 = 0x620; sregs.efer = 0x501;
  if (ioctl(vcpu, KVM_SET_SREGS, &sregs) < 0) die("KVM_SET_SREGS");
  struct kvm_regs regs = {.rip = 0x100000, .rsp = 0x1f0000, .rflags = 0x2};
  if (ioctl(vcpu, KVM_SET_REGS, &regs) < 0) die("KVM_SET_REGS");

  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  long exits = 0;
  while (exits < count) {
    if (ioctl(vcpu, KVM_RUN, 0) < 0) die("KVM_RUN");
    if (run->exit_reason != KVM_EXIT_MMIO || run->mmio.phys_addr != 0xD000F010ull || !run->mmio.is_write) {
      fprintf(stderr, "unexpected exit %u\n", run->exit_reason);
      return 1;
    }
    exits++;
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("{\"exits\":%ld,\"seconds\":%.6f}\n", exits, (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
  return 0;
}
