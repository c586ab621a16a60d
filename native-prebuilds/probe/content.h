/*
 * Working-set content and digest of the pvisor probe guest (docs/probe-guest.md).
 *
 * Shared by probe.c (freestanding guest, compiled with -mgeneral-regs-only) and selftest.c
 * (hosted). The page generators are compiled twice with GCC target attributes: an SSE2 version
 * (x86-64 baseline) and an SSE4.1 version (pmulld), chosen at run time through CPUID. AVX is
 * never used (the VMM does not enable XSAVE/AVX state). Everything here must stay bit-identical
 * to the reference formulas (content_word_ref, content_digest_ref) and to the host's
 * JavaScript implementation.
 */
#ifndef PVISOR_PROBE_CONTENT_H
#define PVISOR_PROBE_CONTENT_H

#include <stdint.h>

#define CONTENT_REPETITIVE   0u
#define CONTENT_RANDOM       1u
#define CONTENT_COMPRESSIBLE 2u
#define CONTENT_KIND_COUNT   3u
#define CONTENT_PAGE_WORDS 1024u
#define CONTENT_PAGE_BYTES 4096u

/*
 * Compressible pages are lines of 32 words (128 bytes): the first 8 words of each line are fresh
 * (the random kind's words), the other 24 repeat those of line 0. A compressor keeps the fresh
 * quarter as literals and matches the rest against line 0, so every page compresses well, yet
 * every page still differs from every other (its fresh words carry its page index).
 */
#define CONTENT_LINE_WORDS  32u
#define CONTENT_FRESH_WORDS 8u

/* may_alias: pages are written through vectors and read back through u64/u32 pointers. */
typedef uint32_t content_v4u __attribute__((vector_size(16), may_alias));
typedef uint64_t content_u64a __attribute__((may_alias));
typedef uint32_t content_u32a __attribute__((may_alias));

static inline uint32_t fmix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    x ^= x >> 16;
    return x;
}

/* Reference definition of word j (0..1023) of page p (4 KiB page index from wsBase). */
static inline uint32_t content_word_ref(uint32_t kind, uint32_t seed, uint64_t p, uint32_t j)
{
    if (kind == CONTENT_REPETITIVE)
        return fmix32(seed + (j & 15u));
    if (kind == CONTENT_COMPRESSIBLE && (j % CONTENT_LINE_WORDS) >= CONTENT_FRESH_WORDS)
        j %= CONTENT_LINE_WORDS; /* repeat line 0 */
    return fmix32(fmix32(((uint32_t)(p << 10) + j) ^ seed) + fmix32(seed ^ 0x9E3779B9u));
}

/* Reference digest over nwords u32 words (nwords even). */
static inline void content_digest_ref(const uint32_t *w, uint64_t nwords, uint32_t *h1o, uint32_t *h2o)
{
    uint32_t h1 = 0x811C9DC5u, h2 = 0x01000193u;
    for (uint64_t i = 0; i < nwords; i++) {
        if ((i & 1) == 0)
            h1 = (h1 ^ w[i]) * 0x01000193u;
        else
            h2 = (h2 ^ w[i]) * 0x5BD1E995u;
    }
    *h1o = h1;
    *h2o = h2;
}

/* ---- vectorised page generators ---- */

#define CONTENT_VFMIX(v)                                                                     \
    ({                                                                                       \
        content_v4u _x = (v);                                                                \
        _x ^= _x >> 16;                                                                      \
        _x *= 0x85EBCA6Bu;                                                                   \
        _x ^= _x >> 13;                                                                      \
        _x *= 0xC2B2AE35u;                                                                   \
        _x ^= _x >> 16;                                                                      \
        _x;                                                                                  \
    })

/* Four random-kind words for the word indices idx (p*1024 + j), k = fmix32(s ^ 0x9E3779B9). */
#define CONTENT_VRANDOM(idx, vs, vk) CONTENT_VFMIX(CONTENT_VFMIX((idx) ^ (vs)) + (vk))

