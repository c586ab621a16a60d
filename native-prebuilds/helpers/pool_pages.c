/*
 * The page pool's pages: per scope, one memfd holding one copy of each page that VMs of the scope
 * share, an index from content key to pool page, a reference count per pool page, and the keys
 * offered but not yet pooled (so that the second VM to offer a page is asked for it).
 *
 * A scope is an owner (a uid, or a gid) and a name: the daemon names the owner from the peer's
 * credentials, so two uids that say the same name have two scopes.
 *
 * One memfd per scope: a client gets only its own scope's, so it can read no other scope's pages.
 * It gets a read-only descriptor of it (reopened through /proc/self/fd), and the memfd's mode is
 * 0400: a client of another uid can neither write through what it got nor reopen it read-write
 * (a memfd is created 0777, so without this any client could change every VM's shared pages).
 * Root, and clients of the daemon's own uid, could change the pool anyway (they could as well
 * write into the VM processes): they are trusted.
 *
 * The daemon never maps the pool: it compares and writes pages with pread and pwrite on its own
 * read-write descriptor. A mapping would charge every pool page the daemon touched to its PSS (a
 * share of each, beside the VMs that map it), and a mapping of the whole pool costs page tables
 * as it fills; a 4 KiB pread per candidate page is nothing beside the hashing of the Put it serves.
 * So the pool's pages are charged to the VMs that map them, and to the memory cgroup of whoever
 * wrote them first (the daemon's).
 *
 * Pages are handed out in the order they are put, so that a run of a VM's consecutive pages put
 * together lands on consecutive pool pages and is mapped as one VMA; freed slots are reused once
 * the fresh ones run out.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pool_pages.h"

#define NIL 0xffffffffu

struct pool_scope {
  /* The name within its owner, and the owner: a uid, or a gid for a group scope. */
  char name[257];
  int group;
  uint32_t owner;
  uint32_t id;
  /* References to its pages, and keys of it remembered as offered. */
  uint64_t references, candidates;
  /* The daemon's read-write descriptor, and the read-only one clients get. */
  int fd, client_fd;
  /* Per slot: references, content key, next slot of the same index bucket. */
  uint32_t *refs;
  uint64_t *keys;
  uint32_t *chain;
  uint32_t cap;
  /* Slots handed out so far (the next fresh one), and those free again (a stack). */
  uint32_t allocated;
  uint32_t *free_slots;
  uint32_t free_count, free_cap;
  /* The index: bucket heads (NIL when empty) into `chain`, a power of two of them. */
  uint32_t *buckets;
  uint32_t bucket_bits;
  uint32_t used;
};

/*
 * A key offered once and not pooled: which scope, which client offered it. In one table over all
 * scopes, in a list from oldest to newest (so the oldest is forgotten first beyond the bound).
 */
struct candidate {
  uint64_t key;
  uint32_t scope, client;
  uint32_t older, newer, hash_next, pad;
};

static struct {
  uint64_t page_count;
  uint64_t used;
  uint64_t references;
  struct pool_scope *scopes[POOL_MAX_SCOPES];
  uint32_t scope_count;
  struct candidate *cands;
  /* Entries: `cand_fresh` of the `cand_cap` allocated were ever used; those freed since are a list. */
  uint32_t cand_cap, cand_fresh, cand_count, cand_free, oldest, newest;
  uint32_t *cand_buckets;
  uint32_t cand_bucket_bits;
} pool;

_Noreturn void pool_out_of_memory(void) {
  static const char msg[] = "pvisor-daemon: out of memory for the pool's bookkeeping\n";
  if (write(2, msg, sizeof msg - 1) < 0) {
    /* Nothing more to say. */
  }
  _exit(125);
}

static void *grow(void *p, size_t count, size_t size) {
  void *q = reallocarray(p, count, size);
  if (!q) pool_out_of_memory();
  return q;
}

static uint32_t hash_bits(uint64_t x, uint32_t bits) {
  x ^= x >> 29;
  x *= 0x9e3779b97f4a7c15ull;
  return (uint32_t)(x >> (64 - bits));
}

void pool_init(uint64_t pool_bytes) {
  pool.page_count = pool_bytes / POOL_PAGE_BYTES;
  pool.cand_free = pool.oldest = pool.newest = NIL;
  pool.cand_bucket_bits = 10;
  pool.cand_buckets = grow(NULL, 1u << pool.cand_bucket_bits, sizeof(uint32_t));
  memset(pool.cand_buckets, 0xff, (sizeof(uint32_t)) << pool.cand_bucket_bits);
}

