/*
 * pvisor-jail-exec UID GID SECCOMP_FD PROGRAM [ARGS...]: the last step into a jailed VMM's
 * process, run by bubblewrap inside the jail (its namespaces and empty root already made, as
 * root): drop to UID and GID with no supplementary groups, set no_new_privs, check that no
 * capability is left, install the seccomp program read from SECCOMP_FD (made by
 * pvisor-seccomp-bpf), and exec PROGRAM. Nothing runs as the jail between the filter and exec.
 *
 * Why not bwrap's own --uid and --seccomp: they need a user namespace, and creating one is
 * refused to a chrooted process (the nested test harness runs every command in a chroot), and on
 * hosts that turn unprivileged user namespaces off. This order (privileges dropped, then the
 * filter, then exec) is the one Firecracker's jailer and Firecracker follow.
 * Exit status 126 with a message on stderr when a step fails (nothing is exec'd).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The largest program the kernel takes (BPF_MAXINSNS). */
#define MAX_INSNS 4096

static int die(const char *what) {
  fprintf(stderr, "pvisor-jail-exec: %s: %s\n", what, errno ? strerror(errno) : "failed");
  return 126;
}

static long number(const char *text, long max) {
  char *end;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno || *end || v <= 0 || v > max) return -1;
  return v;
}

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: pvisor-jail-exec UID GID SECCOMP_FD PROGRAM [ARGS...]\n");
    return 126;
  }
  long uid = number(argv[1], 0xfffffffeL), gid = number(argv[2], 0xfffffffeL), fd = number(argv[3], 1023);
  errno = 0;
  if (uid < 0 || gid < 0 || fd < 0) return die("UID, GID and SECCOMP_FD must be numbers above 0");

  /* The program first: once the uid is dropped nothing else is needed from outside. */
  static struct sock_filter insns[MAX_INSNS + 1];
  size_t got = 0;
  for (;;) {
    ssize_t n = read((int)fd, (char *)insns + got, sizeof insns - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return die("reading the seccomp program");
    if (n == 0) break;
    got += (size_t)n;
  }
  close((int)fd);
  errno = 0;
  if (got == 0 || got % sizeof insns[0] || got > MAX_INSNS * sizeof insns[0]) return die("the seccomp program is empty, not whole instructions, or too long");
  struct sock_fprog prog = { .len = (unsigned short)(got / sizeof insns[0]), .filter = insns };

  if (setgroups(0, NULL) != 0) return die("setgroups");
  if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) != 0) return die("setresgid");
  if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) != 0) return die("setresuid");
  uid_t r, e, s;
  if (getresuid(&r, &e, &s) != 0 || r != (uid_t)uid || e != (uid_t)uid || s != (uid_t)uid) return die("the uid did not change");
  /* Leaving uid 0 for another clears the permitted and effective sets; check, do not assume. */
  struct __user_cap_header_struct hdr = { .version = _LINUX_CAPABILITY_VERSION_3, .pid = 0 };
  struct __user_cap_data_struct caps[2];
  if (syscall(SYS_capget, &hdr, caps) != 0) return die("capget");
  errno = 0;
  if (caps[0].permitted | caps[1].permitted | caps[0].effective | caps[1].effective) return die("capabilities left after the uid change");
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return die("PR_SET_NO_NEW_PRIVS");
  if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0) return die("installing the seccomp filter");
  execv(argv[4], argv + 4);
  return die(argv[4]);
}
