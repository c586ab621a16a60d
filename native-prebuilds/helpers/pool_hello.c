/*
 * A JSON reader for the page pool's Hello, the one JSON a client sends the daemon. Written here
 * rather than taken from a library: it needs three members of one object, and a reader this small
 * can be read whole. The payload comes from any process allowed on the socket, so it is treated
 * as hostile: every read is checked against the end, nesting is bounded (deeper is refused, where
 * JSON.parse would go on), the text must be UTF-8 (JSON.parse in the Node daemon replaced bad
 * bytes instead), and a string escape that is a lone surrogate is refused.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool_hello.h"

/* Deeper nesting than this anywhere in a Hello is refused: no client sends more than one level. */
#define MAX_DEPTH 32

struct reader {
  const uint8_t *p, *end;
  int depth;
};

/* A string as read: its decoded bytes (when a buffer was given) and their count. */
struct text {
  uint8_t *out;
  size_t cap, len;
};

/* What a member of interest held, last. */
enum kind { MISSING, STRING, NUMBER, OTHER };
struct member {
  enum kind kind;
  double number;
  /* The raw text of a number, or the decoded bytes of a string (which may hold NUL). */
  uint8_t bytes[HELLO_MAX_BYTES];
  size_t len;
};

static void skip_space(struct reader *r) {
  while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r')) r->p++;
}

static int put_byte(struct text *t, uint8_t b) {
  if (t->out) {
    if (t->len >= t->cap) return -1;
    t->out[t->len] = b;
  }
  t->len++;
  return 0;
}

static int put_code_point(struct text *t, uint32_t c) {
  if (c < 0x80) return put_byte(t, (uint8_t)c);
  if (c < 0x800) return put_byte(t, (uint8_t)(0xc0 | c >> 6)) || put_byte(t, (uint8_t)(0x80 | (c & 0x3f)));
  if (c < 0x10000) return put_byte(t, (uint8_t)(0xe0 | c >> 12)) || put_byte(t, (uint8_t)(0x80 | ((c >> 6) & 0x3f))) || put_byte(t, (uint8_t)(0x80 | (c & 0x3f)));
  return put_byte(t, (uint8_t)(0xf0 | c >> 18)) || put_byte(t, (uint8_t)(0x80 | ((c >> 12) & 0x3f))) || put_byte(t, (uint8_t)(0x80 | ((c >> 6) & 0x3f))) ||
         put_byte(t, (uint8_t)(0x80 | (c & 0x3f)));
}

static int hex4(struct reader *r, uint32_t *out) {
  if (r->end - r->p < 4) return -1;
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    uint8_t c = r->p[i];
    v <<= 4;
    if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
    else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
    else return -1;
  }
  r->p += 4;
  *out = v;
  return 0;
}

