/*
 * The pool's peers as the kernel knows them. Credentials are those the peer had when it called
 * connect (SO_PEERCRED, SO_PEERGROUPS): a process cannot change what the daemon sees by changing
 * its ids afterwards, nor by passing the socket on.
 *
 * Per uid, a count of what it holds of the daemon, so that each uid can be capped: a hash table
 * from uid to its usage, an entry only while it counts something.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "pool_pages.h"
#include "pool_peers.h"

#ifndef SO_PEERGROUPS
#define SO_PEERGROUPS 59
#endif
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

static int compare_gids(const void *a, const void *b) {
  gid_t x = *(const gid_t *)a, y = *(const gid_t *)b;
  return x < y ? -1 : x > y;
}

gid_t *peer_groups(int fd, uint32_t *count) {
  /* Most peers are in a few groups; the kernel says how many bytes more would take (ERANGE). */
  socklen_t len = 64 * sizeof(gid_t);
  for (int tries = 0; tries < 3; tries++) {
    gid_t *groups = malloc(len ? len : 1);
    if (!groups) pool_out_of_memory();
    socklen_t got = len;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &got) == 0) {
      *count = got / sizeof(gid_t);
      qsort(groups, *count, sizeof(gid_t), compare_gids);
      return groups;
    }
    free(groups);
    if (errno != ERANGE || got <= len) break;
    len = got;
  }
  *count = 0;
  return NULL;
}

int peer_in_group(const gid_t *groups, uint32_t count, gid_t primary, gid_t g) {
  if (primary == g) return 1;
  return groups && bsearch(&g, groups, count, sizeof(gid_t), compare_gids) != NULL;
}

int peer_pidfd(int fd, pid_t pid) {
  int pidfd;
  socklen_t len = sizeof pidfd;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0 && len == sizeof pidfd && pidfd >= 0) return pidfd;
  /* Older kernels: the pid could in principle have been reused between connect and accept; then
     references are only kept longer, until that other process ends. */
  if (pid <= 0) return -1;
  /* Close-on-exec, as pidfd_open makes every pidfd (and SO_PEERPIDFD too). */
  pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
  return pidfd < 0 ? -1 : pidfd;
}

int pidfd_ended(int pidfd) {
  struct pollfd p = { .fd = pidfd, .events = POLLIN };
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLIN | POLLHUP | POLLERR));
}

/* --- Usage per uid. --- */

static struct {
  struct uid_usage **buckets;
  uint32_t bits, count;
} usage;

static uint32_t bucket_of(uid_t uid, uint32_t bits) {
  return (uint32_t)(((uint64_t)uid * 0x9e3779b97f4a7c15ull) >> (64 - bits));
}

struct uid_usage *usage_of(uid_t uid) {
  if (!usage.buckets) {
    usage.bits = 6;
    usage.buckets = calloc(1u << usage.bits, sizeof *usage.buckets);
    if (!usage.buckets) pool_out_of_memory();
  }
  for (struct uid_usage *u = usage.buckets[bucket_of(uid, usage.bits)]; u; u = u->next)
    if (u->uid == uid) return u;
  if (usage.count >= (1u << usage.bits) && usage.bits < 24) {
    uint32_t bits = usage.bits + 1;
    struct uid_usage **buckets = calloc(1u << bits, sizeof *buckets);
    if (!buckets) pool_out_of_memory();
    for (uint32_t b = 0; b < (1u << usage.bits); b++) {
      for (struct uid_usage *u = usage.buckets[b], *next; u; u = next) {
        next = u->next;
        uint32_t nb = bucket_of(u->uid, bits);
        u->next = buckets[nb];
        buckets[nb] = u;
      }
    }
    free(usage.buckets);
    usage.buckets = buckets;
    usage.bits = bits;
  }
  struct uid_usage *u = calloc(1, sizeof *u);
  if (!u) pool_out_of_memory();
  u->uid = uid;
  uint32_t b = bucket_of(uid, usage.bits);
  u->next = usage.buckets[b];
  usage.buckets[b] = u;
  usage.count++;
  return u;
}

void usage_settle(struct uid_usage *u) {
  if (u->connections || u->orphans || u->status_bytes) return;
  struct uid_usage **at = &usage.buckets[bucket_of(u->uid, usage.bits)];
  while (*at != u) at = &(*at)->next;
  *at = u->next;
  usage.count--;
  free(u);
}
