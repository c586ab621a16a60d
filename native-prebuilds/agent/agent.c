/*
 * pvisor's Linux guest agent: /init (PID 1) of the shipped initramfs.
 *
 * It prepares the minimal userspace (mounts, hostname), opens the agent channel (the virtio
 * console /dev/hvc0, a tty put in raw mode), announces itself with the HELLO event and then
 * serves agent protocol v1 (docs/probe-guest.md for framing, docs/agent-protocol.md for the
 * Linux ops) from one poll() loop: processes with streamed stdout/stderr and stdin, signals,
 * terminals, files, memory figures; processes and file ops as a user of the guest's /etc/passwd
 * (agent-users.h) when a request says so.
 *
 * A VM restored from a snapshot wakes up inside that same loop: the host's first request is then
 * RESTORED, which reseeds the kernel's RNG with the host's entropy and sets the wall clock (every
 * clone of one snapshot would otherwise go on with the same random state and the snapshot's
 * time), and detaches what was in flight at the snapshot (its host end is in the snapshotted VM).
 *
 * Output flows under stream credit: each stream (a child's stdout, its stderr, a file being read,
 * a directory being listed) sends at most the credit the host has given it (PV_STREAM_WINDOW at
 * first, more with each CREDIT frame as the host's consumer reads), and is not read while it has
 * none, so a stream nobody reads makes only its own writer block in write(); every other stream
 * and answer goes on.
 *
 * Memory is bounded on every path: the agent stops reading the channel while its output queue
 * holds more than OUT_STOP_INPUT bytes, and stops reading children's pipes and files while it
 * holds more than OUT_STOP_STREAMS, so a host that does not take the channel makes children block
 * in write(), never makes the agent grow.
 *
 * PID 1 must never exit (the kernel would panic): on a fatal error the agent reboots, which
 * with the kernel's reboot=t / panic=-1 ends the VM where the VMM sees it.
 *
 * Not PID 1 (for debugging on a host): `agent CHANNEL` serves CHANNEL (a tty or pty) and skips
 * the system setup (mounts, rootfs, network: agent-net.h); `agent --fd N` serves the open file
 * descriptor N (a socketpair end a test on the host passes: test/unit/agent-credit.test.ts). As PID 1, `pvisor.channel=PATH` on the
 * kernel command line picks another channel than /dev/hvc0 (a virtio-serial port such as
 * /dev/vport0p1, which is not a tty).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/random.h>
#include <sys/ioctl.h>
#include <sys/fsuid.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "agent-frames.h"
#include "agent-users.h"
#include "../linux-guest/workset.h"

/* ---- protocol constants (docs/probe-guest.md, docs/agent-protocol.md) ---- */
#define HDR PV_FRAME_HDR
#define MAX_PAYLOAD PV_FRAME_MAX_PAYLOAD
#define CHUNK_MAX (64u << 10) /* stream chunks carry at most 64 KiB */

enum { T_REQUEST = PV_T_REQUEST, T_RESPONSE = PV_T_RESPONSE, T_CHUNK = PV_T_CHUNK, T_ERROR = PV_T_ERROR, T_EVENT = PV_T_EVENT, T_CREDIT = PV_T_CREDIT };
enum {
  OP_HELLO = 0x0001,
  OP_PING = 0x0002,
  OP_CREDIT = PV_OP_CREDIT,
  OP_EXEC = 0x0201,
  OP_STDIN_WRITE = 0x0202,
  OP_STDIN_CLOSE = 0x0203,
  OP_KILL = 0x0204,
  OP_RESIZE = 0x0205,
  OP_FILE_READ = 0x0210,
  OP_FILE_WRITE = 0x0211,
  OP_FILE_LIST = 0x0212,
  OP_FILE_STAT = 0x0213,
  OP_FILE_MKDIR = 0x0214,
  OP_FILE_REMOVE = 0x0215,
  OP_FILE_RENAME = 0x0216,
  OP_FILE_WRITE_OPEN = 0x0217,
  OP_FILE_WRITE_DATA = 0x0218,
  OP_FILE_WRITE_CLOSE = 0x0219,
  OP_FILE_CANCEL = 0x021a,
  OP_MEMINFO = 0x0220,
  OP_DROP_CACHES = 0x0221,
  OP_SHUTDOWN = 0x0230,
  OP_RESTORED = 0x0231,
  OP_NET_CONFIGURE = 0x0232,
};
enum { E_UNSUPPORTED = 1, E_BADARG = 2, E_BADFRAME = 5, E_OS = 6, E_NOPROC = 7, E_BUSY = 8, E_RESTORED = 9, E_CANCELLED = 10, E_NOUSER = 11 };
enum { CH_STDOUT = 1, CH_STDERR = 2, CH_STARTED = 4 };
enum { EXEC_STDIN = 1, EXEC_PTY = 2, EXEC_FLAGS = EXEC_STDIN | EXEC_PTY };
/* A request frame's flags: bit 0, its payload starts with `str user` (docs/agent-protocol.md, "Users"). */
enum { REQ_AS_USER = 1 };
/* HELLO's features word: what this agent does beyond protocol v1's first ops. */
#define PV_FEATURE_USERS 2u /* REQ_AS_USER on EXEC and the file ops */
#define PV_FEATURE_PTY 4u   /* EXEC_PTY and RESIZE */
enum { FW_APPEND = 1, FW_MKDIRS = 2 };

#define GUEST_KIND_LINUX 2
#define MAX_PROCS 1024

/* RESTORED: host entropy per request, and the earliest wall clock taken (2020-01-01T00:00:00Z). */
#define RESTORED_MIN_ENTROPY 32
#define RESTORED_MAX_ENTROPY 512
#define RESTORED_MIN_REALTIME_NS (1577836800ull * 1000000000ull)

/* A FILE_LIST chunk goes only with room for the longest entry: a shorter credit waits for more. */
#define LIST_MIN_CREDIT (PV_ENTRY_HDR + 255u)

/* Output queue thresholds (see the header comment). */
#define OUT_STOP_STREAMS (256u << 10)
#define OUT_STOP_INPUT (2u << 20)

/* ---- small helpers ---- */
static void logmsg(const char *fmt, ...) {
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n > sizeof line - 2) n = sizeof line - 2;
  line[n++] = '\n';
  ssize_t ignored = write(2, "pvisor-agent: ", 14);
  ignored = write(2, line, (size_t)n);
  (void)ignored;
}

/* a writable rootfs is mounted on /: SHUTDOWN remounts it read-only first */
static int in_rootfs;
static int is_init;

/* PID 1 may not exit: reboot instead, so the VMM sees the VM end. */
static void __attribute__((noreturn)) die(const char *what) {
  logmsg("fatal: %s: %s", what, strerror(errno));
  if (is_init) {
    tcdrain(2); /* the console (8250) sends from a buffer: let the reason out before the VM ends */
    sync();
    reboot(RB_AUTOBOOT);
    for (;;) pause();
  }
  exit(1);
}

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) die("malloc");
  return p;
}

static void set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) die("fcntl O_NONBLOCK");
}

/* A byte queue: data lives at p[head, head+len). */
struct buf {
  uint8_t *p;
  size_t head, len, cap;
};

static uint8_t *buf_reserve(struct buf *b, size_t n) {
  if (b->head + b->len + n > b->cap) {
    if (b->head) {
      memmove(b->p, b->p + b->head, b->len);
      b->head = 0;
    }
    if (b->len + n > b->cap) {
      size_t cap = b->cap ? b->cap : 65536;
      while (cap < b->len + n) cap *= 2;
      uint8_t *p = realloc(b->p, cap);
      if (!p) die("realloc");
      b->p = p;
      b->cap = cap;
    }
  }
  return b->p + b->head + b->len;
}

static void buf_consume(struct buf *b, size_t n) {
  b->head += n;
  b->len -= n;
  if (!b->len) b->head = 0;
}

/* ---- the channel ---- */
static int chan = -1;
static struct buf out, in;

/* Queues one frame; the payload is the concatenation of two parts (either may be empty). */
static void send_frame(int type, uint32_t id, uint16_t op, uint16_t flags, const void *a, size_t alen, const void *b, size_t blen) {
  size_t plen = alen + blen;
  uint8_t *h = buf_reserve(&out, HDR + plen);
  pv_frame_header_put(h, (uint8_t)type, id, op, flags, (uint32_t)plen);
  if (alen) memcpy(h + HDR, a, alen);
  if (blen) memcpy(h + HDR + alen, b, blen);
  out.len += HDR + plen;
}

/* Stream chunks are read straight into the output queue: chunk_space() reserves room for a
 * header and CHUNK_MAX bytes, chunk_commit() writes the header once the length is known. */
static uint8_t *chunk_space(void) { return buf_reserve(&out, HDR + CHUNK_MAX) + HDR; }

static void chunk_commit(uint32_t id, uint16_t op, uint16_t flags, size_t n) {
  pv_frame_header_put(out.p + out.head + out.len, T_CHUNK, id, op, flags, (uint32_t)n);
  out.len += HDR + n;
}

static void respond(uint32_t id, uint16_t op, const void *p, size_t n) { send_frame(T_RESPONSE, id, op, 0, p, n, NULL, 0); }

static void send_error(uint32_t id, uint16_t op, uint32_t code, const char *fmt, ...) {
  char text[600];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  if ((size_t)n >= sizeof text) n = sizeof text - 1;
  uint8_t c[4];
  pv_wr32(c, code);
  send_frame(T_ERROR, id, op, 0, c, 4, text, (size_t)n);
}

/* An OS error: code 6, text "ENAME: description: context" so the host can map the name. */
static void send_os_error(uint32_t id, uint16_t op, int err, const char *context) {
  const char *name = strerrorname_np(err);
  send_error(id, op, E_OS, "%s: %s: %s", name ? name : "E?", strerror(err), context);
}

