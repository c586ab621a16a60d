// The Linux guest's host client against an agent this test plays (pure logic over real framing):
// every operation settles within its timeout, whatever the agent does. No VM.
import { GuestRequestError, InvalidOptionError, OutputLimitError, TimeoutError } from '../../src';
import { LinuxGuest } from '../../src/guest/linux-client';
import { AgentClient } from '../../src/protocol/agent-client';
import { encodeFrame, FrameDecoder, FrameType, type Frame } from '../../src/protocol/frame';
import { STREAM_WINDOW_BYTES } from '../../src/protocol/stream-window';
import { creditHello } from '../flooding-guest';

/** A guest agent that answers requests as `answer` says (nothing: silence). */
function fakeGuest(answer: (request: Frame, reply: (f: Omit<Frame, 'id'>) => void) => void) {
  const decoder = new FrameDecoder();
  const client: AgentClient = new AgentClient(
    (bytes) => {
      for (const f of decoder.push(bytes)) {
        answer(f, (r) => setImmediate(() => client.receive(encodeFrame({ ...r, id: f.id }))));
      }
    },
    () => {},
    () => {},
  );
  client.receive(creditHello());
  return new LinuxGuest(client);
}

/**
 * An agent's output of `total` bytes in chunks of `chunkBytes` for the request `f`, sent as its
 * credit allows (a window at first, then what each CREDIT frame grants); `done` once all is sent.
 * Returns the handler of the later frames (the grants).
 */
function creditedOutput(f: Frame, reply: (r: Omit<Frame, 'id'>) => void, total: number, chunkBytes: number, flags: number, done: () => void = () => {}) {
  let credit = STREAM_WINDOW_BYTES;
  let sent = 0;
  const more = () => {
    while (sent < total && credit >= Math.min(chunkBytes, total - sent)) {
      const n = Math.min(chunkBytes, total - sent);
      reply({ type: FrameType.StreamChunk, op: f.op, flags, payload: Buffer.alloc(n, 0x79) });
      sent += n;
      credit -= n;
      if (sent === total) done();
    }
  };
  more();
  return (g: Frame) => {
    if (g.type === FrameType.Credit && g.id === f.id && g.flags === flags) {
      credit += g.payload.readUInt32LE(0);
      more();
    }
  };
}

const EXEC = 0x0201;
const STARTED = 4;

