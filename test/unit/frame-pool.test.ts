// The compression workers' pool: real worker threads and zstd. No KVM needed.
import { randomFillSync } from 'node:crypto';
import { FramePool } from '../../src/memory/frame-pool';

const FRAME = 64 * 1024;

describe('FramePool', () => {
  it("a pool's slot buffers go to the next pool once it has ended; pools at the same time have their own", async () => {
    const a = await FramePool.start(FRAME, 1);
    const aBuffers = a.slots.map((s) => s.input.buffer);
    await a.close();
    await a.close(); // once only: the buffers are not given back twice
    const b = await FramePool.start(FRAME, 1);
    const c = await FramePool.start(FRAME, 1);
    try {
      for (const s of b.slots) expect(s.input.buffer).toBe(aBuffers[s.index]);
      for (const s of c.slots) expect(aBuffers).not.toContain(s.input.buffer);
      // Reused buffers hold the last pool's bytes; a frame is whatever the job puts there.
      const slot = b.slots[0];
      randomFillSync(slot.input, 0, FRAME);
      const frame = Buffer.from(slot.input.subarray(0, FRAME));
      const encoded = await b.encode(slot, FRAME);
      expect(encoded.kind).toBe('raw');
      slot.input.fill(0);
      frame.copy(slot.input);
      expect(await b.decode(slot, 'raw', FRAME, FRAME)).toBe(encoded.crc);
    } finally {
      await b.close();
      await c.close();
    }
  });
});