uint64_t pool_page_count(void) {
  return pool.page_count;
}

/* The slots a scope may hand out: the pool's size, short of the answer values. */
static uint64_t slot_limit(void) {
  return pool.page_count < POOL_MAX_PAGES ? pool.page_count : POOL_MAX_PAGES;
}

void pool_close(void) {
  for (uint32_t i = 0; i < pool.scope_count; i++) {
    struct pool_scope *s = pool.scopes[i];
    close(s->fd);
    close(s->client_fd);
  }
}

struct pool_scope *pool_scope(int group, uint32_t owner, const char *name, const char **why) {
  for (uint32_t i = 0; i < pool.scope_count; i++) {
    struct pool_scope *s = pool.scopes[i];
    if (s->group == !!group && s->owner == owner && strcmp(s->name, name) == 0) return s;
  }
  if (pool.scope_count >= POOL_MAX_SCOPES) {
    *why = "the pool serves at most 4096 scopes";
    return NULL;
  }
  /*
   * The memfd's name shows in /proc/PID/maps of the VMs that map it (all of the scope): the scope
   * as its clients name it, cut to 200 bytes on a character boundary.
   */
  char memfd_name[256];
  int prefix = group ? snprintf(memfd_name, sizeof memfd_name, "pvisor-page-pool:gid:%u:", owner) : snprintf(memfd_name, sizeof memfd_name, "pvisor-page-pool:");
  size_t n = strlen(name);
  if (n > 200) {
    n = 200;
    while (n > 0 && ((unsigned char)name[n] & 0xc0) == 0x80) n--;
  }
  memcpy(memfd_name + prefix, name, n);
  memfd_name[prefix + n] = 0;
  int fd = memfd_create(memfd_name, MFD_CLOEXEC);
  if (fd < 0) {
    *why = "cannot create the scope's memfd";
    return NULL;
  }
  char self[64];
  snprintf(self, sizeof self, "/proc/self/fd/%d", fd);
  int client_fd = -1;
  /* Sparse: a page costs memory once a client's bytes are written into it. */
  if (ftruncate(fd, (off_t)(pool.page_count * POOL_PAGE_BYTES)) || fchmod(fd, 0400) || (client_fd = open(self, O_RDONLY | O_CLOEXEC)) < 0) {
    close(fd);
    *why = "cannot size or reopen the scope's memfd";
    return NULL;
  }
  struct pool_scope *s = calloc(1, sizeof *s);
  if (!s) pool_out_of_memory();
  strcpy(s->name, name);
  s->group = !!group;
  s->owner = owner;
  s->id = pool.scope_count;
  s->fd = fd;
  s->client_fd = client_fd;
  /* Small to start: any client may make scopes (4096 at most), and most hold few pages. */
  s->bucket_bits = 6;
  s->buckets = grow(NULL, 1u << s->bucket_bits, sizeof(uint32_t));
  memset(s->buckets, 0xff, (sizeof(uint32_t)) << s->bucket_bits);
  pool.scopes[pool.scope_count++] = s;
  return s;
}

uint32_t pool_scope_count(void) {
  return pool.scope_count;
}

struct pool_scope *pool_scope_at(uint32_t i) {
  return i < pool.scope_count ? pool.scopes[i] : NULL;
}

int pool_scope_owner(const struct pool_scope *s, uint32_t *owner) {
  *owner = s->owner;
  return s->group;
}

struct pool_figures pool_scope_figures(const struct pool_scope *s) {
  return (struct pool_figures){ .pages_used = s->used, .references = s->references, .scopes = 1, .candidates = s->candidates };
}

int pool_scope_client_fd(const struct pool_scope *s) {
  return s->client_fd;
}

const char *pool_scope_name(const struct pool_scope *s) {
  return s->name;
}

static int in_use(const struct pool_scope *s, uint32_t page) {
  return page < s->allocated && s->refs[page] > 0;
}

/* Room for slot `page` in the per-slot arrays. */
static void reserve_slot(struct pool_scope *s, uint32_t page) {
  if (page < s->cap) return;
  uint32_t cap = s->cap ? s->cap : 64;
  while (cap <= page) cap = cap > 0x7fffffffu ? 0xffffffffu : cap * 2;
  s->refs = grow(s->refs, cap, sizeof *s->refs);
  s->keys = grow(s->keys, cap, sizeof *s->keys);
  s->chain = grow(s->chain, cap, sizeof *s->chain);
  s->cap = cap;
}

