/*
 * pvisor-pool-daemon: the page pool's daemon, what `pvisor-daemon serve --memory-pool` becomes
 * (src/cli/daemon-main.ts checks the options, then execs this with them). A C program rather than
 * a Node process because the pool's cell charges the daemon to the VMs it serves: Node idle was
 * 15-16 MiB of PSS, and 21-43 MiB after a merge (docs/memory-table3.md, "The daemon pool").
 *
 *   pvisor-pool-daemon SOCKET POOL_BYTES [GID]
 *
 * Listens on SOCKET (0600, or 0660 and of group GID), accepts VM processes (PoolClient) and
 * `pvisor-daemon status`, checks each peer's credentials (SO_PEERCRED: root, the daemon's uid, or
 * group GID), hands the scope's memfd over with the answer to Hello (SCM_RIGHTS), and answers
 * Offer, Put, Settle and Status from the pool (pool_pages.c). The protocol is
 * src/daemon/pool-protocol.ts in the frames of src/protocol/frame.ts. A client that breaks the
 * protocol, sends more than it may, or stops reading is sent an Error frame and disconnected;
 * other clients go on.
 *
 * A client's references outlive its connection for as long as its process does: a VM maps the
 * pool pages it was granted until it says otherwise or ends, whether or not it is still
 * connected, and a slot given to new content while a VM still maps it would change that VM's
 * memory under it. So the references of a client that disconnects are kept until its process is
 * gone (checked every 2 s by pid and start time, against pid reuse).
 *
 * One thread, epoll, non-blocking sockets. Per client it holds at most one frame being assembled
 * (1 MiB, mapped while the client sends large frames and given back when it has been idle) and
 * its unread answers (16 MiB at most, beyond which the client is disconnected).
 *
 * Exits 0 after SIGTERM or SIGINT (the VMs keep every page they map), 2 on bad arguments, 125 if
 * it cannot start.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <malloc.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "pool_hello.h"
#include "pool_pages.h"

/* Frames (src/protocol/frame.ts). */
#define HEADER_BYTES 16u
#define MAX_PAYLOAD_BYTES (1024u * 1024u)
enum { FRAME_REQUEST = 1, FRAME_RESPONSE = 2, FRAME_ERROR = 4 };

/* The pool's protocol (src/daemon/pool-protocol.ts). */
enum { OP_HELLO = 1, OP_OFFER = 2, OP_PUT = 3, OP_SETTLE = 4, OP_STATUS = 5 };
#define PROTOCOL_VERSION 1
#define MAX_OFFER_ENTRIES 65536u
#define MAX_PUT_PAGES 240u
#define MAX_SETTLE_PAGES 131072u
#define ANSWER_SEND 0xffffffffu
#define ANSWER_NONE 0xfffffffeu
#define ANSWER_FULL 0xfffffffdu

/* A client stops reading: beyond this many unread answer bytes it is disconnected. */
#define MAX_UNREAD_BYTES (16u * 1024u * 1024u)
/* How often the references of disconnected clients are checked against their processes. */
#define ORPHAN_CHECK_MS 2000
/* How long a failed client's last bytes (its Error frame) may take to go before it is cut off. */
#define CLOSE_GRACE_MS 1000
/* Payloads up to this size are assembled in the client's own small buffer. */
#define SMALL_PAYLOAD_BYTES 8192u
/*
 * A client's large frame buffer goes this long after its last large frame. A merge pass sends
 * them back to back (kept, no page faults per frame); between passes the daemon holds none: four
 * VMs' buffers were 3 MiB of its PSS when it kept them until the next 2 s check.
 */
#define LARGE_IDLE_MS 250

/* An answer queued for a client that has not read what came before. */
struct chunk {
  struct chunk *next;
  size_t len, sent;
  /* A descriptor to send with the chunk's first byte (Hello's memfd), or -1. */
  int pass_fd;
  uint8_t bytes[];
};

/* Pool pages a client holds references to, with how many: open addressing, page + 1 as the key. */
struct grants {
  uint32_t *pages, *counts;
  uint32_t cap, size;
  uint64_t total;
};

struct client {
  struct client *prev, *next;
  int fd;
  uint32_t id;
  pid_t pid;
  /* The process's start time (/proc/PID/stat), telling it from a later process of the same pid; 0 if unknown. */
  uint64_t start;
  struct pool_scope *scope;
  char name[HELLO_MAX_NAME_BYTES + 1];
  struct grants grants;
  /* The frame being assembled: its header, then its payload. */
  uint8_t header[HEADER_BYTES];
  uint32_t header_fill, payload_len, payload_fill;
  int in_payload;
  uint8_t small[SMALL_PAYLOAD_BYTES];
  /* MAX_PAYLOAD_BYTES mapped for larger frames, unmapped LARGE_IDLE_MS after the last one. */
  uint8_t *large;
  int64_t large_last;
  /* Answers not yet taken by the client. */
  struct chunk *out_head, *out_tail;
  size_t out_bytes;
  int want_out;
  /*
   * Failed: what it sends is read and dropped, its Error frame goes, then its end of the socket is
   * shut for writing; it is closed when the peer closes too, or its grace is over.
   */
  int closing, shut;
  int64_t close_at;
};

