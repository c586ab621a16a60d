// The agent client's bookkeeping of requests, over frames a test writes: pure logic, no VM.
import { GuestRequestError, TimeoutError } from '../../src';
import { AgentClient } from '../../src/protocol/agent-client';
import { encodeFrame, FrameDecoder, FrameType } from '../../src/protocol/frame';

function client() {
  const sent: Buffer[] = [];
  const protocolErrors: string[] = [];
  const c = new AgentClient((b) => sent.push(b), () => {}, (m) => protocolErrors.push(m));
  const lastId = () => new FrameDecoder().push(sent[sent.length - 1])[0].id;
  return { c, protocolErrors, lastId };
}

describe('agent client', () => {
  it('a frame of a type that is no answer still settles its request, once, with a typed error', async () => {
    const { c, protocolErrors, lastId } = client();
    const p = c.request(0x101);
    const id = lastId();
    c.receive(encodeFrame({ type: 9 as FrameType, id, op: 0x101, payload: Buffer.alloc(0) }));
    await expect(p).rejects.toThrow(GuestRequestError);
    await expect(p).rejects.toThrow(/type 9, which is not an answer/);
    expect(protocolErrors).toHaveLength(1);
    // A late answer for the same id finds nothing to settle.
    c.receive(encodeFrame({ type: FrameType.Response, id, op: 0x101, payload: Buffer.alloc(0) }));
  });

  it('a request that times out rejects once; its late answer is dropped', async () => {
    const { c, lastId } = client();
    const p = c.request(0x104, Buffer.alloc(0), { timeoutMs: 10 });
    const id = lastId();
    await expect(p).rejects.toThrow(TimeoutError);
    c.receive(encodeFrame({ type: FrameType.Response, id, op: 0x104, payload: Buffer.alloc(0) }));
  });
});