static void flush_out(void) {
  while (out.len) {
    ssize_t n = write(chan, out.p + out.head, out.len);
    if (n > 0) {
      buf_consume(&out, (size_t)n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    die("write to the agent channel");
  }
}

/* ---- processes ---- */
struct proc {
  uint32_t id; /* the EXEC request id: the process handle */
  pid_t pid;
  int in_fd, out_fd, err_fd;
  int reaped, status;
  /* one STDIN_WRITE at a time: its data and request id */
  uint8_t *wdata;
  size_t wlen, woff;
  uint32_t wreq;
  int wpending;
  uint32_t close_req; /* a STDIN_CLOSE waiting for the pending write */
  int close_pending;
  int detached; /* started before a restore: its output is drained and dropped */
  int pty;      /* runs on a terminal: out_fd is its master (in_fd a dup of it), err_fd is -1 */
  uint32_t credit[2]; /* stdout, stderr: bytes they may still send (stream credit) */
  struct proc *next;
};
static struct proc *procs;
static int nprocs;

static struct proc *find_proc(uint32_t id) {
  for (struct proc *p = procs; p; p = p->next)
    if (p->id == id) return p;
  return NULL;
}

static void close_fd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

/* The environment every child starts from; EXEC's entries override or extend it. */
static const char *const base_env[] = {
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/root",
    NULL,
};

/* Copies a u32-length-prefixed string out (pv_take_str); NULL when it overruns the payload or
 * holds a NUL. */
static char *take_str(const uint8_t **p, const uint8_t *end) {
  const uint8_t *s;
  uint32_t n;
  if (!pv_take_str(p, end, &s, &n)) return NULL;
  char *r = xmalloc((size_t)n + 1);
  memcpy(r, s, n);
  r[n] = 0;
  return r;
}

static void free_strv(char **v) {
  if (!v) return;
  for (char **q = v; *q; q++) free(*q);
  free(v);
}

/* ---- users (docs/agent-protocol.md, "Users") ---- */
/* The user a request runs as, resolved from its spec before its op runs. */
struct cred {
  uid_t uid;
  gid_t gid;
  int ngroups;
  gid_t groups[PV_MAX_GROUPS];
  char home[PV_HOME_MAX];
  char name[PV_USER_SPEC_MAX + 1]; /* empty for "uid:gid" */
};
/* The user of the EXEC being served (NULL: the agent's own, root). */
static const struct cred *req_cred;
/* Where passwd and group are read: /etc, or $PVISOR_AGENT_ETC for an agent a test runs on a host. */
static const char *etc_dir = "/etc";
/* The agent's own supplementary groups, given back after a file op run as a user. */
static gid_t own_groups[256];
static int own_ngroups;

/* All of etc_dir/name in a NUL-terminated buffer of *len bytes (the caller frees it); NULL with
 * errno set, E2BIG for a file over PV_ETC_FILE_MAX (not read further: the guest's, untrusted).
 * The buffer starts at the file's size, so the usual few hundred bytes cost no more. */
static char *read_etc(const char *name, size_t *len) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", etc_dir, name);
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return NULL;
  struct stat st;
  size_t cap = !fstat(fd, &st) && st.st_size >= 0 && (uint64_t)st.st_size < PV_ETC_FILE_MAX ? (size_t)st.st_size + 1 : PV_ETC_FILE_MAX + 1;
  char *buf = xmalloc(cap + 1);
  size_t got = 0;
  for (;;) {
    if (got == cap && cap <= PV_ETC_FILE_MAX) { /* it grew since fstat: take more, up to the bound */
      cap = cap * 2 > PV_ETC_FILE_MAX + 1 ? PV_ETC_FILE_MAX + 1 : cap * 2;
      char *more = realloc(buf, cap + 1);
      if (!more) die("realloc");
      buf = more;
    }
    if (got == cap) break;
    ssize_t r = read(fd, buf + got, cap - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int e = errno;
      close(fd);
      free(buf);
      errno = e;
      return NULL;
    }
    if (r == 0) break;
    got += (size_t)r;
  }
  close(fd);
  if (got > PV_ETC_FILE_MAX) {
    free(buf);
    errno = E2BIG;
    return NULL;
  }
  buf[got] = 0;
  *len = got;
  return buf;
}

/* Resolves the user spec of `n` bytes at `spec` into *c: 1, or 0 after answering the request
 * (error 2: a malformed spec or entry; 11: no such user; 6: passwd or group unreadable). */
static int resolve_user(uint32_t id, uint16_t op, const char *spec, size_t n, struct cred *c) {
  uint32_t uid, gid;
  char shown[PV_USER_SPEC_MAX + 1];
  memcpy(shown, spec, n);
  shown[n] = 0;
  enum pv_user_kind kind = pv_user_spec(spec, n, &uid, &gid);
  if (kind == PV_USER_BAD) return send_error(id, op, E_BADARG, "user %s is neither a user name nor uid:gid", shown), 0;
  memset(c, 0, sizeof *c);
  if (kind == PV_USER_IDS) {
    c->uid = uid;
    c->gid = gid;
    c->groups[0] = gid;
    c->ngroups = 1;
    strcpy(c->home, "/");
    return 1;
  }
  size_t len;
  char *pw = read_etc("passwd", &len);
  if (!pw) {
    if (errno == ENOENT) return send_error(id, op, E_NOUSER, "unknown user %s (the guest has no /etc/passwd)", shown), 0;
    return send_os_error(id, op, errno, "/etc/passwd"), 0;
  }
  int found = pv_passwd_find(pw, len, spec, n, &uid, &gid, c->home);
  free(pw);
  if (found == 0) return send_error(id, op, E_NOUSER, "unknown user %s (not in /etc/passwd)", shown), 0;
  if (found < 0) return send_error(id, op, E_BADARG, "the /etc/passwd entry of user %s is malformed", shown), 0;
  uint32_t groups[PV_MAX_GROUPS];
  int ng = 1;
  groups[0] = gid;
  char *gr = read_etc("group", &len);
  if (gr) {
    ng = pv_group_list(gr, len, spec, n, gid, groups);
    free(gr);
    if (ng < 0) return send_error(id, op, E_BADARG, "an /etc/group entry naming user %s is malformed, or it is in more than %d groups", shown, PV_MAX_GROUPS), 0;
  } else if (errno != ENOENT) return send_os_error(id, op, errno, "/etc/group"), 0;
  c->uid = uid;
  c->gid = gid;
  c->ngroups = ng;
  for (int i = 0; i < ng; i++) c->groups[i] = groups[i];
  memcpy(c->name, spec, n);
  return 1;
}

/* Gives the agent back its own file credentials; it cannot go on as another user's. */
static void own_fs_creds(int groups_changed) {
  setfsuid(geteuid());
  setfsgid(getegid());
  if ((uid_t)setfsuid((uid_t)-1) != geteuid() || (gid_t)setfsgid((gid_t)-1) != getegid()) die("setfsuid back to the agent's own");
  if (groups_changed && setgroups((size_t)own_ngroups, own_groups)) die("setgroups back to the agent's own");
}

/* Takes on c's file credentials (groups, fsgid, fsuid) for a file op, so the kernel checks every
 * path as that user's and what the op creates is that user's: 0, or -1 with errno set (nothing
 * changed; EPERM for an agent that may not, as one run on a host by a non-root user). */
static int become_fs(const struct cred *c) {
  if (setgroups((size_t)c->ngroups, c->groups)) return -1;
  setfsgid(c->gid);
  setfsuid(c->uid);
  if ((uid_t)setfsuid((uid_t)-1) != c->uid || (gid_t)setfsgid((gid_t)-1) != c->gid) {
    own_fs_creds(1);
    errno = EPERM;
    return -1;
  }
  return 0;
}

/* Builds the child's environment: base_env, then the user's HOME, USER and LOGNAME (a command run
 * as a user), then each KEY=VALUE of the request, each replacing a same-named entry. */
static char **make_env(char **req, uint32_t n, const struct cred *c) {
  size_t nbase = sizeof base_env / sizeof *base_env - 1;
  char *user[3] = {NULL, NULL, NULL};
  uint32_t nuser = 0;
  if (c) {
    if (asprintf(&user[nuser++], "HOME=%s", c->home) < 0) die("asprintf");
    if (c->name[0] && asprintf(&user[nuser++], "USER=%s", c->name) < 0) die("asprintf");
    if (c->name[0] && asprintf(&user[nuser++], "LOGNAME=%s", c->name) < 0) die("asprintf");
  }
  char **env = xmalloc((nbase + nuser + n + 1) * sizeof *env);
  size_t cnt = 0;
  for (size_t i = 0; i < nbase; i++) env[cnt++] = strdup(base_env[i]);
  for (uint32_t i = 0; i < nuser + n; i++) {
    char *entry = i < nuser ? user[i] : req[i - nuser];
    size_t klen = (size_t)(strchr(entry, '=') - entry) + 1;
    size_t j;
    for (j = 0; j < cnt; j++)
      if (!strncmp(env[j], entry, klen)) break;
    if (j < cnt) free(env[j]);
    else cnt++;
    env[j] = strdup(entry);
  }
  for (uint32_t i = 0; i < nuser; i++) free(user[i]);
  env[cnt] = NULL;
  for (size_t i = 0; i < cnt; i++)
    if (!env[i]) die("strdup");
  return env;
}

extern char **environ;

/*
 * A terminal of cols x rows for a child: *master (the agent's end, which its output is read
 * from), *input (a dup of it, which its input is written to and STDIN_CLOSE closes) and *slave
 * (the child's), all close-on-exec; the slave is given to the user the child runs as, as login(1)
 * does. 0, or -1 with errno set (EMFILE included: nothing here may end the agent) and nothing
 * left open.
 */
static int open_pty(int *master, int *input, int *slave, uint16_t cols, uint16_t rows, const struct cred *c) {
  char name[64];
  struct winsize ws = {.ws_row = rows, .ws_col = cols};
  *slave = *input = -1;
  *master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (*master < 0) return -1;
  if (grantpt(*master) || unlockpt(*master) || ptsname_r(*master, name, sizeof name) || (*slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0 ||
      ioctl(*master, TIOCSWINSZ, &ws) || (c && fchown(*slave, c->uid, (gid_t)-1)) || (*input = fcntl(*master, F_DUPFD_CLOEXEC, 0)) < 0) {
    int e = errno;
    close_fd(master);
    close_fd(input);
    close_fd(slave);
    errno = e;
    return -1;
  }
  return 0;
}

/*
 * EXEC {u32 flags, u32 argc, u32 envc, u32 terminal, str cwd, str argv[argc], str env[envc]}
 * (str = u32 length + bytes). flags: EXEC_STDIN (stdin a pipe the host writes), EXEC_PTY (stdin,
 * stdout and stderr a new terminal of `terminal` = cols | rows << 16, its controlling one; without
 * it `terminal` is 0). Forks, and reports exec failure synchronously through a close-on-exec pipe
 * (as posix_spawn does), so a missing program is an error frame, not an exit. As a user
 * (req_cred): groups, gid, then uid are set in the child before its cwd and its exec, so both are
 * that user's to reach.
 */
static void op_exec(uint32_t id, const uint8_t *p, size_t n) {
  const uint8_t *end = p + n;
  if (n < 16) return send_error(id, OP_EXEC, E_BADARG, "EXEC payload shorter than 16 bytes");
  uint32_t flags, argc, envc;
  /* every string costs at least its 4-byte length: bounds both counts by the payload */
  if (!pv_exec_counts_fit(p, n, &flags, &argc, &envc)) return send_error(id, OP_EXEC, E_BADARG, argc == 0 ? "EXEC needs argv[0]" : "EXEC counts exceed the payload");
  uint32_t terminal = pv_rd32(p + 12);
  int pty = (flags & EXEC_PTY) != 0;
  uint16_t cols = (uint16_t)terminal, rows = (uint16_t)(terminal >> 16);
  if (flags & ~(uint32_t)EXEC_FLAGS) return send_error(id, OP_EXEC, E_BADARG, "unknown EXEC flags 0x%x", flags);
  if (pty ? !cols || !rows : terminal != 0) return send_error(id, OP_EXEC, E_BADARG, pty ? "EXEC terminal of %u x %u: both must be 1 or more" : "EXEC terminal %u without EXEC_PTY", pty ? cols : terminal, rows);
  p += 16;
  if (find_proc(id)) return send_error(id, OP_EXEC, E_BADARG, "request id %u already names a process", id);
  if (nprocs >= MAX_PROCS) return send_error(id, OP_EXEC, E_BUSY, "%d processes already running", MAX_PROCS);
  const struct cred *c = req_cred;

  char *cwd = take_str(&p, end);
  char **argv = calloc(argc + 1, sizeof *argv), **reqenv = calloc(envc + 1, sizeof *reqenv);
  if (!argv || !reqenv) die("calloc");
  int ok = cwd != NULL;
  for (uint32_t i = 0; ok && i < argc; i++) ok = (argv[i] = take_str(&p, end)) != NULL;
  for (uint32_t i = 0; ok && i < envc; i++) ok = (reqenv[i] = take_str(&p, end)) != NULL && strchr(reqenv[i], '=') && reqenv[i][0] != '=';
  if (!ok) {
    free(cwd);
    free_strv(argv);
    free_strv(reqenv);
    return send_error(id, OP_EXEC, E_BADARG, "EXEC strings malformed (overrun, NUL inside, or env entry without KEY=)");
  }
  char **env = make_env(reqenv, envc, c);
  free_strv(reqenv);

  int pin[2] = {-1, -1}, pout[2] = {-1, -1}, perr[2] = {-1, -1}, pfail[2] = {-1, -1}, master = -1, slave = -1;
  int bad = pty ? (open_pty(&master, &pin[1], &slave, cols, rows, c) ? 1 : 0) : (((flags & EXEC_STDIN) && pipe2(pin, O_CLOEXEC)) || pipe2(pout, O_CLOEXEC) || pipe2(perr, O_CLOEXEC)) ? 2 : 0;
  if (!bad && pipe2(pfail, O_CLOEXEC)) bad = 2;
  if (bad) {
    int e = errno;
    int *all[] = {pin, pout, perr, pfail};
    for (int i = 0; i < 4; i++) close_fd(&all[i][0]), close_fd(&all[i][1]);
    close_fd(&master);
    close_fd(&slave);
    send_os_error(id, OP_EXEC, e, bad == 1 ? "terminal" : "pipe");
    goto out_free;
  }
  pid_t pid = fork();
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL); /* ignored dispositions survive exec: give the child the default */
    setsid();                 /* its own process group, so KILL reaches what it starts too */
    int in_fd = pty ? -1 : pin[0] >= 0 ? pin[0] : open("/dev/null", O_RDONLY);
    int fail[2] = {0, 0};
    if (pty ? ioctl(slave, TIOCSCTTY, 0) < 0 || dup2(slave, 0) < 0 || dup2(slave, 1) < 0 || dup2(slave, 2) < 0
            : in_fd < 0 || dup2(in_fd, 0) < 0 || dup2(pout[1], 1) < 0 || dup2(perr[1], 2) < 0)
      fail[1] = 1;
    else if (c && (setgroups((size_t)c->ngroups, c->groups) || setgid(c->gid) || setuid(c->uid))) fail[1] = 4;
    else if (chdir(cwd[0] ? cwd : "/")) fail[1] = 2;
    else {
      environ = env;
      execvp(argv[0], argv);
      fail[1] = 3;
    }
    fail[0] = errno;
    ssize_t ignored = write(pfail[1], fail, sizeof fail);
    (void)ignored;
    _exit(127);
  }
  int e = errno;
  close_fd(&pin[0]);
  close_fd(&pout[1]);
  close_fd(&perr[1]);
  close_fd(&pfail[1]);
  close_fd(&slave);
  if (pid < 0) {
    close_fd(&pin[1]);
    close_fd(&pout[0]);
    close_fd(&perr[0]);
    close_fd(&pfail[0]);
    close_fd(&master);
    send_os_error(id, OP_EXEC, e, "fork");
    goto out_free;
  }
  int fail[2];
  ssize_t got;
  do got = read(pfail[0], fail, sizeof fail);
  while (got < 0 && errno == EINTR);
  close(pfail[0]);
  if (got == (ssize_t)sizeof fail) {
    waitpid(pid, NULL, 0);
    close_fd(&pin[1]);
    close_fd(&pout[0]);
    close_fd(&perr[0]);
    close_fd(&master);
    send_os_error(id, OP_EXEC, fail[0], fail[1] == 2 ? cwd : fail[1] == 3 ? argv[0] : fail[1] == 4 ? "setgroups/setgid/setuid" : pty ? "terminal" : "child stdio");
    goto out_free;
  }
  struct proc *pr = calloc(1, sizeof *pr);
  if (!pr) die("calloc");
  pr->id = id;
  pr->pid = pid;
  pr->pty = pty;
  pr->in_fd = pin[1]; /* a terminal's: the dup of its master */
  pr->out_fd = pty ? master : pout[0];
  pr->err_fd = pty ? -1 : perr[0];
  pr->credit[0] = pr->credit[1] = PV_STREAM_WINDOW;
  if (pr->in_fd >= 0) set_nonblock(pr->in_fd);
  set_nonblock(pr->out_fd);
  if (pr->err_fd >= 0) set_nonblock(pr->err_fd);
  pr->next = procs;
  procs = pr;
  nprocs++;
  uint8_t started[4];
  pv_wr32(started, (uint32_t)pid);
  send_frame(T_CHUNK, id, OP_EXEC, CH_STARTED, started, 4, NULL, 0);
out_free:
  free(cwd);
  free_strv(argv);
  free_strv(env);
}

