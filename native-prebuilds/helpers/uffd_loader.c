/*
 * pvisor lazy loader: one native thread per lazily resumed VM serves userfaultfd faults on guest
 * RAM from Offload's backing file.
 *
 * Why a native thread: faults must be served while Node's event loop is busy (the event loop
 * itself faults on guest RAM when a device model reads a virtqueue, and then waits on this
 * thread), so the server cannot live on the event loop; a Node worker costs about 8 MiB of PSS
 * and must not load ffi-rs; the libuv pool must not hold a blocking read. The thread never calls
 * into JavaScript: it reports to Node as 16-byte pv_records (pv_record.h: tag 0, value = the
 * piece's offset) on a Unix socket (libuv can watch a socket, not a userfaultfd), like the vCPU
 * runner.
 *
 * What it does with a fault (MISSING mode, registered over all of guest RAM):
 *  - inside a piece the offload wrote (<= 4 MiB, with a CRC32): pread the whole piece into a
 *    bounce buffer, check its CRC32, UFFDIO_COPY it whole, so one fault loads 4 MiB;
 *  - outside every piece (a page that was zero or never resident): UFFDIO_ZEROPAGE a block of up
 *    to 64 KiB around it, clipped to the hole;
 *  - inside a piece already loaded (the page was dropped since, e.g. by IdleRelease): one zero
 *    page, which is what a dropped anonymous page reads as without userfaultfd.
 * A piece whose CRC32 does not match or cannot be read is reported once and never mapped: faults
 * of vCPUs there stay pending until the VM ends (closing the userfaultfd releases them while the
 * VMM no longer handles their exits). A fault of the VMM's own thread there gets one zero page
 * instead, because that thread is the one that must read the report and end the VM.
 * A loaded piece's range of the file is punched out (disk blocks and page cache go back as the
 * guest's RAM comes back). When every piece is loaded the thread unregisters the range (pending hole faults then fill
 * normally), reports DONE and exits.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "pv_record.h"

#define PAGE 4096ULL
#define HOLE_BLOCK (64 * 1024ULL)
#define MAX_PIECE (4 * 1024 * 1024ULL)
/* The 4 MiB bounce buffer is freed after this long without a fault: a load that never finishes
 * (a piece nobody touches) must not keep it resident. */
#define BOUNCE_IDLE_MS 1000

/* pv_record.kind on this helper's socket. */
enum pv_loader_record_kind {
  PV_REC_DONE = 1,  /* every piece is loaded and the range unregistered */
  PV_REC_ERROR = 2, /* a piece could not be loaded: err < 0 is one of pv_load_error, else errno */
};

enum pv_load_error {
  PV_ERR_CRC = -1,   /* CRC32 mismatch */
  PV_ERR_SHORT = -2, /* the file ended inside the piece */
  PV_ERR_UFFD = -3,  /* a userfaultfd ioctl failed (the errno is lost; the VM cannot go on) */
};

/* As Node passes them: offset and length into guest RAM (= into the file), zlib CRC32. */
struct pv_piece {
  uint64_t offset;
  uint64_t length;
  uint32_t crc;
  uint32_t pad;
};

enum piece_state { MISSING = 0, LOADED = 1, BAD = 2 };

struct pv_loader {
  int uffd;
  int file_fd;
  int notify_fd; /* our end of the socketpair */
  int node_fd;   /* Node's end */
  int wake_fd;   /* eventfd: load_all or stopping changed */
  uint64_t base, size;
  struct pv_piece *pieces;
  uint8_t *state;
  uint32_t count, loaded;
  uint8_t *bounce;
  pid_t main_tid;
  pthread_t thread;
  int started;
  volatile int stopping;
  volatile int load_all;
  int failed;
  /* Figures, read by Node at any time. */
  uint64_t faults, pieces_lazy, zero_pages;
};

/* CRC32 as zlib computes it (reflected polynomial 0xEDB88320), slicing by 8. */
static uint32_t crc_table[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t c = n;
    for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    crc_table[0][n] = c;
  }
  for (uint32_t n = 0; n < 256; n++)
    for (int t = 1; t < 8; t++) crc_table[t][n] = (crc_table[t - 1][n] >> 8) ^ crc_table[0][crc_table[t - 1][n] & 0xff];
}