/*
 * Connected clients in the order they came; disconnected ones whose processes may still map what
 * they were granted; the sockets of failed ones on their way out; and those done with, freed once
 * the events at hand are handled (a client that fails while its frames are read is still read).
 */
static struct client *clients, *clients_tail, *orphans, *closing_clients, *retired;
static uint32_t next_client_id = 1;
static int epfd, listen_fd, signal_fd, spare_fd = -1;
static int has_group;
static gid_t group;
static uid_t own_uid;
static const char *socket_path;
static dev_t socket_dev;
static ino_t socket_ino;
/* What one recv takes. Each byte of it, once touched, stays in the PSS; more per call saves little. */
static uint8_t receive_buffer[64 * 1024];

/* Epoll's data of the listening socket and the signalfd; clients are their struct. */
static int listen_tag, signal_tag;

static _Noreturn void die(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("pvisor-daemon: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(status);
}

static int64_t now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static void put_u32(uint8_t *b, uint32_t v) {
  b[0] = (uint8_t)v;
  b[1] = (uint8_t)(v >> 8);
  b[2] = (uint8_t)(v >> 16);
  b[3] = (uint8_t)(v >> 24);
}

static uint32_t get_u32(const uint8_t *b) {
  return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* --- Grants. --- */

static uint32_t grant_slot(const struct grants *g, uint32_t page) {
  uint32_t mask = g->cap - 1, i = (uint32_t)(((uint64_t)page * 0x9e3779b97f4a7c15ull) >> 32) & mask;
  while (g->pages[i] && g->pages[i] != page + 1) i = (i + 1) & mask;
  return i;
}

static uint32_t grant_count(const struct grants *g, uint32_t page) {
  if (!g->cap) return 0;
  uint32_t i = grant_slot(g, page);
  return g->pages[i] ? g->counts[i] : 0;
}

static void grant_add(struct grants *g, uint32_t page) {
  if ((uint64_t)(g->size + 1) * 4 > (uint64_t)g->cap * 3) {
    struct grants bigger = { 0 };
    bigger.cap = g->cap ? g->cap * 2 : 64;
    bigger.pages = calloc(bigger.cap, sizeof(uint32_t));
    bigger.counts = calloc(bigger.cap, sizeof(uint32_t));
    if (!bigger.pages || !bigger.counts) pool_out_of_memory();
    for (uint32_t i = 0; i < g->cap; i++) {
      if (!g->pages[i]) continue;
      uint32_t j = grant_slot(&bigger, g->pages[i] - 1);
      bigger.pages[j] = g->pages[i];
      bigger.counts[j] = g->counts[i];
    }
    bigger.size = g->size;
    bigger.total = g->total;
    free(g->pages);
    free(g->counts);
    *g = bigger;
  }
  uint32_t i = grant_slot(g, page);
  if (!g->pages[i]) {
    g->pages[i] = page + 1;
    g->counts[i] = 0;
    g->size++;
  }
  g->counts[i]++;
  g->total++;
}

/* Takes one grant of `page` away; the caller checked there is one. */
static void grant_drop(struct grants *g, uint32_t page) {
  uint32_t mask = g->cap - 1, i = grant_slot(g, page);
  g->total--;
  if (--g->counts[i]) return;
  /* Backward-shift deletion keeps every probe sequence whole. */
  g->pages[i] = 0;
  g->size--;
  for (uint32_t j = (i + 1) & mask; g->pages[j]; j = (j + 1) & mask) {
    uint32_t home = (uint32_t)(((uint64_t)(g->pages[j] - 1) * 0x9e3779b97f4a7c15ull) >> 32) & mask;
    /* Entry j may move to the hole at i if its home is not in (i, j]. */
    if (((j - home) & mask) >= ((j - i) & mask)) {
      g->pages[i] = g->pages[j];
      g->counts[i] = g->counts[j];
      g->pages[j] = 0;
      i = j;
    }
  }
}

/* Gives every reference of `c` back to the pool. */
static void release_all(struct client *c) {
  for (uint32_t i = 0; i < c->grants.cap; i++)
    for (uint32_t n = c->grants.counts[i]; c->grants.pages[i] && n > 0; n--) pool_release(c->scope, c->grants.pages[i] - 1);
  free(c->grants.pages);
  free(c->grants.counts);
  c->grants = (struct grants){ 0 };
}

/* --- Processes. --- */

/* The start time of process `pid` (field 22 of /proc/PID/stat), or 0 if it is gone. */
static uint64_t process_start(pid_t pid) {
  if (pid <= 0) return 0;
  char path[32], stat[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  ssize_t n = read(fd, stat, sizeof stat - 1);
  close(fd);
  if (n <= 0) return 0;
  stat[n] = 0;
  char *p = strrchr(stat, ')');
  if (!p) return 0;
  /* Fields from 3 (the state) on, one space apart; 22 is the 20th of them. */
  p += 2;
  for (int field = 3; field < 22; field++) {
    p = strchr(p, ' ');
    if (!p) return 0;
    p++;
  }
  return strtoull(p, NULL, 10) + 1;
}

/* The daemon's PSS, from /proc/self/smaps_rollup. */
static uint64_t own_pss_bytes(void) {
  FILE *f = fopen("/proc/self/smaps_rollup", "re");
  if (!f) return 0;
  char line[256];
  uint64_t kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "Pss: %" SCNu64 " kB", &kb) == 1) break;
  fclose(f);
  return kb * 1024;
}

/* --- Sending. --- */

static void want_output(struct client *c, int want) {
  if (c->want_out == want) return;
  c->want_out = want;
  struct epoll_event ev = { .events = EPOLLIN | (want ? EPOLLOUT : 0), .data.ptr = c };
  epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
}

/* Sends what can go of the queue now. -1 if the connection is broken. */
static int flush(struct client *c) {
  while (c->out_head) {
    struct chunk *k = c->out_head;
    ssize_t n;
    if (k->pass_fd >= 0 && k->sent == 0) {
      union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
      } control;
      memset(&control, 0, sizeof control);
      struct iovec iov = { k->bytes, k->len };
      struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf, .msg_controllen = sizeof control.buf };
      struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(sizeof(int));
      memcpy(CMSG_DATA(cm), &k->pass_fd, sizeof(int));
      n = sendmsg(c->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    } else {
      n = send(c->fd, k->bytes + k->sent, k->len - k->sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return -1;
    }
    k->sent += (size_t)n;
    c->out_bytes -= (size_t)n;
    if (k->sent < k->len) break;
    c->out_head = k->next;
    if (!c->out_head) c->out_tail = NULL;
    free(k);
  }
  want_output(c, c->out_head != NULL);
  return 0;
}

/* A frame of `payload` bytes to fill in (after its header), or NULL if out of memory. */
static struct chunk *new_frame(uint8_t type, uint32_t id, uint16_t op, uint32_t payload) {
  struct chunk *k = malloc(sizeof *k + HEADER_BYTES + payload);
  if (!k) return NULL;
  k->next = NULL;
  k->len = HEADER_BYTES + payload;
  k->sent = 0;
  k->pass_fd = -1;
  uint8_t *h = k->bytes;
  h[0] = 'P';
  h[1] = 'V';
  h[2] = PROTOCOL_VERSION;
  h[3] = type;
  put_u32(h + 4, id);
  h[8] = (uint8_t)op;
  h[9] = (uint8_t)(op >> 8);
  h[10] = h[11] = 0;
  put_u32(h + 12, payload);
  return k;
}

static void queue(struct client *c, struct chunk *k) {
  if (c->out_tail) c->out_tail->next = k;
  else c->out_head = k;
  c->out_tail = k;
  c->out_bytes += k->len;
}

static void fail(struct client *c, uint32_t id, const char *why);

/* Queues an answer and sends what can go; a client past MAX_UNREAD_BYTES is failed. */
static void answer(struct client *c, struct chunk *k) {
  queue(c, k);
  if (flush(c)) {
    /* The peer is gone: its hangup comes through epoll. */
    return;
  }
  if (c->out_bytes > MAX_UNREAD_BYTES) fail(c, get_u32(k->bytes + 4), "the client does not read its answers");
}

/* --- Clients coming and going. --- */

static void unlink_client(struct client **head, struct client *c) {
  if (c->prev) c->prev->next = c->next;
  else *head = c->next;
  if (c->next) c->next->prev = c->prev;
  if (head == &clients && clients_tail == c) clients_tail = c->prev;
  c->prev = c->next = NULL;
}

static void push_client(struct client **head, struct client *c) {
  c->prev = NULL;
  c->next = *head;
  if (*head) (*head)->prev = c;
  *head = c;
}

/* Frees `c` once the events at hand are handled. */
static void retire(struct client *c) {
  push_client(&retired, c);
}

static void free_retired(void) {
  while (retired) {
    struct client *c = retired;
    retired = c->next;
    free(c);
  }
}

static void free_buffers(struct client *c) {
  if (c->large) munmap(c->large, MAX_PAYLOAD_BYTES);
  c->large = NULL;
  while (c->out_head) {
    struct chunk *k = c->out_head;
    c->out_head = k->next;
    free(k);
  }
  c->out_tail = NULL;
  c->out_bytes = 0;
}

/* Gives back the references of disconnected clients whose processes have ended. */
static void reap_orphans(void) {
  for (struct client *c = orphans, *next; c; c = next) {
    next = c->next;
    if (c->start && process_start(c->pid) == c->start) continue;
    unlink_client(&orphans, c);
    release_all(c);
    retire(c);
  }
}

/* The connection has ended (or is ending): the client's references stay while its process lives. */
static void drop(struct client *c) {
  unlink_client(&clients, c);
  free_buffers(c);
  if (c->grants.size) push_client(&orphans, c);
  else retire(c);
  reap_orphans();
}

static void close_connection(struct client *c) {
  epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
  close(c->fd);
  c->fd = -1;
}

/* A failed connection's end. */
static void finish(struct client *gone) {
  unlink_client(&closing_clients, gone);
  close_connection(gone);
  free_buffers(gone);
  retire(gone);
}

/* Once a failed connection's last bytes are sent: the peer reads them, then the end of the stream. */
static void shut_when_sent(struct client *gone) {
  if (gone->out_head || gone->shut) return;
  shutdown(gone->fd, SHUT_WR);
  gone->shut = 1;
}

/*
 * Sends an Error frame and disconnects: the client's state goes at once (its references as for
 * any disconnect), its socket once the peer has read the frame and closed, or after
 * CLOSE_GRACE_MS. Not closed at once: a peer that reads with Node's net would lose the frame (libuv
 * takes a hangup after a short read as the end, and a read stops short after a message that
 * carried a descriptor, as the answer to Hello did).
 */
static void fail(struct client *c, uint32_t id, const char *why) {
  if (c->closing) return;
  size_t len = strlen(why);
  if (len > 512) len = 512;
  /* What is left of the client on its way out: its socket and its unsent bytes. */
  struct client *gone = calloc(1, sizeof *gone);
  if (!gone) pool_out_of_memory();
  gone->fd = c->fd;
  gone->id = c->id;
  gone->out_head = c->out_head;
  gone->out_tail = c->out_tail;
  gone->out_bytes = c->out_bytes;
  gone->closing = 1;
  gone->want_out = -1;
  gone->close_at = now_ms() + CLOSE_GRACE_MS;
  c->out_head = c->out_tail = NULL;
  c->out_bytes = 0;
  c->closing = 1;
  c->fd = -1;
  struct chunk *k = new_frame(FRAME_ERROR, id, 0, (uint32_t)len);
  if (k) {
    memcpy(k->bytes + HEADER_BYTES, why, len);
    queue(gone, k);
  }
  push_client(&closing_clients, gone);
  drop(c);
  /* Epoll now reports `gone`; the rest goes as the socket takes it. */
  if (flush(gone)) finish(gone);
  else shut_when_sent(gone);
}

/* Closes failed connections whose Error frame is sent or whose grace is over. */
static void close_failed(int64_t now) {
  for (struct client *c = closing_clients, *next; c; c = next) {
    next = c->next;
    if (now < c->close_at) continue;
    finish(c);
  }
}

static void accept_clients(void) {
  for (;;) {
    int fd = accept4(listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if ((errno == EMFILE || errno == ENFILE) && spare_fd >= 0) {
        /* Out of descriptors: take the connection with the spare one and end it, rather than
           leave it pending (epoll would report it again at once, forever). */
        close(spare_fd);
        fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd >= 0) close(fd);
        spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        continue;
      }
      return;
    }
    struct ucred cred;
    socklen_t cred_len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) || cred_len != sizeof cred) {
      close(fd);
      continue;
    }
    struct client *c = calloc(1, sizeof *c);
    if (!c) pool_out_of_memory();
    c->fd = fd;
    c->id = next_client_id++;
    c->pid = cred.pid;
    c->start = process_start(cred.pid);
    struct epoll_event ev = { .events = EPOLLIN, .data.ptr = c };
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev)) {
      close(fd);
      free(c);
      continue;
    }
    c->prev = clients_tail;
    if (clients_tail) clients_tail->next = c;
    else clients = c;
    clients_tail = c;
    if (!(cred.uid == 0 || cred.uid == own_uid || (has_group && cred.gid == group))) {
      char why[64];
      snprintf(why, sizeof why, "uid %u may not use this pool", (unsigned)cred.uid);
      fail(c, 0, why);
    }
  }
}