/* Writes as much pending stdin as the pipe takes; answers the write when all of it is in. */
static void stdin_progress(struct proc *pr) {
  while (pr->wpending && pr->woff < pr->wlen) {
    ssize_t n = write(pr->in_fd, pr->wdata + pr->woff, pr->wlen - pr->woff);
    if (n > 0) {
      pr->woff += (size_t)n;
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    send_os_error(pr->wreq, OP_STDIN_WRITE, errno, "stdin");
    pr->wpending = 0;
    free(pr->wdata);
    pr->wdata = NULL;
    close_fd(&pr->in_fd); /* EPIPE: the child closed its stdin for good */
    break;
  }
  if (pr->wpending) {
    uint8_t r[8];
    pv_wr64(r, pr->wlen);
    respond(pr->wreq, OP_STDIN_WRITE, r, 8);
    pr->wpending = 0;
    free(pr->wdata);
    pr->wdata = NULL;
  }
  if (pr->close_pending) {
    close_fd(&pr->in_fd);
    respond(pr->close_req, OP_STDIN_CLOSE, NULL, 0);
    pr->close_pending = 0;
  }
}

static struct proc *proc_arg(uint32_t id, uint16_t op, const uint8_t *p, size_t n, size_t need) {
  if (n < need) {
    send_error(id, op, E_BADARG, "payload shorter than %zu bytes", need);
    return NULL;
  }
  struct proc *pr = find_proc(pv_rd32(p));
  if (!pr) send_error(id, op, E_NOPROC, "no running process %u", pv_rd32(p));
  return pr;
}

/* STDIN_WRITE {u32 process, data...} -> {u64 bytesWritten} once the pipe has taken all of it. */
static void op_stdin_write(uint32_t id, const uint8_t *p, size_t n) {
  struct proc *pr = proc_arg(id, OP_STDIN_WRITE, p, n, 4);
  if (!pr) return;
  if (pr->in_fd < 0 || pr->close_pending) return send_error(id, OP_STDIN_WRITE, E_NOPROC, "stdin of process %u is closed", pr->id);
  if (pr->wpending) return send_error(id, OP_STDIN_WRITE, E_BUSY, "a STDIN_WRITE to process %u is still pending", pr->id);
  pr->wlen = n - 4;
  pr->woff = 0;
  pr->wdata = xmalloc(pr->wlen);
  memcpy(pr->wdata, p + 4, pr->wlen);
  pr->wreq = id;
  pr->wpending = 1;
  stdin_progress(pr);
}

/* STDIN_CLOSE {u32 process} -> {} after any pending write went in. */
static void op_stdin_close(uint32_t id, const uint8_t *p, size_t n) {
  struct proc *pr = proc_arg(id, OP_STDIN_CLOSE, p, n, 4);
  if (!pr) return;
  if (pr->in_fd < 0 || pr->close_pending) return send_error(id, OP_STDIN_CLOSE, E_NOPROC, "stdin of process %u is closed", pr->id);
  pr->close_req = id;
  pr->close_pending = 1;
  stdin_progress(pr);
}

/* KILL {u32 process, u32 signal} -> {}: signals the process group the child leads. */
static void op_kill(uint32_t id, const uint8_t *p, size_t n) {
  struct proc *pr = proc_arg(id, OP_KILL, p, n, 8);
  if (!pr) return;
  uint32_t sig = pv_rd32(p + 4);
  if (sig == 0 || sig >= (uint32_t)NSIG) return send_error(id, OP_KILL, E_BADARG, "bad signal %u", sig);
  /* ESRCH: the group is gone (exited, pipes not yet drained): nothing left to signal */
  if (kill(-pr->pid, (int)sig) && errno != ESRCH) return send_os_error(id, OP_KILL, errno, "kill");
  respond(id, OP_KILL, NULL, 0);
}

/* RESIZE {u32 process, u16 cols, u16 rows} -> {}: a new size for a process's terminal (EXEC_PTY);
 * the kernel sends SIGWINCH to the terminal's foreground process group. */
static void op_resize(uint32_t id, const uint8_t *p, size_t n) {
  struct proc *pr = proc_arg(id, OP_RESIZE, p, n, 8);
  if (!pr) return;
  if (n != 8) return send_error(id, OP_RESIZE, E_BADARG, "RESIZE payload is 8 bytes, got %zu", n);
  if (!pr->pty) return send_error(id, OP_RESIZE, E_BADARG, "process %u has no terminal", pr->id);
  uint16_t cols = pv_rd16(p + 4), rows = pv_rd16(p + 6);
  if (!cols || !rows) return send_error(id, OP_RESIZE, E_BADARG, "terminal of %u x %u: both must be 1 or more", cols, rows);
  int fd = pr->out_fd >= 0 ? pr->out_fd : pr->in_fd;
  if (fd < 0) return send_error(id, OP_RESIZE, E_NOPROC, "the terminal of process %u is closed", pr->id);
  struct winsize ws = {.ws_row = rows, .ws_col = cols};
  if (ioctl(fd, TIOCSWINSZ, &ws)) return send_os_error(id, OP_RESIZE, errno, "TIOCSWINSZ");
  respond(id, OP_RESIZE, NULL, 0);
}

/* Reaps every child: ours are marked exited, orphans reparented to PID 1 just disappear. */
static void reap(void) {
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    for (struct proc *pr = procs; pr; pr = pr->next)
      if (pr->pid == pid && !pr->reaped) {
        pr->reaped = 1;
        pr->status = status;
      }
  }
}

