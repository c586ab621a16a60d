/*
 * ColdCompression's block store: guest RAM cut into fixed blocks, each either resident or kept
 * here compressed (lz4-napi's output: a 4-byte little-endian size, then one lz4 block) with the
 * CRC32C of its bytes. Pure bookkeeping and decompression: the userfaultfd server (uffd_server.c)
 * owns the locking, the write protection and the mapping of pages.
 */
#ifndef PV_COLD_STORE_H
#define PV_COLD_STORE_H

#include <stdint.h>

/* A batch compressed at once: at most this many bytes of guest RAM. */
#define COLD_BATCH_BYTES (1024 * 1024)
#define COLD_BATCH_MAX (COLD_BATCH_BYTES / 16384) /* blocks, at the smallest block size */

enum cold_state {
  COLD_RESIDENT = 0,    /* in guest RAM; a page missing there reads as zero */
  COLD_COMPRESSING = 1, /* write-protected in guest RAM while Node compresses it */
  COLD_COMPRESSED = 2,  /* dropped from guest RAM; its bytes are in the store */
  COLD_BAD = 3,         /* its stored bytes failed their check: never mapped */
  COLD_SAVED = 4,       /* dropped; its compressed bytes are in a file while the VM is suspended */
};

struct cold_block {
  union {
    uint8_t *data;     /* COMPRESSED, BAD: the compressed bytes */
    uint64_t file_off; /* SAVED: where they are in the saved file */
  };
  uint32_t size;      /* compressed bytes */
  uint32_t crc;       /* CRC32C of the block as it was compressed */
  uint32_t bytes_crc; /* SAVED: CRC32C of the compressed bytes in the file */
  uint8_t state;
  uint8_t dirtied; /* COMPRESSING: something wrote, or faulted, into it meanwhile */
  uint8_t faulted; /* a fault brought it back since Node last asked */
};

struct cold_store {
  uint64_t block; /* bytes per block: a power of two, at least a page */
  uint32_t count;
  struct cold_block *blocks;
  uint32_t compressed;   /* blocks COMPRESSED */
  uint32_t compressing;  /* blocks COMPRESSING */
  uint64_t stored_bytes; /* bytes held for them */
  uint64_t faults;       /* blocks a fault brought back */
  uint64_t decompress_ns;
  uint64_t bad;          /* blocks that failed their check */
  uint64_t zero_dropped; /* all-zero blocks dropped without storing anything */
  uint32_t saved;        /* blocks SAVED */
  uint64_t saved_bytes;
  int saved_fd;          /* a dup of the file they are in, -1 if none */
  /* The batch last compressed (cold_compress_batch), until it is finished. */
  uint8_t *scratch; /* COLD_BATCH_BYTES, mapped on first use, its pages dropped after each batch */
  uint32_t batch_n;
  uint32_t batch_block[COLD_BATCH_MAX];
  uint32_t batch_size[COLD_BATCH_MAX]; /* 0: did not fit in the size asked for */
  uint32_t batch_off[COLD_BATCH_MAX];  /* where its bytes start in the scratch */
};

/* A store for `ram_size` bytes in blocks of `block`; NULL with errno set on failure. */
struct cold_store *cold_create(uint64_t ram_size, uint64_t block);
void cold_destroy(struct cold_store *c);

/*
 * Compresses the `n` blocks `list` (block indices) of guest RAM at `ram` into the scratch, one
 * after the other, each as lz4-napi writes it (4-byte little-endian size, then one lz4 block) and
 * only if that fits in max_size bytes (lz4 gives up early on content that does not shrink). The
 * batch waits there (batch_off, batch_size) for its finish. Returns how many fit, or -errno.
 */
int cold_compress_batch(struct cold_store *c, const uint8_t *ram, const uint32_t *list, uint32_t n, uint32_t max_size);

/* Whether `list` is the batch cold_compress_batch last made; cold_batch_done forgets it. */
int cold_batch_is(const struct cold_store *c, const uint32_t *list, uint32_t n);
void cold_batch_done(struct cold_store *c);

/* Keeps a copy of `size` bytes as block b's compressed form: COMPRESSED. 0, or -ENOMEM. */
int cold_keep(struct cold_store *c, uint32_t b, const uint8_t *data, uint32_t size, uint32_t crc);

/* Drops block b's stored bytes (COMPRESSED or BAD): RESIDENT, its pages missing. */
void cold_forget(struct cold_store *c, uint32_t b);

/*
 * Decompresses block b (COMPRESSED, or SAVED: read from the file first) into out (block bytes)
 * and checks its size and CRC32C. On success the stored bytes are freed and the block is
 * RESIDENT (the caller maps out) and marked faulted; otherwise it is BAD. Returns 0 or -1.
 */
int cold_take(struct cold_store *c, uint32_t b, uint8_t *out);

/*
 * Writes every COMPRESSED block's bytes to fd (from offset 0; made durable with fdatasync), keeps
 * a dup of fd and frees them: those blocks are SAVED, and a fault there reads its block back from
 * the file (cold_take). Nothing changes if a write fails. Returns how many blocks, or -errno.
 */
int cold_save(struct cold_store *c, int fd);

/*
 * Reads every SAVED block's bytes back from the saved file and checks their CRC32C: they are
 * COMPRESSED again and the file is let go. If one cannot be read or fails its check, nothing
 * changes: -EBADMSG, -ENODATA (the file is short) or another -errno.
 */
int cold_load(struct cold_store *c);

/*
 * Whether some block is not simply resident (being compressed, compressed, saved or bad): only
 * then must guest RAM stay registered with userfaultfd for the store.
 */
int cold_busy(const struct cold_store *c);

/* Whether [p, p+len) is all zero bytes. */
int cold_is_zero(const uint8_t *p, uint64_t len);

#endif