/* --- Requests. --- */

/* A JSON string's text, escaped, appended. */
struct text_out {
  char *p;
  size_t len, cap;
  int failed;
};

static void out_printf(struct text_out *t, const char *fmt, ...) {
  for (;;) {
    if (t->failed) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->p ? t->p + t->len : NULL, t->p ? t->cap - t->len : 0, fmt, ap);
    va_end(ap);
    if (n < 0) {
      t->failed = 1;
      return;
    }
    if (t->p && t->len + (size_t)n < t->cap) {
      t->len += (size_t)n;
      return;
    }
    size_t cap = t->cap ? t->cap : 1024;
    while (cap <= t->len + (size_t)n) cap *= 2;
    char *p = realloc(t->p, cap);
    if (!p) {
      t->failed = 1;
      return;
    }
    t->p = p;
    t->cap = cap;
  }
}

static void out_json_string(struct text_out *t, const char *s) {
  out_printf(t, "\"");
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\') out_printf(t, "\\%c", ch);
    else if (ch < 0x20) out_printf(t, "\\u%04x", ch);
    else out_printf(t, "%c", ch);
  }
  out_printf(t, "\"");
}

/* JSON in the shape of PoolStatus (src/daemon/pool-protocol.ts). */
static void status(struct client *c, uint32_t id) {
  reap_orphans();
  struct pool_figures f = pool_figures();
  uint32_t orphaned = 0;
  for (struct client *o = orphans; o; o = o->next) orphaned++;
  struct text_out t = { 0 };
  out_printf(&t, "{\"pid\":%d,\"poolBytes\":%" PRIu64 ",\"pagesUsed\":%" PRIu64 ",\"orphanedClients\":%u,\"references\":%" PRIu64 ",\"clients\":[", (int)getpid(), pool_page_count() * POOL_PAGE_BYTES, f.pages_used, orphaned, f.references);
  int first = 1;
  for (struct client *k = clients; k; k = k->next) {
    if (!k->scope) continue;
    out_printf(&t, "%s{\"id\":%u,\"scope\":", first ? "" : ",", k->id);
    out_json_string(&t, pool_scope_name(k->scope));
    out_printf(&t, ",\"name\":");
    out_json_string(&t, k->name);
    out_printf(&t, ",\"pid\":%d,\"references\":%" PRIu64 "}", (int)k->pid, k->grants.total);
    first = 0;
  }
  out_printf(&t, "],\"scopes\":%" PRIu64 ",\"candidates\":%" PRIu64 ",\"pssBytes\":%" PRIu64 "}", f.scopes, f.candidates, own_pss_bytes());
  if (t.failed || t.len > MAX_PAYLOAD_BYTES) {
    free(t.p);
    fail(c, 0, t.failed ? "out of memory for the status" : "the status does not fit in a frame");
    return;
  }
  struct chunk *k = new_frame(FRAME_RESPONSE, id, OP_STATUS, (uint32_t)t.len);
  if (!k) {
    free(t.p);
    fail(c, 0, "out of memory for the status");
    return;
  }
  memcpy(k->bytes + HEADER_BYTES, t.p, t.len);
  free(t.p);
  answer(c, k);
}