/* The EXEC request ends (response {i32 exitCode, i32 signal}) once both pipes hit EOF and the child is reaped. */
static void finish_procs(void) {
  for (struct proc **pp = &procs; *pp;) {
    struct proc *pr = *pp;
    if (!pr->reaped || pr->out_fd >= 0 || pr->err_fd >= 0) {
      pp = &pr->next;
      continue;
    }
    if (pr->wpending) send_error(pr->wreq, OP_STDIN_WRITE, E_NOPROC, "process %u exited before reading its stdin", pr->id);
    if (pr->close_pending) respond(pr->close_req, OP_STDIN_CLOSE, NULL, 0);
    uint8_t r[8];
    int code = WIFEXITED(pr->status) ? WEXITSTATUS(pr->status) : -1;
    int sig = WIFSIGNALED(pr->status) ? WTERMSIG(pr->status) : 0;
    pv_wr32(r, (uint32_t)code);
    pv_wr32(r + 4, (uint32_t)sig);
    respond(pr->id, OP_EXEC, r, 8);
    close_fd(&pr->in_fd);
    free(pr->wdata);
    *pp = pr->next;
    free(pr);
    nprocs--;
  }
}

/* Whether a child's pipe is read now: while its stream has credit (a detached child's output is
 * dropped, so always). */
static int pipe_wanted(const struct proc *pr, uint16_t stream) { return pr->detached || pr->credit[stream - 1] > 0; }

/* Moves up to one chunk, within the stream's credit, from a child's pipe to the output queue (a
 * detached child's is dropped: nobody on the host reads it); closes the pipe at EOF. */
static void pump_pipe(struct proc *pr, int *fd, uint16_t stream) {
  static uint8_t dropped[CHUNK_MAX];
  uint32_t *credit = &pr->credit[stream - 1];
  if (!pr->detached && !*credit) return;
  ssize_t n = read(*fd, pr->detached ? dropped : chunk_space(), pr->detached ? CHUNK_MAX : pv_credit_chunk(*credit, CHUNK_MAX));
  if (n > 0) {
    if (pr->detached) return;
    chunk_commit(pr->id, OP_EXEC, stream, (size_t)n);
    *credit -= (uint32_t)n;
  } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) close_fd(fd); /* a terminal's master reads EIO once every slave fd is closed: its EOF */
}

/* ---- files ---- */
/*
 * Open file streams: a FILE_READ (a regular file or a FIFO), a FILE_LIST (a directory) and a
 * FILE_WRITE_OPEN (a write handle that WRITE_DATA frames feed) each stay open here until their
 * end, a FILE_CANCEL or RESTORED. Their fds are non-blocking and served from the poll loop: a
 * FIFO nobody writes (or nobody reads) waits there, never blocks the agent. The request id names
 * the stream, as EXEC's names its process.
 */
enum { FS_READ = 1, FS_LIST, FS_WRITE };
struct fstream {
  uint32_t id;
  int kind;
  int fd; /* FS_READ, FS_WRITE */
  DIR *dir; /* FS_LIST */
  uint64_t total; /* bytes read or written, entries listed */
  uint32_t credit; /* FS_READ, FS_LIST: bytes of chunks it may still send (stream credit) */
  /* FS_WRITE: one WRITE_DATA at a time, its data (what the fd has not yet taken) and request id */
  uint8_t *wdata;
  size_t wlen, woff;
  uint32_t wreq;
  int wpending;
  uint32_t close_req; /* a WRITE_CLOSE waiting for the pending data */
  int close_pending;
  struct fstream *next;
};
static struct fstream *fstreams;
static int nfstreams;
#define MAX_FSTREAMS 1024 /* each holds an fd; PID 1's limit is 1024 soft / 4096 hard */

static uint16_t fstream_op(const struct fstream *s) { return s->kind == FS_READ ? OP_FILE_READ : s->kind == FS_LIST ? OP_FILE_LIST : OP_FILE_WRITE_OPEN; }

static struct fstream *find_fstream(uint32_t id) {
  for (struct fstream *s = fstreams; s; s = s->next)
    if (s->id == id) return s;
  return NULL;
}

/* A new stream for request `id`, or NULL after answering error 2 or 8. */
static struct fstream *new_fstream(uint32_t id, uint16_t op, int kind) {
  if (find_fstream(id)) {
    send_error(id, op, E_BADARG, "request id %u already names an open file stream", id);
    return NULL;
  }
  if (nfstreams >= MAX_FSTREAMS) {
    send_error(id, op, E_BUSY, "%d file streams are open", MAX_FSTREAMS);
    return NULL;
  }
  struct fstream *s = calloc(1, sizeof *s);
  if (!s) die("calloc");
  s->id = id;
  s->kind = kind;
  s->fd = -1;
  s->credit = PV_STREAM_WINDOW;
  s->next = fstreams;
  fstreams = s;
  nfstreams++;
  return s;
}

/* Closes and forgets a stream (its final frame is the caller's). */
static void drop_fstream(struct fstream *s) {
  for (struct fstream **sp = &fstreams; *sp; sp = &(*sp)->next)
    if (*sp == s) {
      *sp = s->next;
      break;
    }
  if (s->dir) closedir(s->dir);
  close_fd(&s->fd);
  free(s->wdata);
  free(s);
  nfstreams--;
}

/* Ends a stream with error `code`: its request, and a pending WRITE_DATA; a pending WRITE_CLOSE
 * is answered (there is nothing left to close). Returns the requests ended. */
static uint32_t end_fstream(struct fstream *s, uint32_t code, const char *why) {
  uint32_t ended = 1;
  send_error(s->id, fstream_op(s), code, "%s", why);
  if (s->wpending) send_error(s->wreq, OP_FILE_WRITE_DATA, code, "%s", why), ended++;
  if (s->close_pending) respond(s->close_req, OP_FILE_WRITE_CLOSE, NULL, 0), ended++;
  drop_fstream(s);
  return ended;
}

/* A request's path (a str, 1 to PATH_MAX - 1 bytes, no NUL), or NULL after answering error 2. */
static char *take_path(uint32_t id, uint16_t op, const uint8_t **p, const uint8_t *end, const char *what) {
  const uint8_t *s;
  uint32_t n;
  if (!pv_take_path(p, end, &s, &n)) {
    send_error(id, op, E_BADARG, "%s malformed (a str of 1 to %d bytes without NUL)", what, PV_PATH_MAX - 1);
    return NULL;
  }
  char *r = xmalloc((size_t)n + 1);
  memcpy(r, s, n);
  r[n] = 0;
  return r;
}

/* FILE_READ {str path} -> chunks (flags 1) of <= 64 KiB, then {u64 totalBytes}. A regular file
 * or a FIFO (read as its writers write; EOF once none is left). */
static void op_file_read(uint32_t id, const uint8_t *p, size_t n) {
  char *path = take_path(id, OP_FILE_READ, &p, p + n, "FILE_READ path");
  if (!path) return;
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  struct stat st;
  struct fstream *s;
  if (fd < 0 || fstat(fd, &st)) {
    send_os_error(id, OP_FILE_READ, errno, path);
  } else if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode)) {
    send_os_error(id, OP_FILE_READ, S_ISDIR(st.st_mode) ? EISDIR : EINVAL, path);
  } else if ((s = new_fstream(id, OP_FILE_READ, FS_READ))) {
    s->fd = fd;
    fd = -1;
  }
  if (fd >= 0) close(fd);
  free(path);
}

/* Reads one chunk, within its credit, of a FILE_READ whose fd is readable; ends it at EOF or on
 * an error. */
static void pump_read(struct fstream *s) {
  if (!s->credit) return;
  ssize_t n = read(s->fd, chunk_space(), pv_credit_chunk(s->credit, CHUNK_MAX));
  if (n > 0) {
    chunk_commit(s->id, OP_FILE_READ, CH_STDOUT, (size_t)n);
    s->total += (uint64_t)n;
    s->credit -= (uint32_t)n;
    return;
  }
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (n < 0) send_os_error(s->id, OP_FILE_READ, errno, "read");
  else {
    uint8_t t[8];
    pv_wr64(t, s->total);
    respond(s->id, OP_FILE_READ, t, 8);
  }
  drop_fstream(s);
}

/* The wire's file type of a st_mode (docs/agent-protocol.md, FILE_STAT). */
static uint8_t file_type(mode_t m) {
  return S_ISREG(m) ? 1 : S_ISDIR(m) ? 2 : S_ISLNK(m) ? 3 : S_ISFIFO(m) ? 4 : S_ISSOCK(m) ? 5 : S_ISCHR(m) ? 6 : S_ISBLK(m) ? 7 : 0;
}
static uint8_t dirent_type(unsigned char t) {
  return t == DT_REG ? 1 : t == DT_DIR ? 2 : t == DT_LNK ? 3 : t == DT_FIFO ? 4 : t == DT_SOCK ? 5 : t == DT_CHR ? 6 : t == DT_BLK ? 7 : 0;
}
static int64_t mtime_ns(const struct stat *st) { return (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec; }

/* FILE_LIST {str path} -> chunks (flags 1) of whole entries, then {u64 entries}; "." and ".."
 * are left out. An entry (PV_ENTRY_HDR + name): {u16 nameLen, u8 type, u8 0, u32 mode, u64 size,
 * i64 mtimeNs, name}, from lstat; one that vanished meanwhile is left out, one that cannot be
 * lstat'ed has its d_type and zeros. */
static void op_file_list(uint32_t id, const uint8_t *p, size_t n) {
  char *path = take_path(id, OP_FILE_LIST, &p, p + n, "FILE_LIST path");
  if (!path) return;
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NONBLOCK);
  DIR *d = fd < 0 ? NULL : fdopendir(fd);
  if (!d) {
    send_os_error(id, OP_FILE_LIST, errno, path);
    if (fd >= 0) close(fd);
  } else {
    struct fstream *s = new_fstream(id, OP_FILE_LIST, FS_LIST);
    if (s) s->dir = d;
    else closedir(d);
  }
  free(path);
}

/* Puts one chunk of entries of a FILE_LIST, within its credit, in the output queue; ends it at the
 * directory's end. */
