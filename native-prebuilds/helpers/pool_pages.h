/*
 * The page pool's pages (pool_pages.c): per scope, one memfd holding one copy of each page the
 * VMs of the scope share, an index from content key to pool page, a reference count per pool
 * page, and the keys offered but not yet pooled. Knows nothing of sockets.
 */
#ifndef PV_POOL_PAGES_H
#define PV_POOL_PAGES_H

#include <stdint.h>

#define POOL_PAGE_BYTES 4096u
/* The most scopes a pool serves at once. */
#define POOL_MAX_SCOPES 4096u
/* The most keys remembered as offered, over all scopes; the oldest are forgotten beyond it. */
#define POOL_MAX_CANDIDATES (1u << 20)
/* No pool page has one of the protocol's answer values (0xfffffffd and up) as its number. */
#define POOL_MAX_PAGES 0xfffffffdull

struct pool_scope;

/* Creates the pool: up to pool_bytes / 4096 pages over all scopes. Dies if out of memory. */
void pool_init(uint64_t pool_bytes);
/* Closes every scope's memfd. */
void pool_close(void);

/* Pages the whole pool may hold. */
uint64_t pool_page_count(void);

/*
 * The scope named `name` (NUL-terminated, at most 256 bytes) of its owner: uid `owner`, or gid
 * `owner` if `group`. Scopes of different owners never share pages, whatever their names.
 * Created with its memfd on first use. NULL with *why set (a static message) if it cannot be:
 * too many scopes, or the memfd could not be made.
 */
struct pool_scope *pool_scope(int group, uint32_t owner, const char *name, const char **why);
/* A read-only descriptor of the scope's memfd: what its clients get. */
int pool_scope_client_fd(const struct pool_scope *s);
/* The scope's name within its owner. */
const char *pool_scope_name(const struct pool_scope *s);
/* The scope's owner in *owner; 1 if it is a gid (a group scope), 0 if a uid. */
int pool_scope_owner(const struct pool_scope *s, uint32_t *owner);
/* Scopes so far (they are kept), and the i-th of them. */
uint32_t pool_scope_count(void);
struct pool_scope *pool_scope_at(uint32_t i);

/* A pool page of `s` in use whose key is `key` (its content to be compared by whoever maps it), or -1. */
int64_t pool_lookup(struct pool_scope *s, uint64_t key);

/*
 * Notes that client `client` offered a page of `key` the pool does not hold; returns 1 if another
 * client offered it before (so it is worth pooling now), else 0.
 */
int pool_offered(struct pool_scope *s, uint64_t key, uint32_t client);

/*
 * A pool page of `s` holding exactly the 4096 bytes at `bytes` (whose key is `key`, as the daemon
 * computed it): an existing one, compared byte for byte, or one written now. The caller then holds
 * one reference. -1 when the pool is full (or the page could not be written).
 */
int64_t pool_put(struct pool_scope *s, uint64_t key, const uint8_t *bytes);

/* One more reference to a page in use. 0, or -1 if the page is not in use or holds too many. */
int pool_hold(struct pool_scope *s, uint32_t page);

/*
 * Gives back `count` references. After the last, the page is punched out and forgotten, and its
 * slot serves a later page. 0, or -1 if the page is not in use or holds fewer.
 */
int pool_release(struct pool_scope *s, uint32_t page, uint32_t count);

struct pool_figures {
  uint64_t pages_used, references, scopes, candidates;
};
struct pool_figures pool_figures(void);
/* The same of one scope (`scopes` is 1). */
struct pool_figures pool_scope_figures(const struct pool_scope *s);

/* Dies with a message: the daemon's bookkeeping could not grow. */
_Noreturn void pool_out_of_memory(void);

#endif
