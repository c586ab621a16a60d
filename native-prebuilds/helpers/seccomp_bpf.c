/*
 * pvisor-seccomp-bpf: turns a jail's allowlist (src/jail/seccomp.ts) into a classic-BPF seccomp
 * program through libseccomp, and writes it to stdout, where `bwrap --seccomp FD` reads it.
 *
 * Why libseccomp and not BPF written by hand: it resolves syscall names for the architecture,
 * checks the audit arch (a 32-bit or x32 call is killed, not matched against x86-64 numbers),
 * compares 64-bit arguments correctly on a 32-bit-word BPF machine, and orders the rules; each of
 * those is a classic way to get a hand-written filter wrong.
 *
 * Input (stdin), one rule a line, nothing else accepted:
 *   allow NAME            the syscall NAME, any arguments
 *   ioctl-type 0xHH       ioctl whose request's type byte (bits 8-15, _IOC_TYPE) is HH
 *   ioctl 0xNNNN          ioctl with exactly this request (the low 32 bits: the kernel's
 *                         ioctl takes an unsigned int, so the upper half of the register is ignored);
 *                         the jail's allowlist uses only this form for ioctl, never ioctl-type
 * Every other call, and every call of another architecture, kills the whole process
 * (SCMP_ACT_KILL_PROCESS: SIGSYS, all threads).
 * Exit status: 0 with the program on stdout; 2 with a message on stderr for a bad line or an
 * unknown syscall name (the allowlist must name only calls this kernel's headers know).
 * It owns nothing that outlives it and runs once per jailed VM, before the jail starts.
 */
#include <errno.h>
#include <seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(scmp_filter_ctx ctx, int line, const char *what, const char *text) {
  fprintf(stderr, "pvisor-seccomp-bpf: line %d: %s: %s\n", line, what, text);
  seccomp_release(ctx);
  return 2;
}

int main(void) {
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_KILL_PROCESS);
  if (!ctx) {
    fprintf(stderr, "pvisor-seccomp-bpf: seccomp_init failed\n");
    return 2;
  }
  /* A binary tree over syscall numbers, not libseccomp's default linear list: each call is judged
   * in about 15 instructions instead of up to 130, and an ioctl's request chain starts at once
   * (KVM_RUN, on every vCPU entry, 78 instead of 195; scripts/measure-filter-cost.js counts them). */
  if (seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2) != 0) {
    fprintf(stderr, "pvisor-seccomp-bpf: libseccomp cannot build a binary tree (libseccomp 2.5 or later needed)\n");
    seccomp_release(ctx);
    return 2;
  }
  /* A call of another architecture (an i386 int 0x80, x32) ends the whole process too: libseccomp's
   * default for it kills only the calling thread, which would leave the VMM running without it. */
  if (seccomp_attr_set(ctx, SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS) != 0) {
    fprintf(stderr, "pvisor-seccomp-bpf: seccomp_attr_set(SCMP_FLTATR_ACT_BADARCH) failed\n");
    seccomp_release(ctx);
    return 2;
  }
  char buf[256];
  int line = 0;
  while (fgets(buf, sizeof buf, stdin)) {
    line++;
    size_t len = strlen(buf);
    if (len && buf[len - 1] == '\n') buf[--len] = 0;
    if (len == 0) continue;
    char kind[32], arg[128];
    char extra;
    if (sscanf(buf, "%31s %127s %c", kind, arg, &extra) != 2) return fail(ctx, line, "expected KIND ARG", buf);
    int rc;
    if (strcmp(kind, "allow") == 0) {
      int nr = seccomp_syscall_resolve_name(arg);
      if (nr == __NR_SCMP_ERROR) return fail(ctx, line, "unknown syscall", arg);
      rc = seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0);
    } else if (strcmp(kind, "ioctl-type") == 0 || strcmp(kind, "ioctl") == 0) {
      char *end;
      errno = 0;
      unsigned long v = strtoul(arg, &end, 0);
      int type = kind[5] == '-';
      if (errno || *end || v > (type ? 0xffUL : 0xffffffffUL)) return fail(ctx, line, "bad number", arg);
      rc = type ? seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(ioctl), 1, SCMP_A1(SCMP_CMP_MASKED_EQ, 0xff00, v << 8))
                : seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(ioctl), 1, SCMP_A1(SCMP_CMP_MASKED_EQ, 0xffffffff, v));
    } else {
      return fail(ctx, line, "unknown rule", kind);
    }
    if (rc < 0) return fail(ctx, line, strerror(-rc), buf);
  }
  int rc = seccomp_export_bpf(ctx, 1);
  seccomp_release(ctx);
  if (rc < 0) {
    fprintf(stderr, "pvisor-seccomp-bpf: seccomp_export_bpf: %s\n", strerror(-rc));
    return 2;
  }
  return 0;
}
