/*
 * Maps runs of one file (or of fresh anonymous memory) privately over parts of a mapping, and
 * gives each run the advice the whole mapping had, in one call; and finds a file's data runs in
 * one call. A page pool's merge pass maps thousands of runs (a repetitive working
 * set shares one pool page per guest page, so every run is a page); made one FFI call at a time,
 * each call's garbage grew the VM process by tens of MiB of heap that Node kept.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

/*
 * runs: n triples of u64 {address, length, file offset}, each page-aligned (the caller checks).
 * fd -1: fresh anonymous memory instead of a file (the offsets are ignored): what a restored
 * clone maps over its RAM file's holes.
 * advice: m advice values applied to each run once it is mapped.
 * Returns how many runs were mapped and advised. Fewer than n: run [return] failed, and *err holds
 * errno, and *stage 1 if mmap failed or 2 if madvise did (the failed run may then be mapped).
 */
uint32_t pv_map_file_runs(const uint64_t *runs, uint32_t n, int32_t fd, const int32_t *advice, uint32_t m, int32_t *err) {
  for (uint32_t i = 0; i < n; i++) {
    void *addr = (void *)(uintptr_t)runs[3 * i];
    size_t len = (size_t)runs[3 * i + 1];
    int flags = MAP_PRIVATE | MAP_NORESERVE | MAP_FIXED | (fd < 0 ? MAP_ANONYMOUS : 0);
    void *got = mmap(addr, len, PROT_READ | PROT_WRITE, flags, fd < 0 ? -1 : fd, fd < 0 ? 0 : (off_t)runs[3 * i + 2]);
    if (got == MAP_FAILED) {
      err[0] = errno;
      err[1] = 1;
      return i;
    }
    for (uint32_t k = 0; k < m; k++) {
      if (madvise(addr, len, advice[k])) {
        err[0] = errno;
        err[1] = 2;
        return i;
      }
    }
  }
  return n;
}

/*
 * The data runs of the first `size` bytes of file `fd` (SEEK_DATA / SEEK_HOLE), as pairs of u64
 * {start, end} into out (room for max pairs). Returns how many pairs, or -errno; -E2BIG if they
 * do not fit. A restore walked them with two FFI calls per run, each milliseconds under emulation.
 */
int64_t pv_file_data_runs(int32_t fd, uint64_t size, uint64_t *out, uint32_t max) {
  uint32_t n = 0;
  for (uint64_t at = 0; at < size;) {
    off_t start = lseek(fd, (off_t)at, SEEK_DATA);
    if (start < 0) {
      if (errno == ENXIO) break;
      return -errno;
    }
    if ((uint64_t)start >= size) break;
    off_t end = lseek(fd, start, SEEK_HOLE);
    if (end < 0) return -errno;
    if (n == max) return -E2BIG;
    out[2 * n] = (uint64_t)start;
    out[2 * n + 1] = (uint64_t)end < size ? (uint64_t)end : size;
    n++;
    at = out[2 * n - 1];
  }
  return n;
}
