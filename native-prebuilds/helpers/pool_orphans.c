/*
 * Orphans: the references of clients whose connections ended while their processes run on.
 *
 * Each orphan watches its process through a pidfd in the daemon's epoll set: when the process ends
 * the pidfd becomes readable, and that one orphan is given back, in time proportional to what it
 * held and nothing else. No disconnect walks the other orphans. The references of a process that
 * comes and goes again in the same scope (a PoolClient reconnecting, VMs stopped one after
 * another) are merged into its one orphan there, found by a hash of pid and scope: a pid is
 * not reused while its pidfd is not readable, so a live orphan of that pid is the same process.
 */
#include <stdlib.h>
#include <sys/epoll.h>
#include <unistd.h>

#include "pool_orphans.h"
#include "pool_pages.h"

static struct {
  int epfd, tag, dead_tag;
  struct orphan *head, *tail, *dead;
  struct orphan **buckets;
  uint32_t bits, count;
} o_;

void orphans_init(int epfd, int tag, int dead_tag) {
  o_.epfd = epfd;
  o_.tag = tag;
  o_.dead_tag = dead_tag;
  o_.bits = 6;
  o_.buckets = calloc(1u << o_.bits, sizeof *o_.buckets);
  if (!o_.buckets) pool_out_of_memory();
}

static uint32_t bucket_of(pid_t pid, const struct pool_scope *s, uint32_t bits) {
  uint64_t x = (uint64_t)(uint32_t)pid * 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)s * 0xc2b2ae3d27d4eb4full;
  x ^= x >> 31;
  return (uint32_t)((x * 0x9e3779b97f4a7c15ull) >> (64 - bits));
}

static void grow_buckets(void) {
  uint32_t bits = o_.bits + 1;
  struct orphan **buckets = calloc(1u << bits, sizeof *buckets);
  if (!buckets) pool_out_of_memory();
  for (uint32_t b = 0; b < (1u << o_.bits); b++) {
    for (struct orphan *o = o_.buckets[b], *next; o; o = next) {
      next = o->hash_next;
      uint32_t nb = bucket_of(o->pid, o->scope, bits);
      o->hash_next = buckets[nb];
      buckets[nb] = o;
    }
  }
  free(o_.buckets);
  o_.buckets = buckets;
  o_.bits = bits;
}

static struct orphan *find(pid_t pid, const struct pool_scope *s) {
  for (struct orphan *o = o_.buckets[bucket_of(pid, s, o_.bits)]; o; o = o->hash_next)
    if (o->pid == pid && o->scope == s) return o;
  return NULL;
}

void orphan_ended(struct orphan *o) {
  if (o->tag != o_.tag) return;
  epoll_ctl(o_.epfd, EPOLL_CTL_DEL, o->pidfd, NULL);
  close(o->pidfd);
  grants_release(&o->grants, o->scope);
  struct orphan **at = &o_.buckets[bucket_of(o->pid, o->scope, o_.bits)];
  while (*at != o) at = &(*at)->hash_next;
  *at = o->hash_next;
  if (o->prev) o->prev->next = o->next;
  else o_.head = o->next;
  if (o->next) o->next->prev = o->prev;
  else o_.tail = o->prev;
  o_.count--;
  o->usage->orphans--;
  usage_settle(o->usage);
  o->tag = o_.dead_tag;
  o->next = o_.dead;
  o_.dead = o;
}

void orphan_adopt(struct uid_usage *u, pid_t pid, int pidfd, struct pool_scope *s, struct grants *g) {
  if (pidfd < 0 || !g->size || pidfd_ended(pidfd)) {
    grants_release(g, s);
    if (pidfd >= 0) close(pidfd);
    return;
  }
  struct orphan *o = find(pid, s);
  /* One found whose process has ended (its event not handled yet) is not this process: it goes first. */
  if (o && pidfd_ended(o->pidfd)) {
    orphan_ended(o);
    o = NULL;
  }
  if (o) {
    grants_merge(&o->grants, g);
    close(pidfd);
    return;
  }
  o = calloc(1, sizeof *o);
  if (!o) pool_out_of_memory();
  o->tag = o_.tag;
  o->pid = pid;
  o->pidfd = pidfd;
  o->usage = u;
  o->scope = s;
  o->grants = *g;
  *g = (struct grants){ 0 };
  struct epoll_event ev = { .events = EPOLLIN, .data.ptr = o };
  if (epoll_ctl(o_.epfd, EPOLL_CTL_ADD, pidfd, &ev)) {
    /* Cannot be watched: kept forever would be a leak, so given back now, as with no pidfd. */
    grants_release(&o->grants, s);
    close(pidfd);
    free(o);
    return;
  }
  if (o_.count >= (1u << o_.bits) && o_.bits < 24) grow_buckets();
  uint32_t b = bucket_of(pid, s, o_.bits);
  o->hash_next = o_.buckets[b];
  o_.buckets[b] = o;
  o->prev = o_.tail;
  if (o_.tail) o_.tail->next = o;
  else o_.head = o;
  o_.tail = o;
  o_.count++;
  u->orphans++;
}

void orphans_collect(void) {
  while (o_.dead) {
    struct orphan *o = o_.dead;
    o_.dead = o->next;
    free(o);
  }
}

struct orphan *orphans_first(void) {
  return o_.head;
}
