/*
 * pvisor's frame: the one binary layout every C program speaks to the host in, mirrored by
 * src/protocol/frame.ts. The Linux agent (agent/), the probe guest (probe/) and the page pool's
 * daemon (helpers/pool_daemon.c) include it; test/unit/frame-vectors.test.ts builds a driver of it
 * and checks its bytes and verdicts against frame.ts both ways.
 *
 * Layout (little-endian, no padding), a 16-byte header and then `len` payload bytes:
 *   magic   u8[2]  "PV" (0x50, 0x56)
 *   version u8     PV_FRAME_VERSION, the version of this layout only: each protocol carried in
 *                  frames says its own version in its hello (the agent protocol's HELLO event,
 *                  the pool protocol's Hello request), so one can change without the other
 *   type    u8     PV_T_*
 *   id      u32    the request a frame belongs to (0 for events)
 *   op      u16    the operation, in the protocol's own numbering
 *   flags   u16    (stream chunks: 1 stdout, 2 stderr)
 *   len     u32    payload bytes, at most PV_FRAME_MAX_PAYLOAD
 *
 * Freestanding: stdint.h and stddef.h only, no libc call, nothing global, no allocation, so that
 * the probe (no libc at all) runs the same code as the agent and the daemon. Every reader of a
 * host's or a client's bytes goes through pv_frame_header_get or pv_frame_scan, which read only
 * the bytes they are given.
 */
#ifndef PV_FRAME_H
#define PV_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define PV_FRAME_HDR 16u
#define PV_FRAME_MAX_PAYLOAD (1u << 20)
#define PV_FRAME_VERSION 1
#define PV_FRAME_MAGIC0 0x50 /* 'P' */
#define PV_FRAME_MAGIC1 0x56 /* 'V' */

/* Frame types (FrameType in frame.ts). */
enum pv_frame_type {
  PV_T_REQUEST = 1,
  PV_T_RESPONSE = 2,
  PV_T_CHUNK = 3, /* a stream's chunk, answering a request */
  PV_T_ERROR = 4,
  PV_T_EVENT = 5,
  PV_T_CREDIT = 6, /* host to guest: a stream's consumer has read (docs/agent-protocol.md, "Stream credit") */
};

/* Little-endian reads and writes at any alignment, for headers and payloads alike. */
static inline uint16_t pv_rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline uint32_t pv_rd32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static inline void pv_wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void pv_wr32(uint8_t *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> 8 * i); }

/* One frame's header as read; payload points just past the header it was read from. */
struct pv_frame {
  uint8_t type;
  uint32_t id;
  uint16_t op;
  uint16_t flags;
  uint32_t len;
  const uint8_t *payload;
};

/*
 * Writes a frame's header into the PV_FRAME_HDR bytes at `h`, for a payload of `len` bytes that
 * the caller puts right after it (at most PV_FRAME_MAX_PAYLOAD: the caller's bound, not checked).
 */
static inline void pv_frame_header_put(uint8_t *h, uint8_t type, uint32_t id, uint16_t op, uint16_t flags, uint32_t len) {
  h[0] = PV_FRAME_MAGIC0;
  h[1] = PV_FRAME_MAGIC1;
  h[2] = PV_FRAME_VERSION;
  h[3] = type;
  pv_wr32(h + 4, id);
  pv_wr16(h + 8, op);
  pv_wr16(h + 10, flags);
  pv_wr32(h + 12, len);
}

/* What a header is; the checks run in this order, as frame.ts runs them (the first failing one is said). */
enum pv_frame_verdict {
  PV_FRAME_OK = 0,
  PV_FRAME_BAD_MAGIC = 1,
  PV_FRAME_BAD_VERSION = 2,
  PV_FRAME_TOO_LONG = 3, /* a payload length over PV_FRAME_MAX_PAYLOAD */
};

/*
 * Reads the PV_FRAME_HDR bytes at `h`. PV_FRAME_OK with *f filled (f->payload = h + PV_FRAME_HDR,
 * whose f->len bytes the caller has or waits for); otherwise what is wrong, *f untouched. Any
 * type is a frame here: which types a reader takes is its protocol's business.
 */
static inline enum pv_frame_verdict pv_frame_header_get(const uint8_t *h, struct pv_frame *f) {
  if (h[0] != PV_FRAME_MAGIC0 || h[1] != PV_FRAME_MAGIC1) return PV_FRAME_BAD_MAGIC;
  if (h[2] != PV_FRAME_VERSION) return PV_FRAME_BAD_VERSION;
  uint32_t len = pv_rd32(h + 12);
  if (len > PV_FRAME_MAX_PAYLOAD) return PV_FRAME_TOO_LONG;
  f->type = h[3];
  f->id = pv_rd32(h + 4);
  f->op = pv_rd16(h + 8);
  f->flags = pv_rd16(h + 10);
  f->len = len;
  f->payload = h + PV_FRAME_HDR;
  return PV_FRAME_OK;
}

enum pv_scan {
  PV_NEED_MORE, /* no whole frame yet: wait for more bytes (never more than PV_FRAME_HDR + PV_FRAME_MAX_PAYLOAD) */
  PV_FRAME,     /* *f is the first frame; it spans PV_FRAME_HDR + f->len bytes */
  PV_BAD,       /* the header is not one of ours (*verdict says why): the stream has lost its framing */
};

/*
 * The first frame of the `n` bytes at `p`. A bad header is said as soon as its 16 bytes are in,
 * before any of its claimed payload: a reader then drops what it holds and resynchronises.
 * `verdict` may be NULL.
 */
static inline enum pv_scan pv_frame_scan(const uint8_t *p, size_t n, struct pv_frame *f, enum pv_frame_verdict *verdict) {
  if (n < PV_FRAME_HDR) return PV_NEED_MORE;
  struct pv_frame h;
  enum pv_frame_verdict v = pv_frame_header_get(p, &h);
  if (verdict) *verdict = v;
  if (v != PV_FRAME_OK) return PV_BAD;
  if (n - PV_FRAME_HDR < h.len) return PV_NEED_MORE;
  *f = h;
  return PV_FRAME;
}

#endif
