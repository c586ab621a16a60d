/*
 * Seeded fuzz driver of the agent's frame reading (agent-frames.h), built by the unit suite
 * (test/unit/agent-frames-fuzz.test.ts) with the host's C compiler under AddressSanitizer and
 * UndefinedBehaviorSanitizer, so an out-of-bounds read or an overflow stops it with a report.
 * It drives the very functions agent.c calls, over input buffers allocated to their exact size
 * (a read past the bytes received is a sanitizer error, not a quiet read of stale data):
 *
 * 1. streams of valid frames cut at random points are served whole and in order, each exactly
 *    once, as they were sent (type, id, op, flags, payload), however the bytes arrive;
 * 2. streams of random bytes and of valid frames with random bytes changed, cut at random points:
 *    every frame served lies inside the bytes received and within the payload limit, the bytes
 *    used never exceed those held, and what is held never exceeds one largest frame;
 * 3. request strings (pv_take_str), files paths (pv_take_path) and EXEC's counts
 *    (pv_exec_counts_fit) over random payloads agree with a plain reference, and a string never
 *    reaches past its payload;
 * 4. a FILE_LIST entry (pv_entry_put) writes exactly its bytes and reads back as written;
 * 5. stream credit: CREDIT frames (pv_credit_parse), well formed or not, read as a plain reference
 *    says, from inside a stream of frames as the agent receives them; and a stream that takes
 *    every grant (pv_credit_add) and sends chunks of what its credit allows (pv_credit_chunk)
 *    never sends more than its window and the grants, never wraps, and never stalls while it
 *    has credit.
 * 6. users (agent-users.h): user specs, and /etc/passwd and /etc/group texts made of valid,
 *    malformed and random lines (in buffers of their exact size, not NUL-terminated), are read
 *    within their bytes; a spec taken as ids prints back as itself, one taken as a name is one;
 *    a user found has a home that is absolute, NUL-terminated and short, on a line of its name;
 *    a group list starts with the primary gid, holds no gid twice and at most PV_MAX_GROUPS.
 *
 * usage: fuzz-frames SEED [ROUNDS]; prints the seed first, so a failure reruns from it.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "agent-frames.h"
#include "agent-users.h"

static uint64_t rng_state;
static uint64_t next64(void) { /* splitmix64 */
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static uint32_t below(uint32_t n) { return n ? (uint32_t)(next64() % n) : 0; }

#define CHECK(cond, ...)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "fuzz-frames: %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                       \
      fprintf(stderr, "\n");                                                              \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

/* A payload length: mostly small, sometimes around 64 KiB, now and then up to the limit. */
static uint32_t some_length(void) {
  switch (below(16)) {
  case 0: return PV_FRAME_MAX_PAYLOAD - below(3);
  case 1: case 2: return below(70000);
  default: return below(64);
  }
}

/* ---- the receiving side, as agent.c's main loop and parse_input() use it ---- */
struct sent { uint8_t type; uint32_t id; uint16_t op, flags; uint32_t len; uint64_t sum; };
struct receiver {
  uint8_t *held; /* exactly `n` bytes, reallocated to size on every arrival */
  size_t n;
  const struct sent *expect; /* property 1: what must come, in order */
  size_t expected, served, bad;
  const uint8_t *lo, *hi; /* the buffer being served, for property 2's bounds */
};