static void hello(struct client *c, uint32_t id, const uint8_t *p, uint32_t len) {
  char why[600], scope_name[HELLO_MAX_NAME_BYTES + 1];
  if (c->scope) return fail(c, 0, "a second Hello");
  if (hello_parse(p, len, scope_name, c->name, why, sizeof why)) return fail(c, 0, why);
  const char *no_scope = NULL;
  struct pool_scope *s = pool_scope(scope_name, &no_scope);
  if (!s) return fail(c, 0, no_scope);
  c->scope = s;
  char welcome[128];
  int n = snprintf(welcome, sizeof welcome, "{\"version\":%d,\"poolBytes\":%" PRIu64 ",\"clientId\":%u}", PROTOCOL_VERSION, pool_page_count() * POOL_PAGE_BYTES, c->id);
  struct chunk *k = new_frame(FRAME_RESPONSE, id, OP_HELLO, (uint32_t)n);
  if (!k) return fail(c, 0, "out of memory");
  memcpy(k->bytes + HEADER_BYTES, welcome, (size_t)n);
  /* The descriptor goes with the answer's first byte, whatever was queued before it. */
  k->pass_fd = pool_scope_client_fd(s);
  answer(c, k);
}

static void offer(struct client *c, uint32_t id, const uint8_t *p, uint32_t len) {
  if (len % 12 || len / 12 > MAX_OFFER_ENTRIES) {
    char why[64];
    snprintf(why, sizeof why, "an Offer of %u bytes", len);
    return fail(c, 0, why);
  }
  uint32_t count = len / 12;
  struct chunk *k = new_frame(FRAME_RESPONSE, id, OP_OFFER, count * 8);
  if (!k) return fail(c, 0, "out of memory");
  uint8_t *out = k->bytes + HEADER_BYTES;
  for (uint32_t i = 0; i < count; i++, p += 12, out += 8) {
    uint32_t page = get_u32(p);
    uint64_t key = (uint64_t)get_u32(p + 4) | (uint64_t)get_u32(p + 8) << 32;
    int64_t pooled = pool_lookup(c->scope, key);
    uint32_t a;
    if (pooled >= 0 && pool_hold(c->scope, (uint32_t)pooled) == 0) {
      grant_add(&c->grants, (uint32_t)pooled);
      a = (uint32_t)pooled;
    } else {
      a = pool_offered(c->scope, key, c->id) ? ANSWER_SEND : ANSWER_NONE;
    }
    put_u32(out, page);
    put_u32(out + 4, a);
  }
  answer(c, k);
}

