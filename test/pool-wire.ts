// Requests of the page pool protocol for tests that speak it to the real daemon by hand, built
// with the client's own writers (src/daemon/pool-protocol.ts), and its answers read back.
import {
  answerOf,
  answerPage,
  ANSWER_ENTRY_BYTES,
  OFFER_ENTRY_BYTES,
  putBytes,
  settleBytes,
  writeOfferEntry,
  writePutCount,
  writeSettle,
  type PageKey,
  type PoolOp,
} from '../src/daemon/pool-protocol';
import type { PoolLink } from '../src/memory/pool-link';
import { FRAME_HEADER_BYTES } from '../src/protocol/frame';

/** Offer entries: guest page, key. */
export function encodeOffer(entries: { page: number; key: PageKey }[]): Buffer {
  const b = Buffer.allocUnsafe(entries.length * OFFER_ENTRY_BYTES);
  entries.forEach((e, i) => writeOfferEntry(b, i, e.page, e.key));
  return b;
}

/** A Put of whole pages. */
export function encodePut(pages: { page: number; bytes: Buffer }[]): Buffer {
  const b = Buffer.allocUnsafe(putBytes(pages.length));
  const slot = writePutCount(b, pages.length);
  pages.forEach((e, k) => e.bytes.copy(slot(k, e.page), 0, 0, 4096));
  return b;
}

export function encodeSettle(keep: readonly number[], drop: readonly number[]): Buffer {
  const b = Buffer.allocUnsafe(settleBytes(keep.length + drop.length));
  writeSettle(b, keep, drop);
  return b;
}

/** An answer's entries; throws on a payload that is not `max` entries or fewer. */
export function decodeAnswers(p: Buffer, max: number): { page: number; answer: number }[] {
  if (p.length % ANSWER_ENTRY_BYTES !== 0 || p.length / ANSWER_ENTRY_BYTES > max) throw new Error(`an answer of ${p.length} bytes`);
  return Array.from({ length: p.length / ANSWER_ENTRY_BYTES }, (_, i) => ({ page: answerPage(p, i), answer: answerOf(p, i) }));
}

/** Sends `payload` as one request on a client's link, as a merge pass does; resolves with the answer's payload. */
export function poolRequest(link: PoolLink, op: PoolOp, payload: Buffer, timeoutMs: number): Promise<Buffer> {
  const frame = Buffer.allocUnsafe(FRAME_HEADER_BYTES + payload.length);
  payload.copy(frame, FRAME_HEADER_BYTES);
  return link.requestBuilt(op, frame, payload.length, timeoutMs);
}
