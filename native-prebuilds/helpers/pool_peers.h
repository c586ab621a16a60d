/*
 * Who is on the other end of a pool connection (pool_peers.c): its groups and its process, as the
 * kernel recorded them at connect, and what each uid holds of the daemon.
 */
#ifndef PV_POOL_PEERS_H
#define PV_POOL_PEERS_H

#include <stdint.h>
#include <sys/types.h>

/*
 * The supplementary groups of the peer on socket `fd` (SO_PEERGROUPS, Linux 4.13), sorted, in a
 * buffer to free; NULL if they cannot be read (then the peer counts as in none).
 */
gid_t *peer_groups(int fd, uint32_t *count);
/* Whether a peer of primary group `primary` and supplementary `groups` (sorted) is in group `g`. */
int peer_in_group(const gid_t *groups, uint32_t count, gid_t primary, gid_t g);
/*
 * A pidfd of the peer's process, readable once it has ended: SO_PEERPIDFD (Linux 6.5), the very
 * process that connected; else pidfd_open of the pid SO_PEERCRED gave. -1 if neither works.
 */
int peer_pidfd(int fd, pid_t pid);
/* Whether a pidfd is readable now (its process has ended). */
int pidfd_ended(int pidfd);

/* What one uid holds: connections (failed ones until their sockets close), orphans, unread Status answers. */
struct uid_usage {
  struct uid_usage *next;
  uid_t uid;
  uint32_t connections, orphans;
  uint64_t status_bytes;
};

/* The usage of `uid`, made on first use. Dies if out of memory. */
struct uid_usage *usage_of(uid_t uid);
/* Forgets `u` if it counts nothing any more. */
void usage_settle(struct uid_usage *u);

#endif