/* One UTF-8 sequence of a string's raw text (well formed: shortest form, no surrogates, <= U+10FFFF). */
static int utf8_sequence(struct reader *r, struct text *t) {
  uint8_t b = *r->p;
  int n;
  uint32_t c, min;
  if (b < 0x80) n = 0, c = b, min = 0;
  else if ((b & 0xe0) == 0xc0) n = 1, c = b & 0x1f, min = 0x80;
  else if ((b & 0xf0) == 0xe0) n = 2, c = b & 0x0f, min = 0x800;
  else if ((b & 0xf8) == 0xf0) n = 3, c = b & 0x07, min = 0x10000;
  else return -1;
  if (r->end - r->p < n + 1) return -1;
  for (int i = 1; i <= n; i++) {
    if ((r->p[i] & 0xc0) != 0x80) return -1;
    c = c << 6 | (r->p[i] & 0x3f);
  }
  if (c < min || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return -1;
  r->p += n + 1;
  return put_code_point(t, c);
}

/* A string, at its opening quote. */
static int read_string(struct reader *r, struct text *t) {
  r->p++;
  for (;;) {
    if (r->p >= r->end) return -1;
    uint8_t c = *r->p;
    if (c == '"') {
      r->p++;
      return 0;
    }
    if (c < 0x20) return -1;
    if (c != '\\') {
      if (utf8_sequence(r, t)) return -1;
      continue;
    }
    if (r->end - r->p < 2) return -1;
    uint8_t e = r->p[1];
    r->p += 2;
    uint32_t u;
    switch (e) {
      case '"': case '\\': case '/': if (put_byte(t, e)) return -1; break;
      case 'b': if (put_byte(t, '\b')) return -1; break;
      case 'f': if (put_byte(t, '\f')) return -1; break;
      case 'n': if (put_byte(t, '\n')) return -1; break;
      case 'r': if (put_byte(t, '\r')) return -1; break;
      case 't': if (put_byte(t, '\t')) return -1; break;
      case 'u':
        if (hex4(r, &u)) return -1;
        if (u >= 0xdc00 && u <= 0xdfff) return -1;
        if (u >= 0xd800 && u <= 0xdbff) {
          uint32_t low;
          if (r->end - r->p < 6 || r->p[0] != '\\' || r->p[1] != 'u') return -1;
          r->p += 2;
          if (hex4(r, &low) || low < 0xdc00 || low > 0xdfff) return -1;
          u = 0x10000 + ((u - 0xd800) << 10) + (low - 0xdc00);
        }
        if (put_code_point(t, u)) return -1;
        break;
      default:
        return -1;
    }
  }
}

static int digits(struct reader *r) {
  const uint8_t *start = r->p;
  while (r->p < r->end && *r->p >= '0' && *r->p <= '9') r->p++;
  return r->p > start ? 0 : -1;
}

/* A number: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)? */
static int read_number(struct reader *r) {
  if (r->p < r->end && *r->p == '-') r->p++;
  if (r->p >= r->end) return -1;
  if (*r->p == '0') r->p++;
  else if (*r->p >= '1' && *r->p <= '9') digits(r);
  else return -1;
  if (r->p < r->end && *r->p == '.') {
    r->p++;
    if (digits(r)) return -1;
  }
  if (r->p < r->end && (*r->p == 'e' || *r->p == 'E')) {
    r->p++;
    if (r->p < r->end && (*r->p == '+' || *r->p == '-')) r->p++;
    if (digits(r)) return -1;
  }
  return 0;
}

static int literal(struct reader *r, const char *word) {
  size_t n = strlen(word);
  if ((size_t)(r->end - r->p) < n || memcmp(r->p, word, n) != 0) return -1;
  r->p += n;
  return 0;
}

static int read_value(struct reader *r, struct member *m);

/* An object or array, at its opening bracket; with the members to keep for the top-level object. */
static int read_container(struct reader *r, struct member *version, struct member *scope, struct member *name) {
  uint8_t close = *r->p == '{' ? '}' : ']';
  if (++r->depth > MAX_DEPTH) return -1;
  r->p++;
  skip_space(r);
  if (r->p < r->end && *r->p == close) {
    r->p++;
    r->depth--;
    return 0;
  }
  for (;;) {
    struct member *m = NULL;
    if (close == '}') {
      if (r->p >= r->end || *r->p != '"') return -1;
      uint8_t key[16];
      struct text t = { key, sizeof key, 0 };
      const uint8_t *at = r->p;
      if (read_string(r, &t)) {
        /* A key too long to be one of ours: read it again without keeping it. */
        r->p = at;
        t = (struct text){ NULL, 0, 0 };
        if (read_string(r, &t)) return -1;
      } else if (version) {
        if (t.len == 7 && memcmp(key, "version", 7) == 0) m = version;
        else if (t.len == 5 && memcmp(key, "scope", 5) == 0) m = scope;
        else if (t.len == 4 && memcmp(key, "name", 4) == 0) m = name;
      }
      skip_space(r);
      if (r->p >= r->end || *r->p != ':') return -1;
      r->p++;
      skip_space(r);
    }
    if (read_value(r, m)) return -1;
    skip_space(r);
    if (r->p >= r->end) return -1;
    if (*r->p == close) {
      r->p++;
      r->depth--;
      return 0;
    }
    if (*r->p != ',') return -1;
    r->p++;
    skip_space(r);
  }
}

/* Any value; what it is kept in `m` if given. */
static int read_value(struct reader *r, struct member *m) {
  if (r->p >= r->end) return -1;
  const uint8_t *start = r->p;
  uint8_t c = *r->p;
  if (c == '"') {
    struct text t = { m ? m->bytes : NULL, m ? sizeof m->bytes : 0, 0 };
    if (read_string(r, &t)) return -1;
    if (m) m->kind = STRING, m->len = t.len;
    return 0;
  }
  int failed;
  enum kind kind = OTHER;
  if (c == '{' || c == '[') failed = read_container(r, NULL, NULL, NULL);
  else if (c == 't') failed = literal(r, "true");
  else if (c == 'f') failed = literal(r, "false");
  else if (c == 'n') failed = literal(r, "null");
  else failed = read_number(r), kind = NUMBER;
  if (failed) return -1;
  if (m) {
    m->kind = kind;
    m->len = (size_t)(r->p - start);
    if (m->len > sizeof m->bytes - 1) m->len = sizeof m->bytes - 1;
    memcpy(m->bytes, start, m->len);
    m->bytes[m->len] = 0;
    if (kind == NUMBER) m->number = strtod((const char *)m->bytes, NULL);
  }
  return 0;
}

/* A scope or name: 1 to 256 bytes, none a control character (U+0000 to U+001F). */
static int check_name(const struct member *m, char out[HELLO_MAX_NAME_BYTES + 1], const char *what, char *why, size_t why_bytes) {
  int ok = m->kind == STRING && m->len >= 1 && m->len <= HELLO_MAX_NAME_BYTES;
  for (size_t i = 0; ok && i < m->len; i++)
    if (m->bytes[i] < 0x20) ok = 0;
  if (!ok) {
    snprintf(why, why_bytes, "Hello.%s: expected 1 to %u bytes of printable text", what, HELLO_MAX_NAME_BYTES);
    return -1;
  }
  memcpy(out, m->bytes, m->len);
  out[m->len] = 0;
  return 0;
}

int hello_parse(const uint8_t *p, size_t len, char scope[HELLO_MAX_NAME_BYTES + 1], char name[HELLO_MAX_NAME_BYTES + 1], char *why, size_t why_bytes) {
  if (len > HELLO_MAX_BYTES) {
    snprintf(why, why_bytes, "Hello: %zu bytes, at most %u", len, HELLO_MAX_BYTES);
    return -1;
  }
  /* Three members of up to a whole payload each: on the heap, not the stack. */
  struct member *m = calloc(3, sizeof *m);
  if (!m) {
    snprintf(why, why_bytes, "Hello: out of memory");
    return -1;
  }
  struct member *version = &m[0], *scope_m = &m[1], *name_m = &m[2];
  struct reader r = { p, p + len, 0 };
  int rc = -1;
  skip_space(&r);
  if (r.p < r.end && *r.p != '{') {
    /* Some other JSON value, or not JSON at all. */
    int json = read_value(&r, NULL) == 0 && (skip_space(&r), r.p == r.end);
    snprintf(why, why_bytes, json ? "Hello: not an object" : "Hello: not JSON");
    goto out;
  }
  if (r.p >= r.end || read_container(&r, version, scope_m, name_m) || (skip_space(&r), r.p != r.end)) {
    snprintf(why, why_bytes, "Hello: not JSON");
    goto out;
  }
  if (version->kind != NUMBER || version->number != POOL_PROTOCOL_VERSION) {
    snprintf(why, why_bytes, "protocol version %.32s; this daemon speaks %d", version->kind == MISSING ? "undefined" : version->kind == STRING ? "(a string)" : (const char *)version->bytes, POOL_PROTOCOL_VERSION);
    goto out;
  }
  if (check_name(scope_m, scope, "scope", why, why_bytes) || check_name(name_m, name, "name", why, why_bytes)) goto out;
  rc = 0;
out:
  free(m);
  return rc;
}

int hello_scope(const char *scope, int *group, uint32_t *gid, const char **name, char *why, size_t why_bytes) {
  *group = 0;
  *gid = 0;
  *name = scope;
  if (strncmp(scope, "gid:", 4) != 0) return 0;
  const char *p = scope + 4;
  uint64_t v = 0;
  int digits = 0;
  for (; *p >= '0' && *p <= '9' && digits <= 10; p++, digits++) v = v * 10 + (uint64_t)(*p - '0');
  if (digits == 0 || digits > 10 || (digits > 1 && scope[4] == '0') || v >= 0xffffffffull || *p != ':' || p[1] == 0) {
    snprintf(why, why_bytes, "Hello.scope: a group's scope is gid:GID:NAME (GID a number below 4294967295, NAME not empty)");
    return -1;
  }
  *group = 1;
  *gid = (uint32_t)v;
  *name = p + 1;
  return 0;
}
