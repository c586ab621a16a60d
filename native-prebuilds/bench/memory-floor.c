/*
 * The physical floors of pvisor's memory operations: what the host itself needs, in plain C with
 * nothing of pvisor in the way, to move SIZE bytes where each operation moves them. `pvisor bench
 * floors` (and `pvisor bench memory`, beside its own figures) compiles and runs it in the same run,
 * so that each pvisor figure can be read as a ratio to its floor on the same host at the same time.
 *
 * Usage: memory-floor DIR SIZE_MIB RUNS
 *   -> one JSON object on stdout: {"sizeMiB","runs","dir","filesystem","a":{..},"b":{..},"c":{..},
 *      "notes":[..]}, each figure a list of RUNS times in ms (null when the host cannot measure it,
 *      with a note saying why). Progress lines on stderr; errors there too, with exit status 1.
 *
 * The data is SIZE of pseudo-random bytes (random so that nothing reads as zero or deduplicates;
 * the content does not matter to a copy). Every run uses freshly mapped memory and a fresh file in
 * DIR (removed afterwards). A time covers the data movement only (the mmap, userfaultfd
 * registration and open before it are microseconds and are left out); every result is compared
 * with the source afterwards, untimed, so a figure is never that of a copy that did not happen.
 * "Fresh memory" is mapped like pvisor's guest RAM: MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
 * MADV_NOHUGEPAGE.
 *
 * (a) Placing SIZE into fresh guest-RAM-like memory: the floor of bringing guest RAM back.
 *   a.uffdCopy2M, a.uffdCopy64K, a.uffdCopy4K: the range registered with userfaultfd (MISSING) and
 *     filled by UFFDIO_COPY in pieces of that size (COPY populates, so no thread has to fault).
 *     The floor of Offload's lazy reload without its reads (it copies pieces of up to 4 MiB), and
 *     the cost of smaller pieces.
 *   a.copyFaults: memcpy into the fresh range, taking a page fault per 4 KiB page: the floor of an
 *     eager reload or of a guest filling its RAM (the VMM or the guest writes to untouched RAM).
 *   a.copyFaultsHuge: the same with MADV_HUGEPAGE (2 MiB-aligned range): what huge pages would
 *     save; it varies with how easily the kernel finds free 2 MiB blocks (a note says how many
 *     MiB were really huge).
 *   a.copyResident: memcpy into memory already resident: the copy alone, no fault; the reference
 *     against which the others show what faults and userfaultfd add.
 * (b) Writing SIZE from memory to a file in DIR: the floor of Offload's suspend.
 *   b.writeCache: pwrite in 2 MiB pieces through the page cache, then fdatasync (a suspend image
 *     is only safe once on disk).
 *   b.writeDirect: the same with O_DIRECT from page-aligned memory (no page cache to fill and
 *     drop afterwards); null with a note when the filesystem refuses O_DIRECT.
 * (c) Reading the backing file back into fresh memory: the floor of resume. Before each cold
 *   figure the file is written back (fdatasync), dropped from the page cache (POSIX_FADV_DONTNEED)
 *   and checked with mincore() to be out of it; "cold" means out of this kernel's page cache (a
 *   virtual disk may still be cached by the host below).
 *   c.readCold: pread in 2 MiB pieces into the fresh range (faults included): an eager reload.
 *   c.readColdDirect: the same with O_DIRECT (null with a note when refused).
 *   c.readColdUffd: pread (O_DIRECT when it works) into a 2 MiB bounce buffer, then UFFDIO_COPY
 *     into the registered fresh range: the pipeline of pvisor's lazy reload, without its CRC32.
 *   c.readWarm: pread with the file in the page cache (after a warm-up read) into the fresh
 *     range: the floor when the backing is still cached (e.g. resumed soon after suspend).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <mntent.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096ul
#define HUGE (2ul << 20)
#define PIECE (2ul << 20) /* file I/O piece, and the bounce buffer of c.readColdUffd */
#define MAX_RUNS 100
#define MAX_NOTES 32

static const char *dir;
static size_t size;
static int runs;
static uint8_t *src;
static char *notes[MAX_NOTES];
static int nnotes;

