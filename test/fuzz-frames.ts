// Random agent-protocol frames and byte streams for the fuzz suites (see fuzz-seed.ts).
import { FRAME_HEADER_BYTES, MAX_PAYLOAD_BYTES, type Frame, type FrameType } from '../src/protocol/frame';
import type { Rng } from './fuzz-seed';

/**
 * A random frame: any type byte, id, op and flags; a payload up to `maxPayload`, mostly small,
 * and (given room for large ones) now and then at the limit.
 */
export function randomFrame(rng: Rng, maxPayload = 64 * 1024): Frame {
  const size = maxPayload >= 64 * 1024 && rng.chance(0.02) ? rng.pick([MAX_PAYLOAD_BYTES, MAX_PAYLOAD_BYTES - 1]) : rng.size(maxPayload);
  return { type: rng.int(256) as FrameType, id: rng.u32(), op: rng.int(0x10000), flags: rng.int(0x10000), payload: rng.bytes(size) };
}

/** `stream` cut into pushes at random points: empty, one byte, header-sized, or anything. */
export function randomSplits(rng: Rng, stream: Buffer): Buffer[] {
  const out: Buffer[] = [];
  for (let at = 0; at < stream.length;) {
    const n = rng.weighted<number>([[2, 0], [3, 1], [2, FRAME_HEADER_BYTES + rng.between(-1, 1)], [4, rng.size(4096)], [1, rng.size(stream.length)]]);
    out.push(stream.subarray(at, at + n));
    at += n;
  }
  return out;
}

/** A frame as a comparable value (for a readable diff). */
export const summary = (f: Frame) => ({ type: f.type, id: f.id, op: f.op, flags: f.flags, payload: f.payload.toString('hex') });
