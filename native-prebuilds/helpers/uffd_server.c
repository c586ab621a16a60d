/*
 * pvisor memory server: one native thread per VM serves userfaultfd MISSING faults on guest RAM
 * from *sources* that Node adds and removes while the VM runs (a backing file, zeros, a buffer in
 * host memory), and loads their ranges ahead of the guest in an order Node chooses.
 *
 * Why a native thread: faults must be served while Node's event loop is busy (the event loop
 * itself faults on guest RAM when a device model reads a virtqueue, and then waits on this
 * thread), so the server cannot live on the event loop; a Node worker costs about 8 MiB of PSS
 * and must not load ffi-rs; the libuv pool must not hold a blocking read. The thread never calls
 * into JavaScript: it reports to Node as pv_records (pv_record.h: tag = source id) on a Unix
 * socket (libuv can watch a socket, not a userfaultfd).
 *
 * A source is a sorted table of ranges of guest RAM (each <= 4 MiB; no two active sources
 * overlap). Loading a range maps it whole, so one fault brings up to 4 MiB:
 *  - FILE: pread into a bounce buffer, check its CRC32C if asked, UFFDIO_COPY; if asked, punch
 *    the range out of the file afterwards (its disk blocks and page cache go back as RAM comes back);
 *  - ZERO: UFFDIO_ZEROPAGE;
 *  - MEMORY: UFFDIO_COPY straight from a host address that Node keeps alive.
 * What a fault gets:
 *  - inside a missing range of an active source: that range, loaded whole;
 *  - inside a loaded range (the page was dropped since, e.g. by IdleRelease): one zero page, which
 *    is what a dropped anonymous page reads as without userfaultfd;
 *  - outside every active range (a hole): zero pages over a 64 KiB-aligned block around it,
 *    clipped to the neighbouring ranges and to RAM.
 * A range that cannot be loaded (read error, CRC32C mismatch, copy refused) is marked bad and
 * reported once per source, and never mapped: faults of vCPUs there stay pending until the VM ends
 * (closing the userfaultfd releases them while the VMM no longer handles their exits). A fault of
 * Node's main thread there gets one zero page instead, because that thread is the one that must
 * read the report and end the VM.
 * Prefetch: between two pieces of work the thread first serves every fault already queued on the
 * userfaultfd, so a vCPU waits for at most one prefetched range.
 * Deferred FILE sources (PV_SRC_DEFERRED: guest RAM restored lazily from an object store): each
 * range's bytes are not in the file yet. A fault in one that is still absent sends a WANT record
 * on the server's *fetch socket* (pv_uffd_fetch_fd) to a fetcher (a Node worker thread, which
 * reads the store, checks each chunk's SHA-256 and writes it into the file) and stays pending;
 * the fetcher answers READY (the thread then loads the range as any FILE range, CRC32C checked,
 * which wakes whoever waits there) or FAILED (the range is bad, as above). The thread never
 * waits for a fetch: faults elsewhere are served meanwhile. The fetcher is not Node's main
 * thread, so a fault of that thread in an absent range waits like a vCPU's; should the range
 * fail, that thread gets one zero page, as on any bad range. A fetcher that closes its end
 * makes every absent range bad.
 * Guest RAM is registered (MISSING mode) only while some source is active (not done, not
 * removed): with nothing left to load, faults fill normally at no cost to this thread.
 *
 * ColdCompression's block store (cold_store.h) keeps RAM registered in MISSING and WRITE-PROTECT
 * modes while it holds a block. A block is compressed in place while it is write-protected
 * (pv_uffd_cold_begin, pv_uffd_cold_compress on Node's thread), then (pv_uffd_cold_finish): unless
 * something wrote, or faulted, into the block meanwhile (a write-protect fault, which this thread
 * answers by lifting the protection and marking the block), the block is dropped and kept here.
 * A write blocked in a fault has not happened yet, so nothing written is ever lost. A fault in a
 * dropped block decompresses it (lz4), checks its CRC32C and maps it whole; a block that fails
 * the check is marked bad and reported, and never mapped, like a bad range of a source.
 *
 * Owns: the thread, the userfaultfd, the wake eventfd, its end of the record socket (Node owns the
 * other), a dup of each file source's fd, the range tables, and a 4 MiB bounce buffer that is
 * unmapped after 1 s without work (a load that never finishes must not keep it resident).
 *
 * Locking: one mutex. The thread holds it while it works (serves a fault, loads a range) and drops
 * it only to sleep in poll(), so Node never sees a range half loaded. glibc mutexes are not fair:
 * a thread that unlocks and relocks in a loop can starve a waiter for a whole prefetch, so Node's
 * calls announce themselves (api_waiting) and the thread hands the mutex over between two pieces
 * of work. Nothing under the mutex touches registered RAM, so no side waits on a fault meanwhile.
 * The thread sends at most two records per source, so it never blocks on a full socket while Node
 * waits for the mutex.
 *
 * Stopping: pv_uffd_destroy shuts the record socket for sending, sets `stopping` under the mutex,
 * wakes the thread and joins it; then closes the userfaultfd, which unregisters guest RAM and
 * releases every thread still blocked in a fault there (so vCPU threads can be joined before RAM
 * is unmapped).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/userfaultfd.h>
#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00) /* <linux/userfaultfd.h> of Linux 6.1 */
#endif
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
#include <time.h>
#include <unistd.h>

#include "cold_store.h"
#include "crc32c.h"
#include "pv_record.h"

#define PAGE 4096ULL
#define HOLE_BLOCK (64 * 1024ULL)
#define MAX_RANGE (4 * 1024 * 1024ULL)
#define BOUNCE_IDLE_MS 1000
#define MAX_SOURCE_ID 65535 /* ids travel in pv_record.tag */

enum pv_source_kind { PV_SRC_FILE = 1, PV_SRC_ZERO = 2, PV_SRC_MEMORY = 3 };

enum pv_source_flag {
  PV_SRC_CHECKSUM = 1, /* FILE: check each range's CRC32C before mapping it */
  PV_SRC_PUNCH = 2,    /* FILE: punch each loaded range out of the file (best effort) */
  PV_SRC_DEFERRED = 4, /* FILE: each range's bytes arrive later, from the fetcher (see the header) */
};

/* pv_record.kind on the fetch socket; tag = source id, value = range index. */
enum pv_fetch_record_kind {
  PV_FETCH_WANT = 1,   /* to the fetcher: a fault waits in this absent range */
  PV_FETCH_READY = 2,  /* from the fetcher: the range's bytes are in the file */
  PV_FETCH_FAILED = 3, /* from the fetcher: they never will be; err = a pv_load_error */
};

/* pv_record.kind on this helper's socket; tag = source id. */
enum pv_server_record_kind {
  PV_REC_SOURCE_DONE = 1,  /* every range of the source is loaded; value = ranges loaded */
  PV_REC_SOURCE_ERROR = 2, /* a range cannot be loaded (reported once per source); value = its offset */
  PV_REC_COLD_ERROR = 3,   /* tag 0: a compressed block failed its check; value = its offset */
};