/* The index keeps about one bucket per page in use. */
static void index_insert(struct pool_scope *s, uint32_t page) {
  if (s->used > (1u << s->bucket_bits) && s->bucket_bits < 31) {
    uint32_t bits = s->bucket_bits + 1;
    uint32_t *buckets = grow(NULL, 1u << bits, sizeof(uint32_t));
    memset(buckets, 0xff, (sizeof(uint32_t)) << bits);
    for (uint32_t b = 0; b < (1u << s->bucket_bits); b++) {
      for (uint32_t p = s->buckets[b], next; p != NIL; p = next) {
        next = s->chain[p];
        uint32_t nb = hash_bits(s->keys[p], bits);
        s->chain[p] = buckets[nb];
        buckets[nb] = p;
      }
    }
    free(s->buckets);
    s->buckets = buckets;
    s->bucket_bits = bits;
  }
  uint32_t b = hash_bits(s->keys[page], s->bucket_bits);
  s->chain[page] = s->buckets[b];
  s->buckets[b] = page;
}

static void index_remove(struct pool_scope *s, uint32_t page) {
  uint32_t *at = &s->buckets[hash_bits(s->keys[page], s->bucket_bits)];
  while (*at != NIL && *at != page) at = &s->chain[*at];
  if (*at == page) *at = s->chain[page];
}

int64_t pool_lookup(struct pool_scope *s, uint64_t key) {
  for (uint32_t p = s->buckets[hash_bits(key, s->bucket_bits)]; p != NIL; p = s->chain[p])
    if (s->keys[p] == key) return p;
  return -1;
}

/* --- Candidates: keys offered once, over all scopes. --- */

static uint32_t cand_bucket(uint32_t scope, uint64_t key) {
  return hash_bits(key ^ ((uint64_t)scope << 40), pool.cand_bucket_bits);
}

static uint32_t cand_find(uint32_t scope, uint64_t key) {
  for (uint32_t c = pool.cand_buckets[cand_bucket(scope, key)]; c != NIL; c = pool.cands[c].hash_next)
    if (pool.cands[c].key == key && pool.cands[c].scope == scope) return c;
  return NIL;
}

static void cand_remove(uint32_t c) {
  struct candidate *e = &pool.cands[c];
  uint32_t *at = &pool.cand_buckets[cand_bucket(e->scope, e->key)];
  while (*at != c) at = &pool.cands[*at].hash_next;
  *at = e->hash_next;
  if (e->older != NIL) pool.cands[e->older].newer = e->newer;
  else pool.oldest = e->newer;
  if (e->newer != NIL) pool.cands[e->newer].older = e->older;
  else pool.newest = e->older;
  e->hash_next = pool.cand_free;
  pool.cand_free = c;
  pool.cand_count--;
  pool.scopes[e->scope]->candidates--;
}

static void cand_add(uint32_t scope, uint64_t key, uint32_t client) {
  if (pool.cand_count >= POOL_MAX_CANDIDATES) cand_remove(pool.oldest);
  if (pool.cand_free == NIL && pool.cand_fresh == pool.cand_cap) {
    /* Grown, not touched: a page of entries costs memory once entries are written in it. */
    pool.cand_cap = pool.cand_cap ? pool.cand_cap * 2 : 1024;
    pool.cands = grow(pool.cands, pool.cand_cap, sizeof *pool.cands);
  }
  if (pool.cand_count >= (1u << pool.cand_bucket_bits)) {
    uint32_t bits = pool.cand_bucket_bits + 1;
    uint32_t *buckets = grow(NULL, 1u << bits, sizeof(uint32_t));
    memset(buckets, 0xff, (sizeof(uint32_t)) << bits);
    uint32_t old_bits = pool.cand_bucket_bits;
    uint32_t *old = pool.cand_buckets;
    pool.cand_buckets = buckets;
    pool.cand_bucket_bits = bits;
    for (uint32_t b = 0; b < (1u << old_bits); b++) {
      for (uint32_t c = old[b], next; c != NIL; c = next) {
        next = pool.cands[c].hash_next;
        uint32_t nb = cand_bucket(pool.cands[c].scope, pool.cands[c].key);
        pool.cands[c].hash_next = buckets[nb];
        buckets[nb] = c;
      }
    }
    free(old);
  }
  uint32_t c;
  if (pool.cand_free != NIL) {
    c = pool.cand_free;
    pool.cand_free = pool.cands[c].hash_next;
  } else {
    c = pool.cand_fresh++;
  }
  struct candidate *e = &pool.cands[c];
  e->key = key;
  e->scope = scope;
  e->client = client;
  uint32_t b = cand_bucket(scope, key);
  e->hash_next = pool.cand_buckets[b];
  pool.cand_buckets[b] = c;
  e->older = pool.newest;
  e->newer = NIL;
  if (pool.newest != NIL) pool.cands[pool.newest].newer = c;
  else pool.oldest = c;
  pool.newest = c;
  pool.cand_count++;
  pool.scopes[scope]->candidates++;
}

