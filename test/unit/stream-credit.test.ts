// Stream credit on the host (src/protocol/stream-window.ts, and the agent client that sends the
// grants): the window's accounting under a seeded guest and consumer, and the CREDIT frames the
// client sends, what it does with a guest beyond its credit, and its saved state. Pure logic over
// real framing; no VM (the real agent is in ./agent-credit.test.ts).
import { GuestRequestError, SnapshotError } from '../../src';
import { AgentClient, FEATURE_STREAM_CREDIT } from '../../src/protocol/agent-client';
import { encodeFrame, FrameDecoder, FrameType, type Frame } from '../../src/protocol/frame';
import { STREAM_WINDOW_BYTES as W, StreamWindow } from '../../src/protocol/stream-window';
import { creditHello } from '../flooding-guest';
import { property, same } from '../fuzz-seed';

const turn = () => new Promise((r) => setImmediate(r));
const chunk = (id: number, flags: number, bytes: number) => encodeFrame({ type: FrameType.StreamChunk, id, op: 0x0201, flags, payload: Buffer.alloc(bytes, 0x61) });

/** A client with what it sent decoded, and its warnings. */
function client(hello = true) {
  const decoder = new FrameDecoder();
  const sent: Frame[] = [];
  let sends = 0;
  const warnings: string[] = [];
  const c = new AgentClient(
    (b) => {
      sends++;
      sent.push(...decoder.push(b));
    },
    () => {},
    (m) => warnings.push(m),
  );
  if (hello) c.receive(creditHello());
  const grants = () => sent.filter((f) => f.type === FrameType.Credit).map((f) => ({ id: f.id, flags: f.flags, op: f.op, bytes: f.payload.readUInt32LE(0), length: f.payload.length }));
  return { c, sent, warnings, grants, sends: () => sends };
}

describe('StreamWindow', () => {
  property('an honest guest never makes the host hold more than a window, and is never left without credit while the consumer has room', 200, (rng) => {
    const w = new StreamWindow();
    let guestCredit = W; // what the guest knows: grants reach it later, in order
    const inFlight: number[] = []; // grants sent, not yet seen by the guest
    let discarded = false;
    for (let step = 0; step < 400; step++) {
      switch (rng.int(5)) {
        case 0:
        case 1: {
          // The guest sends what it may (an agent may send less).
          const n = Math.min(guestCredit, rng.size(64 * 1024));
          if (n === 0) break;
          same(w.receive(n), true);
          guestCredit -= n;
          break;
        }
        case 2:
          w.consume(rng.size(w.heldBytes + 10));
          break;
        case 3:
          if (inFlight.length) guestCredit += inFlight.shift()!;
          break;
        default:
          if (!discarded && rng.chance(0.02)) {
            w.discard();
            discarded = true;
          }
      }
      const g = w.takeGrant();
      if (g > 0) inFlight.push(g);
      // The bound: held + what the guest may still send never pass a window.
      if (w.heldBytes + w.credit > W) same({ step, held: w.heldBytes, credit: w.credit }, { step, held: w.heldBytes, credit: W - w.heldBytes });
      // Liveness: after a decision, the guest has at least a quarter window, or all the room the
      // consumer has left.
      if (w.credit < Math.min(W / 4, W - w.heldBytes)) same({ step, credit: w.credit }, { step, credit: Math.min(W / 4, W - w.heldBytes) });
      // The host's view of the credit is never below the guest's (grants in flight count).
      same(w.credit, guestCredit + inFlight.reduce((a, b) => a + b, 0));
      if (discarded) same(w.heldBytes, 0);
    }
  });

  it('widened by a consumer that holds more at once, it grants up to the wider window, and never narrows', () => {
    const w = new StreamWindow();
    expect(w.receive(W)).toBe(true);
    expect(w.takeGrant()).toBe(0);
    w.widen(4 * W);
    expect(w.takeGrant()).toBe(3 * W);
    w.widen(W);
    expect(w.receive(3 * W)).toBe(true);
    expect(w.heldBytes).toBe(4 * W);
    expect(w.credit).toBe(0);
  });

  it('a guest beyond its credit is refused and nothing of it counted', () => {
    const w = new StreamWindow();
    expect(w.receive(W)).toBe(true);
    expect(w.receive(1)).toBe(false);
    expect(w.heldBytes).toBe(W);
    w.consume(100);
    expect(w.takeGrant()).toBe(100); // credit 0 < a quarter: even 100 bytes go at once
    expect(w.receive(101)).toBe(false);
    expect(w.receive(100)).toBe(true);
  });
});

