/*
 * pvisor vCPU runner: one native thread per vCPU, each looping on KVM_RUN.
 *
 * Why native threads and not Node workers: a Node worker that loads ffi-rs costs about 8 MiB of
 * PSS (measured on the target hosts), more than the whole per-VM budget of the VMM, and ffi-rs's
 * lookup cache is not thread-safe. A pthread costs a few KiB of touched stack. The threads never
 * call into JavaScript: they report each exit as a 16-byte pv_record (pv_record.h: tag = vCPU
 * index, value = KVM_RUN's return, err = its errno) on a Unix socket that Node watches on its
 * event loop (libuv can poll a socket, not an eventfd), then sleep in read() on
 * their own eventfd until the event loop has handled the exit and writes to it. Node writes that
 * eventfd with fs.writeSync: one plain write(2), where an ffi-rs call (pv_vcpu_go) costs several
 * microseconds of argument marshalling on every exit.
 *
 * Kicking a vCPU out of KVM_RUN: kvm_run.immediate_exit = 1, then pthread_kill with a real-time
 * signal whose handler does nothing; KVM_RUN returns -EINTR (immediate_exit alone does not
 * interrupt a running vCPU). The signal is unblocked only in vCPU threads.
 *
 * Watched eventfds (KVM ioeventfds: a guest's queue notifications that KVM completes without
 * leaving the kernel) are read by one more thread per group, which reports each as a NOTIFY record
 * on the same socket, tagged with the number the caller chose; Node cannot poll an eventfd itself.
 *
 * Owned by a group: its threads, their "go" eventfds, the watcher's epoll set and wake eventfd, and
 * the helper's end of the socket. pv_group_destroy stops everything: it shuts the socket for
 * sending (so no thread stays blocked on a full socket), kicks and releases every vCPU thread,
 * wakes the watcher, and joins them all.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "pv_record.h"

#define KVM_RUN_IOCTL 0xAE80 /* _IO(KVMIO, 0x80), <linux/kvm.h> */
#define KVM_RUN_IMMEDIATE_EXIT_OFFSET 1 /* struct kvm_run: __u8 request_interrupt_window; __u8 immediate_exit */
#define PV_MAX_VCPUS 64

/* pv_record.kind on this helper's socket. */
enum pv_vcpu_record_kind {
  PV_REC_EXIT = 1,        /* KVM_RUN returned 0: read exit_reason from kvm_run */
  PV_REC_INTERRUPTED = 2, /* KVM_RUN returned -EINTR (kicked, or a stray signal) */
  PV_REC_ERROR = 3,       /* KVM_RUN failed with another errno */
  PV_REC_STOPPED = 4,     /* the thread left its loop and will exit */
  PV_REC_NOTIFY = 5,      /* a watched eventfd fired; `tag` is the caller's tag, not a vCPU */
};

struct pv_vcpu {
  struct pv_group *group;
  int index;
  int fd;
  volatile uint8_t *run;
  pthread_t thread;
  int started;
  int go_fd; /* eventfd: a write lets the thread (re-)enter KVM_RUN */
};

struct pv_group {
  int notify_fd; /* our end of the socketpair */
  int node_fd;   /* Node's end, handed out by pv_group_create */
  volatile int stopping;
  struct pv_vcpu vcpus[PV_MAX_VCPUS];
  int epoll_fd;  /* the watched eventfds, -1 until the first pv_group_watch */
  int wake_fd;   /* eventfd in the epoll set that tells the watcher to leave */
  pthread_t watcher;
  int watching;
};

static int kick_signal(void) { return SIGRTMIN + 3; }

static void on_kick(int sig) { (void)sig; }

static pthread_once_t handler_once = PTHREAD_ONCE_INIT;
static int handler_error;

static void install_handler(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_kick;
  sigemptyset(&sa.sa_mask);
  /* No SA_RESTART: KVM_RUN must come back with -EINTR. read() on the eventfd is retried by hand. */
  if (sigaction(kick_signal(), &sa, NULL) != 0) handler_error = errno;
}

