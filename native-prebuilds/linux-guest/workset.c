/*
 * pvisor-workset: an application's working set inside the Linux guest, for the memory study
 * (`pvisor bench memory --guest linux`) and the Linux guest's memory tests.
 *
 * It holds anonymous memory the way a program's heap does, filled with the probe guest's content
 * kinds (../probe/content.h: repetitive, random, compressible), so the host can compute the digest
 * the guest must report (src/guest/probe-content.ts) and check that every strategy brought back
 * exactly what the guest had.
 *
 *   pvisor-workset serve SOCKET      holds the working set; serves commands on a Unix socket
 *   pvisor-workset SOCKET COMMAND    sends one command, prints the answer, exits 0 if it is ok
 *
 * The holder is driven through a socket, not its stdin, because the host's end of a process's
 * stdin does not survive a snapshot: a VM restored from one (a clone, a hibernated VM brought
 * back) still runs the holder with its memory, and each command is a new process that finds it.
 * The holder serves one connection at a time, one line in and one line out:
 *
 *   fill SIZE KIND SEED    SIZE bytes (a multiple of 4096) of KIND (repetitive|random|compressible)
 *   rewrite PERMILLE SEED  the probe's REWRITE: the same pages, the same new content
 *   touch HOTBYTES ROUNDS  reads the first word of each page of the first HOTBYTES, ROUNDS times
 *   digest                 the probe's DIGEST over the working set
 *   zero OFFSET LENGTH     writes zeros over a page-aligned range (the pages stay the program's)
 *   free [OFFSET LENGTH]   gives the whole working set (or a page-aligned range of it, which then
 *                          reads as zeros) back to the kernel, as a program's free does
 *   exit
 *
 * Answers: `ok VERB key=value...` (times in ns of CLOCK_MONOTONIC around the work), or
 * `error TEXT`; a bad command never ends the holder. It reads at most one line of 512 bytes per
 * connection, so a client that sends garbage costs the guest nothing.
 *
 * It is linked into the agent's static binary (native-prebuilds/agent/build.sh), which runs
 * workset_main() when called as pvisor-workset: a second static binary would put a second copy of
 * libc (700 KB) into every guest's RAM, since the initramfs lives there.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "../probe/content.h"
#include "workset.h"

#define LINE_MAX_BYTES 512

static uint32_t *ws;        /* the working set's mapping, or NULL */
static uint64_t ws_bytes;   /* its size */
static uint32_t ws_kind;

/* The answer being built for the current command. */
static char reply[LINE_MAX_BYTES];

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
    vsnprintf(reply, sizeof reply, fmt, ap);
    va_end(ap);
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
    for (uint32_t k = 0; s && k < CONTENT_KIND_COUNT; k++) {
        if (strcmp(s, names[k]) == 0) {
            *kind = k;
            return 0;
        }
    }
    return -1;
}