describe('agent client: CREDIT frames', () => {
  it('chunks taken as they come are granted back in quarter windows, one CREDIT frame per stream and one send per turn', async () => {
    const { c, grants, sends } = client();
    const a = c.start(0x0210, Buffer.alloc(0), { onChunk: () => {} });
    const b = c.start(0x0201, Buffer.alloc(0), { onChunk: () => {} });
    a.done.catch(() => {});
    b.done.catch(() => {});
    const sendsBefore = sends();
    c.receive(Buffer.concat([chunk(a.id, 1, W / 4 - 1), chunk(b.id, 2, 1000)]));
    await turn();
    expect(grants()).toEqual([]); // less than a quarter, and plenty of credit left
    c.receive(Buffer.concat([chunk(a.id, 1, 1), chunk(b.id, 2, W / 4), chunk(b.id, 1, W / 4)]));
    await turn();
    expect(grants()).toEqual([
      { id: a.id, flags: 1, op: 0x0003, bytes: W / 4, length: 4 },
      { id: b.id, flags: 2, op: 0x0003, bytes: W / 4 + 1000, length: 4 },
      { id: b.id, flags: 1, op: 0x0003, bytes: W / 4, length: 4 },
    ]);
    expect(sends() - sendsBefore).toBe(1);
    c.close();
  });

  it('held chunks are granted as the consumer reports them; a discarded stream is granted back all it holds and all that comes', async () => {
    const { c, grants } = client();
    const r = c.start(0x0201, Buffer.alloc(0), { onChunk: () => {}, holdsChunks: true });
    r.done.catch(() => {});
    c.receive(chunk(r.id, 1, W));
    await turn();
    expect(grants()).toEqual([]);
    expect(c.heldBytes(r.id, 1)).toBe(W);
    c.consumed(r.id, 1, 10); // the guest has no credit: even 10 bytes are granted
    await turn();
    expect(grants().map((g) => g.bytes)).toEqual([10]);
    c.discard(r.id, 1);
    await turn();
    expect(grants().map((g) => g.bytes)).toEqual([10, W - 10]);
    expect(c.heldBytes(r.id, 1)).toBe(0);
    c.receive(chunk(r.id, 1, W));
    await turn();
    expect(grants().map((g) => g.bytes)).toEqual([10, W - 10, W]);
    c.close();
  });

  it('no grant goes to an agent whose HELLO did not offer credit, and its streams are cut at a window all the same', async () => {
    const { c, grants, warnings } = client(false);
    expect(c.speaksStreamCredit).toBe(false);
    const r = c.start(0x0201, Buffer.alloc(0), { onChunk: () => {} });
    r.done.catch(() => {});
    c.receive(chunk(r.id, 1, W));
    await turn();
    expect(grants()).toEqual([]);
    c.receive(chunk(r.id, 1, 1));
    await expect(r.done).rejects.toThrow(GuestRequestError);
    await expect(r.done).rejects.toThrow(/sent 1 bytes on stream 1 of request 1 \(op 0x201\) with 0 bytes of credit left/);
    expect(warnings).toHaveLength(1);
    c.receive(creditHello());
    expect(c.speaksStreamCredit).toBe(true);
    c.close();
  });

  it('a chunk of unknown flags, or a status chunk longer than a pid, is dropped with a warning; the request goes on', async () => {
    const { c, warnings } = client();
    const seen: number[] = [];
    const r = c.start(0x0201, Buffer.alloc(0), { onChunk: (flags) => seen.push(flags) });
    c.receive(Buffer.concat([chunk(r.id, 8, 10), chunk(r.id, 4, 5), chunk(r.id, 4, 4), chunk(r.id, 0, 3), chunk(r.id, 2, 3)]));
    expect(seen).toEqual([4, 2]);
    expect(warnings).toEqual([
      'stream chunk with flags 8 and 10 bytes for request 1 (op 0x201): dropped',
      'stream chunk with flags 4 and 5 bytes for request 1 (op 0x201): dropped',
      'stream chunk with flags 0 and 3 bytes for request 1 (op 0x201): dropped',
    ]);
    c.receive(encodeFrame({ type: FrameType.Response, id: r.id, op: 0x0201, payload: Buffer.alloc(8) }));
    await expect(r.done).resolves.toHaveLength(8);
  });

  it('saved state carries the HELLO features; a state of before stream credit is refused, saying why', async () => {
    const { c } = client();
    const state = JSON.parse(JSON.stringify(c.saveState()));
    expect(state).toMatchObject({ version: 2, agentFeatures: FEATURE_STREAM_CREDIT });
    const restored = client(false);
    restored.c.restoreState(state);
    expect(restored.c.speaksStreamCredit).toBe(true);
    expect(() => new AgentClient(() => {}, () => {}, () => {}).restoreState({ ...state, version: 1 }, 'snapshot.agent')).toThrow(SnapshotError);
    expect(() => new AgentClient(() => {}, () => {}, () => {}).restoreState({ version: 1, nextId: 3, inFlight: [], partialFrame: '' }, 'snapshot.agent')).toThrow(
      /snapshot\.agent\.version: the snapshot was taken by an earlier pvisor \(agent channel state version 1\), whose guest agent sends its output without stream credit; this pvisor reads version 2 only: take the snapshot again/,
    );
    expect(() => new AgentClient(() => {}, () => {}, () => {}).restoreState({ ...state, agentFeatures: -1 }, 'snapshot.agent')).toThrow(/snapshot\.agent\.agentFeatures/);
    expect(() => new AgentClient(() => {}, () => {}, () => {}).restoreState({ ...state, version: 3 }, 'snapshot.agent')).toThrow(/reads version 2, the state says number 3/);
  });
});
