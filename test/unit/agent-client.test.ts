// The agent client's bookkeeping of requests, over frames a test writes: pure logic, no VM.
import { AbortError, GuestRequestError, RequestTooLargeError, TimeoutError, VmStateError } from '../../src';
import { AgentClient } from '../../src/protocol/agent-client';
import { encodeFrame, FrameDecoder, FrameType, MAX_PAYLOAD_BYTES } from '../../src/protocol/frame';

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

  it("the guest's error text reaches host warnings and errors capped, without control characters", async () => {
    // What the probe's hostile mode (frame-foreign-ids) sent: an error for an id never asked whose
    // text clears the terminal, sets its title and forges a log line, then runs on; a frame may
    // carry 1 MiB of it.
    const { c, protocolErrors, lastId } = client();
    const text = Buffer.concat([Buffer.from('\x1b[2J\x1b]0;pvisor\x07\nhost: all VMs healthy\n'), Buffer.alloc(1024 * 1024 - 64, 'A')]);
    const payload = Buffer.concat([Buffer.from([2, 0, 0, 0]), text]);
    c.receive(encodeFrame({ type: FrameType.Error, id: 0x7ffffffe, op: 0x1f1, payload }));
    const p = c.request(0x101);
    c.receive(encodeFrame({ type: FrameType.Error, id: lastId(), op: 0x101, payload }));
    const err = await p.catch((e: Error) => e);
    expect(err).toBeInstanceOf(GuestRequestError);
    for (const m of [protocolErrors[0], (err as Error).message]) {
      expect(m.length).toBeLessThan(1200);
      expect(m).not.toMatch(/[\x00-\x1f\x7f]/);
      expect(m).toMatch(/\?\[2J\?\]0;pvisor\?\?host: all VMs healthy\?AAAA.*\.\.\. \(\d+ bytes\)$/);
    }
  });

  it("a request its signal aborts rejects with an AbortError caused by the signal's reason; one aborted already sends nothing", async () => {
    const sent: Buffer[] = [];
    const c = new AgentClient((b) => sent.push(b), () => {}, () => {});
    const early = new AbortController();
    early.abort(new Error('not wanted'));
    const before = c.request(0x105, Buffer.alloc(0), { signal: early.signal }).catch((e: Error) => e);
    expect(sent).toHaveLength(0);
    const e1 = await before;
    expect(e1).toBeInstanceOf(AbortError);
    expect(e1).toMatchObject({ name: 'AbortError', message: 'op 0x105 was aborted', cause: early.signal.reason });

    const late = new AbortController();
    const p = c.request(0x106, Buffer.alloc(0), { signal: late.signal }).catch((e: Error) => e);
    expect(sent).toHaveLength(1);
    const id = new FrameDecoder().push(sent[0])[0].id;
    late.abort('changed my mind');
    const e2 = await p;
    expect(e2).toBeInstanceOf(AbortError);
    expect(e2).toMatchObject({ message: 'op 0x106 was aborted', cause: 'changed my mind' });
    c.receive(encodeFrame({ type: FrameType.Response, id, op: 0x106, payload: Buffer.alloc(0) }));
  });

  it('a request that times out rejects once; its late answer is dropped', async () => {
    const { c, lastId } = client();
    const p = c.request(0x104, Buffer.alloc(0), { timeoutMs: 10 });
    const id = lastId();
    await expect(p).rejects.toThrow(TimeoutError);
    c.receive(encodeFrame({ type: FrameType.Response, id, op: 0x104, payload: Buffer.alloc(0) }));
  });
});

