// The agent protocol's frame decoder under seeded fuzzing: valid streams split at random points,
// garbage, wrong magic, versions and lengths. The decoder is the first code that reads what a
// guest sends. (That its time is linear is checked through the client, agent-client-fuzz.)
import { encodeFrame, FrameDecoder, FrameError, MAX_PAYLOAD_BYTES, type Frame } from '../../src/protocol/frame';
import { randomFrame, randomSplits, summary } from '../fuzz-frames';
import { property, same, thrown } from '../fuzz-seed';

/** Pushes every piece, catching FrameError; returns the frames in order and the errors. */
function decodeAll(d: FrameDecoder, pieces: Buffer[]): { frames: Frame[]; errors: unknown[] } {
  const frames: Frame[] = [];
  const errors: unknown[] = [];
  for (const p of pieces) {
    try {
      frames.push(...d.push(p));
    } catch (e) {
      errors.push(e);
    }
  }
  return { frames, errors };
}

describe('agent protocol frame decoder under fuzzing', () => {
  property('a valid stream decodes to its frames however it is split; a fresh decoder goes on from pendingBytes()', 150, (rng) => {
    const sent = Array.from({ length: rng.between(0, 12) }, () => randomFrame(rng));
    const stream = Buffer.concat(sent.map((f) => encodeFrame(f)));
    const pieces = randomSplits(rng, stream);
    // A snapshot of the channel at a random piece: the rest goes to a fresh decoder.
    const cut = rng.int(pieces.length + 1);
    const d = new FrameDecoder();
    const before = decodeAll(d, pieces.slice(0, cut));
    const after = decodeAll(new FrameDecoder(), [d.pendingBytes(), ...pieces.slice(cut)]);
    same([...before.errors, ...after.errors], []);
    const got = [...before.frames, ...after.frames];
    same(got.length, sent.length);
    if (!got.every((f, i) => f.type === sent[i].type && f.id === sent[i].id && f.op === sent[i].op && f.flags === sent[i].flags && f.payload.equals(sent[i].payload))) {
      expect(got.map(summary)).toEqual(sent.map(summary));
    }
  });

  property('garbage and damaged frames only ever raise FrameError; after one, a frame pushed alone decodes', 200, (rng) => {
    const parts: Buffer[] = [];
    for (let n = rng.between(1, 8); n > 0; n--) {
      const frame = encodeFrame(randomFrame(rng, 4096));
      switch (rng.int(6)) {
        case 0: parts.push(rng.bytes(rng.size(256))); break; // noise
        case 1: frame[rng.int(2)] ^= 1 + rng.int(255); parts.push(frame); break; // magic
        case 2: frame[2] = rng.pick([0, 2, 255]); parts.push(frame); break; // version
        case 3: frame.writeUInt32LE(rng.pick([MAX_PAYLOAD_BYTES + 1, 0xffffffff, 2 ** 31, rng.u32()]), 12); parts.push(frame); break; // length
        case 4: parts.push(frame.subarray(0, rng.int(frame.length))); break; // cut short
        default: parts.push(frame);
      }
    }
    const d = new FrameDecoder();
    for (const piece of randomSplits(rng, Buffer.concat(parts))) {
      let frames: Frame[] = [];
      const e = thrown(() => (frames = d.push(piece)));
      if (e !== undefined && !(e instanceof FrameError)) expect(e).toBeInstanceOf(FrameError);
      for (const f of frames) {
        same({ payloadWithinLimit: f.payload.length <= MAX_PAYLOAD_BYTES, id: Number.isInteger(f.id) && f.id >= 0 && f.id <= 0xffffffff }, { payloadWithinLimit: true, id: true });
      }
      if (e !== undefined) {
        // Framing is lost at an error; the decoder starts afresh at the next push.
        const next = randomFrame(rng, 1024);
        const [again, ...more] = d.push(encodeFrame(next));
        same({ more: more.length, again: summary(again) }, { more: 0, again: summary(next) });
      }
    }
  });
});