/* pv_record.err of SOURCE_ERROR when it is not a positive errno of pread. */
enum pv_load_error {
  PV_ERR_CHECKSUM = -1, /* CRC32C mismatch */
  PV_ERR_SHORT = -2,    /* the file ended inside the range */
  PV_ERR_UFFD = -3,     /* a userfaultfd ioctl failed (the errno is lost; the VM cannot go on) */
  PV_ERR_FETCH = -4,    /* deferred: the fetcher is gone or cannot take a request */
  /* -5 and below: the fetcher's own reasons, passed through (src/memory/uffd-server.ts names them) */
};

/*
 * One range as Node passes it: the same 32 bytes for every kind.
 * `where`: FILE, offset in the file (page-aligned: the fd may be O_DIRECT); MEMORY, host address
 * of the bytes (outside this guest RAM); ZERO, unused. `checksum`: FILE with PV_SRC_CHECKSUM,
 * CRC32C of the range's bytes; unused otherwise.
 */
struct pv_range {
  uint64_t offset; /* into guest RAM, page-aligned */
  uint64_t length; /* a page multiple, 1 page to 4 MiB */
  uint64_t where;
  uint32_t checksum;
  uint32_t pad;
};

_Static_assert(sizeof(struct pv_range) == 32, "Node writes 32-byte ranges");

enum range_state { MISSING = 0, LOADED = 1, BAD = 2 };
#define STATE_MASK 0x03
#define QUEUED 0x80 /* state bit: waiting in the prefetch queue (dedupes repeated prefetches) */
#define ABSENT 0x40 /* state bit, deferred source: the bytes are not in the file yet */
#define WANTED 0x20 /* state bit, deferred source: a WANT was sent (a fault waits there) */

struct source {
  uint16_t id;
  int kind, flags, fd;
  int active;   /* may still load something: not done (a removed source is freed) */
  int reported; /* an ERROR record was sent */
  struct pv_range *ranges;
  uint8_t *state;
  uint32_t *touch; /* range indices in the order a fault first loaded them */
  uint32_t count, loaded, touched;
  uint64_t faults, by_fault, by_prefetch, bytes;
};

struct prefetch {
  uint16_t source;
  uint32_t index;
};

