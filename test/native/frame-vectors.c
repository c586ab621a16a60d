/*
 * The C side of the frame test vectors (test/unit/frame-vectors.test.ts): pv_frame.h, the header
 * the agent, the probe and the pool daemon build their frames with and read them by, driven from
 * the unit suite so that its bytes and verdicts can be held against src/protocol/frame.ts.
 *
 * Reads lines from stdin and answers each with one line on stdout:
 *   E TYPE ID OP FLAGS HEX   the frame pv_frame_header_put makes for that header and payload (HEX), as hex
 *   D HEX                    what pv_frame_scan reads in those bytes, one frame after another:
 *                            "F TYPE ID OP FLAGS HEX" per whole frame, then "MORE HELD" (HELD bytes
 *                            wait for the rest of a frame) or "BAD VERDICT" (pv_frame_verdict)
 * Numbers are decimal, bytes lowercase hex (an empty payload is "-"). Anything else is a usage
 * error: exit 2.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../native-prebuilds/include/pv_frame.h"

static void usage(const char *why) {
  fprintf(stderr, "frame-vectors: %s\n", why);
  exit(2);
}

static int nibble(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  usage("bad hex");
  return 0;
}

/* The bytes of a hex token ("-" is none), into a buffer of exactly their length (ASan sees any read past it). */
static uint8_t *unhex(const char *s, size_t *n) {
  if (strcmp(s, "-") == 0) s = "";
  size_t len = strlen(s);
  if (len % 2) usage("odd hex");
  *n = len / 2;
  uint8_t *b = malloc(*n ? *n : 1);
  if (!b) usage("out of memory");
  for (size_t i = 0; i < *n; i++) b[i] = (uint8_t)(nibble(s[2 * i]) << 4 | nibble(s[2 * i + 1]));
  return b;
}

static void put_hex(const uint8_t *p, size_t n) {
  static const char digits[] = "0123456789abcdef";
  if (!n) fputc('-', stdout);
  for (size_t i = 0; i < n; i++) {
    fputc(digits[p[i] >> 4], stdout);
    fputc(digits[p[i] & 15], stdout);
  }
}

static unsigned long number(const char *s, unsigned long max) {
  char *end;
  unsigned long v = strtoul(s, &end, 10);
  if (!*s || *end || v > max) usage("bad number");
  return v;
}

static void encode(char **tok, int ntok) {
  if (ntok != 6) usage("E TYPE ID OP FLAGS HEX");
  size_t n;
  uint8_t *payload = unhex(tok[5], &n);
  uint8_t *frame = malloc(PV_FRAME_HDR + n);
  if (!frame) usage("out of memory");
  pv_frame_header_put(frame, (uint8_t)number(tok[1], 0xff), (uint32_t)number(tok[2], 0xffffffffu), (uint16_t)number(tok[3], 0xffff), (uint16_t)number(tok[4], 0xffff), (uint32_t)n);
  if (n) memcpy(frame + PV_FRAME_HDR, payload, n);
  put_hex(frame, PV_FRAME_HDR + n);
  free(frame);
  free(payload);
}

static void decode(char **tok, int ntok) {
  if (ntok != 2) usage("D HEX");
  size_t n;
  uint8_t *bytes = unhex(tok[1], &n);
  size_t at = 0;
  for (;;) {
    struct pv_frame f;
    enum pv_frame_verdict verdict = PV_FRAME_OK;
    enum pv_scan r = pv_frame_scan(bytes + at, n - at, &f, &verdict);
    if (r == PV_NEED_MORE) {
      printf("MORE %zu", n - at);
      break;
    }
    if (r == PV_BAD) {
      printf("BAD %d", (int)verdict);
      break;
    }
    if (f.payload != bytes + at + PV_FRAME_HDR) usage("payload not after its header");
    printf("F %u %u %u %u ", f.type, f.id, f.op, f.flags);
    put_hex(f.payload, f.len);
    fputc(' ', stdout);
    at += PV_FRAME_HDR + f.len;
  }
  free(bytes);
}

int main(void) {
  size_t cap = 0, len = 0;
  char *line = NULL;
  int c;
  for (;;) {
    c = getchar();
    if (c != EOF && c != '\n') {
      if (len + 1 >= cap) {
        cap = cap ? cap * 2 : 4096;
        line = realloc(line, cap);
        if (!line) usage("out of memory");
      }
      line[len++] = (char)c;
      continue;
    }
    if (len) {
      line[len] = 0;
      char *tok[8];
      int ntok = 0;
      for (char *t = strtok(line, " "); t; t = strtok(NULL, " ")) {
        if (ntok == 8) usage("too many fields");
        tok[ntok++] = t;
      }
      if (ntok && strcmp(tok[0], "E") == 0) encode(tok, ntok);
      else if (ntok && strcmp(tok[0], "D") == 0) decode(tok, ntok);
      else usage("a line is E or D");
      fputc('\n', stdout);
      len = 0;
    }
    if (c == EOF) break;
  }
  free(line);
  return fflush(stdout) == 0 ? 0 : 1;
}
