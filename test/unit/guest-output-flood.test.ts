// Floods: 1 GiB of guest output into exec, spawn and files.read, through the real parts between
// the guest and the caller (guest RAM, the virtio-console device behind its mmio transport, the
// agent client, the Linux client; ../flooding-guest.ts is the agent's side, under stream credit,
// or ignoring it), the caller slow or the output over its limit. The host's resident memory may rise by at most FLOOD_RSS_BOUND while
// the gigabyte goes through, measured at its peak (VmHWM, reset before each flood). Without the
// bounds (a stream that ignored its consumer, exec or files.read that kept all they were sent)
// the process would rise by the gigabyte.
import { OutputLimitError } from '../../src';
import { STREAM_WINDOW_BYTES } from '../../src/protocol/stream-window';
import { FloodingGuest, FRAME_PAYLOAD } from '../flooding-guest';
import { peakRssGrowth } from '../peak-rss';

const MiB = 2 ** 20;
const GiB = 1024 * MiB;
/** What the host may keep of a 1 GiB flood, whichever way it comes: 64 MiB. */
const FLOOD_RSS_BOUND = 64 * MiB;
const turn = () => new Promise((r) => setImmediate(r));

/** A short flood first, so that what any first run allocates once (code, pools) is not counted. */
async function warmUp(op: number): Promise<void> {
  const g = new FloodingGuest(op, 1, 8 * MiB);
  try {
    const s = op === 0x0201 ? g.linux.spawn(['yes']).stdout : g.linux.files.readStream('/warm');
    s.resume();
    while (g.taken < g.sentCount || g.sentBytes < 8 * MiB) {
      g.produce();
      await turn();
    }
    const answer = Buffer.alloc(8); // a spawn's exit status 0, or a read's byte count
    if (op !== 0x0201) answer.writeBigUInt64LE(BigInt(g.sentBytes));
    g.finish(answer);
    await new Promise((r) => (s.readableEnded ? r(null) : s.once('end', r)));
  } finally {
    g.close();
  }
}

describe('1 GiB floods of guest output: host memory stays within 64 MiB', () => {
  it('spawn: 1 GiB of stdout to a consumer slower than the guest arrives whole, the host never holding more than its window', async () => {
    await warmUp(0x0201);
    const g = new FloodingGuest(0x0201, 1, GiB);
    try {
      const { result, growthBytes } = await peakRssGrowth(async () => {
        const p = g.linux.spawn(['yes']);
        let read = 0;
        let maxBuffered = 0;

        let wrongLetters = 0;
        let expected = 0;
        p.stdout.on('data', (c: Buffer) => {
          // Chunks come as the guest sent them: each one letter, the letters in turn.
          if (c.length !== FRAME_PAYLOAD || c[0] !== 97 + (expected++ % 26) || c[c.length - 2] !== c[0]) wrongLetters++;
          read += c.length;
          maxBuffered = Math.max(maxBuffered, p.stdout.readableLength);
          // Slow: after each chunk it looks away for a turn of the event loop.
          p.stdout.pause();
          setImmediate(() => p.stdout.resume());
        });
        while (g.sentBytes < GiB || g.taken < g.sentCount) {
          g.produce();
          await turn();
        }
        g.finish(Buffer.alloc(8));
        const status = await p.exited;
        await new Promise((r) => (p.stdout.readableEnded ? r(null) : p.stdout.once('end', r)));
        return { read, maxBuffered, wrongLetters, status };
      });
      expect(result.status).toEqual({ exitCode: 0, signal: null });
      expect(result.read).toBe(g.sentBytes);
      expect(result.read).toBeGreaterThanOrEqual(GiB);
      expect(result.wrongLetters).toBe(0);
      expect(g.creditWaits).toBeGreaterThan(0); // the consumer was the slower: the guest waited for credit
      expect(g.grants).toBeGreaterThan(0);
      expect(result.maxBuffered).toBeLessThanOrEqual(STREAM_WINDOW_BYTES);
      console.log(`spawn flood: peak RSS growth ${(growthBytes / MiB).toFixed(1)} MiB`);
      expect(growthBytes).toBeLessThan(FLOOD_RSS_BOUND);
      expect(g.warnings).toEqual([]);
    } finally {
      g.close();
    }
  });

  it('exec: a command killed at its 1 MiB maxBuffer whose agent sends 1 GiB more anyway fails with OutputLimitError, the rest taken and dropped', async () => {
    const g = new FloodingGuest(0x0201, 1, GiB);
    try {
      const { result, growthBytes } = await peakRssGrowth(async () => {
        const failed = g.linux.exec(['yes']).then(
          () => null,
          (e: Error) => e,
        );
        // The agent ignores the KILL (it lands in the receive ring, unread) and sends the gigabyte.
        while (g.sentBytes < GiB || g.taken < g.sentCount) {
          g.produce();
          await turn();
        }
        g.finish(Buffer.alloc(8));
        return { error: await failed };
      });
      expect(result.error).toBeInstanceOf(OutputLimitError);
      expect(result.error!.message).toMatch(/more than 1048576 bytes to stdout/);
      expect(g.taken).toBe(g.sentCount - 1); // every chain of the flood came back used
      expect(g.sentBytes).toBeGreaterThanOrEqual(GiB);
      console.log(`exec flood: peak RSS growth ${(growthBytes / MiB).toFixed(1)} MiB`);
      expect(growthBytes).toBeLessThan(FLOOD_RSS_BOUND);
    } finally {
      g.close();
    }
  });

  it('files.read: 1 GiB sent, credit or not, for a read limited to 8 MiB (maxBytes) fails with OutputLimitError, keeping at most the 8 MiB', async () => {
    await warmUp(0x0210);
    // Given up at 8 MiB, the read grants nothing more: an agent that keeps to its credit stops
    // there. This one keeps to it until then, and sends the gigabyte anyway after, which the host
    // takes and drops.
    const g = new FloodingGuest(0x0210, 1, GiB);
    try {
      const { result, growthBytes } = await peakRssGrowth(async () => {
        const failed = g.linux.files.read('/big', { maxBytes: 8 * MiB, timeoutMs: 600_000 }).then(
          () => null,
          (e: Error) => e,
        );
        void failed.then(() => (g.honoursCredit = false));
        while (g.sentBytes < GiB || g.taken < g.sentCount) {
          g.produce();
          await turn();
        }
        const answer = Buffer.alloc(8);
        answer.writeBigUInt64LE(BigInt(g.sentBytes));
        g.finish(answer);
        return { error: await failed };
      });
      expect(result.error).toBeInstanceOf(OutputLimitError);
      expect(result.error!.message).toMatch(/\/big is larger than 8388608 bytes/);
      expect(g.sentBytes).toBeGreaterThanOrEqual(GiB);
      console.log(`files.read flood: peak RSS growth ${(growthBytes / MiB).toFixed(1)} MiB`);
      expect(growthBytes).toBeLessThan(FLOOD_RSS_BOUND);
    } finally {
      g.close();
    }
  });
});