/*
 * One page of a distinct kind (CONTENT_LINE_WORDS above), with `fresh` fresh words per line:
 * CONTENT_LINE_WORDS for random (every word fresh), CONTENT_FRESH_WORDS for compressible. Fresh
 * words are fmix32(fmix32((base + j) ^ s) + k), base = p*1024 mod 2^32, k = fmix32(s ^
 * 0x9E3779B9). Line 0 is all fresh; later lines compute only their fresh vectors and store line
 * 0's others again, which the generator keeps in registers.
 */
#define CONTENT_DEFINE_DISTINCT_PAGE(name, tgt, fresh)                                       \
    __attribute__((target(tgt), noinline)) static void name(uint32_t *dst, uint32_t base,    \
                                                            uint32_t s, uint32_t k)          \
    {                                                                                        \
        const content_v4u vs = {s, s, s, s};                                                 \
        const content_v4u vk = {k, k, k, k};                                                 \
        const content_v4u four = {4, 4, 4, 4};                                               \
        const uint32_t skip = CONTENT_LINE_WORDS - (fresh);                                  \
        const content_v4u vskip = {skip, skip, skip, skip};                                  \
        content_v4u idx = {base, base + 1, base + 2, base + 3};                              \
        content_v4u *d = (content_v4u *)dst;                                                 \
        content_v4u r[CONTENT_LINE_WORDS / 4];                                               \
        _Pragma("GCC unroll 8")                                                              \
        for (uint32_t v = 0; v < CONTENT_LINE_WORDS / 4; v++) {                              \
            r[v] = CONTENT_VRANDOM(idx, vs, vk);                                             \
            d[v] = r[v];                                                                     \
            idx += four;                                                                     \
        }                                                                                    \
        for (uint32_t l = 1; l < CONTENT_PAGE_WORDS / CONTENT_LINE_WORDS; l++) {             \
            d += CONTENT_LINE_WORDS / 4;                                                     \
            _Pragma("GCC unroll 8")                                                          \
            for (uint32_t v = 0; v < (fresh) / 4; v++) {                                     \
                d[v] = CONTENT_VRANDOM(idx, vs, vk);                                         \
                idx += four;                                                                 \
            }                                                                                \
            _Pragma("GCC unroll 8")                                                          \
            for (uint32_t v = (fresh) / 4; v < CONTENT_LINE_WORDS / 4; v++)                  \
                d[v] = r[v];                                                                 \
            idx += vskip;                                                                    \
        }                                                                                    \
    }

CONTENT_DEFINE_DISTINCT_PAGE(content_random_page_sse2, "sse2", CONTENT_LINE_WORDS)
CONTENT_DEFINE_DISTINCT_PAGE(content_random_page_sse41, "sse4.1", CONTENT_LINE_WORDS)
CONTENT_DEFINE_DISTINCT_PAGE(content_compressible_page_sse2, "sse2", CONTENT_FRESH_WORDS)
CONTENT_DEFINE_DISTINCT_PAGE(content_compressible_page_sse41, "sse4.1", CONTENT_FRESH_WORDS)

/* npages consecutive pages of the 64-byte repetitive pattern pat[16]. */
__attribute__((target("sse2"), noinline)) static void
content_repetitive_pages_sse2(uint32_t *dst, uint64_t npages, const uint32_t *pat)
{
    const content_v4u a = {pat[0], pat[1], pat[2], pat[3]};
    const content_v4u b = {pat[4], pat[5], pat[6], pat[7]};
    const content_v4u c = {pat[8], pat[9], pat[10], pat[11]};
    const content_v4u e = {pat[12], pat[13], pat[14], pat[15]};
    content_v4u *d = (content_v4u *)dst;
    uint64_t n = npages * (CONTENT_PAGE_BYTES / 64);
    for (uint64_t i = 0; i < n; i++, d += 4) {
        d[0] = a;
        d[1] = b;
        d[2] = c;
        d[3] = e;
    }
}

/* Set by content_init(): 1 when CPUID reports SSE4.1. */
static int content_use_sse41;