static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("memory-floor: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}
#define die(what) fail("%s: %s", what, strerror(errno))

static void note(const char *fmt, ...) {
  if (nnotes == MAX_NOTES) return;
  va_list ap;
  va_start(ap, fmt);
  if (vasprintf(&notes[nnotes], fmt, ap) >= 0) nnotes++;
  va_end(ap);
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* Fresh memory like pvisor's guest RAM, 2 MiB-aligned so that MADV_HUGEPAGE can take effect. */
static uint8_t *fresh(int advice) {
  uint8_t *m = mmap(NULL, size + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) die("mmap");
  uint8_t *a = (uint8_t *)(((uintptr_t)m + HUGE - 1) & ~(HUGE - 1));
  if (a > m) munmap(m, (size_t)(a - m));
  munmap(a + size, (size_t)(m + HUGE - a));
  if (madvise(a, size, advice) < 0) die("madvise");
  return a;
}

static void check(const uint8_t *m, const char *figure) {
  if (memcmp(m, src, size) != 0) fail("%s: the memory does not hold the source's bytes afterwards", figure);
}

static int uffd_open(void) {
  /* The syscall first (as pvisor's loader does); /dev/userfaultfd where the syscall is refused. */
  int fd = (int)syscall(SYS_userfaultfd, O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    int dev = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
    if (dev < 0) fail("userfaultfd: %s (and /dev/userfaultfd: %s)", strerror(err), strerror(errno));
    fd = ioctl(dev, USERFAULTFD_IOC_NEW, O_CLOEXEC);
    if (fd < 0) die("USERFAULTFD_IOC_NEW");
    close(dev);
  }
  struct uffdio_api api = {.api = UFFD_API};
  if (ioctl(fd, UFFDIO_API, &api) < 0) die("UFFDIO_API");
  return fd;
}

static void uffd_register(int fd, uint8_t *m) {
  struct uffdio_register reg = {.range = {(uintptr_t)m, size}, .mode = UFFDIO_REGISTER_MODE_MISSING};
  if (ioctl(fd, UFFDIO_REGISTER, &reg) < 0) die("UFFDIO_REGISTER");
  if (!(reg.ioctls & (1ull << _UFFDIO_COPY))) fail("UFFDIO_REGISTER: no UFFDIO_COPY on this range");
}

/* UFFDIO_COPY of [from, from+len) to dst; a partial copy (EAGAIN) goes on where it stopped. */
static void uffd_copy(int fd, uint8_t *dst, const uint8_t *from, size_t len) {
  while (len) {
    struct uffdio_copy c = {.dst = (uintptr_t)dst, .src = (uintptr_t)from, .len = len};
    if (ioctl(fd, UFFDIO_COPY, &c) == 0) return;
    if (c.copy > 0) {
      dst += c.copy; from += c.copy; len -= (size_t)c.copy;
    } else if (errno != EAGAIN && errno != EINTR) {
      die("UFFDIO_COPY");
    }
  }
}

static double a_uffd(size_t piece) {
  uint8_t *m = fresh(MADV_NOHUGEPAGE);
  int fd = uffd_open();
  uffd_register(fd, m);
  double t0 = now_ms();
  for (size_t off = 0; off < size; off += piece) uffd_copy(fd, m + off, src + off, size - off < piece ? size - off : piece);
  double ms = now_ms() - t0;
  check(m, "a.uffdCopy");
  close(fd);
  munmap(m, size);
  return ms;
}

/* MiB of the range at m backed by transparent huge pages, from /proc/self/smaps. */
static long huge_mib(const uint8_t *m) {
  FILE *f = fopen("/proc/self/smaps", "r");
  if (!f) return -1;
  char line[256];
  int in = 0;
  long kb = -1;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, ':') > strchr(line, ' ')) in = lo <= (uintptr_t)m && (uintptr_t)m < hi;
    else if (in && sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) break;
  }
  fclose(f);
  return kb < 0 ? -1 : kb / 1024;
}

static double a_copy(int advice, long *huge, const char *figure) {
  uint8_t *m = fresh(advice);
  double t0 = now_ms();
  memcpy(m, src, size);
  double ms = now_ms() - t0;
  check(m, figure);
  if (huge) *huge = huge_mib(m);
  munmap(m, size);
  return ms;
}

