/*
 * pvisor-pool-daemon: the page pool's daemon, what `pvisor-daemon serve --memory-pool` becomes
 * (src/cli/daemon-main.ts checks the options, then execs this with them). A C program rather than
 * a Node process because the pool's cell charges the daemon to the VMs it serves, and a Node
 * daemon costs several times a C one (docs/design-figures.md).
 *
 *   pvisor-pool-daemon SOCKET POOL_BYTES MAX_CLIENTS MAX_CLIENTS_PER_UID [GID]
 *
 * Listens on SOCKET (0600, or 0660 and of group GID), accepts VM processes (PoolClient) and
 * `pvisor-daemon status`, checks each peer's credentials (SO_PEERCRED and SO_PEERGROUPS: root,
 * the daemon's uid, or a member of group GID), hands the scope's memfd over with the answer to
 * Hello (SCM_RIGHTS), and answers Offer, Put, Settle and Status from the pool (pool_pages.c). The
 * protocol is src/daemon/pool-protocol.ts in the frames of src/protocol/frame.ts. A client that
 * breaks the protocol is sent an Error frame and disconnected; other clients go on.
 *
 * Scopes belong to the peer's credentials, not to what it says: a scope NAME is the peer uid's own
 * (uid and name make the scope), and "gid:GID:NAME" is group GID's, open only to its members.
 * Status shows a client only its uid's and its groups' scopes and clients (root sees all).
 *
 * What a client may make the daemon hold is bounded, whatever it sends or leaves unread:
 * - MAX_CLIENTS connections in all, MAX_CLIENTS_PER_UID per uid; one over is refused with an
 *   Error frame at accept, holding nothing;
 * - per connection, the frame coming in is taken apart as it arrives (an Offer's entries one by
 *   one, a Put's pages one at a time), so no more than a page of it is held; and the daemon reads
 *   the next bytes only once the answers to the last have gone into the socket, so what a client
 *   leaves unread stays in its socket's buffer (the kernel's bound) and the daemon keeps at most
 *   the answers to one read (OUT_CHUNK_BYTES) of it;
 * - Status answers, the one large answer to a small request, at most STATUS_UNREAD_PER_UID bytes
 *   unread per uid and STATUS_UNREAD_BYTES in all; a Status beyond them is refused.
 *
 * A client's references outlive its connection for as long as its process does (pool_orphans.c),
 * at most MAX_CLIENTS_PER_UID such processes and scopes per uid: a uid at that bound gets no new
 * Hello until some of them end.
 *
 * One thread, epoll, non-blocking sockets. Exits 0 after SIGTERM or SIGINT (the VMs keep every
 * page they map), 2 on bad arguments, 125 if it cannot start.
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
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "../include/pv_frame.h"
#include "crc32c.h"
#include "pool_grants.h"
#include "pool_hello.h"
#include "pool_orphans.h"
#include "pool_pages.h"
#include "pool_peers.h"

/* The pool's protocol (src/daemon/pool-protocol.ts), in frames (../include/pv_frame.h); its version is Hello's (pool_hello.h). */
enum { OP_HELLO = 1, OP_OFFER = 2, OP_PUT = 3, OP_SETTLE = 4, OP_STATUS = 5 };
#define OFFER_ENTRY_BYTES 12u
#define MAX_OFFER_ENTRIES 65536u
#define MAX_PUT_PAGES 240u
#define MAX_SETTLE_PAGES 131072u
#define ANSWER_BYTES 8u
#define ANSWER_SEND 0xffffffffu
#define ANSWER_NONE 0xfffffffeu
#define ANSWER_FULL 0xfffffffdu

/*
 * What one recv takes at most, and so what the answers to it come to: an Offer's 12-byte entries
 * are answered in 8, so 16 KiB read makes at most 11 KiB of answers, one chunk.
 */
#define RECV_BYTES (16u * 1024u)
#define OUT_CHUNK_BYTES (16u * 1024u)
/* Reads of one client per epoll event: a client sending without pause waits for the others' turn. */
#define READS_PER_EVENT 4
/* Unread Status answers: per uid, and in all. */
#define STATUS_UNREAD_PER_UID (4u * 1024u * 1024u)
#define STATUS_UNREAD_BYTES (16u * 1024u * 1024u)
/* Refused connections whose Error frame lingers, at most (beyond, they are closed at once). */
#define MAX_REFUSED_LINGERING 64u
/* How long a failed client's last bytes (its Error frame) may take to go before it is cut off. */
#define CLOSE_GRACE_MS 1000
/* How often malloc's free memory goes back to the kernel. */
#define TRIM_MS 2000
/* Where a Put's page is assembled in a client's `part`, after its count and page numbers. */
#define PUT_PAGE_AT (4u + 4u * MAX_PUT_PAGES)
/* A client's part buffer: a whole Hello, or a Put's numbers and one page. */
#define PART_BYTES (PUT_PAGE_AT + POOL_PAGE_BYTES)
_Static_assert(PART_BYTES >= HELLO_MAX_BYTES, "a Hello fits in a client's part buffer");
_Static_assert(RECV_BYTES / OFFER_ENTRY_BYTES * ANSWER_BYTES + PV_FRAME_HDR <= OUT_CHUNK_BYTES, "one read's answers fit in one chunk");