uint32_t pv_crc32(const uint8_t *p, uint64_t len) {
  pthread_once(&crc_once, crc_init);
  uint32_t c = 0xffffffffu;
  while (len && ((uintptr_t)p & 7)) {
    c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    len--;
  }
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    w ^= c; /* little-endian: the CRC folds into the low four bytes */
    c = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^ crc_table[5][(w >> 16) & 0xff] ^
        crc_table[4][(w >> 24) & 0xff] ^ crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
        crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
    p += 8;
    len -= 8;
  }
  while (len--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

/* `offset`: of the piece, in guest RAM (and in the file). */
static void report(struct pv_loader *l, uint16_t kind, int32_t err, uint64_t offset) {
  pv_record_send(l->notify_fd, kind, 0, err, offset);
}

static void wake(struct pv_loader *l, uint64_t off, uint64_t len) {
  struct uffdio_range r = {l->base + off, len};
  ioctl(l->uffd, UFFDIO_WAKE, &r);
}

/*
 * Maps [off, off+len) from the bounce buffer (src: its offset there) or as zero pages, and wakes
 * whoever waits there. A page that is already present (EEXIST: a fault raced us) is skipped;
 * EAGAIN (the mm is changing, or a partial copy) is retried from where it stopped.
 * Returns 0, or -errno when the range is gone (the VM is being torn down).
 */
static int fill(struct pv_loader *l, uint64_t off, uint64_t len, int64_t src, uint64_t *pages) {
  while (len) {
    int64_t done;
    int rc;
    if (src < 0) {
      struct uffdio_zeropage z = {{l->base + off, len}, 0, 0};
      rc = ioctl(l->uffd, UFFDIO_ZEROPAGE, &z);
      done = z.zeropage;
    } else {
      struct uffdio_copy c = {l->base + off, (uint64_t)(uintptr_t)(l->bounce + src), len, 0, 0};
      rc = ioctl(l->uffd, UFFDIO_COPY, &c);
      done = c.copy;
    }
    if (rc == 0) {
      if (pages) *pages += len / PAGE;
      return 0;
    }
    int err = errno;
    if (done > 0) {
      if (pages) *pages += (uint64_t)done / PAGE;
      off += (uint64_t)done;
      len -= (uint64_t)done;
      if (src >= 0) src += done;
      continue;
    }
    if (err == EAGAIN || err == EINTR) {
      sched_yield();
      continue;
    }
    if (err == EEXIST) {
      wake(l, off, PAGE);
      off += PAGE;
      len -= PAGE;
      if (src >= 0) src += PAGE;
      continue;
    }
    return -err;
  }
  return 0;
}

/* Index of the piece holding `off`, or of the first piece after it (count if none), by bisection. */
static uint32_t piece_at_or_after(struct pv_loader *l, uint64_t off) {
  uint32_t lo = 0, hi = l->count;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (l->pieces[mid].offset + l->pieces[mid].length <= off) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static void fail_piece(struct pv_loader *l, uint32_t i, int32_t err) {
  l->state[i] = BAD;
  if (!l->failed) report(l, PV_REC_ERROR, err, l->pieces[i].offset);
  l->failed = 1;
}

/* Reads, verifies and maps piece i whole. Returns 0, or -1 if it is bad (already reported). */
static int load_piece(struct pv_loader *l, uint32_t i) {
  struct pv_piece *p = &l->pieces[i];
  if (!l->bounce) {
    /* mmap, not malloc: glibc's dynamic mmap threshold would move a freed 4 MiB block onto a heap
     * that keeps it. */
    void *b = mmap(NULL, MAX_PIECE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (b == MAP_FAILED) {
      fail_piece(l, i, errno);
      return -1;
    }
    l->bounce = b;
  }
  uint64_t got = 0;
  while (got < p->length) {
    ssize_t n = pread(l->file_fd, l->bounce + got, p->length - got, (off_t)(p->offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      fail_piece(l, i, n < 0 ? errno : PV_ERR_SHORT);
      return -1;
    }
    got += (uint64_t)n;
  }
  if (pv_crc32(l->bounce, p->length) != p->crc) {
    fail_piece(l, i, PV_ERR_CRC);
    return -1;
  }
  if (fill(l, p->offset, p->length, 0, NULL) < 0) {
    fail_piece(l, i, PV_ERR_UFFD);
    return -1;
  }
  l->state[i] = LOADED;
  l->loaded++;
  /* The piece now lives in guest RAM only: give its disk blocks and page cache back. Best effort
   * (a filesystem without hole punching just keeps them until the file is removed). */
  fallocate(l->file_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)p->offset, (off_t)p->length);
  return 0;
}

static void serve(struct pv_loader *l, uint64_t addr, pid_t tid) {
  if (addr < l->base || addr >= l->base + l->size) return;
  uint64_t off = (addr - l->base) & ~(PAGE - 1);
  __atomic_add_fetch(&l->faults, 1, __ATOMIC_RELAXED);
  uint32_t i = piece_at_or_after(l, off);
  if (i < l->count && l->pieces[i].offset <= off) {
    if (l->state[i] == MISSING) {
      if (load_piece(l, i) == 0) __atomic_add_fetch(&l->pieces_lazy, 1, __ATOMIC_RELAXED);
      else if (tid == l->main_tid) fill(l, off, PAGE, -1, NULL);
    } else if (l->state[i] == LOADED || tid == l->main_tid) {
      uint64_t zeroed = 0;
      fill(l, off, PAGE, -1, &zeroed);
      __atomic_add_fetch(&l->zero_pages, zeroed, __ATOMIC_RELAXED);
    }
    return; /* BAD, from a vCPU: stays pending until the VM ends */
  }
  /* A hole: zero a 64 KiB-aligned block around the page, clipped to the hole and to RAM. */
  uint64_t start = off & ~(HOLE_BLOCK - 1), end = start + HOLE_BLOCK;
  if (i > 0 && l->pieces[i - 1].offset + l->pieces[i - 1].length > start) start = l->pieces[i - 1].offset + l->pieces[i - 1].length;
  if (i < l->count && l->pieces[i].offset < end) end = l->pieces[i].offset;
  if (end > l->size) end = l->size;
  uint64_t zeroed = 0;
  fill(l, start, end - start, -1, &zeroed);
  wake(l, off, PAGE); /* in case the page itself raced in */
  __atomic_add_fetch(&l->zero_pages, zeroed, __ATOMIC_RELAXED);
}

static void *loader_main(void *arg) {
  struct pv_loader *l = arg;
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, NULL);
  struct uffd_msg msgs[16];
  while (!l->stopping) {
    if (l->load_all && !l->failed) {
      /* Suspend wants everything back before it writes RAM out again. */
      for (uint32_t i = 0; i < l->count && !l->stopping && !l->failed; i++)
        if (l->state[i] == MISSING) load_piece(l, i);
    }
    if (l->loaded == l->count && !l->failed) {
      struct uffdio_range r = {l->base, l->size};
      int err = ioctl(l->uffd, UFFDIO_UNREGISTER, &r) == 0 ? 0 : errno;
      report(l, PV_REC_DONE, err, 0);
      return NULL;
    }
    struct pollfd pfd[2] = {{l->uffd, POLLIN, 0}, {l->wake_fd, POLLIN, 0}};
    int ready = poll(pfd, 2, l->bounce ? BOUNCE_IDLE_MS : -1);
    if (ready == 0) {
      munmap(l->bounce, MAX_PIECE);
      l->bounce = NULL;
    }
    if (ready <= 0) continue;
    if (pfd[1].revents) {
      uint64_t n;
      if (read(l->wake_fd, &n, sizeof n) < 0) { /* EAGAIN: someone else drained it */
      }
    }
    if (!pfd[0].revents) continue;
    ssize_t n = read(l->uffd, msgs, sizeof msgs);
    if (n <= 0) continue;
    for (size_t k = 0; k < (size_t)n / sizeof msgs[0] && !l->stopping; k++) {
      if (msgs[k].event != UFFD_EVENT_PAGEFAULT) continue;
      serve(l, msgs[k].arg.pagefault.address, (pid_t)msgs[k].arg.pagefault.feat.ptid);
    }
  }
  return NULL;
}

static void free_loader(struct pv_loader *l) {
  if (l->uffd >= 0) close(l->uffd);
  if (l->file_fd >= 0) close(l->file_fd);
  if (l->wake_fd >= 0) close(l->wake_fd);
  if (l->notify_fd >= 0) close(l->notify_fd);
  free(l->pieces);
  free(l->state);
  if (l->bounce) munmap(l->bounce, MAX_PIECE);
  free(l);
}

/*
 * Registers guest RAM [base, base+size) with a new userfaultfd (MISSING mode) and starts the
 * thread that serves it from `file_fd` (duplicated; the caller keeps its own; opened read-write so
 * that loaded pieces can be punched out). `pieces` holds
 * `count` struct pv_piece in address order, none longer than 4 MiB. Faults of thread `main_tid`
 * (Node's) are never left pending. Returns NULL with errno set on failure, with nothing changed.
 */
struct pv_loader *pv_loader_start(uint64_t base, uint64_t size, int32_t file_fd, const uint8_t *pieces, int32_t count, int32_t main_tid) {
  pthread_once(&crc_once, crc_init);
  struct pv_loader *l = calloc(1, sizeof *l);
  if (!l) return NULL;
  l->uffd = l->file_fd = l->wake_fd = l->notify_fd = l->node_fd = -1;
  l->base = base;
  l->size = size;
  l->count = (uint32_t)count;
  l->main_tid = main_tid;
  int err = 0;
  l->pieces = malloc(sizeof *l->pieces * (count ? count : 1));
  l->state = calloc(count ? count : 1, 1);
  if (!l->pieces || !l->state) {
    err = ENOMEM;
    goto fail;
  }
  memcpy(l->pieces, pieces, sizeof *l->pieces * count);
  for (int32_t i = 0; i < count; i++) {
    struct pv_piece *p = &l->pieces[i];
    if (p->length == 0 || p->length > MAX_PIECE || p->offset % PAGE || p->length % PAGE || p->offset + p->length > size ||
        (i > 0 && p->offset < l->pieces[i - 1].offset + l->pieces[i - 1].length)) {
      err = EINVAL;
      goto fail;
    }
  }
  l->file_fd = fcntl(file_fd, F_DUPFD_CLOEXEC, 3);
  if (l->file_fd < 0) goto fail_errno;
  l->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (l->wake_fd < 0) goto fail_errno;
  err = -pv_record_socketpair(&l->notify_fd, &l->node_fd);
  if (err) goto fail;
  /* Not UFFD_USER_MODE_ONLY: KVM reaches guest RAM from the kernel (get_user_pages). */
  l->uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
  if (l->uffd < 0) goto fail_errno;
  struct uffdio_api api = {UFFD_API, UFFD_FEATURE_THREAD_ID, 0};
  if (ioctl(l->uffd, UFFDIO_API, &api) != 0) goto fail_errno;
  struct uffdio_register reg = {{base, size}, UFFDIO_REGISTER_MODE_MISSING, 0};
  if (ioctl(l->uffd, UFFDIO_REGISTER, &reg) != 0) goto fail_errno;
  if (!(reg.ioctls & (1ULL << _UFFDIO_COPY)) || !(reg.ioctls & (1ULL << _UFFDIO_ZEROPAGE))) {
    err = EOPNOTSUPP;
    goto fail;
  }
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 256 * 1024);
  int rc = pthread_create(&l->thread, &attr, loader_main, l);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    err = rc;
    goto fail; /* closing the userfaultfd unregisters the range */
  }
  l->started = 1;
  return l;
fail_errno:
  err = errno;
fail:
  if (l->node_fd >= 0) close(l->node_fd);
  free_loader(l);
  errno = err;
  return NULL;
}