static void pump_list(struct fstream *s) {
  if (s->credit < LIST_MIN_CREDIT) return;
  uint8_t *c = chunk_space();
  size_t used = 0, room = pv_credit_chunk(s->credit, CHUNK_MAX);
  int err = 0, end = 0;
  while (used + PV_ENTRY_HDR + 255 <= room) {
    errno = 0;
    struct dirent *e = readdir(s->dir);
    if (!e) {
      err = errno;
      end = 1;
      break;
    }
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    size_t nl = strlen(e->d_name);
    if (nl > 255) continue; /* not Linux's NAME_MAX: not a name this protocol carries */
    struct stat st;
    int got = !fstatat(dirfd(s->dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW);
    if (!got && errno == ENOENT) continue;
    pv_entry_put(c + used, (const uint8_t *)e->d_name, (uint16_t)nl, got ? file_type(st.st_mode) : dirent_type(e->d_type), got ? (uint32_t)(st.st_mode & 07777) : 0,
                 got ? (uint64_t)st.st_size : 0, got ? mtime_ns(&st) : 0);
    used += PV_ENTRY_HDR + nl;
    s->total++;
  }
  if (used) chunk_commit(s->id, OP_FILE_LIST, CH_STDOUT, used);
  s->credit -= (uint32_t)used;
  if (!end) return;
  if (err) send_os_error(s->id, OP_FILE_LIST, err, "readdir");
  else {
    uint8_t t[8];
    pv_wr64(t, s->total);
    respond(s->id, OP_FILE_LIST, t, 8);
  }
  drop_fstream(s);
}

/* FILE_STAT {u32 flags (1: follow a symlink), str path} -> {u32 type, u32 mode, u32 uid, u32 gid,
 * u64 size, i64 mtimeNs, str target (a symlink's, else empty)}. */
static void op_file_stat(uint32_t id, const uint8_t *p, size_t n) {
  const uint8_t *end = p + n;
  if (n < 4) return send_error(id, OP_FILE_STAT, E_BADARG, "FILE_STAT payload shorter than 4 bytes");
  uint32_t flags = pv_rd32(p);
  p += 4;
  char *path = take_path(id, OP_FILE_STAT, &p, end, "FILE_STAT path");
  if (!path) return;
  struct stat st;
  if ((flags & 1) ? stat(path, &st) : lstat(path, &st)) {
    send_os_error(id, OP_FILE_STAT, errno, path);
    free(path);
    return;
  }
  static char target[PV_PATH_MAX];
  ssize_t tl = S_ISLNK(st.st_mode) ? readlink(path, target, sizeof target - 1) : 0;
  if (tl < 0) tl = 0; /* replaced meanwhile: no target to say */
  uint8_t r[36];
  pv_wr32(r, file_type(st.st_mode));
  pv_wr32(r + 4, st.st_mode & 07777);
  pv_wr32(r + 8, st.st_uid);
  pv_wr32(r + 12, st.st_gid);
  pv_wr64(r + 16, (uint64_t)st.st_size);
  pv_wr64(r + 24, (uint64_t)mtime_ns(&st));
  pv_wr32(r + 32, (uint32_t)tl);
  send_frame(T_RESPONSE, id, OP_FILE_STAT, 0, r, sizeof r, target, (size_t)tl);
  free(path);
}

static int mkdir_parents(char *path) {
  for (char *s = path + 1; (s = strchr(s, '/')); s++) {
    *s = 0;
    int rc = mkdir(path, 0755);
    *s = '/';
    if (rc && errno != EEXIST) return -1;
  }
  return 0;
}

/* FILE_MKDIR {u32 flags (1: recursive), u32 mode, str path} -> {}. The mode (0: 0755) is set
 * exactly, not masked by the umask; recursive creates missing parents (0755) and takes an existing
 * directory as done. */
static void op_file_mkdir(uint32_t id, const uint8_t *p, size_t n) {
  const uint8_t *end = p + n;
  if (n < 8) return send_error(id, OP_FILE_MKDIR, E_BADARG, "FILE_MKDIR payload shorter than 8 bytes");
  uint32_t flags = pv_rd32(p), mode = pv_rd32(p + 4) & 07777;
  p += 8;
  char *path = take_path(id, OP_FILE_MKDIR, &p, end, "FILE_MKDIR path");
  if (!path) return;
  if (!mode) mode = 0755;
  struct stat st;
  if ((flags & 1) && mkdir_parents(path)) send_os_error(id, OP_FILE_MKDIR, errno, path);
  else if (!mkdir(path, mode)) {
    if (chmod(path, mode)) send_os_error(id, OP_FILE_MKDIR, errno, path);
    else respond(id, OP_FILE_MKDIR, NULL, 0);
  } else if ((flags & 1) && errno == EEXIST && !stat(path, &st) && S_ISDIR(st.st_mode)) respond(id, OP_FILE_MKDIR, NULL, 0);
  else send_os_error(id, OP_FILE_MKDIR, errno, path);
  free(path);
}

#define REMOVE_MAX_DEPTH 256

/* Removes the tree at name (relative to dirfd) without following symlinks: a directory's
 * entries first (at most REMOVE_MAX_DEPTH levels down), then the directory. 0, or -1 with errno
 * set and `where` naming the entry that failed. */
static int remove_tree(int dirfd, const char *name, int depth, uint64_t *removed, const char **where) {
  *where = name;
  if (!unlinkat(dirfd, name, 0)) return (*removed)++, 0;
  if (errno != EISDIR && errno != EPERM) return -1; /* unlink(2) of a directory is EISDIR (EPERM by POSIX) */
  if (depth >= REMOVE_MAX_DEPTH) return errno = ELOOP, -1;
  int fd = openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return -1;
  DIR *d = fdopendir(fd);
  if (!d) {
    close(fd);
    return -1;
  }
  for (;;) {
    errno = 0;
    struct dirent *e = readdir(d);
    if (!e) break;
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    if (remove_tree(fd, e->d_name, depth + 1, removed, where)) {
      int err = errno;
      closedir(d);
      return errno = err, -1;
    }
  }
  int err = errno;
  closedir(d);
  *where = name;
  if (err) return errno = err, -1;
  if (unlinkat(dirfd, name, AT_REMOVEDIR)) return -1;
  return (*removed)++, 0;
}

/* FILE_REMOVE {u32 flags (1: recursive), str path} -> {u64 removed}. Without recursive: a file,
 * symlink or empty directory. Recursive: the whole tree, symlinks removed, never followed; the
 * first failure stops it (what was removed stays removed) and names its entry. */
static void op_file_remove(uint32_t id, const uint8_t *p, size_t n) {
  const uint8_t *end = p + n;
  if (n < 4) return send_error(id, OP_FILE_REMOVE, E_BADARG, "FILE_REMOVE payload shorter than 4 bytes");
  uint32_t flags = pv_rd32(p);
  p += 4;
  char *path = take_path(id, OP_FILE_REMOVE, &p, end, "FILE_REMOVE path");
  if (!path) return;
  uint64_t removed = 0;
  const char *where = path;
  struct stat st;
  int rc;
  if (flags & 1) rc = remove_tree(AT_FDCWD, path, 0, &removed, &where);
  else if ((rc = lstat(path, &st)) == 0 && (rc = S_ISDIR(st.st_mode) ? rmdir(path) : unlink(path)) == 0) removed = 1;
  if (rc) send_os_error(id, OP_FILE_REMOVE, errno, where);
  else {
    uint8_t r[8];
    pv_wr64(r, removed);
    respond(id, OP_FILE_REMOVE, r, 8);
  }
  free(path);
}

/* FILE_RENAME {str from, str to} -> {} (rename(2): `to` is replaced if it exists). */
static void op_file_rename(uint32_t id, const uint8_t *p, size_t n) {
  const uint8_t *end = p + n;
  char *from = take_path(id, OP_FILE_RENAME, &p, end, "FILE_RENAME from");
  if (!from) return;
  char *to = take_path(id, OP_FILE_RENAME, &p, end, "FILE_RENAME to");
  if (to) {
    if (rename(from, to)) send_os_error(id, OP_FILE_RENAME, errno, from);
    else respond(id, OP_FILE_RENAME, NULL, 0);
  }
  free(from);
  free(to);
}

/*
 * FILE_WRITE {u32 flags, u32 mode, str path, data...} -> {u64 bytesWritten}.
 * Without APPEND it creates or truncates the file and sets its mode (0 means 0644); with APPEND
 * it appends. Files larger than one frame are a create frame followed by APPEND frames: each
 * frame is complete on its own, so the agent keeps no state between them. Non-blocking: a FIFO
 * without a reader is ENXIO, one that is full EAGAIN (FILE_WRITE_OPEN waits for those).
 */
static void op_file_write(uint32_t id, const uint8_t *p, size_t n) {
  const uint8_t *end = p + n;
  if (n < 12) return send_error(id, OP_FILE_WRITE, E_BADARG, "FILE_WRITE payload shorter than 12 bytes");
  uint32_t flags = pv_rd32(p), mode = pv_rd32(p + 4) & 07777;
  p += 8;
  char *path = take_path(id, OP_FILE_WRITE, &p, end, "FILE_WRITE path");
  if (!path) return;
  if (!mode) mode = 0644;
  int fd = -1;
  if ((flags & FW_MKDIRS) && mkdir_parents(path)) goto fail;
  fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | ((flags & FW_APPEND) ? O_APPEND : O_TRUNC), mode);
  if (fd < 0) goto fail;
  if (!(flags & FW_APPEND) && fchmod(fd, mode)) goto fail; /* exact mode, whatever the umask or an old file said */
  size_t len = (size_t)(end - p);
  for (size_t off = 0; off < len;) {
    ssize_t w = write(fd, p + off, len - off);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) goto fail;
    off += (size_t)w;
  }
  if (close(fd)) {
    fd = -1;
    goto fail;
  }
  uint8_t r[8];
  pv_wr64(r, len);
  respond(id, OP_FILE_WRITE, r, 8);
  free(path);
  return;
fail:;
  int e = errno;
  if (fd >= 0) close(fd);
  send_os_error(id, OP_FILE_WRITE, e, path);
  free(path);
}

/*
 * FILE_WRITE_OPEN {u32 flags, u32 mode, str path} (flags and mode as FILE_WRITE's) -> a chunk with
 * flags 4 (OPENED) once the file is open; the request stays open as the write handle that
 * WRITE_DATA and WRITE_CLOSE name, and ends with {u64 bytesWritten} at WRITE_CLOSE.
 */
static void op_file_write_open(uint32_t id, const uint8_t *p, size_t n) {
  const uint8_t *end = p + n;
  if (n < 8) return send_error(id, OP_FILE_WRITE_OPEN, E_BADARG, "FILE_WRITE_OPEN payload shorter than 8 bytes");
  uint32_t flags = pv_rd32(p), mode = pv_rd32(p + 4) & 07777;
  p += 8;
  char *path = take_path(id, OP_FILE_WRITE_OPEN, &p, end, "FILE_WRITE_OPEN path");
  if (!path) return;
  if (!mode) mode = 0644;
  int fd = -1;
  struct fstream *s;
  if (((flags & FW_MKDIRS) && mkdir_parents(path)) ||
      (fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | ((flags & FW_APPEND) ? O_APPEND : O_TRUNC), mode)) < 0 ||
      (!(flags & FW_APPEND) && fchmod(fd, mode))) {
    send_os_error(id, OP_FILE_WRITE_OPEN, errno, path);
  } else if ((s = new_fstream(id, OP_FILE_WRITE_OPEN, FS_WRITE))) {
    s->fd = fd;
    fd = -1;
    send_frame(T_CHUNK, id, OP_FILE_WRITE_OPEN, CH_STARTED, NULL, 0, NULL, 0);
  }
  if (fd >= 0) close(fd);
  free(path);
}

/* Writes what the pending WRITE_DATA holds while the fd takes it; answers it once all is in, then
 * a WRITE_CLOSE waiting behind it (the handle's request ends there). */