/* What epoll's data points at: each struct it can be starts with its tag. */
enum { TAG_LISTEN = 1, TAG_SIGNAL, TAG_CLIENT, TAG_CLOSING, TAG_ORPHAN, TAG_DEAD };

/* Answers queued for a connection: bytes the socket has not taken yet. */
struct chunk {
  struct chunk *next;
  size_t len, cap, sent;
  /* A descriptor to send with the chunk's first byte (Hello's memfd), or -1. */
  int pass_fd;
  /* A Status answer: counted in its uid's and the daemon's unread Status bytes. */
  int status;
  uint8_t bytes[];
};

/* A connection's socket and what waits to go out on it. */
struct link {
  int fd;
  struct chunk *head, *tail;
  size_t bytes;
  /* What epoll watches for now. */
  uint32_t events;
  /* Its uid's usage (NULL for a connection refused at accept). */
  struct uid_usage *usage;
};

struct client {
  int tag;
  struct client *prev, *next;
  struct link link;
  uint32_t id;
  pid_t pid;
  uid_t uid;
  gid_t gid;
  /* The peer's process, watched once the connection ends (pool_orphans.c); -1 if unknown. */
  int pidfd;
  struct pool_scope *scope;
  char name[HELLO_MAX_NAME_BYTES + 1];
  struct grants grants;
  /* The frame coming in: its header, then its payload, taken apart as it comes. */
  uint8_t header[PV_FRAME_HDR];
  uint32_t header_fill;
  int in_payload;
  uint16_t op;
  uint32_t request_id, payload_len, payload_done;
  /* Where the op is: its phase (count, numbers, pages...), a Put's count, a Settle's kept count, entries done. */
  uint32_t phase, count, keep, index;
  /* The element being assembled in `part`: filled up to part_fill, complete at part_want. */
  uint32_t part_fill, part_want;
  uint8_t part[PART_BYTES];
  int closing;
};

/*
 * A connection on its way out: a failed client's (its Error frame goes, then its end of the socket
 * is shut for writing; it is closed when the peer closes too, or its grace is over), or one refused
 * at accept. Not closed at once: a peer that reads with Node's net would lose the frame (libuv takes
 * a hangup after a short read as the end, and a read stops short after a message that carried a
 * descriptor, as the answer to Hello did), and one still writing its Hello would get EPIPE first.
 */
struct closing {
  int tag;
  struct closing *prev, *next;
  struct link link;
  int shut, refused;
  int64_t close_at;
};

/* Connected clients in the order they came; connections on their way out, oldest first. */
static struct client *clients, *clients_tail;
static struct closing *closings, *closings_tail;
/* Connections counted against MAX_CLIENTS (connected and failed ones), and refused ones lingering. */
static uint32_t connections, refused_lingering;
static uint32_t max_clients, max_clients_per_uid;
static uint64_t status_unread;
static uint32_t next_client_id = 1;
static int epfd, listen_fd, signal_fd, spare_fd = -1;
static int has_group;
static gid_t group;
static uid_t own_uid;
static const char *socket_path;
static dev_t socket_dev;
static ino_t socket_ino;
static uint8_t receive_buffer[RECV_BYTES];
static int listen_tag = TAG_LISTEN, signal_tag = TAG_SIGNAL;

/* Structs done with, freed once the events at hand are handled (a later event may still name them). */
static void **retired;
static size_t retired_count, retired_cap;

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

static void retire(void *p, int *tag) {
  *tag = TAG_DEAD;
  if (retired_count == retired_cap) {
    retired_cap = retired_cap ? retired_cap * 2 : 64;
    retired = realloc(retired, retired_cap * sizeof *retired);
    if (!retired) pool_out_of_memory();
  }
  retired[retired_count++] = p;
}