static void put(struct client *c, uint32_t id, const uint8_t *p, uint32_t len) {
  uint32_t count = len >= 4 ? get_u32(p) : 0;
  if (count < 1 || count > MAX_PUT_PAGES || len != 4 + count * (4 + POOL_PAGE_BYTES)) {
    char why[64];
    snprintf(why, sizeof why, "a Put of %u bytes", len);
    return fail(c, 0, why);
  }
  const uint8_t *data = p + 4 + 4 * count;
  uint64_t keys[MAX_PUT_PAGES];
  /* The keys are the daemon's own: a client cannot file a page under another content's key. */
  pv_page_hashes(data, count, keys);
  struct chunk *k = new_frame(FRAME_RESPONSE, id, OP_PUT, count * 8);
  if (!k) return fail(c, 0, "out of memory");
  uint8_t *out = k->bytes + HEADER_BYTES;
  for (uint32_t i = 0; i < count; i++, out += 8) {
    int64_t pooled = pool_put(c->scope, keys[i], data + (size_t)i * POOL_PAGE_BYTES);
    if (pooled >= 0) grant_add(&c->grants, (uint32_t)pooled);
    put_u32(out, get_u32(p + 4 + 4 * i));
    put_u32(out + 4, pooled >= 0 ? (uint32_t)pooled : ANSWER_FULL);
  }
  answer(c, k);
}

