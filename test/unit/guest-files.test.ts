// vm.files and spawn's limits against an agent this test plays (pure logic over real framing):
// what is sent for list, stat, mkdir, remove, rename and a streamed write; timeouts and aborts
// that settle the call and tell the agent to close what it opened; options checked before
// anything is sent. No VM.
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { AbortError, GuestRequestError, InvalidOptionError, OutputLimitError, TimeoutError } from '../../src';
import { LinuxGuest } from '../../src/guest/linux-client';
import { AgentClient } from '../../src/protocol/agent-client';
import { encodeFrame, FrameDecoder, FrameType, type Frame } from '../../src/protocol/frame';

const Op = { Exec: 0x0201, Kill: 0x0204, Read: 0x0210, List: 0x0212, Stat: 0x0213, Mkdir: 0x0214, Remove: 0x0215, Rename: 0x0216, WriteOpen: 0x0217, WriteData: 0x0218, WriteClose: 0x0219, Cancel: 0x021a };

type Reply = (f: Omit<Frame, 'id'> & { id?: number }) => void;

/** A guest agent that answers as `answer` says, recording every request and protocol error. */
function fakeGuest(answer: (request: Frame, reply: Reply) => void) {
  const decoder = new FrameDecoder();
  const requests: Frame[] = [];
  const protocolErrors: string[] = [];
  const client: AgentClient = new AgentClient(
    (bytes) => {
      for (const f of decoder.push(bytes)) {
        requests.push(f);
        answer(f, (r) => setImmediate(() => client.receive(encodeFrame({ ...r, id: r.id ?? f.id }))));
      }
    },
    () => {},
    (m) => protocolErrors.push(m),
  );
  return { guest: new LinuxGuest(client), requests, protocolErrors };
}

const u64 = (n: number) => {
  const b = Buffer.alloc(8);
  b.writeBigUInt64LE(BigInt(n));
  return b;
};
const ok = (op: number, payload: Buffer = Buffer.alloc(0)) => ({ type: FrameType.Response, op, flags: 0, payload });
const chunk = (op: number, flags: number, payload: Buffer = Buffer.alloc(0)) => ({ type: FrameType.StreamChunk, op, flags, payload });
const refuse = (op: number, code: number, text: string) => ({ type: FrameType.Error, op, flags: 0, payload: Buffer.concat([Buffer.from([code, 0, 0, 0]), Buffer.from(text)]) });

function listEntry(name: string): Buffer {
  const b = Buffer.alloc(24 + name.length);
  b.writeUInt16LE(name.length, 0);
  b[2] = 1;
  b.writeUInt32LE(0o644, 4);
  b.write(name, 24);
  return b;
}

/** Lets pending immediates and promise callbacks run. */
const settle = () => new Promise((r) => setTimeout(r, 20));

