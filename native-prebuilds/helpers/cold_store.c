/* ColdCompression's block store: see cold_store.h. */
#define _GNU_SOURCE
#include "cold_store.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

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
  c->saved_fd = -1;
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
  if (c->saved_fd >= 0) close(c->saved_fd);
  for (uint32_t b = 0; b < c->count; b++)
    if (c->blocks[b].state != COLD_SAVED) free(c->blocks[b].data);
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
    c->batch_off[k] = (uint32_t)(out - c->scratch);
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

int cold_batch_is(const struct cold_store *c, const uint32_t *list, uint32_t n) {
  if (n != c->batch_n) return 0;
  for (uint32_t i = 0; i < n; i++)
    if (c->batch_block[i] != list[i]) return 0;
  return 1;
}

void cold_batch_done(struct cold_store *c) {
  c->batch_n = 0;
  /* A VM that idles keeps nothing here. */
  if (c->scratch) madvise(c->scratch, COLD_BATCH_BYTES, MADV_DONTNEED);
}

static void release(struct cold_store *c, struct cold_block *k) {
  if (k->state == COLD_SAVED) { /* its bytes are in the file, not in memory */
    c->saved--;
    c->saved_bytes -= k->size;
    k->data = NULL;
    k->size = 0;
    return;
  }
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

/* Reads a SAVED block's bytes from the saved file into a fresh buffer; NULL if that fails. */
static uint8_t *read_saved(const struct cold_store *c, const struct cold_block *k) {
  uint8_t *bytes = malloc(k->size ? k->size : 1);
  if (!bytes) return NULL;
  for (uint32_t got = 0; got < k->size;) {
    ssize_t n = pread(c->saved_fd, bytes + got, k->size - got, (off_t)(k->file_off + got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      free(bytes);
      errno = n < 0 ? errno : ENODATA;
      return NULL;
    }
    got += (uint32_t)n;
  }
  if (pv_crc32c(bytes, k->size) != k->bytes_crc) {
    free(bytes);
    errno = EBADMSG;
    return NULL;
  }
  return bytes;
}

/* A SAVED block is in memory again (its bytes read back): COMPRESSED. */
static void unsave(struct cold_store *c, struct cold_block *k, uint8_t *bytes) {
  c->saved--;
  c->saved_bytes -= k->size;
  k->data = bytes;
  k->state = COLD_COMPRESSED;
  c->compressed++;
  c->stored_bytes += k->size;
}

int cold_take(struct cold_store *c, uint32_t b, uint8_t *out) {
  struct cold_block *k = &c->blocks[b];
  uint64_t t0 = now_ns();
  if (k->state == COLD_SAVED) {
    uint8_t *bytes = read_saved(c, k);
    if (bytes) unsave(c, k, bytes);
  }
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
    } else {
      release(c, k); /* SAVED: its copy in the file could not be read */
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

int cold_busy(const struct cold_store *c) {
  return c->compressing || c->compressed || c->saved || c->bad;
}

int cold_is_zero(const uint8_t *p, uint64_t len) {
  const uint64_t *w = (const uint64_t *)p;
  for (uint64_t i = 0; i < len / 8; i++)
    if (w[i]) return 0;
  return 1;
}


int cold_save(struct cold_store *c, int fd) {
  if (c->saved_fd >= 0) return -EBUSY;
  uint64_t off = 0;
  int rc = 0;
  for (uint32_t b = 0; b < c->count && !rc; b++) {
    struct cold_block *k = &c->blocks[b];
    if (k->state != COLD_COMPRESSED) continue;
    for (uint32_t done = 0; done < k->size && !rc;) {
      ssize_t n = pwrite(fd, k->data + done, k->size - done, (off_t)(off + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) rc = n < 0 ? -errno : -EIO;
      else done += (uint32_t)n;
    }
    off += k->size;
  }
  if (!rc && fdatasync(fd) != 0) rc = -errno;
  int dup_fd = rc ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (!rc && dup_fd < 0) rc = -errno;
  if (rc) return rc;
  /* Durable: the memory can go. */
  c->saved_fd = dup_fd;
  int saved = 0;
  off = 0;
  for (uint32_t b = 0; b < c->count; b++) {
    struct cold_block *k = &c->blocks[b];
    if (k->state != COLD_COMPRESSED) continue;
    uint32_t size = k->size;
    k->bytes_crc = pv_crc32c(k->data, size);
    release(c, k);
    k->size = size;
    k->file_off = off;
    k->state = COLD_SAVED;
    c->saved++;
    c->saved_bytes += size;
    off += size;
    saved++;
  }
  return saved;
}

int cold_load(struct cold_store *c) {
  if (c->saved_fd < 0) return 0;
  uint8_t **bytes = calloc(c->count, sizeof *bytes);
  if (!bytes) return -ENOMEM;
  int rc = 0;
  for (uint32_t b = 0; b < c->count && !rc; b++)
    if (c->blocks[b].state == COLD_SAVED && !(bytes[b] = read_saved(c, &c->blocks[b]))) rc = -errno;
  int loaded = 0;
  for (uint32_t b = 0; b < c->count; b++) {
    if (!bytes[b]) continue;
    if (rc) {
      free(bytes[b]);
    } else {
      unsave(c, &c->blocks[b], bytes[b]);
      loaded++;
    }
  }
  free(bytes);
  if (rc) return rc;
  close(c->saved_fd);
  c->saved_fd = -1;
  return loaded;
}