static double a_resident(void) {
  uint8_t *m = fresh(MADV_NOHUGEPAGE);
  memset(m, 1, size); /* fault every page in first */
  double t0 = now_ms();
  memcpy(m, src, size);
  double ms = now_ms() - t0;
  check(m, "a.copyResident");
  munmap(m, size);
  return ms;
}

/*
 * Moves SIZE bytes between memory m and the file in PIECE pieces: writes (the source) or reads
 * (into m). Returns -1 when an O_DIRECT transfer is refused with EINVAL at once.
 */
static int transfer_all(int fd, uint8_t *m, int writing, const char *path) {
  for (size_t off = 0; off < size;) {
    size_t len = size - off < PIECE ? size - off : PIECE;
    ssize_t n = writing ? pwrite(fd, m + off, len, (off_t)off) : pread(fd, m + off, len, (off_t)off);
    if (n < 0 && errno == EINVAL && off == 0 && (fcntl(fd, F_GETFL) & O_DIRECT)) return -1;
    if (n <= 0) fail("%s %s at %zu: %s", writing ? "pwrite" : "pread", path, off, n < 0 ? strerror(errno) : writing ? "no progress" : "end of file");
    off += (size_t)n;
  }
  return 0;
}

/* Opens path with O_DIRECT added; -1 when the filesystem refuses it (EINVAL). */
static int open_direct(const char *path, int flags) {
  int fd = open(path, flags | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0 && errno != EINVAL) fail("open %s with O_DIRECT: %s", path, strerror(errno));
  return fd;
}

static double b_write(const char *path, int direct, int *refused) {
  int fd = direct ? open_direct(path, O_WRONLY | O_CREAT | O_EXCL)
                  : open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0 && direct) { *refused = 1; return 0; }
  if (fd < 0) fail("create %s: %s", path, strerror(errno));
  double t0 = now_ms();
  if (transfer_all(fd, src, 1, path) < 0) {
    close(fd);
    *refused = 1;
    return 0;
  }
  if (fdatasync(fd) < 0) fail("fdatasync %s: %s", path, strerror(errno));
  double ms = now_ms() - t0;
  close(fd);
  return ms;
}

/* Pages of the file in the page cache, by mincore() on a mapping of it. */
static size_t cached_pages(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open %s: %s", path, strerror(errno));
  void *f = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
  if (f == MAP_FAILED) die("mmap of the file");
  size_t pages = (size + PAGE - 1) / PAGE, in = 0;
  unsigned char *vec = malloc(pages);
  if (!vec) die("malloc");
  if (mincore(f, size, vec) < 0) die("mincore");
  for (size_t i = 0; i < pages; i++) in += vec[i] & 1;
  free(vec);
  munmap(f, size);
  close(fd);
  return in;
}

static void make_cold(const char *path) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open %s: %s", path, strerror(errno));
  if (fdatasync(fd) < 0) fail("fdatasync %s: %s", path, strerror(errno));
  size_t in = 0;
  /* DONTNEED drops clean pages only; a few tries cover pages still under writeback. */
  for (int i = 0; i < 20; i++) {
    if ((errno = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED))) die("posix_fadvise DONTNEED");
    if (!(in = cached_pages(path))) break;
    usleep(10000);
  }
  close(fd);
  if (in) fail("%s stays in the page cache (%zu of %zu pages after DONTNEED): no cold read can be measured there", path, in, size / PAGE);
}

/* c.readCold (direct 0) and c.readColdDirect (direct 1); -1 when O_DIRECT is refused. */
static double c_read(const char *path, int direct, int cold) {
  if (cold) make_cold(path);
  int fd = direct ? open_direct(path, O_RDONLY) : open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 && direct) return -1;
  if (fd < 0) fail("open %s: %s", path, strerror(errno));
  uint8_t *m = fresh(MADV_NOHUGEPAGE);
  double t0 = now_ms();
  int r = transfer_all(fd, m, 0, path);
  double ms = now_ms() - t0;
  close(fd);
  if (r == 0) check(m, cold ? "c.readCold" : "c.readWarm");
  munmap(m, size);
  return r < 0 ? -1 : ms;
}

