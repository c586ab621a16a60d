/*
 * References of disconnected clients whose processes still run (pool_orphans.c). A VM maps the
 * pool pages it was granted until it says otherwise or ends, connected or not, and a slot given
 * to new content while a VM still maps it would change that VM's memory under it: so what a
 * client held is kept until its process is gone, and no longer.
 */
#ifndef PV_POOL_ORPHANS_H
#define PV_POOL_ORPHANS_H

#include <sys/types.h>

#include "pool_grants.h"
#include "pool_peers.h"

struct pool_scope;

/* What one process held in one scope when its connections ended. */
struct orphan {
  /* The epoll tag of its pidfd's events (orphans_init): first, as in every epoll'd struct of the daemon. */
  int tag;
  struct orphan *prev, *next, *hash_next;
  pid_t pid;
  int pidfd;
  struct uid_usage *usage;
  struct pool_scope *scope;
  struct grants grants;
};

/* Pidfds are watched in `epfd`; their events carry the orphan, whose tag is `tag` (`dead_tag` once it is gone). */
void orphans_init(int epfd, int tag, int dead_tag);

/*
 * Keeps references `g` (emptied) of a client of uid usage `u` whose connection ended, until
 * process `pidfd` (pid `pid`, taken: kept or closed) ends. Those of one process in one scope make
 * one orphan, whatever the number of its connections. Without a pidfd (-1), or if the process has
 * ended, or if `g` is empty, nothing is kept.
 */
void orphan_adopt(struct uid_usage *u, pid_t pid, int pidfd, struct pool_scope *s, struct grants *g);
/* The orphan's process has ended (its pidfd is readable): its references go back and it goes. */
void orphan_ended(struct orphan *o);
/* Frees the orphans that went: after the events at hand, which may still name them. */
void orphans_collect(void);
/* The orphans, oldest first. */
struct orphan *orphans_first(void);

#endif
