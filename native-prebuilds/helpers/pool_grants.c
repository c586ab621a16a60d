/*
 * A client's references to pool pages: a small hash table from pool page to count. Kept apart
 * from the pool (pool_pages.c keeps one count per page over all clients) because the daemon must
 * know what each client holds: a Settle may drop only what its client holds, and a client's
 * references go back only when its process is gone.
 */
#include <stdlib.h>

#include "pool_grants.h"
#include "pool_pages.h"

static uint32_t home_of(uint32_t page, uint32_t mask) {
  return (uint32_t)(((uint64_t)page * 0x9e3779b97f4a7c15ull) >> 32) & mask;
}

static uint32_t slot_of(const struct grants *g, uint32_t page) {
  uint32_t mask = g->cap - 1, i = home_of(page, mask);
  while (g->pages[i] && g->pages[i] != page + 1) i = (i + 1) & mask;
  return i;
}

uint32_t grant_count(const struct grants *g, uint32_t page) {
  if (!g->cap) return 0;
  uint32_t i = slot_of(g, page);
  return g->pages[i] ? g->counts[i] : 0;
}

void grant_add(struct grants *g, uint32_t page, uint32_t n) {
  if ((uint64_t)(g->size + 1) * 4 > (uint64_t)g->cap * 3) {
    struct grants bigger = { 0 };
    bigger.cap = g->cap ? g->cap * 2 : 64;
    bigger.pages = calloc(bigger.cap, sizeof(uint32_t));
    bigger.counts = calloc(bigger.cap, sizeof(uint32_t));
    if (!bigger.pages || !bigger.counts) pool_out_of_memory();
    for (uint32_t i = 0; i < g->cap; i++) {
      if (!g->pages[i]) continue;
      uint32_t j = slot_of(&bigger, g->pages[i] - 1);
      bigger.pages[j] = g->pages[i];
      bigger.counts[j] = g->counts[i];
    }
    bigger.size = g->size;
    bigger.total = g->total;
    free(g->pages);
    free(g->counts);
    *g = bigger;
  }
  uint32_t i = slot_of(g, page);
  if (!g->pages[i]) {
    g->pages[i] = page + 1;
    g->counts[i] = 0;
    g->size++;
  }
  /* No overflow: the pool counts at most 2^32-1 references to a page over all clients. */
  g->counts[i] += n;
  g->total += n;
}

void grant_drop(struct grants *g, uint32_t page) {
  uint32_t mask = g->cap - 1, i = slot_of(g, page);
  g->total--;
  if (--g->counts[i]) return;
  /* Backward-shift deletion keeps every probe sequence whole. */
  g->pages[i] = 0;
  g->size--;
  for (uint32_t j = (i + 1) & mask; g->pages[j]; j = (j + 1) & mask) {
    uint32_t home = home_of(g->pages[j] - 1, mask);
    /* Entry j may move to the hole at i if its home is not in (i, j]. */
    if (((j - home) & mask) >= ((j - i) & mask)) {
      g->pages[i] = g->pages[j];
      g->counts[i] = g->counts[j];
      g->pages[j] = 0;
      i = j;
    }
  }
}

static void grants_free(struct grants *g) {
  free(g->pages);
  free(g->counts);
  *g = (struct grants){ 0 };
}

void grants_merge(struct grants *into, struct grants *from) {
  /* The smaller table is walked: merging is then proportional to what the disconnecting client holds. */
  if (into->size < from->size) {
    struct grants t = *into;
    *into = *from;
    *from = t;
  }
  for (uint32_t i = 0; i < from->cap; i++)
    if (from->pages[i]) grant_add(into, from->pages[i] - 1, from->counts[i]);
  grants_free(from);
}

void grants_release(struct grants *g, struct pool_scope *s) {
  for (uint32_t i = 0; i < g->cap; i++)
    if (g->pages[i]) pool_release(s, g->pages[i] - 1, g->counts[i]);
  grants_free(g);
}