describe('Linux guest files', () => {
  it('list takes entries from several chunks and checks the count; stat, mkdir, remove and rename send their fields', async () => {
    const { guest, requests } = fakeGuest((f, reply) => {
      if (f.op === Op.List) {
        reply(chunk(Op.List, 1, Buffer.concat([listEntry('a'), listEntry('b')])));
        reply(chunk(Op.List, 1, listEntry('c')));
        reply(ok(Op.List, u64(3)));
      } else if (f.op === Op.Remove) reply(ok(f.op, u64(1)));
      else if (f.op === Op.Stat) {
        const r = Buffer.alloc(36);
        r.writeUInt32LE(2, 0);
        r.writeUInt32LE(0o755, 4);
        reply(ok(f.op, r));
      } else reply(ok(f.op));
    });
    expect((await guest.files.list('/d')).map((e) => e.name)).toEqual(['a', 'b', 'c']);
    expect(await guest.files.stat('/d', { followSymlinks: true })).toMatchObject({ type: 'directory', mode: 0o755 });
    await guest.files.mkdir('/d/e', { recursive: true, mode: 0o700 });
    await guest.files.remove('/d', { recursive: true });
    await guest.files.rename('/from', '/to');
    const by = (op: number) => requests.find((r) => r.op === op)!.payload;
    expect(by(Op.Stat).readUInt32LE(0)).toBe(1);
    expect([by(Op.Mkdir).readUInt32LE(0), by(Op.Mkdir).readUInt32LE(4), by(Op.Mkdir).toString('utf8', 12)]).toEqual([1, 0o700, '/d/e']);
    expect(by(Op.Remove).readUInt32LE(0)).toBe(1);
    expect(by(Op.Rename)).toEqual(Buffer.from('\x05\0\0\0/from\x03\0\0\0/to', 'latin1'));
  });

  it('a listing whose count disagrees, or with more than maxEntries, is refused; maxEntries closes the directory in the guest', async () => {
    const { guest, requests, protocolErrors } = fakeGuest((f, reply) => {
      if (f.op === Op.List) {
        reply(chunk(Op.List, 1, Buffer.concat([listEntry('a'), listEntry('b')])));
        reply(ok(Op.List, u64(5)));
      } else if (f.op === Op.Cancel) reply(ok(Op.Cancel)); // the listing had ended: only the cancel's answer, as the agent does
    });
    await expect(guest.files.list('/d')).rejects.toThrow(/said 5 entries but sent 2/);
    await expect(guest.files.list('/d', { maxEntries: 1 })).rejects.toThrow(OutputLimitError);
    await settle();
    const cancel = requests.find((r) => r.op === Op.Cancel)!;
    expect(cancel.payload.readUInt32LE(0)).toBe(requests.filter((r) => r.op === Op.List)[1].id);
    // The cancelled listing's own end (its last chunk, its final frame) is dropped without a word.
    expect(protocolErrors).toEqual([]);
  });

  it('a read that times out or is aborted rejects at once and closes the file in the guest', async () => {
    const { guest, requests, protocolErrors } = fakeGuest((f, reply) => {
      if (f.op === Op.Cancel) {
        reply({ ...refuse(Op.Read, 10, 'cancelled by the host'), id: f.payload.readUInt32LE(0) });
        reply(ok(Op.Cancel));
      }
    });
    await expect(guest.files.read('/fifo', { timeoutMs: 30 })).rejects.toThrow(TimeoutError);
    const ac = new AbortController();
    const reading = guest.files.read('/fifo', { signal: ac.signal });
    ac.abort(new Error('enough'));
    const e = (await reading.catch((x: unknown) => x)) as Error;
    expect(e).toBeInstanceOf(AbortError);
    expect(e.name).toBe('AbortError');
    expect((e as AbortError).cause).toEqual(new Error('enough'));
    await settle();
    const reads = requests.filter((r) => r.op === Op.Read).map((r) => r.id);
    expect(requests.filter((r) => r.op === Op.Cancel).map((r) => r.payload.readUInt32LE(0))).toEqual(reads);
    expect(protocolErrors).toEqual([]);
  });

  it('a signal aborted already sends nothing', async () => {
    const { guest, requests } = fakeGuest(() => {});
    const signal = AbortSignal.abort();
    await expect(guest.files.stat('/', { signal })).rejects.toThrow(AbortError);
    await expect(guest.files.list('/', { signal })).rejects.toThrow(AbortError);
    await expect(guest.files.mkdir('/x', { signal })).rejects.toThrow(AbortError);
    await expect(guest.spawn(['true'], { signal }).exited).rejects.toThrow(AbortError);
    await expect(guest.files.read('/f', { signal })).rejects.toThrow(AbortError);
    await expect((async () => { for await (const _ of guest.files.readStream('/f', { signal })) void _; })()).rejects.toThrow(AbortError);
    await expect(pipeline(Readable.from(['x']), guest.files.writeStream('/f', { signal }))).rejects.toThrow(AbortError);
    await expect(guest.files.write('/f', 'x', { signal })).rejects.toThrow(AbortError);
    await settle();
    expect(requests).toEqual([]);
  });

  it('writeStream sends frames of at most 512 KiB, one in flight, and finishes once the guest confirms every byte', async () => {
    const got: Buffer[] = [];
    let inFlight = 0;
    let maxInFlight = 0;
    let openId = 0;
    const { guest } = fakeGuest((f, reply) => {
      if (f.op === Op.WriteOpen) {
        openId = f.id;
        reply(chunk(Op.WriteOpen, 4));
      } else if (f.op === Op.WriteData) {
        expect(f.payload.readUInt32LE(0)).toBe(openId);
        got.push(Buffer.from(f.payload.subarray(4)));
        maxInFlight = Math.max(maxInFlight, ++inFlight);
        setTimeout(() => {
          inFlight--;
          reply(ok(Op.WriteData, u64(f.payload.length - 4)));
        }, 1);
      } else if (f.op === Op.WriteClose) {
        reply(ok(Op.WriteClose));
        reply({ ...ok(Op.WriteOpen, u64(got.reduce((n, b) => n + b.length, 0))), id: openId });
      }
    });
    const data = Buffer.alloc(3 * 1024 * 1024 + 5, 7);
    for (let i = 0; i < data.length; i += 4099) data[i] = i & 0xff;
    await pipeline(Readable.from((function* () { for (let i = 0; i < data.length; i += 100_000) yield data.subarray(i, i + 100_000); })()), guest.files.writeStream('/big', { mode: 0o600 }));
    expect(Buffer.concat(got).equals(data)).toBe(true);
    expect(Math.max(...got.map((b) => b.length))).toBeLessThanOrEqual(512 * 1024);
    expect(maxInFlight).toBe(1);
    // Also a string, an async iterable of strings, through write().
    got.length = 0;
    await guest.files.write('/s', (async function* () { yield 'ab'; yield 'c'; })());
    expect(Buffer.concat(got).toString()).toBe('abc');
  });

  it('writeStream: a guest that does not take a frame is a TimeoutError and the handle is cancelled; a total that lies is refused', async () => {
    const stuck = fakeGuest((f, reply) => {
      if (f.op === Op.WriteOpen) reply(chunk(Op.WriteOpen, 4));
      else if (f.op === Op.Cancel) reply(ok(Op.Cancel));
    });
    await expect(pipeline(Readable.from([Buffer.alloc(1000)]), stuck.guest.files.writeStream('/f', { timeoutMs: 30 }))).rejects.toThrow(TimeoutError);
    await settle();
    const open = stuck.requests.find((r) => r.op === Op.WriteOpen)!;
    expect(stuck.requests.filter((r) => r.op === Op.Cancel).map((r) => r.payload.readUInt32LE(0))).toEqual([open.id]);

    const neverOpens = fakeGuest(() => {});
    await expect(pipeline(Readable.from([Buffer.alloc(10)]), neverOpens.guest.files.writeStream('/f', { timeoutMs: 30 }))).rejects.toThrow(/did not open \/f/);

    let openId = 0;
    const liar = fakeGuest((f, reply) => {
      if (f.op === Op.WriteOpen) {
        openId = f.id;
        reply(chunk(Op.WriteOpen, 4));
      } else if (f.op === Op.WriteData) reply(ok(f.op, u64(f.payload.length - 4)));
      else if (f.op === Op.WriteClose) {
        reply(ok(Op.WriteClose));
        reply({ ...ok(Op.WriteOpen, u64(999)), id: openId });
      }
    });
    await expect(liar.guest.files.write('/f', Readable.from([Buffer.alloc(10)]))).rejects.toThrow(GuestRequestError);

    const refused = fakeGuest((f, reply) => {
      if (f.op === Op.WriteOpen) reply(refuse(Op.WriteOpen, 6, 'ENOENT: No such file or directory: /no/dir/f'));
    });
    await expect(pipeline(Readable.from([Buffer.alloc(10)]), refused.guest.files.writeStream('/no/dir/f'))).rejects.toThrow(/ENOENT/);
  });

  it('spawn: timeoutMs and signal kill the process (SIGKILL) and reject exited', async () => {
    const { guest, requests } = fakeGuest((f, reply) => {
      if (f.op === Op.Exec) reply(chunk(Op.Exec, 4, Buffer.from([9, 0, 0, 0])));
      else if (f.op === Op.Kill) {
        reply(ok(Op.Kill));
        reply({ ...ok(Op.Exec, Buffer.from([0xff, 0xff, 0xff, 0xff, 9, 0, 0, 0])), id: f.payload.readUInt32LE(0) });
      }
    });
    await expect(guest.spawn(['sleep', '100'], { timeoutMs: 30 }).exited).rejects.toThrow(TimeoutError);
    const ac = new AbortController();
    const p = guest.spawn(['sleep', '100'], { signal: ac.signal });
    await p.pid;
    ac.abort();
    await expect(p.exited).rejects.toThrow(AbortError);
    expect(requests.filter((r) => r.op === Op.Kill).map((r) => r.payload.readUInt32LE(4))).toEqual([9, 9]);
    await expect(guest.exec(['sleep', '100'], { signal: AbortSignal.abort() })).rejects.toThrow(AbortError);
  });

  it('options are checked before anything is sent', async () => {
    const { guest, requests } = fakeGuest(() => {});
    const files = guest.files;
    const calls: [string, () => unknown][] = [
      ['timeoutMs', () => files.stat('/', { timeoutMs: 0 })],
      ['timeoutMs', () => files.list('/', { timeoutMs: NaN })],
      ['timeoutMs', () => files.rename('/a', '/b', { timeoutMs: 2 ** 31 })],
      ['timeoutMs', () => files.writeStream('/a', { timeoutMs: 1.5 })],
      ['timeoutMs', () => files.readStream('/a', { timeoutMs: -1 })],
      ['timeoutMs', () => guest.spawn(['true'], { timeoutMs: Infinity })],
      ['signal', () => files.remove('/a', { signal: {} as AbortSignal })],
      ['signal', () => guest.spawn(['true'], { signal: 'no' as unknown as AbortSignal })],
      ['mode', () => files.mkdir('/a', { mode: 0o10000 })],
      ['mode', () => files.writeStream('/a', { mode: -1 })],
      ['recursive', () => files.remove('/a', { recursive: 'yes' as unknown as boolean })],
      ['followSymlinks', () => files.stat('/a', { followSymlinks: 1 as unknown as boolean })],
      ['maxEntries', () => files.list('/a', { maxEntries: -1 })],
      ['path', () => files.stat('')],
      ['to', () => files.rename('/a', 'b\0')],
      ['data', () => files.write('/a', 42 as unknown as string)],
    ];
    for (const [option, call] of calls) {
      let error: unknown;
      try {
        await call();
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(InvalidOptionError);
      expect((error as InvalidOptionError).option).toBe(option);
    }
    expect(requests).toEqual([]);
  });
});
