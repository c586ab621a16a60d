/*
 * The agent's reading of a request's user (docs/agent-protocol.md, "Users"): the user spec the
 * host sends ("name" or "uid:gid"), and the guest's /etc/passwd and /etc/group, which are the
 * guest's files and so as untrusted as the host's bytes. Pure functions over a byte range, no I/O,
 * no allocation, nothing global, as agent-frames.h: fuzz-frames.c drives them under ASan and
 * UBSan. agent.c reads the files (bounded by PV_ETC_FILE_MAX) and applies what these return.
 */
#ifndef PVISOR_AGENT_USERS_H
#define PVISOR_AGENT_USERS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The longest user spec ("name" or "uid:gid") a request carries; Linux's useradd allows 32. */
#define PV_USER_SPEC_MAX 64
/* The most bytes of /etc/passwd or /etc/group the agent reads: a larger file is refused. */
#define PV_ETC_FILE_MAX (1u << 20)
/* The most supplementary groups a user gets (the primary included); more is refused. */
#define PV_MAX_GROUPS 64
/* The longest home directory taken from /etc/passwd (HOME of a command run as the user). */
#define PV_HOME_MAX 256
/* The highest id accepted: (uid_t)-1 means "unchanged" to setresuid and chown, never a user. */
#define PV_ID_MAX 4294967294u

/* What a user spec is: a name to look up, numeric ids, or neither (refused). */
enum pv_user_kind { PV_USER_BAD = 0, PV_USER_NAME = 1, PV_USER_IDS = 2 };

/* A decimal id of `n` bytes at `s` (no sign, no leading zero but "0", at most PV_ID_MAX): 1 with *id set, else 0. */
static inline int pv_parse_id(const char *s, size_t n, uint32_t *id) {
  if (n == 0 || n > 10 || (n > 1 && s[0] == '0')) return 0;
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) {
    if (s[i] < '0' || s[i] > '9') return 0;
    v = v * 10 + (uint64_t)(s[i] - '0');
  }
  if (v > PV_ID_MAX) return 0;
  *id = (uint32_t)v;
  return 1;
}

/* A user name as shadow-utils accepts one: [A-Za-z0-9_.-], not starting with '-', 1 to 32 bytes, an optional final '$'. */
static inline int pv_user_name_ok(const char *s, size_t n) {
  if (n == 0 || n > 32 || s[0] == '-') return 0;
  for (size_t i = 0; i < n; i++) {
    char c = s[i];
    int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-' || (c == '$' && i == n - 1 && n > 1);
    if (!ok) return 0;
  }
  return 1;
}

/* The kind of the user spec of `n` bytes at `s`; PV_USER_IDS sets *uid and *gid. */
static inline enum pv_user_kind pv_user_spec(const char *s, size_t n, uint32_t *uid, uint32_t *gid) {
  const char *colon = memchr(s, ':', n);
  if (colon) return pv_parse_id(s, (size_t)(colon - s), uid) && pv_parse_id(colon + 1, n - (size_t)(colon - s) - 1, gid) ? PV_USER_IDS : PV_USER_BAD;
  return pv_user_name_ok(s, n) ? PV_USER_NAME : PV_USER_BAD;
}

/* Splits the line [s, e) at ':' into at most `max` fields; returns how many there are (max + 1 when more). */
static inline size_t pv_fields(const char *s, const char *e, const char **f, size_t *fl, size_t max) {
  size_t k = 0;
  for (const char *at = s;;) {
    const char *c = memchr(at, ':', (size_t)(e - at));
    const char *end = c ? c : e;
    if (k == max) return max + 1;
    f[k] = at;
    fl[k] = (size_t)(end - at);
    k++;
    if (!c) return k;
    at = c + 1;
  }
}