static void settle(struct client *c, uint32_t id, const uint8_t *p, uint32_t len) {
  char why[96];
  if (len < 4 || len % 4 || (len - 4) / 4 > MAX_SETTLE_PAGES) {
    snprintf(why, sizeof why, "a Settle of %u bytes", len);
    return fail(c, 0, why);
  }
  uint32_t keep = get_u32(p), total = (len - 4) / 4;
  if (keep > total) {
    snprintf(why, sizeof why, "a Settle keeping %u of %u pages", keep, total);
    return fail(c, 0, why);
  }
  /* The kept pages need nothing: the client holds them already. */
  for (uint32_t i = keep; i < total; i++) {
    uint32_t page = get_u32(p + 4 + 4 * i);
    if (!grant_count(&c->grants, page)) {
      snprintf(why, sizeof why, "Settle drops pool page %u, which the client does not hold", page);
      return fail(c, 0, why);
    }
    grant_drop(&c->grants, page);
    pool_release(c->scope, page);
  }
  struct chunk *k = new_frame(FRAME_RESPONSE, id, OP_SETTLE, 0);
  if (!k) return fail(c, 0, "out of memory");
  answer(c, k);
}

static void handle(struct client *c, const uint8_t *payload) {
  const uint8_t *h = c->header;
  uint32_t id = get_u32(h + 4), len = c->payload_len;
  uint16_t op = (uint16_t)(h[8] | h[9] << 8);
  char why[64];
  if (h[3] != FRAME_REQUEST) {
    snprintf(why, sizeof why, "a frame of type %u, not a request", h[3]);
    return fail(c, 0, why);
  }
  if (op == OP_STATUS) return status(c, id);
  if (op == OP_HELLO) return hello(c, id, payload, len);
  if (!c->scope) {
    snprintf(why, sizeof why, "op %u before Hello", op);
    return fail(c, 0, why);
  }
  switch (op) {
    case OP_OFFER: return offer(c, id, payload, len);
    case OP_PUT: return put(c, id, payload, len);
    case OP_SETTLE: return settle(c, id, payload, len);
    default:
      snprintf(why, sizeof why, "unknown op %u", op);
      return fail(c, 0, why);
  }
}

