/*
 * Host-side self-test of the probe's working-set content and digest (content.h).
 * Checks the vectorised generators (SSE2 and, when the host has it, SSE4.1) against the
 * reference formulas of docs/probe-guest.md, then prints reference values for the host's
 * JavaScript implementation to compare with.
 *
 * Build: gcc -O2 selftest.c -o selftest (build.sh does this).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "content.h"

#define MIB (1024u * 1024u)

static int failures;

static void check(int ok, const char *what)
{
    if (!ok) {
        printf("FAIL: %s\n", what);
        failures++;
    }
}

static uint32_t *alloc_pages(uint64_t npages)
{
    uint32_t *p = aligned_alloc(4096, npages * 4096);
    if (!p) {
        perror("aligned_alloc");
        exit(2);
    }
    memset(p, 0xA5, npages * 4096);
    return p;
}

static void ref_fill(uint32_t *ws, uint64_t first, uint64_t npages, uint32_t kind, uint32_t seed)
{
    for (uint64_t p = first; p < first + npages; p++)
        for (uint32_t j = 0; j < CONTENT_PAGE_WORDS; j++)
            ws[p * CONTENT_PAGE_WORDS + j] = content_word_ref(kind, seed, p, j);
}

static uint64_t ref_rewrite(uint32_t *ws, uint64_t npages, uint32_t kind, uint32_t permille,
                            uint32_t seed)
{
    uint64_t n = 0;
    for (uint64_t p = 0; p < npages; p++) {
        if ((p + 1) * permille / 1000 > p * permille / 1000) {
            n++;
            for (uint32_t j = 0; j < CONTENT_PAGE_WORDS; j++)
                ws[p * CONTENT_PAGE_WORDS + j] = content_word_ref(kind, seed, p, j);
        }
    }
    return n;
}

static void test_path(const char *name)
{
    static const uint32_t seeds[] = {0, 1, 42, 7, 0x9E3779B9u, 0xFFFFFFFFu, 0x12345678u};
    static const uint32_t permilles[] = {0, 1, 7, 250, 333, 500, 999, 1000};
    const uint64_t npages = 1003;
    uint32_t *a = alloc_pages(npages), *b = alloc_pages(npages);
    char what[160];

    for (uint32_t kind = 0; kind < CONTENT_KIND_COUNT; kind++) {
        for (size_t s = 0; s < sizeof(seeds) / sizeof(seeds[0]); s++) {
            memset(a, 0xA5, npages * 4096);
            memset(b, 0xA5, npages * 4096);
            content_fill(a, 0, npages, kind, seeds[s]);
            ref_fill(b, 0, npages, kind, seeds[s]);
            snprintf(what, sizeof(what), "%s fill kind=%u seed=%#x", name, kind, seeds[s]);
            check(memcmp(a, b, npages * 4096) == 0, what);

            /* a sub-range starting at a non-zero page must match and touch nothing else */
            memset(a, 0xA5, npages * 4096);
            memset(b, 0xA5, npages * 4096);
            content_fill(a, 5, 17, kind, seeds[s]);
            ref_fill(b, 5, 17, kind, seeds[s]);
            snprintf(what, sizeof(what), "%s partial fill kind=%u seed=%#x", name, kind, seeds[s]);
            check(memcmp(a, b, npages * 4096) == 0, what);

            uint32_t h1, h2, r1, r2;
            content_fill(a, 0, npages, kind, seeds[s]);
            content_digest(a, npages * 4096, &h1, &h2);
            content_digest_ref(a, npages * CONTENT_PAGE_WORDS, &r1, &r2);
            snprintf(what, sizeof(what), "%s digest kind=%u seed=%#x", name, kind, seeds[s]);
            check(h1 == r1 && h2 == r2, what);
        }
        for (size_t m = 0; m < sizeof(permilles) / sizeof(permilles[0]); m++) {
            content_fill(a, 0, npages, kind, 42);
            ref_fill(b, 0, npages, kind, 42);
            uint64_t na = content_rewrite(a, npages, kind, permilles[m], 7);
            uint64_t nb = ref_rewrite(b, npages, kind, permilles[m], 7);
            snprintf(what, sizeof(what), "%s rewrite kind=%u permille=%u", name, kind, permilles[m]);
            check(na == nb && memcmp(a, b, npages * 4096) == 0, what);
        }
    }

    /* page index wrap: p*1024 is taken mod 2^32 */
    uint64_t bigp[] = {4194303, 4194304, 4194305, 0x123456789ull};
    for (uint32_t kind = CONTENT_RANDOM; kind <= CONTENT_COMPRESSIBLE; kind++) {
        for (size_t i = 0; i < sizeof(bigp) / sizeof(bigp[0]); i++) {
            content_distinct_page(a, kind, bigp[i], 42, fmix32(42 ^ 0x9E3779B9u));
            int ok = 1;
            for (uint32_t j = 0; j < CONTENT_PAGE_WORDS; j++)
                ok &= a[j] == content_word_ref(kind, 42, bigp[i], j);
            snprintf(what, sizeof(what), "%s kind=%u page p=%#llx", name, kind,
                     (unsigned long long)bigp[i]);
            check(ok, what);
        }
    }
    free(a);
    free(b);
}

int main(void)
{
    content_init();
    int have_sse41 = content_use_sse41;

    content_use_sse41 = 0;
    test_path("sse2");
    if (have_sse41) {
        content_use_sse41 = 1;
        test_path("sse4.1");
    } else {
        printf("note: host has no SSE4.1, only the SSE2 path was tested\n");
    }
    content_use_sse41 = have_sse41;

    /* Reference values for the JavaScript implementation. */
    printf("fmix32(0)=%08x fmix32(1)=%08x fmix32(42)=%08x fmix32(42^0x9E3779B9)=%08x\n",
           fmix32(0), fmix32(1), fmix32(42), fmix32(42u ^ 0x9E3779B9u));

    const uint64_t npages = MIB / 4096;
    uint32_t *ws = alloc_pages(npages);
    static const char *const names[CONTENT_KIND_COUNT] = {"repetitive", "random", "compressible"};
    for (uint32_t kind = 0; kind < CONTENT_KIND_COUNT; kind++) {
        uint32_t h1, h2;
        content_fill(ws, 0, npages, kind, 42);
        printf("%s seed=42: w[0]=%08x w[1]=%08x w[15]=%08x w[32]=%08x w[40]=%08x w[1024]=%08x\n",
               names[kind], ws[0], ws[1], ws[15], ws[32], ws[40], ws[1024]);
        content_digest(ws, MIB, &h1, &h2);
        printf("DIGEST %-12s 1 MiB seed=42: h1=%08x h2=%08x\n", names[kind], h1, h2);

        uint64_t n = content_rewrite(ws, npages, kind, 250, 7);
        content_digest(ws, MIB, &h1, &h2);
        printf("DIGEST %-12s 1 MiB seed=42 + REWRITE permille=250 seed=7 (%llu pages): "
               "h1=%08x h2=%08x\n", names[kind], (unsigned long long)n, h1, h2);
    }
    free(ws);

    if (failures) {
        printf("selftest: %d FAILURES\n", failures);
        return 1;
    }
    printf("selftest: ok (%s)\n", have_sse41 ? "sse2 + sse4.1 paths" : "sse2 path");
    return 0;
}