static void write_progress(struct fstream *s) {
  while (s->wpending && s->woff < s->wlen) {
    ssize_t w = write(s->fd, s->wdata + s->woff, s->wlen - s->woff);
    if (w > 0) {
      s->woff += (size_t)w;
      s->total += (uint64_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EAGAIN) return; /* the poll loop waits for POLLOUT */
    send_os_error(s->wreq, OP_FILE_WRITE_DATA, errno, "write");
    s->wpending = 0;
    break;
  }
  if (s->wpending) {
    uint8_t r[8];
    pv_wr64(r, s->wlen);
    respond(s->wreq, OP_FILE_WRITE_DATA, r, 8);
    s->wpending = 0;
  }
  free(s->wdata);
  s->wdata = NULL;
  if (!s->close_pending) return;
  int fd = s->fd;
  s->fd = -1;
  if (close(fd)) {
    send_os_error(s->close_req, OP_FILE_WRITE_CLOSE, errno, "close");
    send_os_error(s->id, OP_FILE_WRITE_OPEN, errno, "close");
  } else {
    respond(s->close_req, OP_FILE_WRITE_CLOSE, NULL, 0);
    uint8_t r[8];
    pv_wr64(r, s->total);
    respond(s->id, OP_FILE_WRITE_OPEN, r, 8);
  }
  s->close_pending = 0;
  drop_fstream(s);
}

/* The open write handle a request names, or NULL after answering error 2 or 7. */
static struct fstream *write_arg(uint32_t id, uint16_t op, const uint8_t *p, size_t n) {
  if (n < 4) {
    send_error(id, op, E_BADARG, "payload shorter than 4 bytes");
    return NULL;
  }
  struct fstream *s = find_fstream(pv_rd32(p));
  if (!s || s->kind != FS_WRITE || s->close_pending) {
    send_error(id, op, E_NOPROC, "no open write handle %u", pv_rd32(p));
    return NULL;
  }
  return s;
}

/* FILE_WRITE_DATA {u32 handle, data...} -> {u64 bytesWritten} once the file has taken all of it;
 * one pending per handle (a second is error 8): the host sends the next after the answer. */
static void op_file_write_data(uint32_t id, const uint8_t *p, size_t n) {
  struct fstream *s = write_arg(id, OP_FILE_WRITE_DATA, p, n);
  if (!s) return;
  if (s->wpending) return send_error(id, OP_FILE_WRITE_DATA, E_BUSY, "a FILE_WRITE_DATA to handle %u is still pending", s->id);
  s->wlen = n - 4;
  s->woff = 0;
  s->wdata = xmalloc(s->wlen);
  memcpy(s->wdata, p + 4, s->wlen);
  s->wreq = id;
  s->wpending = 1;
  write_progress(s);
}

/* FILE_WRITE_CLOSE {u32 handle} -> {} once the pending data went in and the file is closed; the
 * handle's FILE_WRITE_OPEN then ends with {u64 bytesWritten} (both error 6 if close(2) fails). */
static void op_file_write_close(uint32_t id, const uint8_t *p, size_t n) {
  struct fstream *s = write_arg(id, OP_FILE_WRITE_CLOSE, p, n);
  if (!s) return;
  s->close_req = id;
  s->close_pending = 1;
  if (!s->wpending) write_progress(s);
}

/* FILE_CANCEL {u32 stream} -> {}: ends an open FILE_READ, FILE_LIST or write handle with error 10
 * (and its pending WRITE_DATA); what a write handle wrote stays. `{}` too if it has ended already. */
static void op_file_cancel(uint32_t id, const uint8_t *p, size_t n) {
  if (n < 4) return send_error(id, OP_FILE_CANCEL, E_BADARG, "FILE_CANCEL payload shorter than 4 bytes");
  struct fstream *s = find_fstream(pv_rd32(p));
  if (s) end_fstream(s, E_CANCELLED, "cancelled by the host");
  respond(id, OP_FILE_CANCEL, NULL, 0);
}

/* MEMINFO {} -> {u64 memTotalKb, u64 memFreeKb, u64 memAvailableKb, u64 cachedKb} from /proc/meminfo. */
static void op_meminfo(uint32_t id) {
  static const char *const keys[4] = {"MemTotal:", "MemFree:", "MemAvailable:", "Cached:"};
  uint64_t v[4] = {0};
  int found = 0;
  FILE *f = fopen("/proc/meminfo", "re");
  if (!f) return send_os_error(id, OP_MEMINFO, errno, "/proc/meminfo");
  char line[256];
  while (fgets(line, sizeof line, f))
    for (int i = 0; i < 4; i++) {
      size_t kl = strlen(keys[i]);
      if (!strncmp(line, keys[i], kl)) {
        v[i] = strtoull(line + kl, NULL, 10);
        found |= 1 << i;
      }
    }
  fclose(f);
  if (found != 15) return send_error(id, OP_MEMINFO, E_OS, "/proc/meminfo lacks a field");
  uint8_t r[32];
  for (int i = 0; i < 4; i++) pv_wr64(r + 8 * i, v[i]);
  respond(id, OP_MEMINFO, r, 32);
}

/* DROP_CACHES {u32 what: 1 page cache, 2 slab, 3 both} -> {} (after sync, as the kernel docs advise). */
static void op_drop_caches(uint32_t id, const uint8_t *p, size_t n) {
  if (n < 4 || pv_rd32(p) < 1 || pv_rd32(p) > 3) return send_error(id, OP_DROP_CACHES, E_BADARG, "DROP_CACHES wants {u32 1..3}");
  sync();
  int fd = open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
  char c[2] = {(char)('0' + pv_rd32(p)), '\n'};
  if (fd < 0 || write(fd, c, 2) != 2) {
    int e = errno;
    if (fd >= 0) close(fd);
    return send_os_error(id, OP_DROP_CACHES, e, "/proc/sys/vm/drop_caches");
  }
  close(fd);
  respond(id, OP_DROP_CACHES, NULL, 0);
}

/* SHUTDOWN {} -> {} then the VM ends (reboot(2); the kernel's reboot=t makes that a VM exit). */
static void op_shutdown(uint32_t id) {
  respond(id, OP_SHUTDOWN, NULL, 0);
  for (int i = 0; i < 100 && out.len; i++) { /* give the response 1 s to leave */
    flush_out();
    if (out.len) poll(&(struct pollfd){.fd = chan, .events = POLLOUT}, 1, 10);
  }
  if (is_init) {
    /* A clean end for a writable rootfs: every other process goes, then / is remounted read-only,
     * which writes back everything and marks the filesystem clean (no journal replay, nothing
     * lost). On the initramfs the remount fails harmlessly. */
    kill(-1, SIGKILL);
    for (int i = 0; i < 100 && waitpid(-1, NULL, WNOHANG) >= 0; i++) nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
    sync();
    if (in_rootfs && mount(NULL, "/", NULL, MS_REMOUNT | MS_RDONLY, NULL)) logmsg("remount the rootfs read-only: %s", strerror(errno));
    reboot(RB_AUTOBOOT);
  }
  sync();
  exit(0);
}

/*
 * RESTORED {u64 realtimeNs, u32 flags = 0, u32 reserved = 0, entropy (32..512 bytes)}
 * -> {u32 protocolVersion = 1, u32 guestKind = 2, u32 detachedProcesses, u32 endedRequests}.
 * The host sends it first thing after restoring a snapshot; the answer is its sign that the
 * channel works (the HELLO was sent before the snapshot).
 * 1. The entropy goes into the input pool, credited (RNDADDENTROPY), then the CRNG reseeds from
 *    it at once (RNDRESEEDCRNG): credited bytes alone would wait for the next scheduled reseed
 *    (up to a minute), and until then every clone's /dev/urandom would give the same bytes.
 * 2. The wall clock is set to the host's (the guest's clocks went on from the snapshot's instant).
 * 3. What was in flight is the snapshotted VM's: processes keep running, detached (stdin closed,
 *    since nobody will write it; output drained and dropped; the EXEC's final frame still sent);
 *    a pending STDIN_WRITE and every file stream still open (FILE_READ, FILE_LIST, a write handle
 *    and its pending FILE_WRITE_DATA) end with error 9.
 */
static void op_restored(uint32_t id, const uint8_t *p, size_t n) {
  if (n < 16 + RESTORED_MIN_ENTROPY || n > 16 + RESTORED_MAX_ENTROPY)
    return send_error(id, OP_RESTORED, E_BADARG, "RESTORED wants 16 bytes and %d to %d bytes of entropy, got %zu bytes", RESTORED_MIN_ENTROPY, RESTORED_MAX_ENTROPY, n);
  uint64_t ns = (uint64_t)pv_rd32(p) | (uint64_t)pv_rd32(p + 4) << 32;
  if (ns < RESTORED_MIN_REALTIME_NS || ns > (uint64_t)INT64_MAX) return send_error(id, OP_RESTORED, E_BADARG, "RESTORED time %llu ns is not a plausible wall clock", (unsigned long long)ns);
  size_t bytes = n - 16;
  struct {
    struct rand_pool_info info;
    uint8_t buf[RESTORED_MAX_ENTROPY];
  } e;
  e.info.entropy_count = (int)(bytes * 8);
  e.info.buf_size = (int)bytes;
  memcpy(e.buf, p + 16, bytes);
  int fd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return send_os_error(id, OP_RESTORED, errno, "/dev/urandom");
  int bad = ioctl(fd, RNDADDENTROPY, &e) ? 1 : ioctl(fd, RNDRESEEDCRNG) ? 2 : 0;
  int err = errno;
  close(fd);
  explicit_bzero(&e, sizeof e);
  if (bad) return send_os_error(id, OP_RESTORED, err, bad == 1 ? "ioctl(RNDADDENTROPY)" : "ioctl(RNDRESEEDCRNG)");
  struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u), .tv_nsec = (long)(ns % 1000000000u)};
  if (clock_settime(CLOCK_REALTIME, &ts)) return send_os_error(id, OP_RESTORED, errno, "clock_settime(CLOCK_REALTIME)");

  uint32_t detached = 0, ended = 0;
  for (struct proc *pr = procs; pr; pr = pr->next) {
    if (pr->detached) continue;
    pr->detached = 1;
    detached++;
    if (pr->wpending) {
      send_error(pr->wreq, OP_STDIN_WRITE, E_RESTORED, "this VM was restored from a snapshot; the write was made before it");
      pr->wpending = 0;
      free(pr->wdata);
      pr->wdata = NULL;
      ended++;
    }
    if (pr->close_pending) {
      respond(pr->close_req, OP_STDIN_CLOSE, NULL, 0);
      pr->close_pending = 0;
      ended++;
    }
    close_fd(&pr->in_fd);
  }
  while (fstreams) ended += end_fstream(fstreams, E_RESTORED, "this VM was restored from a snapshot; the file stream was opened before it");
  uint8_t r[16];
  pv_wr32(r, 1);
  pv_wr32(r + 4, GUEST_KIND_LINUX);
  pv_wr32(r + 8, detached);
  pv_wr32(r + 12, ended);
  respond(id, OP_RESTORED, r, sizeof r);
  flush_out(); /* the host waits for this answer; the console line can come after it */
  logmsg("restored: RNG reseeded with %zu bytes, clock set, %u processes detached, %u requests ended", bytes, detached, ended);
}

/*
 * NET_CONFIGURE {ADDRESS/PREFIX,GATEWAY[,DNS] as text, no NUL} -> {}: eth0 taken down and given
 * this configuration, as pvisor.net= gives it at boot (agent-net.h); sent to a clone restored
 * from a snapshot, whose network on the host is its own.
 */