static void free_retired(void) {
  for (size_t i = 0; i < retired_count; i++) free(retired[i]);
  retired_count = 0;
  orphans_collect();
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

static struct chunk *new_chunk(size_t cap) {
  struct chunk *k = malloc(sizeof *k + cap);
  if (!k) pool_out_of_memory();
  k->next = NULL;
  k->len = k->sent = 0;
  k->cap = cap;
  k->pass_fd = -1;
  k->status = 0;
  return k;
}

static void append_chunk(struct link *l, struct chunk *k) {
  if (l->tail) l->tail->next = k;
  else l->head = k;
  l->tail = k;
  l->bytes += k->len - k->sent;
}

static void free_chunk(struct link *l, struct chunk *k) {
  if (k->status) {
    l->usage->status_bytes -= k->len;
    status_unread -= k->len;
  }
  free(k);
}

/* Room for `n` more bytes at the end of the queue, to be written at once. */
static uint8_t *reserve(struct link *l, size_t n) {
  struct chunk *k = l->tail;
  if (!k || k->pass_fd >= 0 || k->status || k->cap - k->len < n) {
    k = new_chunk(n > OUT_CHUNK_BYTES ? n : OUT_CHUNK_BYTES);
    append_chunk(l, k);
  }
  uint8_t *p = k->bytes + k->len;
  k->len += n;
  l->bytes += n;
  return p;
}

static void queue_frame(struct link *l, uint8_t type, uint32_t id, uint16_t op, const void *payload, uint32_t len) {
  uint8_t *p = reserve(l, PV_FRAME_HDR + len);
  pv_frame_header_put(p, type, id, op, 0, len);
  if (len) memcpy(p + PV_FRAME_HDR, payload, len);
}

/* A response's header alone: its `len` bytes of answers follow as they are made. */
static void queue_header(struct link *l, uint32_t id, uint16_t op, uint32_t len) {
  pv_frame_header_put(reserve(l, PV_FRAME_HDR), PV_T_RESPONSE, id, op, 0, len);
}

/* Sends what can go of the queue now. -1 if the connection is broken. */
static int flush(struct link *l) {
  while (l->head) {
    struct chunk *k = l->head;
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
      n = sendmsg(l->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    } else {
      n = send(l->fd, k->bytes + k->sent, k->len - k->sent, MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      return -1;
    }
    k->sent += (size_t)n;
    l->bytes -= (size_t)n;
    if (k->sent < k->len) return 0;
    l->head = k->next;
    if (!l->head) l->tail = NULL;
    free_chunk(l, k);
  }
  return 0;
}

static void drop_queue(struct link *l) {
  while (l->head) {
    struct chunk *k = l->head;
    l->head = k->next;
    free_chunk(l, k);
  }
  l->tail = NULL;
  l->bytes = 0;
}

/* Watches for input if `read`, for output while anything waits to go. */
static void watch(struct link *l, void *tag, int read) {
  uint32_t events = (read ? EPOLLIN : 0) | (l->head ? EPOLLOUT : 0);
  if (events == l->events) return;
  struct epoll_event ev = { .events = events, .data.ptr = tag };
  if (epoll_ctl(epfd, EPOLL_CTL_MOD, l->fd, &ev) == 0) l->events = events;
}

/* --- Connections ending. --- */

static void count_connection_end(struct uid_usage *u) {
  connections--;
  u->connections--;
  usage_settle(u);
}

/* The client's state goes; its references become an orphan's while its process runs. */
static void end_client(struct client *c) {
  if (c->prev) c->prev->next = c->next;
  else clients = c->next;
  if (c->next) c->next->prev = c->prev;
  else clients_tail = c->prev;
  orphan_adopt(c->link.usage, c->pid, c->pidfd, c->scope, &c->grants);
  c->pidfd = -1;
  retire(c, &c->tag);
}

/* The peer closed, or the socket broke. */
static void disconnect(struct client *c) {
  epoll_ctl(epfd, EPOLL_CTL_DEL, c->link.fd, NULL);
  close(c->link.fd);
  drop_queue(&c->link);
  struct uid_usage *u = c->link.usage;
  end_client(c);
  count_connection_end(u);
}

static void push_closing(struct closing *g) {
  g->prev = closings_tail;
  if (closings_tail) closings_tail->next = g;
  else closings = g;
  closings_tail = g;
}

static void finish(struct closing *g) {
  epoll_ctl(epfd, EPOLL_CTL_DEL, g->link.fd, NULL);
  close(g->link.fd);
  drop_queue(&g->link);
  if (g->refused) refused_lingering--;
  else count_connection_end(g->link.usage);
  if (g->prev) g->prev->next = g->next;
  else closings = g->next;
  if (g->next) g->next->prev = g->prev;
  else closings_tail = g->prev;
  retire(g, &g->tag);
}

/* Once a closing connection's last bytes are sent: the peer reads them, then the end of the stream. */
static void shut_when_sent(struct closing *g) {
  if (g->link.head || g->shut) return;
  shutdown(g->link.fd, SHUT_WR);
  g->shut = 1;
}

/*
 * Sends an Error frame and disconnects: the client's state goes at once (its references as for any
 * disconnect), its socket once the peer has read the frame and closed, or after CLOSE_GRACE_MS.
 * The connection counts against the caps until then.
 */
static void fail(struct client *c, const char *why) {
  if (c->closing) return;
  c->closing = 1;
  struct closing *g = calloc(1, sizeof *g);
  if (!g) pool_out_of_memory();
  g->tag = TAG_CLOSING;
  g->link = c->link;
  g->close_at = now_ms() + CLOSE_GRACE_MS;
  c->link.head = c->link.tail = NULL;
  c->link.bytes = 0;
  c->link.fd = -1;
  size_t len = strlen(why);
  queue_frame(&g->link, PV_T_ERROR, 0, 0, why, (uint32_t)(len > 512 ? 512 : len));
  push_closing(g);
  end_client(c);
  /* Epoll now reports `g`; the rest goes as the socket takes it. */
  if (flush(&g->link)) return finish(g);
  shut_when_sent(g);
  g->link.events = 0;
  watch(&g->link, g, 1);
}

static void failf(struct client *c, const char *fmt, ...) {
  char why[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  fail(c, why);
}

/* A connection refused at accept: its Error frame goes into the empty socket at once. */
static void refuse(int fd, const char *fmt, ...) {
  char why[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof why) n = sizeof why - 1;
  uint8_t frame[PV_FRAME_HDR + sizeof why];
  pv_frame_header_put(frame, PV_T_ERROR, 0, 0, 0, (uint32_t)n);
  memcpy(frame + PV_FRAME_HDR, why, (size_t)n);
  if (send(fd, frame, PV_FRAME_HDR + (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
    /* The peer is gone already. */
  }
  shutdown(fd, SHUT_WR);
  struct closing *g = refused_lingering < MAX_REFUSED_LINGERING ? calloc(1, sizeof *g) : NULL;
  struct epoll_event ev = { .events = EPOLLIN, .data.ptr = g };
  if (!g || epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev)) {
    close(fd);
    free(g);
    return;
  }
  g->tag = TAG_CLOSING;
  g->link.fd = fd;
  g->link.events = EPOLLIN;
  g->shut = g->refused = 1;
  g->close_at = now_ms() + CLOSE_GRACE_MS;
  push_closing(g);
  refused_lingering++;
}

/* Closes connections whose grace is over: the oldest are first. */
static void close_failed(int64_t now) {
  while (closings && closings->close_at <= now) finish(closings);
}

static void closing_event(struct closing *g, uint32_t events) {
  if ((events & EPOLLOUT) && flush(&g->link)) return finish(g);
  shut_when_sent(g);
  if (events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
    ssize_t n = recv(g->link.fd, receive_buffer, sizeof receive_buffer, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return finish(g);
  }
  watch(&g->link, g, 1);
}

/* --- Accepting. --- */

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
    int allowed = cred.uid == 0 || cred.uid == own_uid;
    if (!allowed && has_group) {
      uint32_t count;
      gid_t *groups = peer_groups(fd, &count);
      allowed = peer_in_group(groups, count, cred.gid, group);
      free(groups);
    }
    if (!allowed) {
      refuse(fd, "uid %u may not use this pool", (unsigned)cred.uid);
      continue;
    }
    if (connections >= max_clients) {
      refuse(fd, "the pool serves %u connections, its most (--max-clients)", max_clients);
      continue;
    }
    struct uid_usage *u = usage_of(cred.uid);
    if (u->connections >= max_clients_per_uid) {
      refuse(fd, "uid %u has %u connections to the pool, its most (--max-clients-per-uid)", (unsigned)cred.uid, u->connections);
      usage_settle(u);
      continue;
    }
    struct client *c = calloc(1, sizeof *c);
    if (!c) pool_out_of_memory();
    c->tag = TAG_CLIENT;
    c->link.fd = fd;
    c->link.events = EPOLLIN;
    c->link.usage = u;
    struct epoll_event ev = { .events = EPOLLIN, .data.ptr = c };
    if (epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev)) {
      close(fd);
      free(c);
      usage_settle(u);
      continue;
    }
    c->id = next_client_id++;
    c->pid = cred.pid;
    c->uid = cred.uid;
    c->gid = cred.gid;
    c->pidfd = peer_pidfd(fd, cred.pid);
    connections++;
    u->connections++;
    c->prev = clients_tail;
    if (clients_tail) clients_tail->next = c;
    else clients = c;
    clients_tail = c;
  }
}

/* --- Requests. --- */

/* Text appended to a growing buffer. */
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

/* Whether the peer of `c` is in group `g` (its primary group, or one of its supplementary ones). */
static int client_in_group(const struct client *c, gid_t g) {
  if (c->gid == g) return 1;
  uint32_t count;
  gid_t *groups = peer_groups(c->link.fd, &count);
  int in = peer_in_group(groups, count, c->gid, g);
  free(groups);
  return in;
}

/* Who asks for the status, and what it may see: root all, others their uid's and groups' scopes. */
struct viewer {
  uid_t uid;
  gid_t gid;
  gid_t *groups;
  uint32_t count;
};

static int sees(const struct viewer *v, const struct pool_scope *s) {
  if (v->uid == 0) return 1;
  uint32_t owner;
  if (pool_scope_owner(s, &owner)) return peer_in_group(v->groups, v->count, v->gid, owner);
  return owner == v->uid;
}

/* A scope as its clients name it. */
static void out_scope(struct text_out *t, const struct pool_scope *s) {
  uint32_t owner;
  if (!pool_scope_owner(s, &owner)) return out_json_string(t, pool_scope_name(s));
  char text[HELLO_MAX_NAME_BYTES + 32];
  snprintf(text, sizeof text, "gid:%u:%s", owner, pool_scope_name(s));
  out_json_string(t, text);
}

/* JSON in the shape of PoolStatus (src/daemon/pool-protocol.ts), of what the asker may see. */
static void status(struct client *c) {
  struct viewer v = { .uid = c->uid, .gid = c->gid };
  if (v.uid != 0) v.groups = peer_groups(c->link.fd, &v.count);
  struct pool_figures f = { 0 };
  if (v.uid == 0) {
    f = pool_figures();
  } else {
    for (uint32_t i = 0; i < pool_scope_count(); i++) {
      const struct pool_scope *s = pool_scope_at(i);
      if (!sees(&v, s)) continue;
      struct pool_figures g = pool_scope_figures(s);
      f.pages_used += g.pages_used;
      f.references += g.references;
      f.candidates += g.candidates;
      f.scopes++;
    }
  }
  uint32_t orphaned = 0;
  for (struct orphan *o = orphans_first(); o; o = o->next)
    if (sees(&v, o->scope)) orphaned++;
  struct text_out t = { 0 };
  out_printf(&t, "{\"pid\":%d,\"poolBytes\":%" PRIu64 ",\"pagesUsed\":%" PRIu64 ",\"orphanedClients\":%u,\"references\":%" PRIu64 ",\"clients\":[", (int)getpid(), pool_page_count() * POOL_PAGE_BYTES, f.pages_used, orphaned, f.references);
  int first = 1;
  for (struct client *k = clients; k; k = k->next) {
    if (!k->scope || !sees(&v, k->scope)) continue;
    out_printf(&t, "%s{\"id\":%u,\"scope\":", first ? "" : ",", k->id);
    out_scope(&t, k->scope);
    out_printf(&t, ",\"name\":");
    out_json_string(&t, k->name);
    out_printf(&t, ",\"pid\":%d,\"uid\":%u,\"references\":%" PRIu64 "}", (int)k->pid, (unsigned)k->uid, k->grants.total);
    first = 0;
  }
  out_printf(&t, "],\"scopes\":%" PRIu64 ",\"candidates\":%" PRIu64 ",\"pssBytes\":%" PRIu64 "}", f.scopes, f.candidates, own_pss_bytes());
  free(v.groups);
  if (t.failed || t.len > PV_FRAME_MAX_PAYLOAD) {
    free(t.p);
    return fail(c, t.failed ? "out of memory for the status" : "the status does not fit in a frame");
  }
  size_t len = PV_FRAME_HDR + t.len;
  struct uid_usage *u = c->link.usage;
  if (u->status_bytes + len > STATUS_UNREAD_PER_UID || status_unread + len > STATUS_UNREAD_BYTES) {
    free(t.p);
    return failf(c, "uid %u leaves %" PRIu64 " bytes of Status answers unread (the daemon %" PRIu64 "): no more", (unsigned)c->uid, u->status_bytes, status_unread);
  }
  struct chunk *k = new_chunk(len);
  pv_frame_header_put(k->bytes, PV_T_RESPONSE, c->request_id, OP_STATUS, 0, (uint32_t)t.len);
  memcpy(k->bytes + PV_FRAME_HDR, t.p, t.len);
  free(t.p);
  k->len = len;
  k->status = 1;
  u->status_bytes += len;
  status_unread += len;
  append_chunk(&c->link, k);
}

static void hello(struct client *c) {
  char why[600], scope[HELLO_MAX_NAME_BYTES + 1];
  if (hello_parse(c->part, c->payload_len, scope, c->name, why, sizeof why)) return fail(c, why);
  int is_group;
  uint32_t gid;
  const char *name;
  if (hello_scope(scope, &is_group, &gid, &name, why, sizeof why)) return fail(c, why);
  if (is_group && c->uid != 0 && !client_in_group(c, gid)) return failf(c, "scope %s: uid %u is not in group %u", scope, (unsigned)c->uid, gid);
  if (c->link.usage->orphans >= max_clients_per_uid)
    return failf(c, "uid %u keeps the references of %u disconnected clients whose processes run on, its most (--max-clients-per-uid)", (unsigned)c->uid, c->link.usage->orphans);
  const char *no_scope = NULL;
  struct pool_scope *s = pool_scope(is_group, is_group ? gid : (uint32_t)c->uid, name, &no_scope);
  if (!s) return fail(c, no_scope);
  c->scope = s;
  char welcome[128];
  int n = snprintf(welcome, sizeof welcome, "{\"version\":%d,\"poolBytes\":%" PRIu64 ",\"clientId\":%u}", POOL_PROTOCOL_VERSION, pool_page_count() * POOL_PAGE_BYTES, c->id);
  struct chunk *k = new_chunk(PV_FRAME_HDR + (size_t)n);
  pv_frame_header_put(k->bytes, PV_T_RESPONSE, c->request_id, OP_HELLO, 0, (uint32_t)n);
  memcpy(k->bytes + PV_FRAME_HDR, welcome, (size_t)n);
  k->len = PV_FRAME_HDR + (size_t)n;
  /* The descriptor goes with the answer's first byte. */
  k->pass_fd = pool_scope_client_fd(s);
  append_chunk(&c->link, k);
}

static void offer_entry(struct client *c, const uint8_t *p) {
  uint32_t page = pv_rd32(p);
  uint64_t key = (uint64_t)pv_rd32(p + 4) | (uint64_t)pv_rd32(p + 8) << 32;
  int64_t pooled = pool_lookup(c->scope, key);
  uint32_t a;
  if (pooled >= 0 && pool_hold(c->scope, (uint32_t)pooled) == 0) {
    grant_add(&c->grants, (uint32_t)pooled, 1);
    a = (uint32_t)pooled;
  } else {
    a = pool_offered(c->scope, key, c->id) ? ANSWER_SEND : ANSWER_NONE;
  }
  uint8_t *out = reserve(&c->link, ANSWER_BYTES);
  pv_wr32(out, page);
  pv_wr32(out + 4, a);
}

static void put_page(struct client *c, const uint8_t *data) {
  uint64_t key;
  /* The key is the daemon's own: a client cannot file a page under another content's key. */
  pv_page_hashes(data, 1, &key);
  int64_t pooled = pool_put(c->scope, key, data);
  if (pooled >= 0) grant_add(&c->grants, (uint32_t)pooled, 1);
  uint8_t *out = reserve(&c->link, ANSWER_BYTES);
  pv_wr32(out, pv_rd32(c->part + 4 + 4 * c->index));
  pv_wr32(out + 4, pooled >= 0 ? (uint32_t)pooled : ANSWER_FULL);
  c->index++;
}

static void settle_drop(struct client *c, uint32_t page) {
  if (!grant_count(&c->grants, page)) return failf(c, "Settle drops pool page %u, which the client does not hold", page);
  grant_drop(&c->grants, page);
  pool_release(c->scope, page, 1);
}

/* A frame's header is in: checks it, and readies the op for its payload. */
static void start_frame(struct client *c) {
  const uint8_t *h = c->header;
  struct pv_frame f;
  switch (pv_frame_header_get(h, &f)) {
    case PV_FRAME_OK: break;
    case PV_FRAME_BAD_MAGIC: return fail(c, "bad frame magic");
    case PV_FRAME_BAD_VERSION: return failf(c, "unsupported frame version %u (this daemon reads version %u)", h[2], PV_FRAME_VERSION);
    case PV_FRAME_TOO_LONG: return failf(c, "payload length %u exceeds %u", pv_rd32(h + 12), PV_FRAME_MAX_PAYLOAD);
  }
  if (f.type != PV_T_REQUEST) return failf(c, "a frame of type %u, not a request", f.type);
  uint32_t len = f.len;
  c->op = f.op;
  c->request_id = f.id;
  c->payload_len = len;
  c->payload_done = c->part_fill = c->phase = c->index = 0;
  switch (c->op) {
    case OP_STATUS:
      c->part_want = 0;
      break;
    case OP_HELLO:
      if (c->scope) return fail(c, "a second Hello");
      if (len > HELLO_MAX_BYTES) return failf(c, "Hello: %u bytes, at most %u", len, HELLO_MAX_BYTES);
      c->part_want = len;
      break;
    default:
      if (!c->scope) return failf(c, "op %u before Hello", c->op);
      switch (c->op) {
        case OP_OFFER:
          if (len % OFFER_ENTRY_BYTES || len / OFFER_ENTRY_BYTES > MAX_OFFER_ENTRIES) return failf(c, "an Offer of %u bytes", len);
          queue_header(&c->link, c->request_id, OP_OFFER, len / OFFER_ENTRY_BYTES * ANSWER_BYTES);
          c->part_want = OFFER_ENTRY_BYTES;
          break;
        case OP_PUT:
          if (len < 4) return failf(c, "a Put of %u bytes", len);
          c->part_want = 4;
          break;
        case OP_SETTLE:
          if (len < 4 || len % 4 || (len - 4) / 4 > MAX_SETTLE_PAGES) return failf(c, "a Settle of %u bytes", len);
          c->part_want = 4;
          break;
        default:
          return failf(c, "unknown op %u", c->op);
      }
  }
  c->in_payload = 1;
}

/* An element of the payload is whole in `part`. */
static void element(struct client *c) {
  switch (c->op) {
    case OP_OFFER:
      offer_entry(c, c->part);
      c->part_fill = 0;
      return;
    case OP_PUT:
      if (c->phase == 0) {
        c->count = pv_rd32(c->part);
        if (c->count < 1 || c->count > MAX_PUT_PAGES || c->payload_len != 4 + c->count * (4 + POOL_PAGE_BYTES)) return failf(c, "a Put of %u bytes", c->payload_len);
        queue_header(&c->link, c->request_id, OP_PUT, c->count * ANSWER_BYTES);
        c->phase = 1;
        c->part_want = 4 + 4 * c->count;
      } else {
        if (c->phase == 2) put_page(c, c->part + PUT_PAGE_AT);
        c->phase = 2;
        c->part_fill = PUT_PAGE_AT;
        c->part_want = PUT_PAGE_AT + POOL_PAGE_BYTES;
      }
      return;
    case OP_SETTLE:
      if (c->phase == 0) {
        c->keep = pv_rd32(c->part);
        uint32_t total = (c->payload_len - 4) / 4;
        if (c->keep > total) return failf(c, "a Settle keeping %u of %u pages", c->keep, total);
        c->phase = 1;
      } else {
        /* The kept pages need nothing: the client holds them already. */
        if (c->index >= c->keep) settle_drop(c, pv_rd32(c->part));
        c->index++;
      }
      c->part_fill = 0;
      return;
    default:
      return;
  }
}

static void end_frame(struct client *c) {
  c->in_payload = 0;
  c->header_fill = 0;
  switch (c->op) {
    case OP_HELLO:
      return hello(c);
    case OP_STATUS:
      return status(c);
    case OP_SETTLE:
      return queue_header(&c->link, c->request_id, OP_SETTLE, 0);
    default:
      /* Offer and Put answered entry by entry. */
      return;
  }
}

/* Takes what came of the frame; handles each element as it completes. Stops at a failure. */
static void feed(struct client *c, const uint8_t *b, size_t n) {
  while (n > 0 && !c->closing) {
    if (!c->in_payload) {
      size_t take = PV_FRAME_HDR - c->header_fill;
      if (take > n) take = n;
      memcpy(c->header + c->header_fill, b, take);
      c->header_fill += (uint32_t)take;
      b += take;
      n -= take;
      if (c->header_fill < PV_FRAME_HDR) return;
      start_frame(c);
      if (!c->closing && c->payload_len == 0) end_frame(c);
      continue;
    }
    size_t take = c->payload_len - c->payload_done;
    if (take > n) take = n;
    if (c->op == OP_STATUS) {
      /* A Status's payload means nothing. */
    } else if (c->op == OP_PUT && c->phase == 2 && c->part_fill == PUT_PAGE_AT && take >= POOL_PAGE_BYTES) {
      /* A whole page came: straight from the receive buffer. */
      take = POOL_PAGE_BYTES;
      put_page(c, b);
    } else {
      if (take > c->part_want - c->part_fill) take = c->part_want - c->part_fill;
      memcpy(c->part + c->part_fill, b, take);
      c->part_fill += (uint32_t)take;
      if (c->part_fill == c->part_want) element(c);
    }
    b += take;
    n -= take;
    c->payload_done += (uint32_t)take;
    if (!c->closing && c->payload_done == c->payload_len) end_frame(c);
  }
}

/*
 * Reads what the client sent, a frame's header or at most RECV_BYTES of its payload at a time,
 * while every answer so far has gone into the socket: a client that does not read its answers is
 * not read either. At most READS_PER_EVENT reads, then the other clients' turn. 0, or -1 if the
 * client is gone (disconnected or failed).
 */
static int read_requests(struct client *c) {
  for (int reads = 0; reads < READS_PER_EVENT; reads++) {
    size_t want = c->in_payload ? c->payload_len - c->payload_done : PV_FRAME_HDR - c->header_fill;
    if (want > RECV_BYTES) want = RECV_BYTES;
    ssize_t n = recv(c->link.fd, receive_buffer, want, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    if (n <= 0) {
      disconnect(c);
      return -1;
    }
    feed(c, receive_buffer, (size_t)n);
    if (c->closing) return -1;
    if (flush(&c->link)) {
      disconnect(c);
      return -1;
    }
    if (c->link.head || (size_t)n < want) return 0;
  }
  return 0;
}

static void client_event(struct client *c, uint32_t events) {
  if ((events & (EPOLLOUT | EPOLLHUP | EPOLLERR)) && c->link.head && flush(&c->link)) return disconnect(c);
  if (!c->link.head && read_requests(c)) return;
  watch(&c->link, c, !c->link.head);
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

/*
 * Descriptors: two per connection (its socket and its process's pidfd), one per orphan, two per
 * scope. The soft limit is often 1024; the hard one is the administrator's bound.
 */
static void raise_descriptor_limit(void) {
  struct rlimit r;
  if (getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
    r.rlim_cur = r.rlim_max;
    setrlimit(RLIMIT_NOFILE, &r);
  }
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
  uint64_t pool_bytes, gid = 0, clients_max, per_uid_max;
  if (argc < 5 || argc > 6 || parse_u64(argv[2], &pool_bytes) || pool_bytes < POOL_PAGE_BYTES || pool_bytes > (1ull << 44) || parse_u64(argv[3], &clients_max) || clients_max < 1 ||
      clients_max > 65536 || parse_u64(argv[4], &per_uid_max) || per_uid_max < 1 || per_uid_max > clients_max || (argc == 6 && (parse_u64(argv[5], &gid) || gid >= 0xffffffffull))) {
    fprintf(stderr,
            "usage: pvisor-pool-daemon SOCKET POOL_BYTES MAX_CLIENTS MAX_CLIENTS_PER_UID [GID]\n"
            "  POOL_BYTES from 4096 to 2^44, MAX_CLIENTS from 1 to 65536, MAX_CLIENTS_PER_UID from 1 to MAX_CLIENTS;\n"
            "  run by pvisor-daemon serve --memory-pool\n");
    return 2;
  }
  socket_path = argv[1];
  max_clients = (uint32_t)clients_max;
  max_clients_per_uid = (uint32_t)per_uid_max;
  has_group = argc == 6;
  group = (gid_t)gid;
  own_uid = getuid();
  take_signals();
  raise_descriptor_limit();
  /* Fixed thresholds: answers of hundreds of KiB are mapped and unmapped, not kept in a heap that grew. */
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  mallopt(M_TRIM_THRESHOLD, 128 * 1024);
  pool_init(pool_bytes);
  epfd = epoll_create1(EPOLL_CLOEXEC);
  if (epfd < 0) die(125, "epoll_create1: %s", strerror(errno));
  orphans_init(epfd, TAG_ORPHAN, TAG_DEAD);
  listen_on(socket_path);
  spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  struct epoll_event ev = { .events = EPOLLIN, .data.ptr = &listen_tag };
  if (epoll_ctl(epfd, EPOLL_CTL_ADD, listen_fd, &ev)) die(125, "epoll_ctl: %s", strerror(errno));
  ev.data.ptr = &signal_tag;
  if (epoll_ctl(epfd, EPOLL_CTL_ADD, signal_fd, &ev)) die(125, "epoll_ctl: %s", strerror(errno));
  fprintf(stderr, "pvisor-daemon: page pool of up to %" PRIu64 " bytes on %s (pid %d)\n", pool_bytes, socket_path, (int)getpid());

  int64_t next_trim = now_ms() + TRIM_MS;
  for (int running = 1; running;) {
    int64_t now = now_ms(), wake = next_trim;
    if (closings && closings->close_at < wake) wake = closings->close_at;
    struct epoll_event events[64];
    int n = epoll_wait(epfd, events, 64, wake > now ? (int)(wake - now) : 0);
    if (n < 0 && errno != EINTR) die(125, "epoll_wait: %s", strerror(errno));
    for (int i = 0; i < n; i++) {
      void *tag = events[i].data.ptr;
      switch (*(int *)tag) {
        case TAG_LISTEN: accept_clients(); break;
        case TAG_SIGNAL: running = 0; break;
        case TAG_CLIENT: client_event(tag, events[i].events); break;
        case TAG_CLOSING: closing_event(tag, events[i].events); break;
        case TAG_ORPHAN: orphan_ended(tag); break;
        default: break;
      }
    }
    free_retired();
    now = now_ms();
    close_failed(now);
    if (now >= next_trim) {
      /* What the bookkeeping freed goes back too. */
      malloc_trim(0);
      next_trim = now + TRIM_MS;
    }
    free_retired();
  }

  /* Ends every connection and frees the pool; the VMs keep the pages they map. */
  struct stat st;
  if (stat(socket_path, &st) == 0 && st.st_dev == socket_dev && st.st_ino == socket_ino) unlink(socket_path);
  close(listen_fd);
  for (struct client *c = clients; c; c = c->next) close(c->link.fd);
  for (struct closing *g = closings; g; g = g->next) close(g->link.fd);
  pool_close();
  return 0;
}
