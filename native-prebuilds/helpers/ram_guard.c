/*
 * SIGBUS guard for guest RAM. A page of guest RAM backed by a file can vanish under the VMM: a
 * SharedSnapshot clone maps its snapshot's RAM file, whose owner can truncate it, and a disk can
 * fail to read a page back. Touched by the kernel on a vCPU's behalf, such a page makes KVM_RUN
 * fail (EFAULT), which ends that VM alone. Touched from user space (a device model on Node's main
 * thread reading a virtqueue, a checksum, a worker reading a page) it raises SIGBUS, whose default
 * action ends the whole process and every VM in it.
 *
 * So guest RAM mappings are registered here, and a SIGBUS handler, installed once and chained to
 * the handler it replaced, looks the faulting address up. Inside a registered mapping it maps a
 * fresh anonymous page over the faulting page (MAP_FIXED: the access is retried and reads zero),
 * records the first fault's offset in the mapping's slot of a table that Node reads directly, and
 * sends one record (pv_record.h: tag = slot) on a socket that Node watches, so that Node ends that
 * VM with a typed error and never runs it on. Anywhere else the previous handler runs, or the
 * default action (the process ends, as it would have without this guard).
 *
 * Async-signal safety: the handler makes system calls only (mmap, madvise, send, sigaction,
 * raise) and reads the table with atomic loads. A slot is published start first, length last; a
 * length of 0 is a free slot, cleared before the mapping goes away.
 *
 * Owns: the handler, the table, and this helper's end of the record socket, for the life of the
 * process (Node owns the other end).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "pv_record.h"

#define PV_GUARD_SLOTS 4096
#define PV_GUARD_PAGE 4096 /* x86-64; sysconf is not async-signal-safe */
#define PV_GUARD_REC_HIT 1

struct pv_guard_slot {
  _Atomic uint64_t start;
  _Atomic uint64_t length; /* 0: a free slot */
  _Atomic uint64_t hit;    /* 0, or 1 + the offset of the first byte that faulted */
};

_Static_assert(sizeof(struct pv_guard_slot) == 24, "Node reads 24-byte slots");

static struct pv_guard_slot slots[PV_GUARD_SLOTS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct sigaction previous;
static _Atomic int send_fd = -1;
static int installed;

static void run_previous(int sig, siginfo_t *info, void *ctx) {
  if (previous.sa_flags & SA_SIGINFO) {
    previous.sa_sigaction(sig, info, ctx);
    return;
  }
  if (previous.sa_handler == SIG_IGN && info->si_code <= 0) return; /* sent by kill(): ignored, as asked */
  if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
    return;
  }
  /* The default action. A fault cannot be ignored (the access would fault again for ever). The
   * signal is blocked while this runs: raised now, it is delivered, by default, on return. */
  struct sigaction dfl;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(SIGBUS, &dfl, NULL);
  raise(SIGBUS);
}

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
  int saved = errno;
  uintptr_t at = (uintptr_t)info->si_addr;
  for (int i = 0; i < PV_GUARD_SLOTS; i++) {
    uint64_t length = atomic_load(&slots[i].length);
    if (length == 0) continue;
    uint64_t start = atomic_load(&slots[i].start);
    if (at < start || at - start >= length) continue;
    void *page = (void *)(at & ~(uintptr_t)(PV_GUARD_PAGE - 1));
    if (mmap(page, PV_GUARD_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) break;
    /* Guest RAM is MADV_DONTFORK: a child process must not copy it, this page included. */
    madvise(page, PV_GUARD_PAGE, MADV_DONTFORK);
    uint64_t none = 0;
    if (atomic_compare_exchange_strong(&slots[i].hit, &none, 1 + (at - start))) {
      struct pv_record rec = {PV_GUARD_REC_HIT, (uint16_t)i, info->si_code, at - start};
      /* Never waits: the slot says it all, the record only wakes Node. */
      send(atomic_load(&send_fd), &rec, sizeof rec, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    errno = saved;
    return;
  }
  errno = saved;
  run_previous(sig, info, ctx);
}

/*
 * Installs the handler (once per process) and makes a new record socket, on which the handler
 * sends from then on; returns Node's end (Node owns it), or -errno. One call per process is the
 * rule; a later one (a test runner loading the module afresh) gets its own socket, and the old
 * helper end stays open, so that the handler never sends on a number since reused.
 */
int32_t pv_ram_guard_init(void) {
  pthread_mutex_lock(&lock);
  int ours = -1, node = -1;
  int32_t ret = pv_record_socketpair(&ours, &node);
  if (ret == 0 && !installed) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    atomic_store(&send_fd, ours);
    if (sigaction(SIGBUS, &sa, &previous) != 0) {
      ret = -errno;
      atomic_store(&send_fd, -1);
      close(ours);
      close(node);
    } else {
      installed = 1;
    }
  } else if (ret == 0) {
    atomic_store(&send_fd, ours);
  }
  pthread_mutex_unlock(&lock);
  return ret == 0 ? node : ret;
}

/* The table's address: PV_GUARD_SLOTS slots of struct pv_guard_slot, for Node to read. */
uint64_t pv_ram_guard_table(void) { return (uint64_t)(uintptr_t)slots; }

uint32_t pv_ram_guard_slot_count(void) { return PV_GUARD_SLOTS; }

/* Guards [start, start + length); returns its slot, or -ENOSPC when every slot is taken. */
int32_t pv_ram_guard_add(uint64_t start, uint64_t length) {
  if (length == 0) return -EINVAL;
  pthread_mutex_lock(&lock);
  int32_t ret = -ENOSPC;
  for (int i = 0; i < PV_GUARD_SLOTS; i++) {
    if (atomic_load(&slots[i].length) != 0) continue;
    atomic_store(&slots[i].hit, 0);
    atomic_store(&slots[i].start, start);
    atomic_store(&slots[i].length, length);
    ret = i;
    break;
  }
  pthread_mutex_unlock(&lock);
  return ret;
}

/* Stops guarding a slot; before its mapping goes away. */
void pv_ram_guard_remove(int32_t slot) {
  if (slot < 0 || slot >= PV_GUARD_SLOTS) return;
  pthread_mutex_lock(&lock);
  atomic_store(&slots[slot].length, 0);
  atomic_store(&slots[slot].start, 0);
  pthread_mutex_unlock(&lock);
}
