/*
 * pvisor-workset: an application's working set inside the Linux guest, for the memory study
 * (`pvisor bench memory --guest linux`) and the Linux guest's memory tests.
 *
 * It holds anonymous memory the way a program's heap does, filled with the probe guest's content
 * kinds (../probe/content.h: repetitive, random, compressible), so the host can compute the digest
 * the guest must report (src/guest/probe-content.ts) and check that every strategy brought back
 * exactly what the guest had. One process holds one working set until it is told to free it or
 * to exit; the host drives it through stdin, one command per line, and reads one answer line per
 * command on stdout:
 *
 *   fill SIZE KIND SEED    SIZE bytes (a multiple of 4096) of KIND (repetitive|random|compressible)
 *   rewrite PERMILLE SEED  the probe's REWRITE: the same pages, the same new content
 *   touch HOTBYTES ROUNDS  reads the first word of each page of the first HOTBYTES, ROUNDS times
 *   digest                 the probe's DIGEST over the working set
 *   zero OFFSET LENGTH     writes zeros over a page-aligned range (the pages stay the program's)
 *   task PATH              Table 2's task: digest, write the working set to PATH, fsync, read it
 *                          back and compare, remove PATH
 *   free                   gives the working set back to the kernel (munmap)
 *   exit
 *
 * Answers: `ok VERB key=value...` (times in ns of CLOCK_MONOTONIC around the work), or
 * `error TEXT`; a bad command never ends the process. Nothing is buffered beyond one line of
 * input (a longer line is an error), so a host that sends garbage costs the guest nothing.
 *
 * It is linked into the agent's static binary (native-prebuilds/agent/build.sh), which runs
 * workset_main() when called as pvisor-workset: a second static binary would put a second copy of
 * libc (700 KB) into every guest's RAM, since the initramfs lives there.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "../probe/content.h"
#include "workset.h"

#define LINE_MAX_BYTES 512

static uint32_t *ws;        /* the working set's mapping, or NULL */
static uint64_t ws_bytes;   /* its size */
static uint32_t ws_kind;

static uint64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void answer(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
}

/* A decimal u64 with nothing after it; 0 on success. */
static int parse_u64(const char *s, uint64_t *out)
{
    if (!s || !*s || *s == '-' || *s == '+')
        return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

static int parse_kind(const char *s, uint32_t *kind)
{
    static const char *const names[CONTENT_KIND_COUNT] = {"repetitive", "random", "compressible"};
    for (uint32_t k = 0; s && k < CONTENT_KIND_COUNT; k++)
        if (strcmp(s, names[k]) == 0)
            return *kind = k, 0;
    return -1;
}

static void release_ws(void)
{
    if (ws)
        munmap(ws, ws_bytes);
    ws = NULL;
    ws_bytes = 0;
}

static void cmd_fill(char **arg)
{
    uint64_t size, seed;
    uint32_t kind;
    if (parse_u64(arg[0], &size) || size % CONTENT_PAGE_BYTES || parse_kind(arg[1], &kind) ||
        parse_u64(arg[2], &seed) || seed > UINT32_MAX) {
        answer("error fill: expected SIZE (a multiple of 4096) KIND SEED (0..2^32-1)");
        return;
    }
    release_ws();
    if (size) {
        void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            answer("error fill: mmap of %" PRIu64 " bytes: %s", size, strerror(errno));
            return;
        }
        ws = m;
    }
    ws_bytes = size;
    ws_kind = kind;
    uint64_t t0 = now_ns();
    content_fill(ws, 0, size / CONTENT_PAGE_BYTES, kind, (uint32_t)seed);
    answer("ok fill bytes=%" PRIu64 " ns=%" PRIu64, size, now_ns() - t0);
}

static void cmd_rewrite(char **arg)
{
    uint64_t permille, seed;
    if (parse_u64(arg[0], &permille) || permille > 1000 || parse_u64(arg[1], &seed) || seed > UINT32_MAX) {
        answer("error rewrite: expected PERMILLE (0..1000) SEED (0..2^32-1)");
        return;
    }
    uint64_t t0 = now_ns();
    uint64_t n = ws ? content_rewrite(ws, ws_bytes / CONTENT_PAGE_BYTES, ws_kind, (uint32_t)permille, (uint32_t)seed) : 0;
    answer("ok rewrite pages=%" PRIu64 " ns=%" PRIu64, n, now_ns() - t0);
}

static void cmd_touch(char **arg)
{
    uint64_t hot, rounds;
    if (parse_u64(arg[0], &hot) || hot % CONTENT_PAGE_BYTES || hot > ws_bytes || parse_u64(arg[1], &rounds) || rounds > 1000000) {
        answer("error touch: expected HOTBYTES (a multiple of 4096, at most the working set) ROUNDS (at most 10^6)");
        return;
    }
    uint64_t t0 = now_ns();
    volatile uint32_t sink = 0;
    for (uint64_t r = 0; r < rounds; r++)
        for (uint64_t p = 0; p < hot / CONTENT_PAGE_BYTES; p++)
            sink ^= ((volatile uint32_t *)ws)[p * CONTENT_PAGE_WORDS];
    (void)sink;
    answer("ok touch pages=%" PRIu64 " ns=%" PRIu64, hot / CONTENT_PAGE_BYTES * rounds, now_ns() - t0);
}