static double c_read_uffd(const char *path, int direct, uint8_t *bounce) {
  make_cold(path);
  int fd = direct ? open_direct(path, O_RDONLY) : open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open %s: %s", path, strerror(errno));
  uint8_t *m = fresh(MADV_NOHUGEPAGE);
  int uffd = uffd_open();
  uffd_register(uffd, m);
  double t0 = now_ms();
  for (size_t off = 0; off < size; off += PIECE) {
    size_t len = size - off < PIECE ? size - off : PIECE;
    for (size_t got = 0; got < len;) {
      ssize_t n = pread(fd, bounce + got, len - got, (off_t)(off + got));
      if (n <= 0) fail("pread %s at %zu: %s", path, off + got, n < 0 ? strerror(errno) : "end of file");
      got += (size_t)n;
    }
    uffd_copy(uffd, m + off, bounce, len);
  }
  double ms = now_ms() - t0;
  close(fd);
  check(m, "c.readColdUffd");
  close(uffd);
  munmap(m, size);
  return ms;
}

static const char *filesystem_of(const char *path) {
  static char type[64] = "unknown";
  char *real = realpath(path, NULL);
  if (!real) fail("%s: %s", path, strerror(errno));
  FILE *f = setmntent("/proc/mounts", "r");
  size_t best = 0;
  struct mntent *e;
  while (f && (e = getmntent(f))) {
    size_t n = strlen(e->mnt_dir);
    int inside = strcmp(e->mnt_dir, "/") == 0 || (strncmp(real, e->mnt_dir, n) == 0 && (real[n] == '/' || real[n] == 0));
    if (inside && n >= best) {
      best = n;
      snprintf(type, sizeof type, "%s", e->mnt_type);
    }
  }
  if (f) endmntent(f);
  free(real);
  return type;
}

static void print_list(const char *name, const double *ms, int skipped, int last) {
  printf("\"%s\":", name);
  if (skipped) printf("null");
  else {
    putchar('[');
    for (int i = 0; i < runs; i++) printf("%s%.3f", i ? "," : "", ms[i]);
    putchar(']');
  }
  if (!last) putchar(',');
}

static void print_json_string(const char *s) {
  putchar('"');
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') printf("\\%c", *s);
    else if ((unsigned char)*s < 0x20) printf("\\u%04x", *s);
    else putchar(*s);
  }
  putchar('"');
}