/* A page-aligned range inside the working set; 0 on success. */
static int parse_range(char **arg, uint64_t *off, uint64_t *len)
{
    return parse_u64(arg[0], off) || parse_u64(arg[1], len) || *off % CONTENT_PAGE_BYTES ||
           *len % CONTENT_PAGE_BYTES || *off > ws_bytes || *len > ws_bytes - *off;
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
    if (parse_u64(arg[0], &hot) || hot % CONTENT_PAGE_BYTES || hot > ws_bytes || parse_u64(arg[1], &rounds) ||
        rounds > 1000000) {
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

static void cmd_digest(void)
{
    uint32_t h1, h2;
    uint64_t t0 = now_ns();
    content_digest(ws, ws_bytes, &h1, &h2);
    answer("ok digest hex=%08" PRIx32 "%08" PRIx32 " bytes=%" PRIu64 " ns=%" PRIu64, h2, h1, ws_bytes, now_ns() - t0);
}

static void cmd_zero(char **arg)
{
    uint64_t off, len;
    if (parse_range(arg, &off, &len)) {
        answer("error zero: expected OFFSET LENGTH (multiples of 4096, inside the working set)");
        return;
    }
    uint64_t t0 = now_ns();
    memset((char *)ws + off, 0, len);
    answer("ok zero bytes=%" PRIu64 " ns=%" PRIu64, len, now_ns() - t0);
}

static void cmd_free(char **arg)
{
    uint64_t t0 = now_ns(), off = 0, len = ws_bytes;
    if (arg[0] && parse_range(arg, &off, &len)) {
        answer("error free: expected nothing, or OFFSET LENGTH (multiples of 4096, inside the working set)");
        return;
    }
    /* A range, even the whole set, stays the working set and reads as zeros: only a free without
     * one gives the working set up. */
    if (!arg[0]) {
        release_ws();
    } else if (len) {
        /* A fresh mapping over the range: its pages go back to the kernel and read as zeros. */
        if (mmap((char *)ws + off, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) {
            answer("error free: mmap over %" PRIu64 " bytes: %s", len, strerror(errno));
            return;
        }
    }
    answer("ok free bytes=%" PRIu64 " ns=%" PRIu64, len, now_ns() - t0);
}

/* Runs one command line (NUL-terminated, without its newline) into `reply`; 1 for exit. */
static int run_command(char *line)
{
    char *arg[4] = {0};
    char *save = NULL;
    char *verb = strtok_r(line, " \t\r", &save);
    for (int i = 0; i < 4 && verb; i++)
        arg[i] = strtok_r(NULL, " \t\r", &save);
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
    else if (!strcmp(verb, "free"))
        cmd_free(arg);
    else if (!strcmp(verb, "exit")) {
        answer("ok exit");
        return 1;
    } else
        answer("error unknown command %.64s", verb);
    return 0;
}

static int socket_address(const char *path, struct sockaddr_un *sa)
{
    if (strlen(path) >= sizeof sa->sun_path)
        return -1;
    memset(sa, 0, sizeof *sa);
    sa->sun_family = AF_UNIX;
    strcpy(sa->sun_path, path);
    return 0;
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Reads one line of at most LINE_MAX_BYTES - 1 bytes (without its newline); -1 if there is none. */
static int read_line(int fd, char *line)
{
    size_t n = 0;
    while (n < LINE_MAX_BYTES - 1) {
        ssize_t r = read(fd, line + n, 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        if (line[n] == '\n') {
            line[n] = 0;
            return 0;
        }
        n++;
    }
    line[n] = 0;
    return n == LINE_MAX_BYTES - 1 ? -2 : (n ? 0 : -1);
}

static int serve(const char *path)
{
    struct sockaddr_un sa;
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0 || socket_address(path, &sa)) {
        fprintf(stderr, "pvisor-workset: bad socket path %s\n", path);
        return 2;
    }
    unlink(path);
    if (bind(s, (struct sockaddr *)&sa, sizeof sa) || listen(s, 4)) {
        fprintf(stderr, "pvisor-workset: cannot listen on %s: %s\n", path, strerror(errno));
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    /* Ready: the host waits for this line before its first command. */
    printf("ok serve\n");
    fflush(stdout);
    content_init();
    for (;;) {
        int c = accept4(s, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0)
            continue;
        /* A client that connects and says nothing must not hold the holder. */
        struct timeval limit = {.tv_sec = 10};
        setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
        char line[LINE_MAX_BYTES];
        int got = read_line(c, line), done = 0;
        if (got == -2)
            answer("error a command line is at most %d bytes", LINE_MAX_BYTES - 2);
        else if (got == 0)
            done = run_command(line);
        if (got != -1) {
            size_t n = strlen(reply);
            reply[n] = '\n';
            write_all(c, reply, n + 1);
        }
        close(c);
        if (done) {
            unlink(path);
            return 0;
        }
    }
}

/* Sends argv[2..] as one command to the holder at argv[1] and prints its answer. */
static int client(int argc, char **argv)
{
    char line[LINE_MAX_BYTES];
    size_t n = 0;
    for (int i = 2; i < argc; i++) {
        int w = snprintf(line + n, sizeof line - n, "%s%s", i > 2 ? " " : "", argv[i]);
        if (w < 0 || (size_t)w >= sizeof line - n - 1) {
            printf("error a command line is at most %d bytes\n", LINE_MAX_BYTES - 2);
            return 1;
        }
        n += (size_t)w;
    }
    line[n++] = '\n';
    struct sockaddr_un sa;
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0 || socket_address(argv[1], &sa) || connect(s, (struct sockaddr *)&sa, sizeof sa)) {
        printf("error no pvisor-workset serves %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    if (write_all(s, line, n)) {
        printf("error cannot send to %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    int got = read_line(s, line);
    if (got) {
        printf("error the holder at %s did not answer\n", argv[1]);
        return 1;
    }
    printf("%s\n", line);
    return strncmp(line, "ok ", 3) == 0 ? 0 : 1;
}

int workset_main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "serve") == 0)
        return serve(argv[2]);
    if (argc >= 3 && argv[1][0] == '/')
        return client(argc, argv);
    fprintf(stderr, "usage: pvisor-workset serve SOCKET | pvisor-workset SOCKET COMMAND [ARGS]\n");
    return 2;
}