static void digest_hex(char out[17], uint64_t *ns)
{
    uint32_t h1, h2;
    uint64_t t0 = now_ns();
    content_digest(ws, ws_bytes, &h1, &h2);
    *ns = now_ns() - t0;
    snprintf(out, 17, "%08" PRIx32 "%08" PRIx32, h2, h1);
}

static void cmd_digest(void)
{
    char hex[17];
    uint64_t ns;
    digest_hex(hex, &ns);
    answer("ok digest hex=%s bytes=%" PRIu64 " ns=%" PRIu64, hex, ws_bytes, ns);
}

static void cmd_zero(char **arg)
{
    uint64_t off, len;
    if (parse_u64(arg[0], &off) || parse_u64(arg[1], &len) || off % CONTENT_PAGE_BYTES || len % CONTENT_PAGE_BYTES ||
        off > ws_bytes || len > ws_bytes - off) {
        answer("error zero: expected OFFSET LENGTH (multiples of 4096, inside the working set)");
        return;
    }
    uint64_t t0 = now_ns();
    memset((char *)ws + off, 0, len);
    answer("ok zero bytes=%" PRIu64 " ns=%" PRIu64, len, now_ns() - t0);
}

static int write_all(int fd, const char *p, uint64_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n > (1u << 20) ? (1u << 20) : n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (uint64_t)w;
    }
    return 0;
}

/* Reads the file back in 1 MiB pieces and compares each with the working set. */
static int read_compare(int fd, const char **why)
{
    static char buf[1u << 20];
    uint64_t at = 0;
    for (;;) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return *why = "read", -1;
        if (r == 0)
            break;
        if ((uint64_t)r > ws_bytes - at || memcmp(buf, (char *)ws + at, (size_t)r))
            return *why = "the file read back differs from the working set", -1;
        at += (uint64_t)r;
    }
    if (at != ws_bytes)
        return *why = "the file read back is short", -1;
    return 0;
}

static void cmd_task(char **arg)
{
    const char *path = arg[0];
    if (!path || !*path) {
        answer("error task: expected PATH");
        return;
    }
    uint64_t t0 = now_ns(), digest_ns;
    char hex[17];
    digest_hex(hex, &digest_ns);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        answer("error task: open %s: %s", path, strerror(errno));
        return;
    }
    const char *why = NULL;
    if (write_all(fd, (const char *)ws, ws_bytes))
        why = "write";
    else if (fsync(fd))
        why = "fsync";
    else if (lseek(fd, 0, SEEK_SET) != 0)
        why = "lseek";
    else
        read_compare(fd, &why);
    int err = errno;
    close(fd);
    unlink(path);
    if (why) {
        answer("error task: %s of %s: %s", why, path, strerror(err));
        return;
    }
    answer("ok task hex=%s bytes=%" PRIu64 " ns=%" PRIu64, hex, ws_bytes, now_ns() - t0);
}

static void cmd_free(void)
{
    uint64_t bytes = ws_bytes, t0 = now_ns();
    release_ws();
    answer("ok free bytes=%" PRIu64 " ns=%" PRIu64, bytes, now_ns() - t0);
}

int workset_main(void)
{
    content_init();
    char line[LINE_MAX_BYTES];
    while (fgets(line, sizeof line, stdin)) {
        size_t n = strlen(line);
        if (n && line[n - 1] != '\n' && !feof(stdin)) {
            /* A line longer than the buffer: drop the rest of it, answer once. */
            int c;
            while ((c = getchar()) != EOF && c != '\n')
                ;
            answer("error a command line is at most %d bytes", LINE_MAX_BYTES - 2);
            continue;
        }
        char *arg[5] = {0};
        char *save = NULL;
        char *verb = strtok_r(line, " \t\r\n", &save);
        for (int i = 0; i < 4 && verb; i++)
            arg[i] = strtok_r(NULL, " \t\r\n", &save);
        if (arg[3])
            answer("error too many arguments");
        else if (!verb)
            answer("error empty command");
        else if (!strcmp(verb, "fill"))
            cmd_fill(arg);
        else if (!strcmp(verb, "rewrite"))
            cmd_rewrite(arg);
        else if (!strcmp(verb, "touch"))
            cmd_touch(arg);
        else if (!strcmp(verb, "digest"))
            cmd_digest();
        else if (!strcmp(verb, "zero"))
            cmd_zero(arg);
        else if (!strcmp(verb, "task"))
            cmd_task(arg);
        else if (!strcmp(verb, "free"))
            cmd_free();
        else if (!strcmp(verb, "exit"))
            return 0;
        else
            answer("error unknown command %s", verb);
    }
    return 0;
}