int main(int argc, char **argv) {
  if (argc != 4) fail("usage: memory-floor DIR SIZE_MIB RUNS");
  dir = argv[1];
  char *end;
  long mib = strtol(argv[2], &end, 10);
  if (*end || mib < 1 || mib > 65536) fail("SIZE_MIB: expected 1 to 65536, got %s", argv[2]);
  runs = (int)strtol(argv[3], &end, 10);
  if (*end || runs < 1 || runs > MAX_RUNS) fail("RUNS: expected 1 to %d, got %s", MAX_RUNS, argv[3]);
  size = (size_t)mib << 20;
  const char *fs = filesystem_of(dir);
  /* On tmpfs the "file" is RAM: nothing would reach a disk, and nothing can be made cold. */
  if (!strcmp(fs, "tmpfs") || !strcmp(fs, "ramfs")) fail("%s is on %s: the floors of writing and reading back need a directory on a disk", dir, fs);

  /* The source: page-aligned (O_DIRECT writes from it), resident, pseudo-random (xorshift64). */
  src = fresh(MADV_NOHUGEPAGE);
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < size / 8; i++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    ((uint64_t *)src)[i] = x;
  }
  uint8_t *bounce = fresh(MADV_NOHUGEPAGE);
  memset(bounce, 0, PIECE < size ? PIECE : size);

  static double uffd2m[MAX_RUNS], uffd64k[MAX_RUNS], uffd4k[MAX_RUNS], faults[MAX_RUNS], faultsHuge[MAX_RUNS], resident[MAX_RUNS];
  static double wcache[MAX_RUNS], wdirect[MAX_RUNS], rcold[MAX_RUNS], rdirect[MAX_RUNS], ruffd[MAX_RUNS], rwarm[MAX_RUNS];
  static long huge[MAX_RUNS];
  /* Untimed warm-up: otherwise the first figure of the first run alone pays for the process's
   * first touches (the source read into cache, page tables, the allocator's per-CPU lists). */
  a_uffd(PIECE);
  a_copy(MADV_NOHUGEPAGE, NULL, "warm-up");
  int directWriteRefused = 0, directReadRefused = 0;
  char path[4096], pathDirect[4096];
  for (int r = 0; r < runs; r++) {
    snprintf(path, sizeof path, "%s/memory-floor-%d-%d.img", dir, (int)getpid(), r);
    snprintf(pathDirect, sizeof pathDirect, "%s/memory-floor-%d-%d-direct.img", dir, (int)getpid(), r);
    uffd2m[r] = a_uffd(2ul << 20);
    uffd64k[r] = a_uffd(64ul << 10);
    uffd4k[r] = a_uffd(4ul << 10);
    faults[r] = a_copy(MADV_NOHUGEPAGE, NULL, "a.copyFaults");
    faultsHuge[r] = a_copy(MADV_HUGEPAGE, &huge[r], "a.copyFaultsHuge");
    resident[r] = a_resident();

    wcache[r] = b_write(path, 0, NULL);
    if (!directWriteRefused) {
      wdirect[r] = b_write(pathDirect, 1, &directWriteRefused);
      unlink(pathDirect);
    }

    /* The file b.writeCache wrote is the backing file that (c) reads back. */
    double d = directReadRefused ? -1 : c_read(path, 1, 1);
    if (d < 0) directReadRefused = 1;
    else rdirect[r] = d;
    rcold[r] = c_read(path, 0, 1);
    ruffd[r] = c_read_uffd(path, !directReadRefused, bounce);
    c_read(path, 0, 0); /* warm-up: the whole file into the page cache */
    if (cached_pages(path) != size / PAGE) note("c.readWarm run %d: the file was not wholly in the page cache", r + 1);
    rwarm[r] = c_read(path, 0, 0);
    if (unlink(path) < 0) fail("unlink %s: %s", path, strerror(errno));
    fprintf(stderr, "run %d/%d: uffdCopy2M %.1f ms, copyFaults %.1f ms, writeCache %.1f ms, readCold %.1f ms\n", r + 1, runs, uffd2m[r], faults[r], wcache[r], rcold[r]);
  }

  char hugeList[1024] = "";
  for (int r = 0; r < runs; r++) snprintf(hugeList + strlen(hugeList), sizeof hugeList - strlen(hugeList), "%s%ld", r ? ", " : "", huge[r]);
  note("a.copyFaultsHuge: MiB of %zu in huge pages per run: %s", size >> 20, hugeList);
  if (directWriteRefused) note("b.writeDirect: %s refuses O_DIRECT writes (EINVAL); skipped", fs);
  if (directReadRefused) note("c.readColdDirect: %s refuses O_DIRECT reads (EINVAL); skipped, and c.readColdUffd reads through the page cache", fs);
  else note("c.readColdUffd reads with O_DIRECT");
  note("cold = out of this kernel's page cache (checked with mincore); a virtual disk may be cached by the host below");

  printf("{\"sizeMiB\":%ld,\"runs\":%d,\"dir\":", mib, runs);
  print_json_string(dir);
  printf(",\"filesystem\":");
  print_json_string(fs);
  printf(",\"a\":{");
  print_list("uffdCopy2M", uffd2m, 0, 0);
  print_list("uffdCopy64K", uffd64k, 0, 0);
  print_list("uffdCopy4K", uffd4k, 0, 0);
  print_list("copyFaults", faults, 0, 0);
  print_list("copyFaultsHuge", faultsHuge, 0, 0);
  print_list("copyResident", resident, 0, 1);
  printf("},\"b\":{");
  print_list("writeCache", wcache, 0, 0);
  print_list("writeDirect", wdirect, directWriteRefused, 1);
  printf("},\"c\":{");
  print_list("readCold", rcold, 0, 0);
  print_list("readColdDirect", rdirect, directReadRefused, 0);
  print_list("readColdUffd", ruffd, 0, 0);
  print_list("readWarm", rwarm, 0, 1);
  printf("},\"notes\":[");
  for (int i = 0; i < nnotes; i++) {
    if (i) putchar(',');
    print_json_string(notes[i]);
  }
  printf("]}\n");
  return 0;
}