describe('agent client: every request settles exactly once', () => {
  /** How often each of a request's settle paths ran. */
  function settles(p: Promise<unknown>) {
    const seen = { resolved: 0, rejected: 0, error: undefined as unknown };
    p.then(() => seen.resolved++, (e) => (seen.rejected++, (seen.error = e)));
    return seen;
  }

  it('a payload bigger than one frame carries is a RequestTooLargeError before anything is sent; the channel goes on', async () => {
    const { c, lastId } = client();
    const sent: Buffer[] = [];
    const c2 = new AgentClient((b) => sent.push(b), () => {}, () => {});
    for (const size of [MAX_PAYLOAD_BYTES + 1, 4 * MAX_PAYLOAD_BYTES]) {
      const err = await c2.request(0x101, Buffer.alloc(size), { timeoutMs: 50 }).catch((e: Error) => e);
      expect(err).toBeInstanceOf(RequestTooLargeError);
      expect(err).toMatchObject({ code: 'PVISOR_REQUEST_TOO_LARGE', sizeBytes: size, limitBytes: MAX_PAYLOAD_BYTES });
    }
    expect(sent).toHaveLength(0);
    // The largest payload a frame carries still goes, as one frame, and its answer is taken.
    const p = c.request(0x101, Buffer.alloc(MAX_PAYLOAD_BYTES));
    c.receive(encodeFrame({ type: FrameType.Response, id: lastId(), op: 0x101, payload: Buffer.from('ok') }));
    expect((await p).toString()).toBe('ok');
  });

  it('a send that throws (the VM stopped under it) rejects the request once, and no timer or close settles it again', async () => {
    let fail = true;
    const c = new AgentClient(() => {
      if (fail) throw new VmStateError('the machine is gone');
    }, () => {}, () => {});
    const p = c.request(0x101, Buffer.alloc(8), { timeoutMs: 20 });
    const seen = settles(p);
    await new Promise((r) => setTimeout(r, 60)); // past the timeout
    expect(c.saveState().inFlight).toEqual([]); // nothing left waiting
    fail = false;
    const ok = c.request(0x101);
    expect(c.saveState().inFlight).toHaveLength(1);
    c.close();
    await expect(ok).rejects.toThrow(VmStateError);
    expect(seen).toMatchObject({ resolved: 0, rejected: 1 });
    expect(seen.error).toBeInstanceOf(VmStateError);
    expect((seen.error as Error).message).toMatch(/the machine is gone/);
  });

  it('ids wrap past 2^32 - 1 without reusing one still in flight', async () => {
    const { c, lastId } = client();
    c.restoreState({ version: 2, nextId: 0xffffffff, inFlight: [{ id: 2, op: 0x101 }], partialFrame: '', agentFeatures: 1 });
    const long = c.request(0x201); // 0xffffffff: a process that runs on
    expect(lastId()).toBe(0xffffffff);
    const a = c.request(0x101);
    expect(lastId()).toBe(1);
    const b = c.request(0x101);
    expect(lastId()).toBe(3); // 2 was in flight at the snapshot
    c.receive(encodeFrame({ type: FrameType.Response, id: 3, op: 0x101, payload: Buffer.from('b') }));
    c.receive(encodeFrame({ type: FrameType.Response, id: 1, op: 0x101, payload: Buffer.from('a') }));
    c.receive(encodeFrame({ type: FrameType.Response, id: 0xffffffff, op: 0x201, payload: Buffer.from('long') }));
    expect((await Promise.all([long, a, b])).map(String)).toEqual(['long', 'a', 'b']);
  });
});

describe('agent channel state across a snapshot', () => {
  it('a restored client goes on mid-frame, and answers to requests in flight at the snapshot are reported, not taken for new ones', async () => {
    const warnings: string[] = [];
    const a = new AgentClient(() => {}, () => {}, () => {});
    void a.request(0x0104).catch(() => {}); // id 1: in flight at the snapshot
    const answer = encodeFrame({ type: FrameType.Response, id: 2, op: 0x0104, payload: Buffer.from('new') });
    a.receive(answer.subarray(0, 20)); // a frame half received
    const state = JSON.parse(JSON.stringify(a.saveState()));
    expect(state.inFlight).toEqual([{ id: 1, op: 0x0104 }]);

    const b = new AgentClient(() => {}, () => {}, (m) => warnings.push(m));
    b.restoreState(state);
    // The restored guest finishes request 1 (its caller was in the snapshotted VM) ...
    b.receive(answer.subarray(20));
    b.receive(encodeFrame({ type: FrameType.Response, id: 1, op: 0x0104, payload: Buffer.alloc(0) }));
    expect(warnings).toEqual(['request 1 (op 0x104) was in flight when the snapshot was taken; its answer after the restore has no caller and was dropped']);
    // ... and new requests take ids after the snapshot's.
    const sent: Buffer[] = [];
    const c = new AgentClient((bytes) => sent.push(bytes), () => {}, () => {});
    c.restoreState(state);
    void c.request(0x0104).catch(() => {});
    expect(new FrameDecoder().push(sent[0])[0].id).toBe(2);
    expect(() => c.restoreState(state)).toThrow(/already been used/);
    expect(() => new AgentClient(() => {}, () => {}, () => {}).restoreState({ ...state, partialFrame: Buffer.from('garbage!!garbage!').toString('base64') })).toThrow(/agent\.partialFrame: bad frame magic/);
  });
});
