/*
 * The native floor of serving guest-RAM faults through userfaultfd: one thread touches one byte
 * of each BLOCK of a fresh registered range (as a vCPU reading a dropped block), another reads
 * each fault from the userfaultfd and maps the whole block with UFFDIO_COPY from a source buffer,
 * waking the toucher. No decompression, no checksum: what pvisor's ColdCompression fault path
 * (lz4 + CRC32C + the same UFFDIO_COPY) is compared with by `pvisor bench memory`.
 *
 * Usage: uffd-fault-loop SIZE_MIB BLOCK_KIB RUNS
 *   -> {"sizeMiB","blockKiB","runs","faultsPerSecond":[..]} on stdout; errors on stderr, exit 1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static size_t size, block;
static uint8_t *src;

static void die(const char *what) {
  fprintf(stderr, "uffd-fault-loop: %s: %s\n", what, strerror(errno));
  exit(1);
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

struct run {
  int uffd;
  uint8_t *ram;
  volatile int done;
};

static void *serve(void *arg) {
  struct run *r = arg;
  while (!r->done) {
    struct pollfd p = {r->uffd, POLLIN, 0};
    if (poll(&p, 1, 10) <= 0) continue;
    struct uffd_msg m;
    if (read(r->uffd, &m, sizeof m) != sizeof m) continue;
    if (m.event != UFFD_EVENT_PAGEFAULT) continue;
    size_t off = ((uintptr_t)m.arg.pagefault.address - (uintptr_t)r->ram) / block * block;
    struct uffdio_copy c = {(uintptr_t)r->ram + off, (uintptr_t)src + off, block, 0, 0};
    while (ioctl(r->uffd, UFFDIO_COPY, &c) != 0) {
      if (errno == EEXIST) break;
      if (errno != EAGAIN) die("UFFDIO_COPY");
      c.dst += (uint64_t)(c.copy > 0 ? c.copy : 0);
      c.src += (uint64_t)(c.copy > 0 ? c.copy : 0);
      c.len -= (uint64_t)(c.copy > 0 ? c.copy : 0);
    }
  }
  return NULL;
}

static double one_run(void) {
  struct run r = {0};
  r.ram = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r.ram == MAP_FAILED) die("mmap");
  madvise(r.ram, size, MADV_NOHUGEPAGE);
  r.uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
  if (r.uffd < 0) die("userfaultfd");
  struct uffdio_api api = {UFFD_API, 0, 0};
  if (ioctl(r.uffd, UFFDIO_API, &api) != 0) die("UFFDIO_API");
  struct uffdio_register reg = {{(uintptr_t)r.ram, size}, UFFDIO_REGISTER_MODE_MISSING, 0};
  if (ioctl(r.uffd, UFFDIO_REGISTER, &reg) != 0) die("UFFDIO_REGISTER");
  pthread_t t;
  if (pthread_create(&t, NULL, serve, &r) != 0) die("pthread_create");
  volatile uint8_t sum = 0;
  double t0 = now_ms();
  for (size_t off = 0; off < size; off += block) sum += r.ram[off];
  double ms = now_ms() - t0;
  r.done = 1;
  pthread_join(t, NULL);
  if (memcmp(r.ram, src, size) != 0) {
    fprintf(stderr, "uffd-fault-loop: the range does not hold the source's bytes afterwards\n");
    exit(1);
  }
  (void)sum;
  close(r.uffd);
  munmap(r.ram, size);
  return (double)(size / block) / (ms / 1e3);
}

int main(int argc, char **argv) {
  if (argc != 4) {
    fprintf(stderr, "usage: uffd-fault-loop SIZE_MIB BLOCK_KIB RUNS\n");
    return 1;
  }
  long mib = atol(argv[1]), kib = atol(argv[2]), runs = atol(argv[3]);
  if (mib < 1 || mib > 4096 || kib < 4 || kib > 4096 || (kib & (kib - 1)) || runs < 1 || runs > 100) {
    fprintf(stderr, "uffd-fault-loop: SIZE_MIB 1-4096, BLOCK_KIB a power of two 4-4096, RUNS 1-100\n");
    return 1;
  }
  size = (size_t)mib << 20;
  block = (size_t)kib << 10;
  src = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (src == MAP_FAILED) die("mmap");
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < size / 8; i++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    ((uint64_t *)src)[i] = x;
  }
  one_run(); /* untimed warm-up */
  printf("{\"sizeMiB\":%ld,\"blockKiB\":%ld,\"runs\":%ld,\"faultsPerSecond\":[", mib, kib, runs);
  for (long r = 0; r < runs; r++) printf("%s%.0f", r ? "," : "", one_run());
  printf("]}\n");
  return 0;
}
