import { encodeFrame, FrameDecoder, FrameError, FrameType } from '../../src/protocol/frame';

describe('agent protocol framing', () => {
  const a = encodeFrame({ type: FrameType.Request, id: 7, op: 0x0101, payload: Buffer.from([1, 2, 3]) });
  const b = encodeFrame({ type: FrameType.Response, id: 0xfffffffe, op: 0x0104, flags: 2, payload: Buffer.alloc(70000, 0xab) });

  it('round-trips frames split at every byte boundary', () => {
    const stream = Buffer.concat([a, b]);
    for (let cut = 0; cut <= stream.length; cut += 997) {
      const d = new FrameDecoder();
      const frames = [...d.push(stream.subarray(0, cut)), ...d.push(stream.subarray(cut))];
      expect(frames.map((f) => [f.type, f.id, f.op, f.flags, f.payload.length])).toEqual([
        [FrameType.Request, 7, 0x0101, 0, 3],
        [FrameType.Response, 0xfffffffe, 0x0104, 2, 70000],
      ]);
      expect(frames[1].payload.every((x) => x === 0xab)).toBe(true);
    }
  });

  it('is binary-safe: payload bytes that look like a header stay payload', () => {
    const inner = encodeFrame({ type: FrameType.Event, id: 0, op: 1, payload: a });
    const [f] = new FrameDecoder().push(inner);
    expect(f.payload.equals(a)).toBe(true);
  });

  it('rejects bad magic, version and oversized lengths', () => {
    expect(() => new FrameDecoder().push(Buffer.from('GET / HTTP/1.1\r\n\r\n'))).toThrow(FrameError);
    const v2 = Buffer.from(a);
    v2[2] = 2;
    expect(() => new FrameDecoder().push(v2)).toThrow(/version 2/);
    const huge = Buffer.from(a);
    huge.writeUInt32LE(64 * 1024 * 1024, 12);
    expect(() => new FrameDecoder().push(huge)).toThrow(/exceeds/);
  });

  it('recovers after garbage: the next valid frame decodes', () => {
    const d = new FrameDecoder();
    expect(() => d.push(Buffer.from('garbage-garbage!'))).toThrow(FrameError);
    expect(d.push(a)).toHaveLength(1);
  });

  it('a 1 MiB frame pushed a byte at a time costs each byte one copy, not one per byte', () => {
    // Quadratic reassembly took minutes for this (issue 10, item 4); linear takes about a second.
    const big = encodeFrame({ type: FrameType.Response, id: 3, op: 2, payload: Buffer.alloc(1024 * 1024 - 1, 0x5a) });
    const d = new FrameDecoder();
    const frames = [];
    for (let i = 0; i < big.length; i++) frames.push(...d.push(big.subarray(i, i + 1)));
    expect(frames).toHaveLength(1);
    expect(frames[0].payload.length).toBe(1024 * 1024 - 1);
    expect(frames[0].payload.every((x) => x === 0x5a)).toBe(true);
  });

  it('reusePayloads: every frame comes through pushEach, assembled in one buffer, whole while it is handled', () => {
    const c = encodeFrame({ type: FrameType.Request, id: 9, op: 3, payload: Buffer.alloc(5000, 0xcd) });
    const stream = Buffer.concat([b, a, c, b]);
    for (let cut = 0; cut <= stream.length; cut += 4999) {
      const d = new FrameDecoder({ reusePayloads: true });
      const seen: [number, number, boolean][] = [];
      const buffers = new Set<ArrayBuffer>();
      const handle = (f: { id: number; payload: Buffer }) => {
        const fill = f.id === 7 ? -1 : f.id === 9 ? 0xcd : 0xab;
        seen.push([f.id, f.payload.length, fill < 0 ? f.payload.equals(Buffer.from([1, 2, 3])) : f.payload.every((x) => x === fill)]);
        buffers.add(f.payload.buffer as ArrayBuffer);
      };
      d.pushEach(stream.subarray(0, cut), handle);
      d.pushEach(stream.subarray(cut), handle);
      expect(seen).toEqual([[0xfffffffe, 70000, true], [7, 3, true], [9, 5000, true], [0xfffffffe, 70000, true]]);
      expect(buffers.size).toBe(1);
    }
    expect(() => new FrameDecoder({ reusePayloads: true }).push(a)).toThrow(/pushEach/);
  });
});