static void report(struct pv_vcpu *v, uint16_t kind, int32_t ret, int32_t err) {
  pv_record_send(v->group->notify_fd, kind, (uint16_t)v->index, err, (uint64_t)(int64_t)ret);
}

static void wait_go(struct pv_vcpu *v) {
  uint64_t n;
  while (read(v->go_fd, &n, sizeof n) < 0 && errno == EINTR) {
  }
}

static void post_go(struct pv_vcpu *v) {
  uint64_t one = 1;
  while (write(v->go_fd, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

static void *vcpu_main(void *arg) {
  struct pv_vcpu *v = arg;
  sigset_t only_kick;
  sigfillset(&only_kick);
  sigdelset(&only_kick, kick_signal());
  pthread_sigmask(SIG_SETMASK, &only_kick, NULL);

  wait_go(v);
  while (!v->group->stopping) {
    int ret = ioctl(v->fd, KVM_RUN_IOCTL, 0);
    int err = ret < 0 ? errno : 0;
    if (v->group->stopping) break;
    /* An application processor leaving wait-for-SIPI in the in-kernel APIC: KVM_RUN returns
       -EAGAIN and wants to be called again (as QEMU and Firecracker do). */
    if (ret < 0 && err == EAGAIN) continue;
    if (ret == 0) report(v, PV_REC_EXIT, 0, 0);
    else if (err == EINTR) report(v, PV_REC_INTERRUPTED, ret, err);
    else report(v, PV_REC_ERROR, ret, err);
    wait_go(v);
  }
  report(v, PV_REC_STOPPED, 0, 0);
  return NULL;
}

/* Creates a group for one VM; pv_group_node_fd() then gives the socket Node reads records from. */
struct pv_group *pv_group_create(void) {
  pthread_once(&handler_once, install_handler);
  if (handler_error) {
    errno = handler_error;
    return NULL;
  }
  struct pv_group *g = calloc(1, sizeof *g);
  if (!g) return NULL;
  int rc = pv_record_socketpair(&g->notify_fd, &g->node_fd);
  if (rc < 0) {
    free(g);
    errno = -rc;
    return NULL;
  }
  g->epoll_fd = -1;
  g->wake_fd = -1;
  return g;
}

static void *watcher_main(void *arg) {
  struct pv_group *g = arg;
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, NULL);
  struct epoll_event ev[16];
  for (;;) {
    int n = epoll_wait(g->epoll_fd, ev, 16, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      return NULL;
    }
    for (int i = 0; i < n; i++) {
      int fd = (int)(ev[i].data.u64 >> 32);
      uint32_t tag = (uint32_t)ev[i].data.u64;
      if (fd == g->wake_fd) return NULL;
      uint64_t count;
      /* Reset the eventfd; several notifications since the last read are one record: the
         device drains its whole queue each time. */
      if (read(fd, &count, sizeof count) == sizeof count) pv_record_send(g->notify_fd, PV_REC_NOTIFY, (uint16_t)tag, 0, 0);
    }
  }
}

/*
 * Watches eventfd `fd` (non-blocking, owned by the caller, kept open until pv_group_destroy):
 * each time it fires, a NOTIFY record with tag `tag` (0..65535) arrives on the socket.
 */
int32_t pv_group_watch(struct pv_group *g, int32_t fd, int32_t tag) {
  if (tag < 0 || tag > UINT16_MAX) return -EINVAL;
  if (g->epoll_fd < 0) {
    g->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    if (g->epoll_fd < 0) return -errno;
    g->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    struct epoll_event wake = {.events = EPOLLIN, .data.u64 = (uint64_t)(uint32_t)g->wake_fd << 32};
    if (g->wake_fd < 0 || epoll_ctl(g->epoll_fd, EPOLL_CTL_ADD, g->wake_fd, &wake) != 0) return -errno;
  }
  struct epoll_event ev = {.events = EPOLLIN, .data.u64 = ((uint64_t)(uint32_t)fd << 32) | (uint32_t)tag};
  if (epoll_ctl(g->epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) return -errno;
  if (!g->watching) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    int rc = pthread_create(&g->watcher, &attr, watcher_main, g);
    pthread_attr_destroy(&attr);
    if (rc != 0) return -rc;
    g->watching = 1;
  }
  return 0;
}

/* Node's end of the record socket; Node owns it (closes it) from then on. */
int32_t pv_group_node_fd(struct pv_group *g) { return g->node_fd; }

/* Starts the thread of vCPU `index`; it waits for the first pv_vcpu_go() before KVM_RUN. */
int32_t pv_vcpu_start(struct pv_group *g, int32_t index, int32_t vcpu_fd, void *kvm_run) {
  if (index < 0 || index >= PV_MAX_VCPUS || g->vcpus[index].started) return -EINVAL;
  struct pv_vcpu *v = &g->vcpus[index];
  v->group = g;
  v->index = index;
  v->fd = vcpu_fd;
  v->run = kvm_run;
  v->go_fd = eventfd(0, EFD_CLOEXEC);
  if (v->go_fd < 0) return -errno;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  /* The loop needs little stack; a small one keeps the mapping count and VSZ down. */
  pthread_attr_setstacksize(&attr, 256 * 1024);
  int rc = pthread_create(&v->thread, &attr, vcpu_main, v);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    close(v->go_fd);
    return -rc;
  }
  v->started = 1;
  return 0;
}

/* Lets vCPU `index` (re-)enter KVM_RUN after its last record was handled. */
int32_t pv_vcpu_go(struct pv_group *g, int32_t index) {
  if (index < 0 || index >= PV_MAX_VCPUS || !g->vcpus[index].started) return -EINVAL;
  post_go(&g->vcpus[index]);
  return 0;
}

/* The eventfd that pv_vcpu_go writes, for a caller that writes it directly; owned by the group. */
int32_t pv_vcpu_go_fd(struct pv_group *g, int32_t index) {
  if (index < 0 || index >= PV_MAX_VCPUS || !g->vcpus[index].started) return -EINVAL;
  return g->vcpus[index].go_fd;
}

/* Forces vCPU `index` out of KVM_RUN (or keeps it from entering): it then reports INTERRUPTED. */
int32_t pv_vcpu_kick(struct pv_group *g, int32_t index) {
  if (index < 0 || index >= PV_MAX_VCPUS || !g->vcpus[index].started) return -EINVAL;
  struct pv_vcpu *v = &g->vcpus[index];
  __atomic_store_n(&v->run[KVM_RUN_IMMEDIATE_EXIT_OFFSET], 1, __ATOMIC_SEQ_CST);
  return -pthread_kill(v->thread, kick_signal());
}

/* Stops and joins every vCPU thread, closes the sockets and frees the group. */
void pv_group_destroy(struct pv_group *g) {
  if (!g) return;
  g->stopping = 1;
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  /* Node reads no more records (it is in this call): a thread blocked in send() on a full socket
     would never return, so shut the socket for sending; blocked and later sends fail at once. */
  shutdown(g->notify_fd, SHUT_WR);
  for (int i = 0; i < PV_MAX_VCPUS; i++) {
    struct pv_vcpu *v = &g->vcpus[i];
    if (!v->started) continue;
    __atomic_store_n(&v->run[KVM_RUN_IMMEDIATE_EXIT_OFFSET], 1, __ATOMIC_SEQ_CST);
    post_go(v);
    pthread_kill(v->thread, kick_signal());
  }
  for (int i = 0; i < PV_MAX_VCPUS; i++) {
    struct pv_vcpu *v = &g->vcpus[i];
    if (!v->started) continue;
    pthread_join(v->thread, NULL);
    close(v->go_fd);
  }
  if (g->watching) {
    uint64_t one = 1;
    while (write(g->wake_fd, &one, sizeof one) < 0 && errno == EINTR) {
    }
    pthread_join(g->watcher, NULL);
  }
  if (g->wake_fd >= 0) close(g->wake_fd);
  if (g->epoll_fd >= 0) close(g->epoll_fd);
  close(g->notify_fd);
  free(g);
}
