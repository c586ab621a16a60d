/* ColdCompression's block store: see cold_store.h. */
#define _GNU_SOURCE
#include "cold_store.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "crc32c.h"
#include "lz4.h"

struct cold_store *cold_create(uint64_t ram_size, uint64_t block) {
  if (block < 4096 || (block & (block - 1)) || !ram_size || ram_size % block || ram_size / block > UINT32_MAX) {
    errno = EINVAL;
    return NULL;
  }
  struct cold_store *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->block = block;
  c->count = (uint32_t)(ram_size / block);
  c->blocks = calloc(c->count, sizeof *c->blocks);
  if (!c->blocks) {
    free(c);
    errno = ENOMEM;
    return NULL;
  }
  return c;
}

void cold_destroy(struct cold_store *c) {
  if (!c) return;
  if (c->scratch) munmap(c->scratch, COLD_BATCH_BYTES);
  for (uint32_t b = 0; b < c->count; b++) free(c->blocks[b].data);
  free(c->blocks);
  free(c);
}

int cold_compress_batch(struct cold_store *c, const uint8_t *ram, const uint32_t *list, uint32_t n, uint32_t max_size) {
  if (n > COLD_BATCH_MAX || (uint64_t)n * c->block > COLD_BATCH_BYTES || max_size <= 4) return -EINVAL;
  if (!c->scratch) {
    void *m = mmap(NULL, COLD_BATCH_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return -errno;
    c->scratch = m;
  }
  if (max_size > c->block) max_size = (uint32_t)c->block;
  uint8_t *out = c->scratch;
  int fit = 0;
  for (uint32_t k = 0; k < n; k++) {
    int got = LZ4_compress_default((const char *)ram + (uint64_t)list[k] * c->block, (char *)out + 4, (int)c->block, (int)max_size - 4);
    c->batch_block[k] = list[k];
    c->batch_size[k] = got > 0 ? (uint32_t)got + 4 : 0;
    if (got <= 0) continue;
    out[0] = (uint8_t)c->block;
    out[1] = (uint8_t)(c->block >> 8);
    out[2] = (uint8_t)(c->block >> 16);
    out[3] = (uint8_t)(c->block >> 24);
    out += c->batch_size[k];
    fit++;
  }
  c->batch_n = n;
  return fit;
}

const uint8_t *cold_batch_take(const struct cold_store *c, const uint32_t *list, uint32_t n, uint32_t k, uint32_t *size) {
  *size = 0;
  if (n != c->batch_n || k >= n) return NULL;
  for (uint32_t i = 0; i < n; i++)
    if (c->batch_block[i] != list[i]) return NULL;
  const uint8_t *at = c->scratch;
  for (uint32_t i = 0; i < k; i++) at += c->batch_size[i];
  *size = c->batch_size[k];
  return at;
}

void cold_batch_done(struct cold_store *c) {
  c->batch_n = 0;
  /* A VM that idles keeps nothing here. */
  if (c->scratch) madvise(c->scratch, COLD_BATCH_BYTES, MADV_DONTNEED);
}

static void release(struct cold_store *c, struct cold_block *k) {
  if (k->state == COLD_COMPRESSED) {
    c->compressed--;
    c->stored_bytes -= k->size;
  }
  free(k->data);
  k->data = NULL;
  k->size = 0;
}

int cold_keep(struct cold_store *c, uint32_t b, const uint8_t *data, uint32_t size, uint32_t crc) {
  struct cold_block *k = &c->blocks[b];
  uint8_t *copy = malloc(size);
  if (!copy) return -ENOMEM;
  memcpy(copy, data, size);
  release(c, k);
  k->data = copy;
  k->size = size;
  k->crc = crc;
  k->state = COLD_COMPRESSED;
  c->compressed++;
  c->stored_bytes += size;
  return 0;
}

void cold_forget(struct cold_store *c, uint32_t b) {
  struct cold_block *k = &c->blocks[b];
  release(c, k);
  k->state = COLD_RESIDENT;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

int cold_take(struct cold_store *c, uint32_t b, uint8_t *out) {
  struct cold_block *k = &c->blocks[b];
  uint64_t t0 = now_ns();
  int ok = k->state == COLD_COMPRESSED && k->size > 4;
  if (ok) {
    /* lz4-napi's frame: the uncompressed size, little-endian, then the lz4 block. */
    uint32_t said = (uint32_t)k->data[0] | (uint32_t)k->data[1] << 8 | (uint32_t)k->data[2] << 16 | (uint32_t)k->data[3] << 24;
    ok = said == c->block &&
         LZ4_decompress_safe((const char *)k->data + 4, (char *)out, (int)(k->size - 4), (int)c->block) == (int)c->block &&
         pv_crc32c(out, c->block) == k->crc;
  }
  c->decompress_ns += now_ns() - t0;
  if (!ok) {
    if (k->state == COLD_COMPRESSED) {
      c->compressed--;
      c->stored_bytes -= k->size;
    }
    k->state = COLD_BAD;
    c->bad++;
    return -1;
  }
  release(c, k);
  k->state = COLD_RESIDENT;
  k->faulted = 1;
  c->faults++;
  return 0;
}

int cold_is_zero(const uint8_t *p, uint64_t len) {
  const uint64_t *w = (const uint64_t *)p;
  for (uint64_t i = 0; i < len / 8; i++)
    if (w[i]) return 0;
  return 1;
}