/* Assembles frames from what came, handling each as it completes; stops at a failure. */
static void feed(struct client *c, const uint8_t *b, size_t n) {
  while (!c->closing && (n > 0 || (c->in_payload && c->payload_fill == c->payload_len))) {
    if (!c->in_payload) {
      size_t take = HEADER_BYTES - c->header_fill;
      if (take > n) take = n;
      memcpy(c->header + c->header_fill, b, take);
      c->header_fill += (uint32_t)take;
      b += take;
      n -= take;
      if (c->header_fill < HEADER_BYTES) return;
      c->header_fill = 0;
      const uint8_t *h = c->header;
      char why[64];
      if (h[0] != 'P' || h[1] != 'V') return fail(c, 0, "bad frame magic");
      if (h[2] != PROTOCOL_VERSION) {
        snprintf(why, sizeof why, "unsupported protocol version %u", h[2]);
        return fail(c, 0, why);
      }
      c->payload_len = get_u32(h + 12);
      if (c->payload_len > MAX_PAYLOAD_BYTES) {
        snprintf(why, sizeof why, "payload length %u exceeds %u", c->payload_len, MAX_PAYLOAD_BYTES);
        return fail(c, 0, why);
      }
      if (c->payload_len > SMALL_PAYLOAD_BYTES && !c->large) {
        void *m = mmap(NULL, MAX_PAYLOAD_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return fail(c, 0, "out of memory for the frame");
        c->large = m;
      }
      c->in_payload = 1;
      c->payload_fill = 0;
    }
    uint8_t *payload = c->payload_len > SMALL_PAYLOAD_BYTES ? c->large : c->small;
    size_t take = c->payload_len - c->payload_fill;
    if (take > n) take = n;
    memcpy(payload + c->payload_fill, b, take);
    c->payload_fill += (uint32_t)take;
    b += take;
    n -= take;
    if (c->payload_fill < c->payload_len) return;
    c->in_payload = 0;
    if (payload == c->large) c->large_last = now_ms();
    handle(c, payload);
  }
}

static void client_event(struct client *c, uint32_t events) {
  if (c->closing) {
    /* A failed connection: its last bytes go, what it sends is dropped, its close ends it. */
    if ((events & EPOLLOUT) && flush(c)) return finish(c);
    shut_when_sent(c);
    if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
      ssize_t n = recv(c->fd, receive_buffer, sizeof receive_buffer, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) finish(c);
    }
    return;
  }
  if (events & EPOLLOUT) {
    if (flush(c)) {
      close_connection(c);
      drop(c);
      return;
    }
  }
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
    ssize_t n = recv(c->fd, receive_buffer, sizeof receive_buffer, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) {
      close_connection(c);
      drop(c);
      return;
    }
    feed(c, receive_buffer, (size_t)n);
  }
}

/*
 * Gives back the frame buffers of clients that sent no large frame for LARGE_IDLE_MS (and are not
 * in the middle of one); returns when the next one is due, or `never`.
 */
static int64_t trim_buffers(int64_t now, int64_t never) {
  int64_t next = never;
  for (struct client *c = clients; c; c = c->next) {
    if (!c->large || (c->in_payload && c->payload_len > SMALL_PAYLOAD_BYTES)) continue;
    if (now >= c->large_last + LARGE_IDLE_MS) {
      munmap(c->large, MAX_PAYLOAD_BYTES);
      c->large = NULL;
    } else if (c->large_last + LARGE_IDLE_MS < next) {
      next = c->large_last + LARGE_IDLE_MS;
    }
  }
  return next;
}

/* --- Starting and ending. --- */

/* Removes a socket file nobody listens on; refuses one a live daemon serves, or any other file. */
static void remove_stale_socket(const char *path) {
  struct stat st;
  if (lstat(path, &st)) {
    if (errno == ENOENT) return;
    die(125, "%s: %s", path, strerror(errno));
  }
  if (!S_ISSOCK(st.st_mode)) die(125, "%s exists and is not a socket", path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) die(125, "socket: %s", strerror(errno));
  struct sockaddr_un addr = { .sun_family = AF_UNIX };
  memcpy(addr.sun_path, path, strlen(path) + 1);
  int live = connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0 || errno == EAGAIN || errno == EINPROGRESS;
  close(fd);
  if (live) die(125, "a daemon already serves %s", path);
  if (unlink(path) && errno != ENOENT) die(125, "cannot remove the stale socket %s: %s", path, strerror(errno));
}

static void listen_on(const char *path) {
  struct sockaddr_un addr = { .sun_family = AF_UNIX };
  size_t len = strlen(path);
  if (len == 0 || len >= sizeof addr.sun_path) die(125, "socket path of %zu bytes: at most %zu", len, sizeof addr.sun_path - 1);
  memcpy(addr.sun_path, path, len + 1);
  remove_stale_socket(path);
  listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listen_fd < 0) die(125, "socket: %s", strerror(errno));
  /* Created 0600 from the start, not opened to others between bind and chmod. */
  mode_t mask = umask(0177);
  int bound = bind(listen_fd, (struct sockaddr *)&addr, sizeof addr);
  umask(mask);
  if (bound) die(125, "cannot listen on %s: %s", path, strerror(errno));
  if (has_group && chown(path, own_uid, group)) die(125, "cannot give %s to group %u: %s", path, (unsigned)group, strerror(errno));
  if (chmod(path, has_group ? 0660 : 0600)) die(125, "chmod %s: %s", path, strerror(errno));
  if (listen(listen_fd, 511)) die(125, "cannot listen on %s: %s", path, strerror(errno));
  struct stat st;
  if (stat(path, &st) == 0) socket_dev = st.st_dev, socket_ino = st.st_ino;
}