static int net_apply(const char *spec, int reconfigure, const char **why); /* agent-net.h */
static void op_net_configure(uint32_t id, const uint8_t *p, size_t n) {
  char spec[128];
  if (n == 0 || n >= sizeof spec || memchr(p, 0, n)) return send_error(id, OP_NET_CONFIGURE, E_BADARG, "NET_CONFIGURE wants 1 to %zu bytes of text", sizeof spec - 1);
  memcpy(spec, p, n);
  spec[n] = 0;
  const char *why = "";
  int e = net_apply(spec, 1, &why);
  if (e == EINVAL && !strcmp(why, "ADDRESS/PREFIX,GATEWAY[,DNS]")) return send_error(id, OP_NET_CONFIGURE, E_BADARG, "NET_CONFIGURE wants ADDRESS/PREFIX,GATEWAY[,DNS], got %s", spec);
  if (e) return send_os_error(id, OP_NET_CONFIGURE, e, why);
  respond(id, OP_NET_CONFIGURE, NULL, 0);
}

static void handle_request(uint32_t id, uint16_t op, const uint8_t *p, size_t n) {
  switch (op) {
  case OP_PING: return respond(id, op, p, n);
  case OP_EXEC: return op_exec(id, p, n);
  case OP_STDIN_WRITE: return op_stdin_write(id, p, n);
  case OP_STDIN_CLOSE: return op_stdin_close(id, p, n);
  case OP_KILL: return op_kill(id, p, n);
  case OP_RESIZE: return op_resize(id, p, n);
  case OP_FILE_READ: return op_file_read(id, p, n);
  case OP_FILE_WRITE: return op_file_write(id, p, n);
  case OP_FILE_LIST: return op_file_list(id, p, n);
  case OP_FILE_STAT: return op_file_stat(id, p, n);
  case OP_FILE_MKDIR: return op_file_mkdir(id, p, n);
  case OP_FILE_REMOVE: return op_file_remove(id, p, n);
  case OP_FILE_RENAME: return op_file_rename(id, p, n);
  case OP_FILE_WRITE_OPEN: return op_file_write_open(id, p, n);
  case OP_FILE_WRITE_DATA: return op_file_write_data(id, p, n);
  case OP_FILE_WRITE_CLOSE: return op_file_write_close(id, p, n);
  case OP_FILE_CANCEL: return op_file_cancel(id, p, n);
  case OP_MEMINFO: return op_meminfo(id);
  case OP_DROP_CACHES: return op_drop_caches(id, p, n);
  case OP_SHUTDOWN: return op_shutdown(id);
  case OP_RESTORED: return op_restored(id, p, n);
  case OP_NET_CONFIGURE: return op_net_configure(id, p, n);
  default: return send_error(id, op, E_UNSUPPORTED, "unsupported op 0x%04x", op);
  }
}

/*
 * CREDIT (frame type 6, never answered): the host's consumer of stream (f->id, flags) has read,
 * so it may send that many bytes more. A grant for a stream that has ended is ignored (it crossed
 * the stream's end on the way); a malformed one is answered with error 2 under id 0, which names
 * no request, so that the host hears of its mistake without a request of its being ended by it.
 */
static void take_credit(const struct pv_frame *f) {
  uint16_t channel;
  uint32_t bytes;
  if (!pv_credit_parse(f, &channel, &bytes)) return send_error(0, OP_CREDIT, E_BADARG, "malformed CREDIT for request %u (op 0x%04x, flags %u, %u bytes)", f->id, f->op, f->flags, f->len);
  struct proc *pr = find_proc(f->id);
  if (pr) {
    pr->credit[channel - 1] = pv_credit_add(pr->credit[channel - 1], bytes);
    return;
  }
  struct fstream *s = find_fstream(f->id);
  if (s && s->kind != FS_WRITE && channel == CH_STDOUT) s->credit = pv_credit_add(s->credit, bytes);
}

/* Whether an op may run as a user: EXEC, and the file ops that reach a path (the others name a
 * stream opened already). */
static int op_takes_user(uint16_t op) { return op == OP_EXEC || (op >= OP_FILE_READ && op <= OP_FILE_WRITE_OPEN); }

/*
 * A request: with REQ_AS_USER, its payload's `str user` is taken off and resolved first; an EXEC
 * then runs its child as that user, a file op runs under that user's file credentials
 * (become_fs), and the agent's own come back before anything else is served.
 */
static void serve_request(const struct pv_frame *f) {
  if (f->flags & ~REQ_AS_USER) return send_error(f->id, f->op, E_BADARG, "unknown request flags 0x%x", f->flags);
  if (!(f->flags & REQ_AS_USER)) return handle_request(f->id, f->op, f->payload, f->len);
  const uint8_t *p = f->payload, *end = p + f->len, *u;
  uint32_t ul;
  if (!pv_take_str(&p, end, &u, &ul) || ul == 0 || ul > PV_USER_SPEC_MAX) return send_error(f->id, f->op, E_BADARG, "user malformed (a str of 1 to %d bytes without NUL)", PV_USER_SPEC_MAX);
  if (!op_takes_user(f->op)) return send_error(f->id, f->op, E_BADARG, "op 0x%04x does not run as a user", f->op);
  static struct cred c;
  if (!resolve_user(f->id, f->op, (const char *)u, ul, &c)) return;
  if (f->op == OP_EXEC) {
    req_cred = &c;
    handle_request(f->id, f->op, p, (size_t)(end - p));
    req_cred = NULL;
    return;
  }
  if (become_fs(&c)) return send_os_error(f->id, f->op, errno, "setfsuid");
  handle_request(f->id, f->op, p, (size_t)(end - p));
  own_fs_creds(1);
}

static void serve_frame(void *ctx, const struct pv_frame *f) {
  (void)ctx;
  if (f->type == T_CREDIT) take_credit(f);
  else if (f->type != T_REQUEST) send_error(f->id, f->op, E_BADFRAME, "frame type %u is not a request", f->type);
  else serve_request(f);
}

static void bad_frame(void *ctx) {
  (void)ctx;
  /* resynchronise: everything buffered is dropped (as the probe does) */
  send_error(0, 0, E_BADFRAME, "bad frame header (magic, version or length)");
}

/* Serves every complete frame in the input buffer. */
static void parse_input(void) { buf_consume(&in, pv_frames_take(in.p + in.head, in.len, serve_frame, bad_frame, NULL)); }

/* ---- start-up ---- */
/* Copies the value of NAME=VALUE from the kernel command line into out; 0 if absent or too long. */
static int cmdline_param(const char *name, char *out, size_t outlen) {
  char cmd[4096] = {0};
  FILE *f = fopen("/proc/cmdline", "re");
  if (!f) return 0;
  char *ok = fgets(cmd, sizeof cmd, f);
  fclose(f);
  size_t nl = strlen(name);
  for (char *h = ok ? cmd : NULL; h && (h = strstr(h, name)); h += nl) {
    if ((h != cmd && h[-1] != ' ') || h[nl] != '=') continue;
    size_t l = strcspn(h + nl + 1, " \n");
    if (l == 0 || l >= outlen) return 0;
    memcpy(out, h + nl + 1, l);
    out[l] = 0;
    return 1;
  }
  return 0;
}

static void setup_system(void) {
  /* initramfs is not covered by DEVTMPFS_MOUNT: mount /dev ourselves (EBUSY: already there) */
  mkdir("/dev", 0755);
  if (mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755") && errno != EBUSY) logmsg("mount /dev: %s", strerror(errno));
  /* the kernel had no /dev/console to give us: fill fds 0-2 so later fds never land there */
  int fd;
  while ((fd = open("/dev/null", O_RDWR)) >= 0 && fd < 3) {}
  if (fd > 2) close(fd);
  static const struct {
    const char *src, *dir, *type, *opts;
    unsigned long flags;
    mode_t mode;
  } m[] = {
      {"proc", "/proc", "proc", NULL, MS_NOSUID | MS_NODEV | MS_NOEXEC, 0555},
      {"sysfs", "/sys", "sysfs", NULL, MS_NOSUID | MS_NODEV | MS_NOEXEC, 0555},
      {"devpts", "/dev/pts", "devpts", "mode=0620,ptmxmode=0666", MS_NOSUID | MS_NOEXEC, 0755},
      {"tmpfs", "/dev/shm", "tmpfs", "mode=1777", MS_NOSUID | MS_NODEV, 01777},
      {"tmpfs", "/tmp", "tmpfs", "mode=1777", MS_NOSUID | MS_NODEV, 01777},
      {"tmpfs", "/run", "tmpfs", "mode=0755", MS_NOSUID | MS_NODEV, 0755},
  };
  for (size_t i = 0; i < sizeof m / sizeof *m; i++) {
    mkdir(m[i].dir, m[i].mode);
    if (mount(m[i].src, m[i].dir, m[i].type, m[i].flags, m[i].opts)) logmsg("mount %s: %s", m[i].dir, strerror(errno));
  }
  static const char *const links[][2] = {{"/proc/self/fd", "/dev/fd"}, {"/proc/self/fd/0", "/dev/stdin"}, {"/proc/self/fd/1", "/dev/stdout"}, {"/proc/self/fd/2", "/dev/stderr"}, {"pts/ptmx", "/dev/ptmx"}};
  for (size_t i = 0; i < sizeof links / sizeof *links; i++) {
    if (i == 4) unlink(links[i][1]); /* devtmpfs' own ptmx node belongs to the initial devpts, not ours */
    if (symlink(links[i][0], links[i][1]) && errno != EEXIST) logmsg("symlink %s: %s", links[i][1], strerror(errno));
  }
  /* Free page reporting (the balloon hands free guest RAM back to the host) reports only free
   * blocks of at least 2^page_reporting_order pages. The kernel sets the order when the balloon
   * registers (6.1 overwrites a command-line value there): pageblock_order, 10 (4 MiB) in this
   * kernel, and a heap freed in pieces seldom leaves whole 4 MiB blocks. Order 5 (128 KiB),
   * measured in a 512 MiB guest: booted 34.0 -> 29.4 MiB of guest RAM on the host, a process's
   * 64 MiB freed 34.4 -> 28.7, 16 of its 64 MiB freed in the middle gave back 12.0 -> 15.9 MiB;
   * order 2 did no better, 9 no better than 10. */
  int order_fd = open("/sys/module/page_reporting/parameters/page_reporting_order", O_WRONLY | O_CLOEXEC);
  if (order_fd < 0 || write(order_fd, "5", 1) != 1) logmsg("page_reporting_order: %s", strerror(errno));
  if (order_fd >= 0) close(order_fd);
  /* hostname: pvisor.hostname=NAME on the kernel command line, else "pvisor" */
  char name[65] = "pvisor";
  cmdline_param("pvisor.hostname", name, sizeof name);
  if (sethostname(name, strlen(name))) logmsg("sethostname: %s", strerror(errno));
  if (chdir("/")) die("chdir /");
  umask(022);
}

static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw) {
  (void)st;
  if (ftw->level > 0) (type == FTW_DP ? rmdir : unlink)(path); /* best effort: what stays costs RAM only */
  return 0;
}

/*
 * pvisor.rootfs=DEV on the kernel command line (pvisor.rootfs_ro=1: read-only): mounts DEV
 * (ext4, else ext3/ext2) and makes it the root that the agent and every command see, as busybox's
 * switch_root does: the mounts of setup_system() move into it, the initramfs' files are deleted
 * (they would hold guest RAM for good), the new root is moved onto / and the agent chroots into it.
 * A rootfs that cannot be used is fatal: the VM ends with the reason on the serial console, which
 * the VMM reports.
 */