static uint64_t sum_of(const uint8_t *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static void on_frame(void *ctx, const struct pv_frame *f) {
  struct receiver *r = ctx;
  CHECK(f->len <= PV_FRAME_MAX_PAYLOAD, "frame of %u bytes", f->len);
  CHECK(f->payload >= r->lo + PV_FRAME_HDR && f->payload + f->len <= r->hi, "payload outside the bytes received");
  if (r->expect) {
    CHECK(r->served < r->expected, "frame %zu served, only %zu sent", r->served, r->expected);
    const struct sent *s = &r->expect[r->served];
    CHECK(f->type == s->type && f->id == s->id && f->op == s->op && f->flags == s->flags && f->len == s->len, "frame %zu differs from what was sent", r->served);
    CHECK(sum_of(f->payload, f->len) == s->sum, "frame %zu's payload differs", r->served);
  }
  r->served++;
}

static void on_bad(void *ctx) { ((struct receiver *)ctx)->bad++; }

/* Bytes arrive: held grows by them, then every whole frame is served and dropped. */
static void arrive(struct receiver *r, const uint8_t *bytes, size_t k) {
  uint8_t *held = malloc(r->n + k ? r->n + k : 1);
  CHECK(held != NULL, "malloc");
  if (r->n) memcpy(held, r->held, r->n);
  memcpy(held + r->n, bytes, k);
  free(r->held);
  r->held = held;
  r->n += k;
  r->lo = held;
  r->hi = held + r->n;
  size_t used = pv_frames_take(held, r->n, on_frame, on_bad, r);
  CHECK(used <= r->n, "used %zu of %zu bytes", used, r->n);
  /* exact size again: what is left is all the next pass may read */
  size_t left = r->n - used;
  uint8_t *rest = malloc(left ? left : 1);
  CHECK(rest != NULL, "malloc");
  memcpy(rest, held + used, left);
  free(held);
  r->held = rest;
  r->n = left;
  CHECK(r->n < PV_FRAME_HDR + PV_FRAME_MAX_PAYLOAD, "%zu bytes held without a whole frame", r->n);
}

/*
 * Feeds a stream in pieces of random sizes (single bytes, a header's worth, large runs), often
 * cut one byte before, at or after a frame's end (`ends`, if known): where an off-by-one shows.
 */
static void feed(struct receiver *r, const uint8_t *s, size_t n, const size_t *ends, size_t nends) {
  size_t e = 0;
  for (size_t at = 0; at < n;) {
    size_t k;
    while (e < nends && ends[e] <= at + 1) e++;
    switch (below(5)) {
    case 0: k = 1; break;
    case 1: k = 1 + below(PV_FRAME_HDR * 2); break;
    case 2: k = 1 + below(4096); break;
    case 3: k = e < nends ? ends[e] - at - 1 + below(3) : 1; break;
    default: k = 1 + below(300000); break;
    }
    if (k > n - at) k = n - at;
    arrive(r, s + at, k);
    at += k;
  }
}

/* A stream of valid frames, and what each was. */
static uint8_t *valid_stream(size_t frames, struct sent *sent, size_t *len, size_t *ends) {
  size_t cap = 0;
  for (size_t i = 0; i < frames; i++) {
    sent[i] = (struct sent){.type = (uint8_t)below(256), .id = (uint32_t)next64(), .op = (uint16_t)next64(), .flags = (uint16_t)next64(), .len = some_length()};
    cap += PV_FRAME_HDR + sent[i].len;
  }
  uint8_t *s = malloc(cap ? cap : 1), *p = s;
  CHECK(s != NULL, "malloc");
  for (size_t i = 0; i < frames; i++) {
    pv_frame_header_put(p, sent[i].type, sent[i].id, sent[i].op, sent[i].flags, sent[i].len);
    for (uint32_t j = 0; j < sent[i].len; j++) p[PV_FRAME_HDR + j] = (uint8_t)next64();
    sent[i].sum = sum_of(p + PV_FRAME_HDR, sent[i].len);
    p += PV_FRAME_HDR + sent[i].len;
    ends[i] = (size_t)(p - s);
  }
  *len = cap;
  return s;
}

static void property_valid_streams(void) {
  struct sent sent[24];
  size_t ends[24], frames = 1 + below(24), n;
  uint8_t *s = valid_stream(frames, sent, &n, ends);
  struct receiver r = {.expect = sent, .expected = frames};
  feed(&r, s, n, ends, frames);
  CHECK(r.served == frames && r.bad == 0 && r.n == 0, "%zu of %zu frames served, %zu bad, %zu bytes left", r.served, frames, r.bad, r.n);
  free(r.held);
  free(s);
}

static void property_hostile_streams(void) {
  size_t n, ends[16], nends = 0;
  uint8_t *s;
  if (below(2)) {
    n = below(200000);
    s = malloc(n ? n : 1);
    CHECK(s != NULL, "malloc");
    for (size_t i = 0; i < n; i++) s[i] = (uint8_t)next64();
    /* now and then a plausible header inside the noise */
    for (size_t k = below(8); k-- && n >= PV_FRAME_HDR;) {
      uint8_t *h = s + below((uint32_t)(n - PV_FRAME_HDR + 1));
      h[0] = PV_FRAME_MAGIC0, h[1] = PV_FRAME_MAGIC1, h[2] = PV_FRAME_VERSION;
      pv_wr32(h + 12, below(3) ? some_length() : (uint32_t)next64());
    }
  } else {
    struct sent sent[16];
    nends = 1 + below(16);
    s = valid_stream(nends, sent, &n, ends);
    for (size_t k = 1 + below(16); k-- && n;) s[below((uint32_t)n)] = (uint8_t)next64();
  }
  struct receiver r = {0};
  feed(&r, s, n, ends, nends);
  free(r.held);
  free(s);
}

/* The reference: a string as the protocol describes it, checked with 64-bit arithmetic. */
static int ref_take_str(const uint8_t *p, size_t avail, size_t *len) {
  if (avail < 4) return 0;
  uint64_t n = pv_rd32(p);
  if (4 + n > avail) return 0;
  for (uint64_t i = 0; i < n; i++)
    if (!p[4 + i]) return 0;
  *len = (size_t)n;
  return 1;
}

static void property_payload_fields(void) {
  size_t n = below(4) ? below(64) : below(5000);
  uint8_t *pl = malloc(n ? n : 1);
  CHECK(pl != NULL, "malloc");
  for (size_t i = 0; i < n; i++) pl[i] = below(8) ? (uint8_t)(1 + below(255)) : (uint8_t)next64();
  /* strings whose lengths are near what is left, at random places */
  for (size_t at = 0; at + 4 <= n && below(4);) {
    uint32_t v = (uint32_t)(n - at - 4) + below(5) - 2;
    if (below(8) == 0) v = (uint32_t)next64();
    pv_wr32(pl + at, v);
    at += 4 + below((uint32_t)(n - at));
  }
  const uint8_t *p = pl, *end = pl + n;
  while (p <= end) {
    size_t ref_len = 0;
    int ref = ref_take_str(p, (size_t)(end - p), &ref_len);
    const uint8_t *before = p, *str = NULL;
    uint32_t len = 0;
    int got = pv_take_str(&p, end, &str, &len);
    CHECK(got == ref, "pv_take_str says %d, the reference %d", got, ref);
    if (!got) {
      CHECK(p == before, "a refused string moved the cursor");
      break;
    }
    CHECK(len == ref_len && str == before + 4 && p == str + len && p <= end, "string of %u bytes, the reference %zu", len, ref_len);
    CHECK(!memchr(str, 0, len), "a NUL inside an accepted string");
  }
  /* the same payload read as files paths (pv_take_path): a string of 1 to PV_PATH_MAX - 1 bytes */
  for (p = pl; p <= end;) {
    size_t ref_len = 0;
    int ref = ref_take_str(p, (size_t)(end - p), &ref_len) && ref_len >= 1 && ref_len < PV_PATH_MAX;
    const uint8_t *before = p, *str = NULL;
    uint32_t len = 0;
    int got = pv_take_path(&p, end, &str, &len);
    CHECK(got == ref, "pv_take_path says %d, the reference %d", got, ref);
    if (!got) {
      CHECK(p == before, "a refused path moved the cursor");
      break;
    }
    CHECK(len == ref_len && str == before + 4 && p == str + len && p <= end && len < PV_PATH_MAX, "path of %u bytes, the reference %zu", len, ref_len);
  }
  uint32_t flags, argc, envc;
  int fit = pv_exec_counts_fit(pl, n, &flags, &argc, &envc);
  if (n >= 16) {
    int ref = pv_rd32(pl + 4) != 0 && (unsigned __int128)pv_rd32(pl + 4) + pv_rd32(pl + 8) + 1 <= (n - 16) / 4;
    CHECK(fit == ref && argc == pv_rd32(pl + 4) && envc == pv_rd32(pl + 8) && flags == pv_rd32(pl), "EXEC counts: %d, the reference %d", fit, ref);
    /* what the agent then allocates: argc + envc + 2 pointers, bounded by the payload */
    if (fit) CHECK((uint64_t)argc + envc <= n / 4, "counts %u + %u beyond a %zu-byte payload", argc, envc, n);
  } else CHECK(!fit, "EXEC counts fit a %zu-byte payload", n);
  free(pl);
}

/* A FILE_LIST entry (pv_entry_put) fills exactly PV_ENTRY_HDR + nameLen bytes (the buffer is that
 * size: a byte more is a sanitizer error) and reads back as written. */
static void property_list_entry(void) {
  uint8_t name[255];
  uint16_t nl = (uint16_t)(1 + below(255));
  for (uint16_t i = 0; i < nl; i++) name[i] = (uint8_t)(1 + below(255));
  uint8_t type = (uint8_t)below(8);
  uint32_t mode = below(07777 + 1);
  uint64_t size = next64(), mt = next64();
  uint8_t *e = malloc(PV_ENTRY_HDR + nl);
  CHECK(e != NULL, "malloc");
  pv_entry_put(e, name, nl, type, mode, size, (int64_t)mt);
  uint64_t size_back = 0, mt_back = 0;
  for (int i = 0; i < 8; i++) size_back |= (uint64_t)e[8 + i] << 8 * i, mt_back |= (uint64_t)e[16 + i] << 8 * i;
  CHECK(pv_rd16(e) == nl && e[2] == type && e[3] == 0 && pv_rd32(e + 4) == mode && size_back == size && mt_back == mt && !memcmp(e + PV_ENTRY_HDR, name, nl), "entry of a %u-byte name reads back otherwise", nl);
  free(e);
}

/* The reference reading of a CREDIT frame, from the protocol's words. */
static int ref_credit(const struct pv_frame *f, uint16_t *channel, uint32_t *bytes) {
  if (f->op != 0x0003 || f->len != 4 || !(f->flags == 1 || f->flags == 2)) return 0;
  uint32_t n = (uint32_t)f->payload[0] | (uint32_t)f->payload[1] << 8 | (uint32_t)f->payload[2] << 16 | (uint32_t)f->payload[3] << 24;
  if (!n) return 0;
  *channel = f->flags;
  *bytes = n;
  return 1;
}

/* What a stream of frames carries for credit: frames served are checked against the reference,
 * and a stream's credit is kept as the agent keeps it. */
struct credit_rx {
  size_t credits, good;
  uint32_t credit;       /* the stream's credit, as agent.c keeps it */
  uint64_t granted;      /* the reference: window plus every grant, without saturation */
  uint64_t sent;
  int saturated; /* a grant met UINT32_MAX: from then on credit is below the reference */
};

static void on_credit_frame(void *ctx, const struct pv_frame *f) {
  struct credit_rx *r = ctx;
  uint16_t ch = 0, rch = 0;
  uint32_t n = 0, rn = 0;
  int got = pv_credit_parse(f, &ch, &n), ref = ref_credit(f, &rch, &rn);
  CHECK(got == ref, "pv_credit_parse says %d, the reference %d (op 0x%x, flags %u, %u bytes)", got, ref, f->op, f->flags, f->len);
  if (f->type == PV_T_CREDIT) r->credits++;
  if (!got) return;
  CHECK(ch == rch && n == rn && n > 0, "grant of %u on %u, the reference %u on %u", n, ch, rn, rch);
  r->good++;
  uint32_t before = r->credit;
  r->credit = pv_credit_add(r->credit, n);
  r->granted += n;
  CHECK(r->credit >= before && (r->credit == UINT32_MAX || r->credit == before + n), "credit %u + %u gave %u", before, n, r->credit);
  if ((uint64_t)before + n > UINT32_MAX) r->saturated = 1;
}

static void property_credit(void) {
  /* CREDIT frames (some well formed, some not: op, flags, length, zero), and other frames. */
  size_t frames = 1 + below(40), cap = 0;
  uint8_t *s = malloc(frames * (PV_FRAME_HDR + 8));
  CHECK(s != NULL, "malloc");
  for (size_t i = 0; i < frames; i++) {
    uint8_t *p = s + cap;
    uint32_t len = below(4) ? 4 : below(9);
    p[0] = PV_FRAME_MAGIC0, p[1] = PV_FRAME_MAGIC1, p[2] = PV_FRAME_VERSION, p[3] = below(4) ? PV_T_CREDIT : (uint8_t)below(8);
    pv_wr32(p + 4, (uint32_t)next64());
    pv_wr16(p + 8, below(4) ? PV_OP_CREDIT : (uint16_t)next64());
    pv_wr16(p + 10, below(4) ? (uint16_t)(1 + below(2)) : (uint16_t)below(5));
    pv_wr32(p + 12, len);
    uint32_t grant = below(8) == 0 ? 0 : below(8) == 0 ? UINT32_MAX - below(3) : below(3) ? below(PV_STREAM_WINDOW) : (uint32_t)next64();
    for (uint32_t j = 0; j < len; j++) p[PV_FRAME_HDR + j] = j < 4 ? (uint8_t)(grant >> 8 * j) : (uint8_t)next64();
    cap += PV_FRAME_HDR + len;
  }
  struct credit_rx cr = {.credit = PV_STREAM_WINDOW, .granted = PV_STREAM_WINDOW};
  /* arrive in random pieces, as the agent reads its channel */
  uint8_t *held = NULL;
  size_t n = 0;
  for (size_t at = 0; at < cap;) {
    size_t k = 1 + below(below(2) ? 24 : (uint32_t)(cap - at));
    if (k > cap - at) k = cap - at;
    uint8_t *h = malloc(n + k);
    CHECK(h != NULL, "malloc");
    if (n) memcpy(h, held, n);
    memcpy(h + n, s + at, k);
    free(held);
    held = h;
    n += k;
    at += k;
    size_t used = pv_frames_take(held, n, on_credit_frame, on_bad, &cr);
    memmove(held, held + used, n - used);
    n -= used;
    /* between arrivals the stream sends what its credit allows, a chunk at a time */
    for (int c = below(4); c-- && cr.credit;) {
      uint32_t want = 1 + below(80000);
      uint32_t got = pv_credit_chunk(cr.credit, want);
      CHECK(got > 0 && got <= want && got <= cr.credit, "a chunk of %u with %u credit, %u wanted", got, cr.credit, want);
      cr.credit -= got;
      cr.sent += got;
    }
    CHECK(cr.sent <= cr.granted, "sent %llu with %llu granted", (unsigned long long)cr.sent, (unsigned long long)cr.granted);
    CHECK(cr.credit <= cr.granted - cr.sent, "credit %u beyond what was granted", cr.credit);
    CHECK(cr.saturated || cr.credit == cr.granted - cr.sent, "credit %u, granted - sent %llu", cr.credit, (unsigned long long)(cr.granted - cr.sent));
  }
  CHECK(n == 0, "%zu bytes of whole frames left", n);
  free(held);
  free(s);
}

/* ---- users ---- */
static const char *const some_names[] = {"root", "nobody", "alice", "bob", "a", "x$", "-x", "al:ce", "", "bo,b"};

/* Appends a passwd or group line to s at *n (capacity cap): valid, malformed, or random bytes. */
static void put_line(char *s, size_t *n, size_t cap, int group) {
  char line[600];
  int len;
  const char *name = some_names[below(sizeof some_names / sizeof *some_names)];
  switch (below(6)) {
  case 0: case 1:
    len = group ? snprintf(line, sizeof line, "%s:x:%u:%s,%s", name, below(5) ? below(70000) : (uint32_t)next64(), some_names[below(10)], some_names[below(10)])
                : snprintf(line, sizeof line, "%s:x:%u:%u:g:/%s:/bin/sh", name, below(70000), below(4) ? below(70000) : (uint32_t)next64(), below(3) ? "home" : "");
    break;
  case 2: /* fields missing or too many */
    len = snprintf(line, sizeof line, "%s:x:%u%s", name, below(100), below(2) ? "" : ":1:2:3:4:5:6:7");
    break;
  case 3: /* ids that are not decimals */
    len = snprintf(line, sizeof line, group ? "%s:x:%s:%s" : "%s:x:%s:1::/:", name, below(2) ? "0x10" : below(2) ? "-1" : "99999999999", name);
    break;
  default: /* random bytes, NUL and newline included */
    len = (int)below(sizeof line);
    for (int i = 0; i < len; i++) line[i] = below(8) ? (char)("ab:,/0123\n"[below(11)]) : (char)next64();
  }
  if (len < 0) len = 0;
  if ((size_t)len > sizeof line - 1) len = sizeof line - 1;
  if (*n + (size_t)len + 1 > cap) return;
  memcpy(s + *n, line, (size_t)len);
  *n += (size_t)len;
  s[(*n)++] = '\n';
}

static void property_users(void) {
  /* a spec: ids, a name, or random bytes */
  char spec[PV_USER_SPEC_MAX + 8];
  size_t sl = 0;
  switch (below(3)) {
  case 0: sl = (size_t)snprintf(spec, sizeof spec, "%u:%u", below(3) ? below(70000) : (uint32_t)next64(), (uint32_t)(next64() >> below(33))); break;
  case 1: sl = strlen(strcpy(spec, some_names[below(10)])); break;
  default:
    sl = below(PV_USER_SPEC_MAX + 1);
    for (size_t i = 0; i < sl; i++) spec[i] = below(4) ? "0123456789:a-$"[below(14)] : (char)next64();
  }
  char *exact = malloc(sl ? sl : 1);
  CHECK(exact != NULL, "malloc");
  memcpy(exact, spec, sl);
  uint32_t uid = 0, gid = 0;
  enum pv_user_kind kind = pv_user_spec(exact, sl, &uid, &gid);
  if (kind == PV_USER_IDS) {
    char back[32];
    int bl = snprintf(back, sizeof back, "%u:%u", uid, gid);
    CHECK((size_t)bl == sl && !memcmp(back, exact, sl) && uid <= PV_ID_MAX && gid <= PV_ID_MAX, "ids %u:%u from a spec of %zu bytes", uid, gid, sl);
  }
  if (kind == PV_USER_NAME) CHECK(pv_user_name_ok(exact, sl) && !memchr(exact, ':', sl), "a name that is not one");
  /* passwd and group texts, in buffers of their exact size */
  for (int group = 0; group < 2; group++) {
    size_t cap = 1 + below(4000), n = 0;
    char *text = malloc(cap);
    CHECK(text != NULL, "malloc");
    for (int lines = (int)below(30); lines-- > 0;) put_line(text, &n, cap, group);
    char *buf = malloc(n ? n : 1);
    CHECK(buf != NULL, "malloc");
    memcpy(buf, text, n);
    free(text);
    const char *name = some_names[below(10)];
    size_t nl = strlen(name);
    if (!group) {
      char home[PV_HOME_MAX];
      int r = pv_passwd_find(buf, n, name, nl, &uid, &gid, home);
      CHECK(r >= -1 && r <= 1, "pv_passwd_find said %d", r);
      if (r == 1) {
        size_t hl = strnlen(home, sizeof home);
        CHECK(hl < sizeof home && home[0] == '/', "home of %zu bytes", hl);
        int at_line_start = 0;
        for (size_t i = 0; i + nl < n && !at_line_start; i++) at_line_start = (i == 0 || buf[i - 1] == '\n') && !memcmp(buf + i, name, nl) && buf[i + nl] == ':';
        CHECK(at_line_start, "found %s on no line of that name", name);
      }
    } else {
      uint32_t groups[PV_MAX_GROUPS], primary = (uint32_t)next64();
      int c = pv_group_list(buf, n, name, nl, primary, groups);
      CHECK(c == -1 || (c >= 1 && c <= PV_MAX_GROUPS), "pv_group_list said %d", c);
      if (c > 0) {
        CHECK(groups[0] == primary, "the primary gid is not first");
        for (int i = 0; i < c; i++)
          for (int j = i + 1; j < c; j++) CHECK(groups[i] != groups[j], "gid %u twice", groups[i]);
      }
    }
    free(buf);
  }
  free(exact);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: fuzz-frames SEED [ROUNDS]\n");
    return 2;
  }
  uint64_t seed = strtoull(argv[1], NULL, 0);
  long rounds = argc > 2 ? strtol(argv[2], NULL, 0) : 300;
  printf("fuzz-frames: seed %llu, %ld rounds\n", (unsigned long long)seed, rounds);
  fflush(stdout);
  for (long i = 0; i < rounds; i++) {
    rng_state = seed ^ (0x51ed2701u * (uint64_t)(i + 1));
    property_valid_streams();
    property_hostile_streams();
    for (int k = 0; k < 20; k++) property_payload_fields();
    property_list_entry();
    for (int k = 0; k < 5; k++) property_credit();
    for (int k = 0; k < 20; k++) property_users();
  }
  printf("fuzz-frames: ok, %ld rounds of each property\n", rounds);
  return 0;
}