/* Node's end of the record socket; Node owns (closes) it from then on. */
int32_t pv_loader_node_fd(struct pv_loader *l) { return l->node_fd; }

/* Asks the thread to load every remaining piece now; it reports DONE (or ERROR) when through. */
void pv_loader_load_all(struct pv_loader *l) {
  l->load_all = 1;
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  uint64_t one = 1;
  while (write(l->wake_fd, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

/* 0: faults served, 1: pieces loaded by a fault, 2: pages zero-filled. */
uint64_t pv_loader_figure(struct pv_loader *l, int32_t which) {
  switch (which) {
    case 0: return __atomic_load_n(&l->faults, __ATOMIC_RELAXED);
    case 1: return __atomic_load_n(&l->pieces_lazy, __ATOMIC_RELAXED);
    case 2: return __atomic_load_n(&l->zero_pages, __ATOMIC_RELAXED);
    default: return 0;
  }
}

/*
 * Stops and joins the thread, then closes the userfaultfd: that unregisters guest RAM and
 * releases every thread still blocked in a fault there (so vCPU threads can be joined before RAM
 * is unmapped). Frees the loader.
 */
void pv_loader_destroy(struct pv_loader *l) {
  if (!l) return;
  l->stopping = 1;
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  uint64_t one = 1;
  while (write(l->wake_fd, &one, sizeof one) < 0 && errno == EINTR) {
  }
  if (l->started) pthread_join(l->thread, NULL);
  free_loader(l);
}
