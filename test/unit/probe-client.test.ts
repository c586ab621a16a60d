// The probe guest's host client against an agent this test plays (real framing, no VM).
import { GuestRequestError } from '../../src';
import { ProbeGuest } from '../../src/guest/probe-client';
import { AgentClient } from '../../src/protocol/agent-client';
import { encodeFrame, FrameDecoder, FrameType } from '../../src/protocol/frame';

/** A probe that answers every request with `payload`. */
function probeAnswering(payload: Buffer): ProbeGuest {
  const decoder = new FrameDecoder();
  const client: AgentClient = new AgentClient(
    (bytes) => {
      for (const f of decoder.push(bytes)) setImmediate(() => client.receive(encodeFrame({ type: FrameType.Response, id: f.id, op: f.op, payload })));
    },
    () => {},
    () => {},
  );
  return new ProbeGuest(client);
}

describe('probe guest client', () => {
  it('a short DIGEST answer is a GuestRequestError, not a RangeError (found by agent-client-fuzz)', async () => {
    await expect(probeAnswering(Buffer.alloc(8)).digest()).rejects.toThrow(GuestRequestError);
    await expect(probeAnswering(Buffer.alloc(8)).digest()).rejects.toThrow(/DIGEST with 8 bytes, 24 expected/);
    const answer = Buffer.alloc(24);
    answer.writeUInt32LE(0x11223344, 8);
    answer.writeUInt32LE(0x55667788, 12);
    await expect(probeAnswering(answer).digest()).resolves.toMatchObject({ hex: '5566778811223344' });
  });
});