/* The next line of [*p, end) (without its '\n') as [*s, *e); 0 at the end. */
static inline int pv_next_line(const char **p, const char *end, const char **s, const char **e) {
  if (*p >= end) return 0;
  const char *nl = memchr(*p, '\n', (size_t)(end - *p));
  *s = *p;
  *e = nl ? nl : end;
  *p = nl ? nl + 1 : end;
  return 1;
}

/*
 * Finds user `name` (`nl` bytes) in /etc/passwd's `n` bytes at `buf`: the first line whose name
 * field is it, as getpwnam(3) does. 1 with *uid, *gid and `home` (NUL-terminated, PV_HOME_MAX
 * bytes) set; 0 if no line names it; -1 if the line that names it is malformed (not 7 fields, an
 * id that is not a decimal up to PV_ID_MAX, a home not absolute or too long, a NUL in it): such a
 * user is refused, never run under ids half read.
 */
static inline int pv_passwd_find(const char *buf, size_t n, const char *name, size_t nl, uint32_t *uid, uint32_t *gid, char *home) {
  const char *p = buf, *end = buf + n, *s, *e;
  while (pv_next_line(&p, end, &s, &e)) {
    const char *f[7];
    size_t fl[7];
    size_t k = pv_fields(s, e, f, fl, 7);
    if (k == 0 || fl[0] != nl || memcmp(f[0], name, nl)) continue;
    if (k != 7 || memchr(s, 0, (size_t)(e - s)) || !pv_parse_id(f[2], fl[2], uid) || !pv_parse_id(f[3], fl[3], gid)) return -1;
    if (fl[5] == 0 || fl[5] >= PV_HOME_MAX || f[5][0] != '/') return -1;
    memcpy(home, f[5], fl[5]);
    home[fl[5]] = 0;
    return 1;
  }
  return 0;
}

/* Whether the comma-separated list [s, s + n) holds `name`. */
static inline int pv_list_has(const char *s, size_t n, const char *name, size_t nl) {
  for (const char *at = s, *e = s + n; at <= e;) {
    const char *c = memchr(at, ',', (size_t)(e - at));
    const char *end = c ? c : e;
    if ((size_t)(end - at) == nl && !memcmp(at, name, nl)) return 1;
    if (!c) break;
    at = c + 1;
  }
  return 0;
}

/*
 * The groups of user `name` in /etc/group's `n` bytes at `buf`, after its primary `gid`, which is
 * groups[0]: every group whose member list names the user, once each, as initgroups(3) gives them.
 * Returns how many (1 and up), or -1 if a line that names the user is malformed (not 4 fields, a
 * gid that is not a decimal, a NUL) or the user is in more than PV_MAX_GROUPS groups. A malformed
 * line that does not name the user is skipped: it says nothing about this user.
 */
static inline int pv_group_list(const char *buf, size_t n, const char *name, size_t nl, uint32_t gid, uint32_t *groups) {
  int count = 1;
  groups[0] = gid;
  const char *p = buf, *end = buf + n, *s, *e;
  while (pv_next_line(&p, end, &s, &e)) {
    const char *f[4];
    size_t fl[4];
    size_t k = pv_fields(s, e, f, fl, 4);
    uint32_t g;
    if (k == 4 && !pv_list_has(f[3], fl[3], name, nl)) continue;
    if (k != 4) {
      /* does it name the user anywhere, as a field or a member? then it cannot be skipped */
      int names = 0;
      for (const char *at = s; at < e && !names;) {
        size_t len = 0;
        while (at + len < e && at[len] != ':' && at[len] != ',') len++;
        names = len == nl && !memcmp(at, name, nl);
        at += len + 1;
      }
      if (names) return -1;
      continue;
    }
    if (memchr(s, 0, (size_t)(e - s)) || !pv_parse_id(f[2], fl[2], &g)) return -1;
    int seen = 0;
    for (int i = 0; i < count; i++) seen |= groups[i] == g;
    if (seen) continue;
    if (count == PV_MAX_GROUPS) return -1;
    groups[count++] = g;
  }
  return count;
}

#endif
