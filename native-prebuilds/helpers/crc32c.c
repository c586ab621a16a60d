/*
 * CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as iSCSI, ext4 and btrfs compute it: the
 * checksum of memory strategies' pieces of guest RAM. Part of libpvisor-memory.so, where the
 * userfaultfd server checks each piece before the guest sees it, and exported for Node, which
 * computes them over guest RAM in place.
 *
 * Why CRC32C and not zlib's CRC32: x86-64 has an instruction for it (SSE4.2), which runs at
 * memory bandwidth when three streams are interleaved; zlib's needs carry-less multiplication
 * to get there. The portable slicing-by-8 path is for CPUs without SSE4.2, for CPUs that only
 * emulate the instruction (QEMU's TCG: 6 times slower than the portable path there, which is why
 * the first call times the two), and for the test that holds the two against each other.
 */
#include <cpuid.h>
#include <nmmintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "crc32c.h"

#define CRC32C_POLY 0x82F63B78u
/* Lengths of the three interleaved streams of the SSE4.2 path (powers of two: see zeros_op). */
#define CRC_LONG 8192
#define CRC_SHORT 256

static uint32_t crc_table[8][256];
static uint32_t crc_long[4][256], crc_short[4][256];
static int crc_hw;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
  uint32_t sum = 0;
  for (; vec; vec >>= 1, mat++)
    if (vec & 1) sum ^= *mat;
  return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
  for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* The operator that feeds `len` zero bytes (a power of two) through a CRC register. */
static void zeros_op(uint32_t *even, uint32_t len) {
  uint32_t odd[32];
  odd[0] = CRC32C_POLY; /* one zero bit */
  for (int n = 1; n < 32; n++) odd[n] = 1u << (n - 1);
  gf2_square(even, odd); /* two bits */
  gf2_square(odd, even); /* four bits */
  do {
    gf2_square(even, odd);
    len >>= 1;
    if (!len) return;
    gf2_square(odd, even);
    len >>= 1;
  } while (len);
  memcpy(even, odd, sizeof odd);
}

static void zeros_tables(uint32_t zeros[4][256], uint32_t len) {
  uint32_t op[32];
  zeros_op(op, len);
  for (uint32_t n = 0; n < 256; n++)
    for (int k = 0; k < 4; k++) zeros[k][n] = gf2_times(op, n << (8 * k));
}

static uint32_t crc_sw(uint32_t c, const uint8_t *p, uint64_t len);
static uint32_t crc_hw_run(uint32_t crc, const uint8_t *p, uint64_t len);

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* The fastest of three runs of `crc` over `len` bytes of p, in ns. */
static uint64_t best_of_three(uint32_t (*crc)(uint32_t, const uint8_t *, uint64_t), const uint8_t *p, uint64_t len) {
  uint64_t best = UINT64_MAX;
  volatile uint32_t sink = 0;
  for (int k = 0; k < 3; k++) {
    uint64_t t0 = now_ns();
    sink ^= crc(~0u, p, len);
    uint64_t t = now_ns() - t0;
    if (t < best) best = t;
  }
  (void)sink;
  return best;
}

static uint32_t crc_shift(uint32_t zeros[4][256], uint32_t crc) {
  return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

static void crc_init(void) {
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t c = n;
    for (int k = 0; k < 8; k++) c = c & 1 ? CRC32C_POLY ^ (c >> 1) : c >> 1;
    crc_table[0][n] = c;
  }
  for (uint32_t n = 0; n < 256; n++)
    for (int t = 1; t < 8; t++) crc_table[t][n] = (crc_table[t - 1][n] >> 8) ^ crc_table[0][crc_table[t - 1][n] & 0xff];
  unsigned a, b, c, d;
  crc_hw = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_SSE4_2);
  zeros_tables(crc_long, CRC_LONG);
  zeros_tables(crc_short, CRC_SHORT);
  if (crc_hw) {
    /* An emulated CPU may offer SSE4.2 and run it slower than table lookups: keep whichever is
     * faster here (both give the same checksum). 16 KiB: microseconds on hardware. */
    uint8_t sample[16384];
    for (uint32_t i = 0; i < sizeof sample; i++) sample[i] = (uint8_t)(i * 2654435761u >> 24);
    crc_hw = best_of_three(crc_hw_run, sample, sizeof sample) <= best_of_three(crc_sw, sample, sizeof sample);
  }
}