struct pv_uffd_server {
  int uffd, notify_fd, node_fd, wake_fd;
  uint64_t base, size;
  pid_t main_tid;
  pthread_t thread;
  int started;
  pthread_mutex_t lock;
  pthread_cond_t handed; /* Node's call is through: the thread may take the mutex back */
  int api_waiting;       /* Node's calls waiting for the mutex (atomic) */
  int stopping;
  int registered; /* the UFFDIO_REGISTER_MODE_* guest RAM is registered with, 0 if none */
  struct cold_store *cold;
  struct source **sources;
  uint32_t nsources;
  uint16_t last_id;
  struct prefetch *queue;
  uint32_t qhead, qlen, qcap;
  uint8_t *bounce;
  uint64_t bounce_used_ms;
  uint64_t faults, zero_pages;
  int fetch_fd, fetch_node_fd; /* the fetch socket (deferred sources), -1 until asked for */
  uint8_t fetch_carry[sizeof(struct pv_record)];
  uint32_t fetch_carried;
  int main_waiting; /* Node's main thread waits in an absent range, at main_wait_off */
  uint64_t main_wait_off;
};

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static void post_wake(struct pv_uffd_server *s) {
  uint64_t one = 1;
  while (write(s->wake_fd, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

/* Node's side of the mutex: announce, so that a busy thread hands it over (see the header). */
static void api_lock(struct pv_uffd_server *s) {
  __atomic_add_fetch(&s->api_waiting, 1, __ATOMIC_SEQ_CST);
  pthread_mutex_lock(&s->lock);
  __atomic_sub_fetch(&s->api_waiting, 1, __ATOMIC_SEQ_CST);
}

static void api_unlock(struct pv_uffd_server *s) {
  pthread_cond_signal(&s->handed);
  pthread_mutex_unlock(&s->lock);
}

/* The thread's side, between two pieces of work. */
static void let_node_in(struct pv_uffd_server *s) {
  while (__atomic_load_n(&s->api_waiting, __ATOMIC_SEQ_CST)) pthread_cond_wait(&s->handed, &s->lock);
}

static void wake_range(struct pv_uffd_server *s, uint64_t off, uint64_t len) {
  struct uffdio_range r = {s->base + off, len};
  ioctl(s->uffd, UFFDIO_WAKE, &r);
}

/*
 * Maps [off, off+len) from `src` (host memory) or as zero pages (src NULL), and wakes whoever
 * waits there. A page that is already present (EEXIST: it raced in, or was never dropped) is
 * skipped and woken; EAGAIN (the mm is changing, or a partial copy) is retried from where it
 * stopped. Adds the pages it mapped to *pages. Returns 0, or -errno (range not registered, mm gone).
 */
static int fill(struct pv_uffd_server *s, uint64_t off, uint64_t len, const uint8_t *src, uint64_t *pages) {
  while (len) {
    int64_t done;
    int rc;
    if (!src) {
      struct uffdio_zeropage z = {{s->base + off, len}, 0, 0};
      rc = ioctl(s->uffd, UFFDIO_ZEROPAGE, &z);
      done = z.zeropage;
    } else {
      struct uffdio_copy c = {s->base + off, (uint64_t)(uintptr_t)src, len, 0, 0};
      rc = ioctl(s->uffd, UFFDIO_COPY, &c);
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
      if (src) src += done;
      continue;
    }
    if (err == EAGAIN || err == EINTR) {
      sched_yield();
      continue;
    }
    if (err == EEXIST) {
      wake_range(s, off, PAGE);
      off += PAGE;
      len -= PAGE;
      if (src) src += PAGE;
      continue;
    }
    return -err;
  }
  return 0;
}

static int any_active(struct pv_uffd_server *s) {
  for (uint32_t k = 0; k < s->nsources; k++)
    if (s->sources[k]->active) return 1;
  return 0;
}

/*
 * Registers guest RAM while some source is active or the block store holds something (then also
 * for write-protect faults), unregisters it otherwise: while nothing is compressed, the guest's
 * first touches of fresh RAM are the kernel's alone (through this thread they cost a fresh fill
 * almost half as much again: docs/design-figures.md). Returns 0 or -errno.
 */
static int update_registration(struct pv_uffd_server *s) {
  int want = any_active(s) || (s->cold && cold_busy(s->cold));
  int mode = UFFDIO_REGISTER_MODE_MISSING | (s->cold ? UFFDIO_REGISTER_MODE_WP : 0);
  if (want && s->registered != mode) {
    /* Registering again with more modes is allowed for the same userfaultfd. */
    struct uffdio_register reg = {{s->base, s->size}, (uint64_t)mode, 0};
    if (ioctl(s->uffd, UFFDIO_REGISTER, &reg) != 0) return -errno;
    uint64_t need = (1ULL << _UFFDIO_COPY) | (1ULL << _UFFDIO_ZEROPAGE) | (s->cold ? 1ULL << _UFFDIO_WRITEPROTECT : 0);
    if ((reg.ioctls & need) != need) {
      struct uffdio_range r = {s->base, s->size};
      ioctl(s->uffd, UFFDIO_UNREGISTER, &r);
      s->registered = 0;
      return -EOPNOTSUPP;
    }
    s->registered = mode;
  } else if (!want && s->registered) {
    /* Wakes every fault still pending in the range: they retry and fill normally. */
    struct uffdio_range r = {s->base, s->size};
    if (ioctl(s->uffd, UFFDIO_UNREGISTER, &r) != 0) return -errno;
    s->registered = 0;
  }
  return 0;
}

static struct source *find_source(struct pv_uffd_server *s, int32_t id) {
  for (uint32_t k = 0; k < s->nsources; k++)
    if (s->sources[k]->id == id) return s->sources[k];
  return NULL;
}

/* Index of the range holding `off`, or of the first range after it (count if none), by bisection. */
static uint32_t range_at_or_after(const struct source *src, uint64_t off) {
  uint32_t lo = 0, hi = src->count;
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (src->ranges[mid].offset + src->ranges[mid].length <= off) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

static void fail_range(struct pv_uffd_server *s, struct source *src, uint32_t i, int32_t err) {
  src->state[i] = (src->state[i] & QUEUED) | BAD;
  if (!src->reported) pv_record_send(s->notify_fd, PV_REC_SOURCE_ERROR, src->id, err, src->ranges[i].offset);
  src->reported = 1;
  /* Node's main thread must read the report and end the VM: it gets a zero page, as on any bad range. */
  const struct pv_range *r = &src->ranges[i];
  if (s->main_waiting && s->main_wait_off >= r->offset && s->main_wait_off < r->offset + r->length) {
    s->main_waiting = 0;
    fill(s, s->main_wait_off, PAGE, NULL, &s->zero_pages);
  }
}

/* The 4 MiB bounce buffer, mapped on first use; NULL with errno set if it cannot be. */
static uint8_t *bounce_buffer(struct pv_uffd_server *s) {
  if (!s->bounce) {
    /* mmap, not malloc: glibc's dynamic mmap threshold would move a freed 4 MiB block onto a
     * heap that keeps it. Page-aligned, as O_DIRECT needs. */
    void *b = mmap(NULL, MAX_RANGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (b == MAP_FAILED) return NULL;
    s->bounce = b;
  }
  s->bounce_used_ms = now_ms();
  return s->bounce;
}

/* Sets (on) or lifts write protection over [off, off+len); lifting it wakes whoever waits there. */
static int write_protect(struct pv_uffd_server *s, uint64_t off, uint64_t len, int on) {
  struct uffdio_writeprotect wp = {{s->base + off, len}, on ? UFFDIO_WRITEPROTECT_MODE_WP : 0};
  while (ioctl(s->uffd, UFFDIO_WRITEPROTECT, &wp) != 0) {
    if (errno != EAGAIN && errno != EINTR) return -errno;
    sched_yield();
  }
  return 0;
}

/*
 * A write into a write-protected page: if its block is being compressed, the block is marked and
 * its protection lifted (its compressed form is thrown away at pv_uffd_cold_finish); otherwise
 * the page's protection is a leftover and goes. Either way the writer is woken: if the page was
 * dropped meanwhile, it retries into a missing-page fault.
 */
static void serve_write_protect(struct pv_uffd_server *s, uint64_t off) {
  struct cold_store *c = s->cold;
  if (c && c->blocks[off / c->block].state == COLD_COMPRESSING) {
    c->blocks[off / c->block].dirtied = 1;
    write_protect(s, off / c->block * c->block, c->block, 0);
  } else {
    write_protect(s, off, PAGE, 0);
  }
  wake_range(s, off, PAGE);
}

/*
 * A missing page in guest RAM outside every source's ranges, with the block store attached.
 * Returns 1 if the fault was dealt with here, 0 to fill it as a hole.
 */
static int serve_cold(struct pv_uffd_server *s, uint64_t off, pid_t tid) {
  struct cold_store *c = s->cold;
  uint32_t b = (uint32_t)(off / c->block);
  struct cold_block *k = &c->blocks[b];
  if (k->state == COLD_COMPRESSING) {
    /* A page dropped during the compression: whatever comes next there is new. */
    k->dirtied = 1;
    return 0;
  }
  if (k->state == COLD_RESIDENT) return 0;
  if (k->state == COLD_COMPRESSED || k->state == COLD_SAVED) {
    uint8_t *out = bounce_buffer(s);
    if (out && cold_take(c, b, out) == 0) {
      if (fill(s, (uint64_t)b * c->block, c->block, out, NULL) == 0) {
        update_registration(s); /* the store may be empty now */
        return 1;
      }
      k->state = COLD_BAD;
      c->bad++;
      pv_record_send(s->notify_fd, PV_REC_COLD_ERROR, 0, PV_ERR_UFFD, (uint64_t)b * c->block);
    } else {
      pv_record_send(s->notify_fd, PV_REC_COLD_ERROR, 0, out ? PV_ERR_CHECKSUM : errno, (uint64_t)b * c->block);
      if (!out) { /* no memory to decompress into: as lost as a bad block */
        cold_forget(c, b);
        k->state = COLD_BAD;
        c->bad++;
      }
    }
  }
  /* BAD: a vCPU stays pending until the VM ends; Node's main thread reads a zero page. */
  if (tid == s->main_tid) fill(s, off, PAGE, NULL, &s->zero_pages);
  return 1;
}

/* Reads, verifies and maps range i of `src` whole. Returns 0, or -1 if it is bad (reported). */
static int load_range(struct pv_uffd_server *s, struct source *src, uint32_t i, int by_fault) {
  struct pv_range *r = &src->ranges[i];
  const uint8_t *from = NULL;
  if (src->kind == PV_SRC_MEMORY) from = (const uint8_t *)(uintptr_t)r->where;
  if (src->kind == PV_SRC_FILE) {
    if (!bounce_buffer(s)) {
      fail_range(s, src, i, errno);
      return -1;
    }
    uint64_t got = 0;
    while (got < r->length) {
      ssize_t n = pread(src->fd, s->bounce + got, r->length - got, (off_t)(r->where + got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        fail_range(s, src, i, n < 0 ? errno : PV_ERR_SHORT);
        return -1;
      }
      got += (uint64_t)n;
    }
    if ((src->flags & PV_SRC_CHECKSUM) && pv_crc32c(s->bounce, r->length) != r->checksum) {
      fail_range(s, src, i, PV_ERR_CHECKSUM);
      return -1;
    }
    from = s->bounce;
  }
  if (fill(s, r->offset, r->length, from, NULL) < 0) {
    fail_range(s, src, i, PV_ERR_UFFD);
    return -1;
  }
  src->state[i] = (src->state[i] & QUEUED) | LOADED;
  if (s->main_waiting && s->main_wait_off >= r->offset && s->main_wait_off < r->offset + r->length) s->main_waiting = 0;
  src->loaded++;
  src->bytes += r->length;
  if (by_fault) {
    src->by_fault++;
    src->touch[src->touched++] = i;
  } else {
    src->by_prefetch++;
  }
  /* The range now lives in guest RAM only: give its disk blocks and page cache back. Best effort
   * (a filesystem without hole punching keeps them until the file is removed). */
  if (src->kind == PV_SRC_FILE && (src->flags & PV_SRC_PUNCH))
    fallocate(src->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)r->where, (off_t)r->length);
  if (src->loaded == src->count) {
    src->active = 0;
    pv_record_send(s->notify_fd, PV_REC_SOURCE_DONE, src->id, 0, src->loaded);
    update_registration(s);
  }
  return 0;
}

/*
 * A fault in an absent range of a deferred source: asks the fetcher for it once (non-blocking:
 * the thread holds the mutex, and a fetcher that does not read its socket must not stall it);
 * the fault stays pending. A fetcher that cannot take the request makes the range bad.
 */
static void want_range(struct pv_uffd_server *s, struct source *src, uint32_t i, uint64_t off, pid_t tid) {
  if (tid == s->main_tid) {
    s->main_waiting = 1;
    s->main_wait_off = off;
  }
  if (src->state[i] & WANTED) return;
  struct pv_record rec = {PV_FETCH_WANT, src->id, 0, i};
  ssize_t n;
  do n = s->fetch_fd >= 0 ? send(s->fetch_fd, &rec, sizeof rec, MSG_NOSIGNAL | MSG_DONTWAIT) : -1;
  while (n < 0 && errno == EINTR);
  if (n != (ssize_t)sizeof rec) {
    fail_range(s, src, i, PV_ERR_FETCH);
    return;
  }
  src->state[i] |= WANTED;
}

static void serve(struct pv_uffd_server *s, uint64_t addr, uint64_t flags, pid_t tid) {
  if (addr < s->base || addr >= s->base + s->size) return;
  uint64_t off = (addr - s->base) & ~(PAGE - 1);
  s->faults++;
  if (flags & UFFD_PAGEFAULT_FLAG_WP) {
    serve_write_protect(s, off);
    return;
  }
  uint64_t lo = 0, hi = s->size; /* the hole around off, between active ranges */
  for (uint32_t k = 0; k < s->nsources; k++) {
    struct source *src = s->sources[k];
    if (!src->active) continue;
    uint32_t i = range_at_or_after(src, off);
    if (i < src->count && src->ranges[i].offset <= off) {
      src->faults++;
      int state = src->state[i] & STATE_MASK;
      if (state == MISSING && (src->state[i] & ABSENT)) {
        want_range(s, src, i, off, tid);
        return; /* pending until the fetcher answers */
      }
      if (state == MISSING) {
        if (load_range(s, src, i, 1) == 0) return;
        state = BAD;
      }
      if (state == LOADED || tid == s->main_tid) fill(s, off, PAGE, NULL, &s->zero_pages);
      return; /* BAD, from a vCPU: stays pending until the VM ends */
    }
    if (i > 0 && src->ranges[i - 1].offset + src->ranges[i - 1].length > lo) lo = src->ranges[i - 1].offset + src->ranges[i - 1].length;
    if (i < src->count && src->ranges[i].offset < hi) hi = src->ranges[i].offset;
  }
  if (s->cold) {
    if (serve_cold(s, off, tid)) return;
    /* Never over a neighbouring block, which may be compressed. */
    uint64_t block_start = off / s->cold->block * s->cold->block;
    if (block_start > lo) lo = block_start;
    if (block_start + s->cold->block < hi) hi = block_start + s->cold->block;
  }
  uint64_t start = off & ~(HOLE_BLOCK - 1), end = start + HOLE_BLOCK;
  if (start < lo) start = lo;
  if (end > hi) end = hi;
  fill(s, start, end - start, NULL, &s->zero_pages);
  wake_range(s, off, PAGE); /* in case the page itself raced in */
}

/* Serves the faults queued on the userfaultfd now. Returns how many messages it read. */
static int serve_pending(struct pv_uffd_server *s) {
  struct uffd_msg msgs[16];
  ssize_t n = read(s->uffd, msgs, sizeof msgs);
  if (n <= 0) return 0; /* EAGAIN: none */
  size_t count = (size_t)n / sizeof msgs[0];
  for (size_t k = 0; k < count && !s->stopping; k++) {
    if (msgs[k].event == UFFD_EVENT_PAGEFAULT) serve(s, msgs[k].arg.pagefault.address, msgs[k].arg.pagefault.flags, (pid_t)msgs[k].arg.pagefault.feat.ptid);
    let_node_in(s);
  }
  return (int)count;
}

/* Loads the next prefetched range that is still missing. Returns 1 if it did some work. */
static int prefetch_one(struct pv_uffd_server *s) {
  while (s->qhead < s->qlen) {
    struct prefetch p = s->queue[s->qhead++];
    struct source *src = find_source(s, p.source);
    if (!src) continue;
    src->state[p.index] &= ~QUEUED;
    /* An absent range loads when the fetcher says it is there. */
    if (!src->active || src->state[p.index] != MISSING) continue;
    load_range(s, src, p.index, 0);
    return 1;
  }
  /* Empty: give the queue's memory back (it can be as long as every range of every source). */
  free(s->queue);
  s->queue = NULL;
  s->qhead = s->qlen = s->qcap = 0;
  return 0;
}

/* Every absent range of every deferred source is bad: the fetcher is gone. */
static void fetcher_gone(struct pv_uffd_server *s) {
  close(s->fetch_fd);
  s->fetch_fd = -1;
  for (uint32_t k = 0; k < s->nsources; k++) {
    struct source *src = s->sources[k];
    for (uint32_t i = 0; src->active && (src->flags & PV_SRC_DEFERRED) && i < src->count; i++)
      if ((src->state[i] & STATE_MASK) == MISSING && (src->state[i] & ABSENT)) fail_range(s, src, i, PV_ERR_FETCH);
  }
}

/* What the fetcher says of one range: READY loads it (checked as any FILE range), FAILED makes it bad. */
static void take_fetch_record(struct pv_uffd_server *s, const struct pv_record *rec) {
  struct source *src = find_source(s, rec->tag);
  if (!src || !src->active || !(src->flags & PV_SRC_DEFERRED) || rec->value >= src->count) return;
  uint32_t i = (uint32_t)rec->value;
  if ((src->state[i] & STATE_MASK) != MISSING || !(src->state[i] & ABSENT)) return;
  int by_fault = (src->state[i] & WANTED) != 0;
  src->state[i] &= (uint8_t)~(ABSENT | WANTED);
  if (rec->kind == PV_FETCH_READY) load_range(s, src, i, by_fault);
  else fail_range(s, src, i, rec->err < PV_ERR_FETCH ? rec->err : PV_ERR_FETCH);
}

/* Takes one record from the fetch socket. Returns 1 if it read something. */
static int take_fetched(struct pv_uffd_server *s) {
  if (s->fetch_fd < 0) return 0;
  ssize_t n = recv(s->fetch_fd, s->fetch_carry + s->fetch_carried, sizeof s->fetch_carry - s->fetch_carried, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
  if (n <= 0) {
    fetcher_gone(s);
    return 1;
  }
  s->fetch_carried += (uint32_t)n;
  if (s->fetch_carried < sizeof s->fetch_carry) return 1;
  s->fetch_carried = 0;
  struct pv_record rec;
  memcpy(&rec, s->fetch_carry, sizeof rec);
  take_fetch_record(s, &rec);
  return 1;
}

static void *server_main(void *arg) {
  struct pv_uffd_server *s = arg;
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, NULL);
  pthread_mutex_lock(&s->lock);
  while (!s->stopping) {
    let_node_in(s);
    if (s->stopping) break;
    /* Faults first: a vCPU waits for at most one prefetched range. */
    if (serve_pending(s) || take_fetched(s) || prefetch_one(s)) continue;
    int timeout_ms = -1;
    if (s->bounce) {
      uint64_t idle_ms = now_ms() - s->bounce_used_ms;
      if (idle_ms >= BOUNCE_IDLE_MS) {
        munmap(s->bounce, MAX_RANGE);
        s->bounce = NULL;
      } else {
        timeout_ms = (int)(BOUNCE_IDLE_MS - idle_ms);
      }
    }
    pthread_mutex_unlock(&s->lock);
    struct pollfd pfd[3] = {{s->uffd, POLLIN, 0}, {s->wake_fd, POLLIN, 0}, {s->fetch_fd, POLLIN, 0}};
    poll(pfd, s->fetch_fd >= 0 ? 3 : 2, timeout_ms);
    if (pfd[1].revents) {
      uint64_t n;
      if (read(s->wake_fd, &n, sizeof n) < 0) { /* EAGAIN: already drained */
      }
    }
    pthread_mutex_lock(&s->lock);
  }
  pthread_mutex_unlock(&s->lock);
  return NULL;
}

static void free_source(struct source *src) {
  if (src->fd >= 0) close(src->fd);
  free(src->ranges);
  free(src->state);
  free(src->touch);
  free(src);
}

static void free_server(struct pv_uffd_server *s) {
  if (s->uffd >= 0) close(s->uffd);
  if (s->wake_fd >= 0) close(s->wake_fd);
  if (s->notify_fd >= 0) close(s->notify_fd);
  if (s->fetch_fd >= 0) close(s->fetch_fd);
  for (uint32_t k = 0; k < s->nsources; k++) free_source(s->sources[k]);
  free(s->sources);
  free(s->queue);
  cold_destroy(s->cold);
  if (s->bounce) munmap(s->bounce, MAX_RANGE);
  pthread_cond_destroy(&s->handed);
  pthread_mutex_destroy(&s->lock);
  free(s);
}

/*
 * Creates the server of guest RAM [base, base+size) (page-aligned) and starts its thread. RAM is
 * registered only once a source is added. Faults of thread `main_tid` (Node's main thread) are
 * never left pending. Returns NULL with errno set on failure, with nothing left behind.
 */
struct pv_uffd_server *pv_uffd_create(uint64_t base, uint64_t size, int32_t main_tid) {
  if (!size || base % PAGE || size % PAGE || base + size < base) {
    errno = EINVAL;
    return NULL;
  }
  struct pv_uffd_server *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->uffd = s->wake_fd = s->notify_fd = s->node_fd = s->fetch_fd = s->fetch_node_fd = -1;
  s->base = base;
  s->size = size;
  s->main_tid = main_tid;
  pthread_mutex_init(&s->lock, NULL);
  pthread_cond_init(&s->handed, NULL);
  int err = 0;
  s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s->wake_fd < 0) goto fail_errno;
  err = -pv_record_socketpair(&s->notify_fd, &s->node_fd);
  if (err) goto fail;
  /* Not UFFD_USER_MODE_ONLY: KVM reaches guest RAM from the kernel (get_user_pages). */
  s->uffd = (int)syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
  if (s->uffd < 0 && errno == EPERM) {
    /* An unprivileged process (a jailed VMM, src/jail/) may not make one that handles kernel
     * faults unless vm.unprivileged_userfaultfd is 1; since Linux 6.1 /dev/userfaultfd gives one
     * to whoever may open the node (the jail's launcher makes one for the jail's uid). */
    int dev = open("/dev/userfaultfd", O_RDWR | O_CLOEXEC);
    if (dev >= 0) {
      s->uffd = ioctl(dev, USERFAULTFD_IOC_NEW, O_CLOEXEC | O_NONBLOCK);
      close(dev);
    } else {
      errno = EPERM;
    }
  }
  if (s->uffd < 0) goto fail_errno;
  struct uffdio_api api = {UFFD_API, UFFD_FEATURE_THREAD_ID, 0};
  if (ioctl(s->uffd, UFFDIO_API, &api) != 0) goto fail_errno;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 256 * 1024);
  int rc = pthread_create(&s->thread, &attr, server_main, s);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    err = rc;
    goto fail;
  }
  s->started = 1;
  return s;
fail_errno:
  err = errno;
fail:
  if (s->node_fd >= 0) close(s->node_fd);
  free_server(s);
  errno = err;
  return NULL;
}

/* Node's end of the record socket; Node owns (closes) it from then on. */
int32_t pv_uffd_node_fd(struct pv_uffd_server *s) { return s->node_fd; }

/*
 * The fetcher's end of the fetch socket (deferred sources), made on the first call; the caller
 * owns (closes) it from then on. A second call returns -EBUSY. Returns the fd or -errno.
 */
int32_t pv_uffd_fetch_fd(struct pv_uffd_server *s) {
  api_lock(s);
  int32_t rc = -EBUSY;
  if (s->fetch_fd < 0 && s->fetch_node_fd < 0) {
    int ours = -1, theirs = -1;
    rc = pv_record_socketpair(&ours, &theirs);
    if (rc == 0) {
      s->fetch_fd = ours;
      s->fetch_node_fd = theirs;
      rc = theirs;
    }
  }
  api_unlock(s);
  if (rc >= 0) post_wake(s); /* poll the new socket from now on */
  return rc;
}

/* Whether `r` is a valid range of a `kind` source in guest RAM of `size` bytes at `base`. */
static int range_ok(const struct pv_uffd_server *s, int32_t kind, const struct pv_range *r) {
  if (!r->length || r->length > MAX_RANGE || r->offset % PAGE || r->length % PAGE) return 0;
  if (r->offset >= s->size || r->length > s->size - r->offset) return 0;
  if (kind == PV_SRC_FILE && r->where % PAGE) return 0;
  /* Copying from registered RAM would fault in this very thread, which nobody would serve. */
  if (kind == PV_SRC_MEMORY && (!r->where || (r->where < s->base + s->size && r->where + r->length > s->base))) return 0;
  return 1;
}

/*
 * Adds a source of `count` ranges (32-byte struct pv_range each, in address order) of `kind`;
 * `fd` is duplicated for FILE (the caller keeps its own; read-write if PV_SRC_PUNCH). Returns the
 * source id (1..65535), or -errno with nothing changed: -EINVAL if any range is malformed,
 * unsorted, or overlaps another or an active source's. A source of no ranges is done at once.
 */
int32_t pv_uffd_add_source(struct pv_uffd_server *s, int32_t kind, int32_t fd, const uint8_t *ranges, int32_t count, int32_t flags) {
  if (kind < PV_SRC_FILE || kind > PV_SRC_MEMORY || count < 0 || (uint64_t)count > s->size / PAGE) return -EINVAL;
  if (flags & ~(PV_SRC_CHECKSUM | PV_SRC_PUNCH | PV_SRC_DEFERRED) || (kind != PV_SRC_FILE && flags)) return -EINVAL;
  struct source *src = calloc(1, sizeof *src);
  if (!src) return -ENOMEM;
  src->fd = -1;
  src->kind = kind;
  src->flags = flags;
  src->count = (uint32_t)count;
  src->ranges = malloc(sizeof *src->ranges * (count ? count : 1));
  src->state = calloc(count ? count : 1, 1);
  src->touch = malloc(sizeof *src->touch * (count ? count : 1));
  if (!src->ranges || !src->state || !src->touch) {
    free_source(src);
    return -ENOMEM;
  }
  if (count) memcpy(src->ranges, ranges, sizeof *src->ranges * count);
  if (flags & PV_SRC_DEFERRED) memset(src->state, ABSENT, count ? count : 1);
  if (kind == PV_SRC_FILE) {
    src->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (src->fd < 0) {
      int err = errno;
      free_source(src);
      return -err;
    }
  }
  api_lock(s);
  /* Deferred: its bytes come from a fetcher, which must exist first. */
  int32_t rc = (flags & PV_SRC_DEFERRED) && s->fetch_fd < 0 ? -ENOTCONN : 0;
  for (int32_t i = 0; i < count && !rc; i++) {
    const struct pv_range *r = &src->ranges[i];
    if (!range_ok(s, kind, r) || (i > 0 && r->offset < src->ranges[i - 1].offset + src->ranges[i - 1].length)) rc = -EINVAL;
    for (uint32_t k = 0; k < s->nsources && !rc; k++) {
      struct source *other = s->sources[k];
      if (!other->active) continue;
      uint32_t j = range_at_or_after(other, r->offset);
      if (j < other->count && other->ranges[j].offset < r->offset + r->length) rc = -EINVAL;
    }
  }
  /* A free id after the last one given: ids come back only after 65535 others. */
  uint16_t id = s->last_id;
  if (!rc) {
    int tries = 0;
    do id = id == MAX_SOURCE_ID ? 1 : id + 1;
    while (find_source(s, id) && ++tries < MAX_SOURCE_ID);
    if (find_source(s, id)) rc = -ENOSPC;
  }
  struct source **grown = rc ? NULL : realloc(s->sources, sizeof *s->sources * (s->nsources + 1));
  if (!rc && !grown) rc = -ENOMEM;
  if (!rc) {
    s->sources = grown;
    src->id = id;
    src->active = count > 0;
    s->sources[s->nsources++] = src;
    rc = update_registration(s);
    if (rc) s->nsources--; /* could not register: as if never added */
  }
  if (rc) {
    api_unlock(s);
    free_source(src);
    return rc;
  }
  s->last_id = id;
  if (!count) pv_record_send(s->notify_fd, PV_REC_SOURCE_DONE, id, 0, 0);
  api_unlock(s);
  return id;
}

static int queue_range(struct pv_uffd_server *s, struct source *src, uint32_t i) {
  if (src->state[i] != MISSING) return 0; /* loaded, bad, or queued already */
  if (s->qlen == s->qcap) {
    uint32_t cap = s->qcap ? s->qcap * 2 : 64;
    struct prefetch *q = realloc(s->queue, sizeof *q * cap);
    if (!q) return -ENOMEM;
    s->queue = q;
    s->qcap = cap;
  }
  s->queue[s->qlen++] = (struct prefetch){src->id, i};
  src->state[i] |= QUEUED;
  return 1;
}

/* Queues `count` ranges of a source in the order given, or all of them in address order when
 * `order` is NULL; ranges already loaded are skipped. Returns how many were queued or -errno. */
static int32_t queue_ranges(struct pv_uffd_server *s, int32_t source, const uint32_t *order, int32_t count) {
  api_lock(s);
  struct source *src = find_source(s, source);
  int32_t rc = src ? 0 : -ENOENT;
  if (src && !order) count = (int32_t)src->count;
  for (int32_t k = 0; order && k < count && !rc; k++)
    if (order[k] >= src->count) rc = -EINVAL;
  for (int32_t k = 0; k < count && rc >= 0 && src->active; k++) {
    int q = queue_range(s, src, order ? order[k] : (uint32_t)k);
    rc = q < 0 ? q : rc + q;
  }
  api_unlock(s);
  if (rc > 0) post_wake(s);
  return rc;
}

/*
 * Appends ranges `order[0..count)` (indices into the source's table) to the prefetch queue; the
 * thread loads them in that order, skipping those already loaded. Returns how many it queued, or
 * -errno (-EINVAL with nothing queued if an index is out of range, -ENOENT for no such source).
 */
int32_t pv_uffd_prefetch(struct pv_uffd_server *s, int32_t source, const uint32_t *order, int32_t count) {
  return queue_ranges(s, source, order, count);
}

/* Queues every range of the source not loaded yet, in address order. Returns as pv_uffd_prefetch. */
int32_t pv_uffd_load_all(struct pv_uffd_server *s, int32_t source) {
  return queue_ranges(s, source, NULL, 0);
}

/*
 * Stops serving a source (once a load in progress has finished): its missing ranges are never
 * loaded, a later fault there is a hole's. Unregisters guest RAM if no source is left active.
 * Returns how many of its ranges were loaded, or -ENOENT.
 */
int32_t pv_uffd_remove_source(struct pv_uffd_server *s, int32_t source) {
  api_lock(s);
  struct source *src = find_source(s, source);
  if (!src) {
    api_unlock(s);
    return -ENOENT;
  }
  uint32_t kept = 0;
  for (uint32_t k = s->qhead; k < s->qlen; k++)
    if (s->queue[k].source != src->id) s->queue[kept++] = s->queue[k];
  s->qhead = 0;
  s->qlen = kept;
  uint32_t k = 0;
  while (s->sources[k] != src) k++;
  s->sources[k] = s->sources[--s->nsources];
  int32_t loaded = (int32_t)src->loaded;
  free_source(src);
  update_registration(s);
  api_unlock(s);
  return loaded;
}

/* Writes each range's state (0 missing, 1 loaded, 2 bad) to out[0..count). Returns the source's range count, or -ENOENT. */
int32_t pv_uffd_range_states(struct pv_uffd_server *s, int32_t source, uint8_t *out, int32_t count) {
  api_lock(s);
  struct source *src = find_source(s, source);
  int32_t rc = src ? (int32_t)src->count : -ENOENT;
  for (int32_t i = 0; src && i < count && (uint32_t)i < src->count; i++) out[i] = src->state[i] & STATE_MASK;
  api_unlock(s);
  return rc;
}

/*
 * Writes the indices of the ranges that faults loaded, in the order they did, to out[0..max).
 * Returns how many there are in all (at most the range count), or -ENOENT.
 */
int32_t pv_uffd_touch_order(struct pv_uffd_server *s, int32_t source, uint32_t *out, int32_t max) {
  api_lock(s);
  struct source *src = find_source(s, source);
  int32_t rc = src ? (int32_t)src->touched : -ENOENT;
  for (int32_t i = 0; src && i < max && (uint32_t)i < src->touched; i++) out[i] = src->touch[i];
  api_unlock(s);
  return rc;
}

/*
 * A source's figures: 0 faults served in its ranges, 1 ranges loaded by a fault, 2 ranges loaded
 * by prefetch, 3 bytes loaded. Source 0, the server's: 0 faults served, 4 zero pages mapped
 * outside a first load (holes, dropped pages, the main thread on a bad range). 0 if unknown.
 */
uint64_t pv_uffd_figure(struct pv_uffd_server *s, int32_t source, int32_t which) {
  api_lock(s);
  uint64_t v = 0;
  struct source *src = source ? find_source(s, source) : NULL;
  if (!source && which == 0) v = s->faults;
  else if (!source && which == 4) v = s->zero_pages;
  else if (src && which == 0) v = src->faults;
  else if (src && which == 1) v = src->by_fault;
  else if (src && which == 2) v = src->by_prefetch;
  else if (src && which == 3) v = src->bytes;
  api_unlock(s);
  return v;
}

/*
 * Stops and joins the thread, then closes the userfaultfd: that unregisters guest RAM and
 * releases every thread still blocked in a fault there. Closes every fd of the server (Node
 * closes its own end of the socket) and frees it. Call once, before guest RAM is unmapped.
 */
void pv_uffd_destroy(struct pv_uffd_server *s) {
  if (!s) return;
  /* Nobody reads records any more (Node is in this call): a send must fail, not block. */
  shutdown(s->notify_fd, SHUT_WR);
  api_lock(s);
  s->stopping = 1;
  api_unlock(s);
  post_wake(s);
  if (s->started) pthread_join(s->thread, NULL);
  free_server(s);
}

/*
 * ColdCompression's side. Blocks are indices into guest RAM cut in blocks of the size given at
 * attach. Every call returns -errno on failure with nothing changed, -ENOENT without a store.
 */

/*
 * Attaches a block store of `block`-byte blocks (a power of two, 4 KiB to 4 MiB, dividing guest
 * RAM): guest RAM is registered, also for write-protect faults, while the store holds something.
 * -EOPNOTSUPP if the kernel cannot write-protect it, -EBUSY if a store is attached already.
 */
int32_t pv_uffd_cold_attach(struct pv_uffd_server *s, uint64_t block) {
  if (block > MAX_RANGE) return -EINVAL;
  api_lock(s);
  int32_t rc = 0;
  if (s->cold) rc = -EBUSY;
  if (!rc && !(s->cold = cold_create(s->size, block))) rc = -errno;
  /* Fail now, not at the first compression, where the kernel cannot write-protect guest RAM:
   * register as a compression would, then go back to what the sources need. */
  if (!rc) {
    s->cold->compressing = 1;
    rc = update_registration(s);
    s->cold->compressing = 0;
    int back = update_registration(s);
    if (!rc) rc = back;
  }
  if (rc && s->cold) {
    cold_destroy(s->cold);
    s->cold = NULL;
    update_registration(s);
  }
  api_unlock(s);
  return rc;
}

static int32_t check_blocks(struct pv_uffd_server *s, const uint32_t *list, int32_t n) {
  if (!s->cold) return -ENOENT;
  if (n < 0) return -EINVAL;
  for (int32_t k = 0; k < n; k++)
    if (list[k] >= s->cold->count) return -EINVAL;
  return 0;
}

/* Bytes of each page that pv_uffd_cold_scan checksums: the first 256 (see there). */
#define SCAN_SAMPLE 256

/*
 * For blocks [first, first+count): out[2k+1] is how many of the block's pages are present in
 * guest RAM (UINT32_MAX if the block is compressed or bad), out[2k] a checksum of the block when all
 * are, else 0. The checksum covers the first SCAN_SAMPLE bytes of each page (CRC32C, combined):
 * it tells whether a block changed since the last scan at a sixteenth of the cost, and a write it
 * misses costs no data (a write during a compression keeps the block, one after brings it back).
 * Reads guest RAM without the mutex (a page read there may fault into this server). Returns count.
 */
int32_t pv_uffd_cold_scan(struct pv_uffd_server *s, uint32_t first, int32_t count, uint32_t *out) {
  api_lock(s);
  struct cold_store *c = s->cold;
  int32_t rc = !c ? -ENOENT : count < 0 || first > c->count || (uint32_t)count > c->count - first ? -EINVAL : count;
  for (int32_t k = 0; rc > 0 && k < count; k++) {
    uint8_t state = c->blocks[first + k].state;
    out[2 * k + 1] = state == COLD_RESIDENT || state == COLD_COMPRESSING ? 0 : UINT32_MAX;
  }
  uint64_t block = c ? c->block : 0;
  api_unlock(s);
  if (rc <= 0) return rc;
  uint32_t pages = (uint32_t)(block / PAGE);
  uint8_t *at = (uint8_t *)(uintptr_t)(s->base + (uint64_t)first * block);
  unsigned char *vec = malloc((size_t)count * pages);
  if (!vec) return -ENOMEM;
  if (mincore(at, (size_t)count * block, vec) != 0) {
    int err = errno;
    free(vec);
    return -err;
  }
  for (int32_t k = 0; k < count; k++) {
    out[2 * k] = 0;
    if (out[2 * k + 1] == UINT32_MAX) continue;
    uint32_t present = 0;
    for (uint32_t p = 0; p < pages; p++) present += vec[(size_t)k * pages + p] & 1;
    out[2 * k + 1] = present;
    if (present != pages) continue;
    uint32_t sum = 0;
    for (uint32_t p = 0; p < pages; p++) sum = (sum << 5 | sum >> 27) ^ pv_crc32c(at + (uint64_t)k * block + (uint64_t)p * PAGE, SCAN_SAMPLE);
    out[2 * k] = sum;
  }
  free(vec);
  return count;
}

/*
 * Write-protects each listed block that is resident, to be compressed in place: began[k] = 1 for
 * each it did. Returns how many.
 */
int32_t pv_uffd_cold_begin(struct pv_uffd_server *s, const uint32_t *list, int32_t n, uint8_t *began) {
  api_lock(s);
  int32_t rc = check_blocks(s, list, n);
  /* Registered for write-protect faults before the first block is protected. */
  if (rc >= 0 && n > 0) {
    s->cold->compressing++;
    int reg = update_registration(s);
    s->cold->compressing--;
    if (reg) rc = reg;
  }
  for (int32_t k = 0; rc >= 0 && k < n; k++) {
    struct cold_block *blk = &s->cold->blocks[list[k]];
    began[k] = 0;
    if (blk->state != COLD_RESIDENT) continue;
    if (write_protect(s, (uint64_t)list[k] * s->cold->block, s->cold->block, 1) != 0) continue;
    blk->state = COLD_COMPRESSING;
    blk->dirtied = 0;
    s->cold->compressing++;
    began[k] = 1;
    rc++;
  }
  if (s->cold) update_registration(s);
  api_unlock(s);
  return rc;
}

/*
 * Compresses the listed blocks (being compressed: pv_uffd_cold_begin; at most 1 MiB of them)
 * from guest RAM with lz4, keeping each only if it fits in max_size bytes. On Node's thread: a
 * page it reads that went missing meanwhile faults into this server like any other. Returns how
 * many fit, or -errno; pv_uffd_cold_finish takes the batch.
 */
int32_t pv_uffd_cold_compress(struct pv_uffd_server *s, const uint32_t *list, int32_t n, int32_t max_size) {
  api_lock(s);
  int32_t rc = check_blocks(s, list, n);
  for (int32_t k = 0; rc >= 0 && k < n; k++)
    if (s->cold->blocks[list[k]].state != COLD_COMPRESSING) rc = -EINVAL;
  api_unlock(s);
  if (rc < 0) return rc;
  /* Without the mutex: reading guest RAM may fault into this server. */
  return cold_compress_batch(s->cold, (const uint8_t *)(uintptr_t)s->base, list, (uint32_t)n, max_size > 0 ? (uint32_t)max_size : 0);
}

/* What pv_uffd_cold_finish did with a block. */
enum cold_outcome { COLD_KEPT = 0, COLD_STORED = 1, COLD_ZERO = 2, COLD_WRITTEN = 3, COLD_NOT_BEGUN = 4 };

/*
 * Ends the compression of the listed blocks (the batch pv_uffd_cold_compress made of them; any
 * other list keeps them all resident). A block written or faulted into since pv_uffd_cold_begin
 * stays resident; an all-zero block is dropped without storing anything (it reads back as zero);
 * a block whose compressed form fitted is dropped and stored; any other stays resident. out[k] is
 * an enum cold_outcome. Returns how many were stored.
 */
int32_t pv_uffd_cold_finish(struct pv_uffd_server *s, const uint32_t *list, int32_t n, uint8_t *out) {
  api_lock(s);
  int32_t rc = check_blocks(s, list, n);
  uint64_t block = s->cold ? s->cold->block : 0;
  /* Only Node calls compress and finish, one after the other: the batch stays put meanwhile. */
  int ours = rc >= 0 && cold_batch_is(s->cold, list, (uint32_t)n);
  api_unlock(s);
  if (rc < 0) return rc;
  /* Checksums first, without the mutex: reading guest RAM may fault into this server. */
  uint32_t *crc = malloc(sizeof *crc * (n ? n : 1));
  uint8_t *zero = malloc(n ? n : 1);
  if (!crc || !zero) {
    free(crc);
    free(zero);
    return -ENOMEM;
  }
  for (int32_t k = 0; k < n; k++) {
    const uint8_t *at = (const uint8_t *)(uintptr_t)(s->base + (uint64_t)list[k] * block);
    uint32_t size = ours ? s->cold->batch_size[k] : 0;
    zero[k] = size && cold_is_zero(at, block);
    crc[k] = size && !zero[k] ? pv_crc32c(at, block) : 0;
  }
  api_lock(s);
  struct cold_store *c = s->cold;
  for (int32_t k = 0; k < n; k++) {
    struct cold_block *blk = &c->blocks[list[k]];
    uint64_t off = (uint64_t)list[k] * block;
    uint32_t size = ours ? c->batch_size[k] : 0;
    const uint8_t *bytes = ours ? c->scratch + c->batch_off[k] : NULL;
    if (blk->state != COLD_COMPRESSING) {
      out[k] = COLD_NOT_BEGUN;
      continue;
    }
    blk->state = COLD_RESIDENT;
    c->compressing--;
    int stored = 0;
    if (blk->dirtied) {
      out[k] = COLD_WRITTEN;
    } else if (zero[k]) {
      out[k] = COLD_ZERO;
      c->zero_dropped++;
    } else if (size && cold_keep(c, list[k], bytes, size, crc[k]) == 0) {
      out[k] = COLD_STORED;
      stored = 1;
      rc++;
    } else {
      out[k] = COLD_KEPT;
    }
    if (out[k] == COLD_ZERO || stored) {
      /* Still write-protected and unwritten: what was compressed is what the guest had. A write
       * waiting in a fault has not happened yet; it retries into the missing page. */
      madvise((void *)(uintptr_t)(s->base + off), block, MADV_DONTNEED);
    } else {
      write_protect(s, off, block, 0);
    }
  }
  cold_batch_done(c);
  update_registration(s);
  api_unlock(s);
  free(crc);
  free(zero);
  return rc;
}

/*
 * Copies each block's state (enum cold_state) to states[0..count) and whether a fault brought it
 * back since the marks were last cleared to faulted[0..count); clears them if `clear`. Returns
 * the block count.
 */
int32_t pv_uffd_cold_states(struct pv_uffd_server *s, uint8_t *states, uint8_t *faulted, int32_t count, int32_t clear) {
  api_lock(s);
  struct cold_store *c = s->cold;
  int32_t rc = !c ? -ENOENT : (uint32_t)count != c->count ? -EINVAL : count;
  for (int32_t b = 0; rc > 0 && b < count; b++) {
    states[b] = c->blocks[b].state;
    faulted[b] = c->blocks[b].faulted;
    if (clear) c->blocks[b].faulted = 0;
  }
  api_unlock(s);
  return rc;
}

/* Forgets the stored bytes of the listed blocks (the guest freed them): they read as zero. Returns how many it forgot. */
int32_t pv_uffd_cold_forget(struct pv_uffd_server *s, const uint32_t *list, int32_t n) {
  api_lock(s);
  int32_t rc = check_blocks(s, list, n);
  for (int32_t k = 0; rc >= 0 && k < n; k++) {
    struct cold_block *blk = &s->cold->blocks[list[k]];
    if (blk->state != COLD_COMPRESSED) continue;
    cold_forget(s->cold, list[k]);
    rc++;
  }
  if (rc > 0) update_registration(s);
  api_unlock(s);
  return rc;
}

/*
 * The store's figures: 0 blocks stored, 1 bytes stored, 2 blocks a fault brought back, 3
 * nanoseconds spent decompressing, 4 blocks that failed their check, 5 all-zero blocks dropped,
 * 6 blocks saved to a file (while suspended), 7 their bytes.
 */
uint64_t pv_uffd_cold_figure(struct pv_uffd_server *s, int32_t which) {
  api_lock(s);
  struct cold_store *c = s->cold;
  uint64_t v = 0;
  if (c) {
    switch (which) {
      case 0: v = c->compressed; break;
      case 1: v = c->stored_bytes; break;
      case 2: v = c->faults; break;
      case 3: v = c->decompress_ns; break;
      case 4: v = c->bad; break;
      case 5: v = c->zero_dropped; break;
      case 6: v = c->saved; break;
      case 7: v = c->saved_bytes; break;
    }
  }
  api_unlock(s);
  return v;
}

/*
 * While the VM is suspended: writes the stored blocks to fd (durably) and frees them (SAVED; a
 * fault there reads its block from the file), or reads them all back (COMPRESSED again). See
 * cold_save and cold_load. Return how many blocks, or -errno. File I/O under the mutex: the
 * thread has nothing to serve while the VM is suspended but what these calls decide.
 */
int32_t pv_uffd_cold_save(struct pv_uffd_server *s, int32_t fd) {
  api_lock(s);
  int32_t rc = s->cold ? cold_save(s->cold, fd) : -ENOENT;
  api_unlock(s);
  return rc;
}

int32_t pv_uffd_cold_load(struct pv_uffd_server *s) {
  api_lock(s);
  int32_t rc = s->cold ? cold_load(s->cold) : -ENOENT;
  api_unlock(s);
  return rc;
}

/* For tests of the integrity check only: flips one stored byte of a compressed block. */
int32_t pv_uffd_cold_damage(struct pv_uffd_server *s, uint32_t b) {
  api_lock(s);
  int32_t rc = -ENOENT;
  if (s->cold && b < s->cold->count && s->cold->blocks[b].state == COLD_COMPRESSED) {
    struct cold_block *blk = &s->cold->blocks[b];
    blk->data[blk->size / 2] ^= 0x5a;
    rc = 0;
  }
  api_unlock(s);
  return rc;
}
