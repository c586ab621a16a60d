/*
 * The agent's reading of agent protocol v1 (docs/probe-guest.md): the frames (../include/pv_frame.h)
 * found in the bytes received so far, and the length-prefixed strings inside request payloads.
 * Everything the host sends passes through these before any op sees it, so they are kept apart
 * from agent.c: pure functions over a byte range, no I/O, no allocation, nothing global. The
 * fuzz driver beside them (fuzz-frames.c, run by the unit suite under ASan and UBSan) calls the
 * very code the agent runs.
 */
#ifndef PVISOR_AGENT_FRAMES_H
#define PVISOR_AGENT_FRAMES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../include/pv_frame.h"

static inline void pv_wr64(uint8_t *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> 8 * i); }

/*
 * Serves the whole frames at the start of the `n` bytes at `p`, in order: each to `frame`; a bad
 * header to `bad`, which drops everything held (the sender resynchronises from there). Returns
 * the bytes used, which the caller drops from its input; what is left is the start of a frame.
 */
static inline size_t pv_frames_take(const uint8_t *p, size_t n, void (*frame)(void *ctx, const struct pv_frame *f), void (*bad)(void *ctx), void *ctx) {
  size_t used = 0;
  for (;;) {
    struct pv_frame f;
    enum pv_scan r = pv_frame_scan(p + used, n - used, &f, NULL);
    if (r == PV_NEED_MORE) return used;
    if (r == PV_BAD) {
      bad(ctx);
      return n;
    }
    frame(ctx, &f);
    used += PV_FRAME_HDR + (size_t)f.len;
  }
}

/*
 * A string of a request payload (u32 length, then its bytes) at *p, before `end`: 1 with *s and
 * *len set to its bytes (not NUL-terminated) and *p moved past it; 0 if it overruns the payload
 * or holds a NUL (it will be a C string), and *p is left as it was.
 */
static inline int pv_take_str(const uint8_t **p, const uint8_t *end, const uint8_t **s, uint32_t *len) {
  if (end < *p || (size_t)(end - *p) < 4) return 0;
  uint32_t n = pv_rd32(*p);
  if (n > (size_t)(end - *p) - 4) return 0;
  const uint8_t *at = *p + 4;
  if (memchr(at, 0, n)) return 0;
  *s = at;
  *len = n;
  *p = at + n;
  return 1;
}

/* Longest path a files request carries, its NUL included (Linux's PATH_MAX). */
#define PV_PATH_MAX 4096

/*
 * A path of a files request: a string (pv_take_str) that is not empty and shorter than
 * PV_PATH_MAX, so that a C string of it is a path the kernel takes. Same contract as pv_take_str.
 */
static inline int pv_take_path(const uint8_t **p, const uint8_t *end, const uint8_t **s, uint32_t *len) {
  const uint8_t *at = *p;
  if (!pv_take_str(&at, end, s, len) || *len == 0 || *len >= PV_PATH_MAX) return 0;
  *p = at;
  return 1;
}

/* A FILE_LIST entry's fixed part: {u16 nameLen, u8 type, u8 0, u32 mode, u64 size, i64 mtimeNs}. */
#define PV_ENTRY_HDR 24

/* Writes one FILE_LIST entry (PV_ENTRY_HDR + nameLen bytes) at `at`. */
static inline void pv_entry_put(uint8_t *at, const uint8_t *name, uint16_t nameLen, uint8_t type, uint32_t mode, uint64_t size, int64_t mtimeNs) {
  pv_wr16(at, nameLen);
  at[2] = type;
  at[3] = 0;
  pv_wr32(at + 4, mode);
  pv_wr64(at + 8, size);
  pv_wr64(at + 16, (uint64_t)mtimeNs);
  memcpy(at + PV_ENTRY_HDR, name, nameLen);
}

/*
 * Stream credit (docs/agent-protocol.md, "Stream credit"). Every output stream (an EXEC's stdout
 * and stderr, a FILE_READ's content, a FILE_LIST's entries) may carry at most its credit in chunk
 * payload: PV_STREAM_WINDOW when it opens, plus what the host grants with CREDIT frames as its
 * consumer reads. One stream nobody reads then stops only itself; the channel goes on.
 */
#define PV_OP_CREDIT 0x0003      /* the op a CREDIT frame carries */
#define PV_FEATURE_STREAM_CREDIT 1u /* HELLO's features bit: this agent honours stream credit */
#define PV_STREAM_WINDOW (256u << 10)
#define PV_CREDIT_BYTES 4        /* a CREDIT payload: u32 bytes granted, 1 and up */

/*
 * A CREDIT frame's grant: 1 with *channel (1 stdout / content, 2 stderr) and *bytes set if the
 * frame is well formed (op PV_OP_CREDIT, flags 1 or 2, a payload of exactly PV_CREDIT_BYTES
 * holding at least 1); else 0. The stream is f->id, which may name nothing open any more (its
 * request ended while the grant was on its way): the caller ignores such a grant.
 */
static inline int pv_credit_parse(const struct pv_frame *f, uint16_t *channel, uint32_t *bytes) {
  if (f->op != PV_OP_CREDIT || (f->flags != 1 && f->flags != 2) || f->len != PV_CREDIT_BYTES) return 0;
  uint32_t n = pv_rd32(f->payload);
  if (n == 0) return 0;
  *channel = f->flags;
  *bytes = n;
  return 1;
}

/* A stream's credit after a grant: saturates rather than wraps (a host that grants without end
 * gives at most 4 GiB at a time; the output queue bounds what the agent holds anyway). */
static inline uint32_t pv_credit_add(uint32_t credit, uint32_t bytes) { return bytes > UINT32_MAX - credit ? UINT32_MAX : credit + bytes; }

/* How many bytes a stream may read for its next chunk: at most `max` (one chunk), at most its credit. */
static inline uint32_t pv_credit_chunk(uint32_t credit, uint32_t max) { return credit < max ? credit : max; }

/*
 * EXEC's fixed part {u32 flags, u32 argc, u32 envc, u32 reserved}: 1 if its counts can be right
 * for a payload of `n` bytes (argv[0] is there, and every string costs at least its 4-byte length,
 * cwd included), which bounds what the agent allocates for them by the payload; else 0.
 */
static inline int pv_exec_counts_fit(const uint8_t *p, size_t n, uint32_t *flags, uint32_t *argc, uint32_t *envc) {
  if (n < 16) return 0;
  *flags = pv_rd32(p);
  *argc = pv_rd32(p + 4);
  *envc = pv_rd32(p + 8);
  return *argc != 0 && (uint64_t)*argc + *envc + 1 <= (n - 16) / 4;
}

#endif