static inline void content_cpuid(uint32_t leaf, uint32_t *a, uint32_t *b, uint32_t *c, uint32_t *d)
{
    __asm__ volatile("cpuid" : "=a"(*a), "=b"(*b), "=c"(*c), "=d"(*d) : "a"(leaf), "c"(0));
}

static void content_init(void)
{
    uint32_t a, b, c, d;
    content_cpuid(0, &a, &b, &c, &d);
    content_use_sse41 = 0;
    if (a >= 1) {
        content_cpuid(1, &a, &b, &c, &d);
        content_use_sse41 = (c >> 19) & 1; /* CPUID.1:ECX.SSE4_1 */
    }
}

/* Page p of a kind whose pages all differ (random or compressible); k = fmix32(s ^ 0x9E3779B9). */
static inline void content_distinct_page(uint32_t *dst, uint32_t kind, uint64_t p, uint32_t s,
                                         uint32_t k)
{
    uint32_t base = (uint32_t)(p << 10);
    if (kind == CONTENT_COMPRESSIBLE) {
        if (content_use_sse41)
            content_compressible_page_sse41(dst, base, s, k);
        else
            content_compressible_page_sse2(dst, base, s, k);
    } else if (content_use_sse41) {
        content_random_page_sse41(dst, base, s, k);
    } else {
        content_random_page_sse2(dst, base, s, k);
    }
}

static inline void content_pattern(uint32_t seed, uint32_t *pat)
{
    for (uint32_t j = 0; j < 16; j++)
        pat[j] = fmix32(seed + j);
}

/* FILL: write pages [first, first+npages) of the working set that starts at ws. */
static void content_fill(uint32_t *ws, uint64_t first, uint64_t npages, uint32_t kind, uint32_t seed)
{
    if (kind == CONTENT_REPETITIVE) {
        uint32_t pat[16];
        content_pattern(seed, pat);
        content_repetitive_pages_sse2(ws + first * CONTENT_PAGE_WORDS, npages, pat);
        return;
    }
    uint32_t k = fmix32(seed ^ 0x9E3779B9u);
    for (uint64_t p = first; p < first + npages; p++)
        content_distinct_page(ws + p * CONTENT_PAGE_WORDS, kind, p, seed, k);
}

/*
 * REWRITE: page p of the npages-page working set is rewritten iff
 * floor((p+1)*permille/1000) > floor(p*permille/1000), i.e. iff (p*permille mod 1000) +
 * permille >= 1000 (permille <= 1000). Returns the number of pages rewritten.
 */
static uint64_t content_rewrite(uint32_t *ws, uint64_t npages, uint32_t kind, uint32_t permille,
                                uint32_t seed)
{
    uint32_t pat[16];
    uint32_t k = fmix32(seed ^ 0x9E3779B9u);
    uint32_t acc = 0; /* p*permille mod 1000 */
    uint64_t n = 0;
    content_pattern(seed, pat);
    if (permille == 0)
        return 0;
    for (uint64_t p = 0; p < npages; p++) {
        acc += permille;
        if (acc < 1000)
            continue;
        acc -= 1000;
        n++;
        if (kind == CONTENT_REPETITIVE)
            content_repetitive_pages_sse2(ws + p * CONTENT_PAGE_WORDS, 1, pat);
        else
            content_distinct_page(ws + p * CONTENT_PAGE_WORDS, kind, p, seed, k);
    }
    return n;
}

/* DIGEST over bytes (a multiple of 8) of memory at ws. Two independent serial chains. */
static void content_digest(const uint32_t *ws, uint64_t bytes, uint32_t *h1o, uint32_t *h2o)
{
    const content_u64a *q = (const content_u64a *)ws;
    uint64_t n = bytes / 8;
    uint32_t h1 = 0x811C9DC5u, h2 = 0x01000193u;
#pragma GCC unroll 8
    for (uint64_t i = 0; i < n; i++) {
        uint64_t x = q[i];
        h1 = (h1 ^ (uint32_t)x) * 0x01000193u;
        h2 = (h2 ^ (uint32_t)(x >> 32)) * 0x5BD1E995u;
    }
    *h1o = h1;
    *h2o = h2;
}

#endif
