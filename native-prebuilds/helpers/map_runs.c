/*
 * Maps runs of one file privately over parts of a mapping, and gives each run the advice the whole
 * mapping had, in one call. A page pool's merge pass maps thousands of runs (a repetitive working
 * set shares one pool page per guest page, so every run is a page); made one FFI call at a time,
 * each call's garbage grew the VM process by tens of MiB of heap that Node kept.
 */
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>

/*
 * runs: n triples of u64 {address, length, file offset}, each page-aligned (the caller checks).
 * advice: m advice values applied to each run once it is mapped.
 * Returns how many runs were mapped and advised. Fewer than n: run [return] failed, and *err holds
 * errno, and *stage 1 if mmap failed or 2 if madvise did (the failed run may then be mapped).
 */
uint32_t pv_map_file_runs(const uint64_t *runs, uint32_t n, int32_t fd, const int32_t *advice, uint32_t m, int32_t *err) {
  for (uint32_t i = 0; i < n; i++) {
    void *addr = (void *)(uintptr_t)runs[3 * i];
    size_t len = (size_t)runs[3 * i + 1];
    void *got = mmap(addr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_NORESERVE | MAP_FIXED, fd, (off_t)runs[3 * i + 2]);
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