static void enter_rootfs(void) {
  char dev[128], ro[8] = "0", what[300];
  if (!cmdline_param("pvisor.rootfs", dev, sizeof dev)) return;
  cmdline_param("pvisor.rootfs_ro", ro, sizeof ro);
  unsigned long flags = strcmp(ro, "0") ? MS_RDONLY : 0;
  /* the disk's node appears when its driver probes, normally before init runs */
  for (int i = 0; i < 500 && access(dev, F_OK); i++) nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
  mkdir("/rootfs", 0755);
  static const char *const types[] = {"ext4", "ext3", "ext2"};
  int err = 0;
  size_t t;
  for (t = 0; t < sizeof types / sizeof *types; t++) {
    if (!mount(dev, "/rootfs", types[t], flags, NULL)) break;
    if (!err) err = errno; /* ext4's answer is the telling one */
  }
  if (t == sizeof types / sizeof *types) {
    errno = err;
    snprintf(what, sizeof what, "cannot mount the rootfs %s (ext4, ext3 or ext2)%s%s", dev, flags ? " read-only" : "",
             err == EINVAL ? " (no ext2/3/4 filesystem on it?)"
             : flags && err == EROFS ? " (its journal needs a replay a read-only disk cannot do: run e2fsck -p on the image)" : "");
    die(what);
  }
  static const struct {
    const char *dir;
    int needed; /* commands cannot run without it (the agent opens /dev/null, /dev/hvc0, /proc) */
  } moves[] = {{"/dev", 1}, {"/proc", 1}, {"/sys", 0}, {"/tmp", 0}, {"/run", 0}};
  for (size_t i = 0; i < sizeof moves / sizeof *moves; i++) {
    char to[64];
    snprintf(to, sizeof to, "/rootfs%s", moves[i].dir);
    mkdir(to, 0755); /* a missing mount point is created (a read-only image must have it) */
    if (!mount(moves[i].dir, to, NULL, MS_MOVE, NULL)) continue;
    snprintf(what, sizeof what, "move %s into the rootfs %s (does the image have %s?)", moves[i].dir, dev, moves[i].dir);
    if (moves[i].needed) die(what);
    logmsg("%s: %s", what, strerror(errno));
  }
  /* FTW_MOUNT: stays on the initramfs, never reaches into /rootfs */
  nftw("/", remove_entry, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
  if (chdir("/rootfs") || mount(".", "/", NULL, MS_MOVE, NULL) || chroot(".") || chdir("/")) die("switch to the rootfs");
  in_rootfs = !flags;
}

#include "agent-net.h"

/*
 * Opens the channel, waiting for the device: virtio ports may appear after init starts, and on a
 * loaded host much later (eight guests booting at once in one process under the nested harness:
 * more than 10 s). The host ends a VM that is not ready within its boot timeout, so waiting long
 * here costs nothing; giving up early ended a guest that would have come up.
 */
static int open_channel(const char *path) {
  for (int i = 0; i < 30000; i++) { /* 300 s in steps of 10 ms */
    int fd = open(path, O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
    if (fd >= 0) return fd;
    if (errno != ENOENT && errno != ENXIO && errno != ENODEV) break;
    if (i == 1000) logmsg("%s is not there after 10 s; waiting for it", path);
    nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
  }
  die(path);
}

int main(int argc, char **argv) {
  /* One static binary, two programs: /bin/pvisor-workset links here, which costs the guest's
   * RAM no second copy of libc (workset.c). */
  const char *base = argc > 0 ? strrchr(argv[0], '/') : NULL;
  if (argc > 0 && strcmp(base ? base + 1 : argv[0], "pvisor-workset") == 0) return workset_main(argc, argv);
  is_init = getpid() == 1;
  if (is_init) {
    setup_system();
    enter_rootfs();
    setup_network();
  }
  /* the channel: argv[1] (debugging), else pvisor.channel=PATH on the kernel command line (a
   * test harness may use a multiport virtio-serial port such as /dev/vport0p1), else /dev/hvc0 */
  static char chanpath[256] = "/dev/hvc0";
  if (argc > 1) snprintf(chanpath, sizeof chanpath, "%s", argv[1]);
  else if (is_init) cmdline_param("pvisor.channel", chanpath, sizeof chanpath);
  const char *path = chanpath;
  signal(SIGPIPE, SIG_IGN); /* a child closing its stdin must give EPIPE, not kill the agent */
  if (!is_init && getenv("PVISOR_AGENT_ETC")) etc_dir = getenv("PVISOR_AGENT_ETC");
  own_ngroups = getgroups(sizeof own_groups / sizeof *own_groups, own_groups);
  if (own_ngroups < 0) die("getgroups");

  /* SIGCHLD through a signalfd, so reaping is one more fd in the poll loop */
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  if (sigprocmask(SIG_BLOCK, &chld, NULL)) die("sigprocmask");
  int sfd = signalfd(-1, &chld, SFD_NONBLOCK | SFD_CLOEXEC);
  if (sfd < 0) die("signalfd");

  if (argc > 2 && !is_init && !strcmp(argv[1], "--fd")) {
    chan = atoi(argv[2]);
    set_nonblock(chan);
    if (fcntl(chan, F_SETFD, FD_CLOEXEC)) die("fcntl FD_CLOEXEC"); /* children must not hold the channel */
  } else chan = open_channel(path);
  struct termios t;
  if (isatty(chan)) {
    /* raw: binary-clean both ways, no echo, no line editing, no flow control characters */
    if (tcgetattr(chan, &t)) die("tcgetattr");
    cfmakeraw(&t);
    t.c_cc[VMIN] = 1;
    t.c_cc[VTIME] = 0;
    if (tcsetattr(chan, TCSANOW, &t)) die("tcsetattr");
    tcflush(chan, TCIFLUSH);
  }

  struct sysinfo si;
  if (sysinfo(&si)) die("sysinfo");
  uint8_t hello[36] = {0};
  pv_wr32(hello, 1);
  pv_wr32(hello + 4, GUEST_KIND_LINUX);
  pv_wr64(hello + 8, (uint64_t)si.totalram * si.mem_unit);
  /* wsBase / wsLimit stay 0: the Linux guest has no probe working set */
  pv_wr32(hello + 32, PV_FEATURE_STREAM_CREDIT | PV_FEATURE_USERS | PV_FEATURE_PTY);
  send_frame(T_EVENT, 0, OP_HELLO, 0, hello, sizeof hello, NULL, 0);
  logmsg("ready on %s", path);

  struct pollfd *pfd = NULL;
  struct proc **pproc = NULL;
  struct fstream **pfs = NULL;
  size_t pcap = 0;
  for (;;) {
    flush_out();
    size_t need = 2 + 3 * (size_t)nprocs + (size_t)nfstreams;
    if (need > pcap) {
      pcap = need * 2;
      pfd = realloc(pfd, pcap * sizeof *pfd);
      pproc = realloc(pproc, pcap * sizeof *pproc);
      pfs = realloc(pfs, pcap * sizeof *pfs);
      if (!pfd || !pproc || !pfs) die("realloc");
    }
    int streams = out.len < OUT_STOP_STREAMS;
    pfd[0] = (struct pollfd){.fd = chan, .events = (short)((out.len ? POLLOUT : 0) | (out.len < OUT_STOP_INPUT ? POLLIN : 0))};
    pfd[1] = (struct pollfd){.fd = sfd, .events = POLLIN};
    size_t np = 2;
    /* a stream without credit is not polled: its writer blocks, nothing else waits for it */
    for (struct proc *pr = procs; pr; pr = pr->next) {
      if (streams && pr->out_fd >= 0 && pipe_wanted(pr, CH_STDOUT)) pfs[np] = NULL, pproc[np] = pr, pfd[np++] = (struct pollfd){.fd = pr->out_fd, .events = POLLIN};
      if (streams && pr->err_fd >= 0 && pipe_wanted(pr, CH_STDERR)) pfs[np] = NULL, pproc[np] = pr, pfd[np++] = (struct pollfd){.fd = pr->err_fd, .events = POLLIN};
      if (pr->in_fd >= 0 && pr->wpending) pfs[np] = NULL, pproc[np] = pr, pfd[np++] = (struct pollfd){.fd = pr->in_fd, .events = POLLOUT};
    }
    /* a regular file is always readable and writable; a FIFO waits here for its other end */
    int lists = 0;
    for (struct fstream *s = fstreams; s; s = s->next) {
      if (s->kind == FS_READ && streams && s->credit) pproc[np] = NULL, pfs[np] = s, pfd[np++] = (struct pollfd){.fd = s->fd, .events = POLLIN};
      if (s->kind == FS_WRITE && s->wpending) pproc[np] = NULL, pfs[np] = s, pfd[np++] = (struct pollfd){.fd = s->fd, .events = POLLOUT};
      if (s->kind == FS_LIST && s->credit >= LIST_MIN_CREDIT) lists = 1;
    }
    /* a directory is not pollable: while a FILE_LIST can go on, poll only looks */
    int rc = poll(pfd, np, lists && streams ? 0 : -1);
    if (rc < 0 && errno != EINTR) die("poll");
    if (rc < 0) continue;

    if (pfd[1].revents) {
      struct signalfd_siginfo ssi;
      while (read(sfd, &ssi, sizeof ssi) > 0) {}
      reap();
    }
    for (size_t i = 2; i < np; i++) {
      if (!pfd[i].revents) continue;
      struct proc *pr = pproc[i];
      if (pfs[i]) {
        /* each stream has one entry; serving it may end it, which frees it */
        if (pfs[i]->kind == FS_READ) {
          if (out.len < OUT_STOP_STREAMS) pump_read(pfs[i]);
        } else write_progress(pfs[i]);
      } else if (pfd[i].fd == pr->out_fd) pump_pipe(pr, &pr->out_fd, CH_STDOUT);
      else if (pfd[i].fd == pr->err_fd) pump_pipe(pr, &pr->err_fd, CH_STDERR);
      else if (pfd[i].fd == pr->in_fd) stdin_progress(pr);
    }
    for (struct fstream *s = fstreams, *next; s && out.len < OUT_STOP_STREAMS; s = next) {
      next = s->next;
      if (s->kind == FS_LIST) pump_list(s);
    }
    if (pfd[0].revents & POLLOUT) flush_out();
    if (pfd[0].revents & POLLIN) {
      for (;;) {
        uint8_t *dst = buf_reserve(&in, 65536);
        ssize_t n = read(chan, dst, 65536);
        if (n > 0) {
          in.len += (size_t)n;
          if (in.len >= HDR + MAX_PAYLOAD + 65536) break; /* serve before reading more */
          continue;
        }
        if (n == 0 || errno == EAGAIN || errno == EINTR) break;
        die("read from the agent channel");
      }
      parse_input();
    } else if (pfd[0].revents & (POLLHUP | POLLERR)) {
      /* nobody on the host end (a tty hang-up): do not spin */
      nanosleep(&(struct timespec){.tv_nsec = 50 * 1000 * 1000}, NULL);
    }
    finish_procs();
  }
}