describe('Linux guest client', () => {
  it('a silent agent makes files, memory figures, kill and drop-caches reject within their timeouts', async () => {
    const guest = fakeGuest(() => {});
    const t0 = performance.now();
    await expect(guest.files.read('/etc/hostname', { timeoutMs: 30 })).rejects.toThrow(TimeoutError);
    await expect(guest.files.write('/tmp/x', 'data', { timeoutMs: 30 })).rejects.toThrow(TimeoutError);
    await expect(guest.memInfo({ timeoutMs: 30 })).rejects.toThrow(TimeoutError);
    await expect(guest.dropCaches({ timeoutMs: 30 })).rejects.toThrow(TimeoutError);
    await expect(guest.spawn(['sleep', '1']).kill('SIGTERM', { timeoutMs: 30 })).rejects.toThrow(TimeoutError);
    expect(performance.now() - t0).toBeLessThan(2000);
  });

  it("exec's timeout rejects even when the agent never reports the killed command's end", async () => {
    const guest = fakeGuest((f, reply) => {
      if (f.op === EXEC) reply({ type: FrameType.StreamChunk, op: EXEC, flags: STARTED, payload: Buffer.from([1, 0, 0, 0]) });
      // KILL and everything else: silence.
    });
    const t0 = performance.now();
    await expect(guest.exec(['sleep', '100'], { timeoutMs: 50 })).rejects.toThrow(/did not finish within 50 ms/);
    const took = performance.now() - t0;
    expect(took).toBeGreaterThanOrEqual(50);
    expect(took).toBeLessThan(50 + 5000 + 2000); // the timeout, the kill's grace, slack
  }, 15_000);

  it('a command the guest refuses rejects its pid too, and a short STARTED chunk is ignored', async () => {
    const refusing = fakeGuest((f, reply) => {
      if (f.op === EXEC) reply({ type: FrameType.Error, op: EXEC, flags: 0, payload: Buffer.concat([Buffer.from([2, 0, 0, 0]), Buffer.from('no such program')]) });
    });
    const p = refusing.spawn(['nonexistent']);
    await expect(p.pid).rejects.toThrow(GuestRequestError);
    await expect(p.exited).rejects.toThrow(/no such program/);

    const sloppy = fakeGuest((f, reply) => {
      if (f.op !== EXEC) return;
      reply({ type: FrameType.StreamChunk, op: EXEC, flags: STARTED, payload: Buffer.alloc(0) });
      reply({ type: FrameType.Response, op: EXEC, flags: 0, payload: Buffer.alloc(8) });
    });
    await expect(sloppy.exec(['true'])).resolves.toMatchObject({ exitCode: 0, signal: null });
  });

  // Both found by agent-client-fuzz.
  it('a command that ends without reporting a pid rejects its pid, which never waits forever', async () => {
    const sloppy = fakeGuest((f, reply) => {
      if (f.op !== EXEC) return;
      reply({ type: FrameType.StreamChunk, op: EXEC, flags: STARTED, payload: Buffer.alloc(2) }); // too short for a pid
      reply({ type: FrameType.Response, op: EXEC, flags: 0, payload: Buffer.alloc(8) });
    });
    const p = sloppy.spawn(['true']);
    await expect(p.exited).resolves.toEqual({ exitCode: 0, signal: null });
    await expect(p.pid).rejects.toThrow(/ended the command without reporting its pid/);
    const started = fakeGuest((f, reply) => {
      if (f.op !== EXEC) return;
      reply({ type: FrameType.StreamChunk, op: EXEC, flags: STARTED, payload: Buffer.from([7, 0, 0, 0]) });
      reply({ type: FrameType.Response, op: EXEC, flags: 0, payload: Buffer.alloc(8) });
    }).spawn(['true']);
    await expect(started.pid).resolves.toBe(7);
  });

  it('files.read whose total disagrees with the bytes sent is a GuestRequestError', async () => {
    const liar = fakeGuest((f, reply) => {
      reply({ type: FrameType.StreamChunk, op: f.op, flags: 0, payload: Buffer.from('abc') });
      reply({ type: FrameType.Response, op: f.op, flags: 0, payload: Buffer.alloc(8, 0xff) });
    });
    await expect(liar.files.read('/x')).rejects.toThrow(GuestRequestError);
  });

  it('a short answer is a typed error, not a RangeError out of the receive path', async () => {
    const short = fakeGuest((f, reply) => {
      if (f.op === EXEC) reply({ type: FrameType.Response, op: EXEC, flags: 0, payload: Buffer.alloc(3) });
      else reply({ type: FrameType.Response, op: f.op, flags: 0, payload: Buffer.alloc(2) });
    });
    await expect(short.exec(['true'])).rejects.toThrow(GuestRequestError);
    await expect(short.memInfo()).rejects.toThrow(/MEMINFO with 2 bytes/);
    await expect(short.files.read('/x')).rejects.toThrow(/FILE_READ with 2 bytes/);
  });

  it.each([NaN, Infinity, -1, 0, 1.5, 2 ** 31, 2 ** 53, '100'])('timeoutMs %p is refused, not rounded or fired at once', async (bad) => {
    const guest = fakeGuest(() => {});
    await expect(guest.exec(['true'], { timeoutMs: bad as number })).rejects.toThrow(InvalidOptionError);
    await expect(guest.memInfo({ timeoutMs: bad as number })).rejects.toThrow(/timeoutMs: expected a whole number of milliseconds/);
  });

  it('exec kills a command that prints more than maxBuffer and rejects with an OutputLimitError', async () => {
    const ops: number[] = [];
    let grants = (_f: Frame) => {};
    const guest = fakeGuest((f, reply) => {
      if (f.type === FrameType.Credit) return grants(f);
      ops.push(f.op);
      if (f.op !== EXEC) return; // the KILL: the command's end is never reported (grace applies)
      reply({ type: FrameType.StreamChunk, op: EXEC, flags: STARTED, payload: Buffer.from([9, 0, 0, 0]) });
      grants = creditedOutput(f, reply, 40 * 64 * 1024, 64 * 1024, 1); // 2.5 MiB of 'y'
    });
    const err = await guest.exec(['yes'], { maxBuffer: 1024 * 1024 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(OutputLimitError);
    expect((err as OutputLimitError).message).toMatch(/more than 1048576 bytes to stdout/);
    expect(ops).toContain(0x0204); // KILL was sent
  }, 15_000);

  it('files.read of a file larger than maxBytes rejects with an OutputLimitError and keeps none of it', async () => {
    const grants = new Map<number, (g: Frame) => void>();
    const guest = fakeGuest((f, reply) => {
      if (f.type === FrameType.Credit) return grants.get(f.id)?.(f);
      const total = Buffer.alloc(8);
      total.writeBigUInt64LE(BigInt(8 * 128 * 1024));
      grants.set(f.id, creditedOutput(f, reply, 8 * 128 * 1024, 128 * 1024, 1, () => reply({ type: FrameType.Response, op: f.op, flags: 0, payload: total })));
    });
    await expect(guest.files.read('/big', { maxBytes: 512 * 1024 })).rejects.toThrow(OutputLimitError);
    await expect(guest.files.read('/big', { maxBytes: 1024 * 1024 })).resolves.toHaveLength(1024 * 1024);
    await expect(guest.files.read('/big', { maxBytes: -1 })).rejects.toThrow(/maxBytes: expected a whole number of bytes or Infinity/);
    await expect(guest.exec(['true'], { maxBuffer: NaN })).rejects.toThrow(/maxBuffer/);
  });
});
