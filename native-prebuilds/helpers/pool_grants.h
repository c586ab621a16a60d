/*
 * The pool pages one client holds references to (pool_grants.c): what the daemon gives back for
 * it when it disconnects and its process is gone, and what it checks a Settle against.
 */
#ifndef PV_POOL_GRANTS_H
#define PV_POOL_GRANTS_H

#include <stdint.h>

struct pool_scope;

/* Pool pages with how many references to each: open addressing, page + 1 as the key. */
struct grants {
  uint32_t *pages, *counts;
  uint32_t cap, size;
  /* References over all pages. */
  uint64_t total;
};

/* References held to `page`. */
uint32_t grant_count(const struct grants *g, uint32_t page);
/* `n` more references to `page` (n >= 1). Dies if out of memory. */
void grant_add(struct grants *g, uint32_t page, uint32_t n);
/* One reference to `page` less; the caller checked there is one. */
void grant_drop(struct grants *g, uint32_t page);
/* Moves every reference of `from` into `into`; `from` is left empty. */
void grants_merge(struct grants *into, struct grants *from);
/* Gives every reference back to scope `s`; `g` is left empty, its memory freed. */
void grants_release(struct grants *g, struct pool_scope *s);

#endif