/*
 * Signal dispositions and mask as a fresh Node process has them, whatever the exec'ing process
 * left (Node leaves SIGPIPE ignored, and may leave signals blocked): all default but SIGPIPE and
 * SIGXFSZ, ignored; SIGTERM and SIGINT then come through a signalfd.
 */
static void take_signals(void) {
  struct sigaction sa = { 0 };
  for (int s = 1; s < NSIG; s++) {
    if (s == SIGKILL || s == SIGSTOP) continue;
    sa.sa_handler = s == SIGPIPE || s == SIGXFSZ ? SIG_IGN : SIG_DFL;
    sigaction(s, &sa, NULL);
  }
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  if (sigprocmask(SIG_SETMASK, &set, NULL)) die(125, "sigprocmask: %s", strerror(errno));
  signal_fd = signalfd(-1, &set, SFD_NONBLOCK | SFD_CLOEXEC);
  if (signal_fd < 0) die(125, "signalfd: %s", strerror(errno));
}

static int parse_u64(const char *s, uint64_t *out) {
  if (!*s || *s < '0' || *s > '9') return -1;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end) return -1;
  *out = v;
  return 0;
}

int main(int argc, char **argv) {
  uint64_t pool_bytes, gid = 0;
  if (argc < 3 || argc > 4 || parse_u64(argv[2], &pool_bytes) || pool_bytes < POOL_PAGE_BYTES || pool_bytes > (1ull << 44) || (argc == 4 && (parse_u64(argv[3], &gid) || gid >= 0xffffffffull))) {
    fprintf(stderr, "usage: pvisor-pool-daemon SOCKET POOL_BYTES [GID]\n  POOL_BYTES from 4096 to 2^44; run by pvisor-daemon serve --memory-pool\n");
    return 2;
  }
  socket_path = argv[1];
  has_group = argc == 4;
  group = (gid_t)gid;
  own_uid = getuid();
  take_signals();
  /* Fixed thresholds: frames and answers of hundreds of KiB are mapped and unmapped, not kept in a heap that grew. */
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  mallopt(M_TRIM_THRESHOLD, 128 * 1024);
  pool_init(pool_bytes);
  epfd = epoll_create1(EPOLL_CLOEXEC);
  if (epfd < 0) die(125, "epoll_create1: %s", strerror(errno));
  listen_on(socket_path);
  spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  struct epoll_event ev = { .events = EPOLLIN, .data.ptr = &listen_tag };
  if (epoll_ctl(epfd, EPOLL_CTL_ADD, listen_fd, &ev)) die(125, "epoll_ctl: %s", strerror(errno));
  ev.data.ptr = &signal_tag;
  if (epoll_ctl(epfd, EPOLL_CTL_ADD, signal_fd, &ev)) die(125, "epoll_ctl: %s", strerror(errno));
  fprintf(stderr, "pvisor-daemon: page pool of up to %" PRIu64 " bytes on %s (pid %d)\n", pool_bytes, socket_path, (int)getpid());

  int64_t next_check = now_ms() + ORPHAN_CHECK_MS, next_trim = next_check;
  for (int running = 1; running;) {
    int64_t now = now_ms(), wake = next_check < next_trim ? next_check : next_trim;
    for (struct client *c = closing_clients; c; c = c->next)
      if (c->close_at < wake) wake = c->close_at;
    struct epoll_event events[64];
    int n = epoll_wait(epfd, events, 64, wake > now ? (int)(wake - now) : 0);
    if (n < 0 && errno != EINTR) die(125, "epoll_wait: %s", strerror(errno));
    for (int i = 0; i < n; i++) {
      void *tag = events[i].data.ptr;
      if (tag == &listen_tag) accept_clients();
      else if (tag == &signal_tag) running = 0;
      else client_event(tag, events[i].events);
    }
    free_retired();
    now = now_ms();
    close_failed(now);
    next_trim = trim_buffers(now, next_check);
    if (now >= next_check) {
      reap_orphans();
      /* What the bookkeeping freed goes back too. */
      malloc_trim(0);
      next_check = now + ORPHAN_CHECK_MS;
    }
    free_retired();
  }

  /* Ends every connection and frees the pool; the VMs keep the pages they map. */
  struct stat st;
  if (stat(socket_path, &st) == 0 && st.st_dev == socket_dev && st.st_ino == socket_ino) unlink(socket_path);
  close(listen_fd);
  for (struct client *c = clients; c; c = c->next) close(c->fd);
  for (struct client *c = closing_clients; c; c = c->next) close(c->fd);
  pool_close();
  return 0;
}