int pool_offered(struct pool_scope *s, uint64_t key, uint32_t client) {
  uint32_t c = cand_find(s->id, key);
  if (c != NIL) return pool.cands[c].client != client;
  cand_add(s->id, key, client);
  return 0;
}

/* --- Pages. --- */

static int page_equals(const struct pool_scope *s, uint32_t page, const uint8_t *bytes) {
  uint8_t held[POOL_PAGE_BYTES];
  ssize_t n;
  do n = pread(s->fd, held, sizeof held, (off_t)page * POOL_PAGE_BYTES);
  while (n < 0 && errno == EINTR);
  return n == (ssize_t)sizeof held && memcmp(held, bytes, sizeof held) == 0;
}

int64_t pool_put(struct pool_scope *s, uint64_t key, const uint8_t *bytes) {
  for (uint32_t p = s->buckets[hash_bits(key, s->bucket_bits)]; p != NIL; p = s->chain[p]) {
    if (s->keys[p] == key && s->refs[p] < 0xffffffffu && page_equals(s, p, bytes)) {
      s->refs[p]++;
      s->references++;
      pool.references++;
      return p;
    }
  }
  /* The limit is on pages held, over all scopes; within a scope, fresh slots first (they keep runs
     consecutive), then slots freed. */
  if (pool.used >= pool.page_count) return -1;
  uint32_t page;
  int fresh = s->allocated < slot_limit();
  if (fresh) page = s->allocated;
  else if (s->free_count) page = s->free_slots[s->free_count - 1];
  else return -1;
  ssize_t n;
  do n = pwrite(s->fd, bytes, POOL_PAGE_BYTES, (off_t)page * POOL_PAGE_BYTES);
  while (n < 0 && errno == EINTR);
  /* Out of memory for the page (tmpfs refuses it): as full, and the slot stays free. */
  if (n != (ssize_t)POOL_PAGE_BYTES) return -1;
  reserve_slot(s, page);
  if (fresh) s->allocated++;
  else s->free_count--;
  s->keys[page] = key;
  s->refs[page] = 1;
  s->used++;
  s->references++;
  pool.used++;
  pool.references++;
  index_insert(s, page);
  uint32_t c = cand_find(s->id, key);
  if (c != NIL) cand_remove(c);
  return page;
}

int pool_hold(struct pool_scope *s, uint32_t page) {
  if (!in_use(s, page) || s->refs[page] == 0xffffffffu) return -1;
  s->refs[page]++;
  s->references++;
  pool.references++;
  return 0;
}

int pool_release(struct pool_scope *s, uint32_t page, uint32_t count) {
  if (!in_use(s, page) || count > s->refs[page]) return -1;
  pool.references -= count;
  s->references -= count;
  if ((s->refs[page] -= count) > 0) return 0;
  index_remove(s, page);
  fallocate(s->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)page * POOL_PAGE_BYTES, POOL_PAGE_BYTES);
  if (s->free_count == s->free_cap) {
    s->free_cap = !s->free_cap ? 256 : s->free_cap > 0x7fffffffu ? 0xffffffffu : s->free_cap * 2;
    s->free_slots = grow(s->free_slots, s->free_cap, sizeof *s->free_slots);
  }
  s->free_slots[s->free_count++] = page;
  s->used--;
  pool.used--;
  return 0;
}

struct pool_figures pool_figures(void) {
  return (struct pool_figures){ .pages_used = pool.used, .references = pool.references, .scopes = pool.scope_count, .candidates = pool.cand_count };
}