static uint64_t load64(const uint8_t *p) {
  uint64_t w;
  memcpy(&w, p, 8);
  return w;
}

/* Slicing by 8, on the raw register (no pre/post inversion). */
static uint32_t crc_sw(uint32_t c, const uint8_t *p, uint64_t len) {
  while (len && ((uintptr_t)p & 7)) {
    c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    len--;
  }
  for (; len >= 8; p += 8, len -= 8) {
    uint64_t w = load64(p) ^ c; /* little-endian: the CRC folds into the low four bytes */
    c = crc_table[7][w & 0xff] ^ crc_table[6][(w >> 8) & 0xff] ^ crc_table[5][(w >> 16) & 0xff] ^
        crc_table[4][(w >> 24) & 0xff] ^ crc_table[3][(w >> 32) & 0xff] ^ crc_table[2][(w >> 40) & 0xff] ^
        crc_table[1][(w >> 48) & 0xff] ^ crc_table[0][w >> 56];
  }
  while (len--) c = crc_table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return c;
}

/*
 * The crc32 instruction has a latency of 3 cycles and a throughput of one per cycle: three
 * independent streams keep it busy, and their CRCs are folded together by shifting the earlier
 * ones over the length of the later (crc_shift), which costs a few table lookups per block.
 */
__attribute__((target("sse4.2"))) static uint32_t crc_hw_run(uint32_t crc, const uint8_t *p, uint64_t len) {
  uint64_t c0 = crc;
  while (len && ((uintptr_t)p & 7)) {
    c0 = _mm_crc32_u8((uint32_t)c0, *p++);
    len--;
  }
  while (len >= 3 * CRC_LONG) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t *end = p + CRC_LONG;
    do {
      c0 = _mm_crc32_u64(c0, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + CRC_LONG));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * CRC_LONG));
      p += 8;
    } while (p < end);
    c0 = crc_shift(crc_long, (uint32_t)c0) ^ (uint32_t)c1;
    c0 = crc_shift(crc_long, (uint32_t)c0) ^ (uint32_t)c2;
    p += 2 * CRC_LONG;
    len -= 3 * CRC_LONG;
  }
  while (len >= 3 * CRC_SHORT) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t *end = p + CRC_SHORT;
    do {
      c0 = _mm_crc32_u64(c0, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + CRC_SHORT));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * CRC_SHORT));
      p += 8;
    } while (p < end);
    c0 = crc_shift(crc_short, (uint32_t)c0) ^ (uint32_t)c1;
    c0 = crc_shift(crc_short, (uint32_t)c0) ^ (uint32_t)c2;
    p += 2 * CRC_SHORT;
    len -= 3 * CRC_SHORT;
  }
  for (; len >= 8; p += 8, len -= 8) c0 = _mm_crc32_u64(c0, load64(p));
  while (len--) c0 = _mm_crc32_u8((uint32_t)c0, *p++);
  return (uint32_t)c0;
}

/* CRC32C of [p, p+len): the SSE4.2 instruction when the CPU has it. Callable from any thread. */
uint32_t pv_crc32c(const uint8_t *p, uint64_t len) {
  pthread_once(&crc_once, crc_init);
  return ~(crc_hw ? crc_hw_run(~0u, p, len) : crc_sw(~0u, p, len));
}

/* The portable path alone, so a test can hold the two against each other. */
uint32_t pv_crc32c_sw(const uint8_t *p, uint64_t len) {
  pthread_once(&crc_once, crc_init);
  return ~crc_sw(~0u, p, len);
}

void pv_page_hashes(const uint8_t *p, uint64_t pages, uint64_t *out) {
  for (uint64_t i = 0; i < pages; i++, p += 4096) {
    /* Two halves, two checksums: 64 bits to tell pages apart before they are compared byte by byte. */
    out[i] = (uint64_t)pv_crc32c(p, 2048) | (uint64_t)pv_crc32c(p + 2048, 2048) << 32;
  }
}
