// The ring a background process's output is kept in (`stdout: { keep }`): whatever the chunk
// sizes, it holds exactly the last `capacity` bytes of the stream, oldest first, and never more;
// listeners get every chunk as it comes. Seeded: a failure prints its seed.
import { InvalidOptionError } from '../../src';
import { MAX_KEEP_BYTES, OutputRing, parseOutputMode } from '../../src/guest/output-ring';
import { property } from '../fuzz-seed';

describe('OutputRing', () => {
  property('keeps exactly the last capacity bytes of any stream, however it is cut', 200, (rng) => {
    const capacity = rng.between(1, 300);
    const ring = new OutputRing(capacity);
    const all: Buffer[] = [];
    const heard: Buffer[] = [];
    const stop = ring.listen((c) => heard.push(c));
    for (let n = rng.int(40); n > 0; n--) {
      const chunk = rng.bytes(rng.chance(0.1) ? rng.between(capacity, 3 * capacity) : rng.int(capacity + 1));
      ring.push(chunk);
      all.push(chunk);
      const stream = Buffer.concat(all);
      expect(ring.kept()).toEqual(stream.subarray(Math.max(0, stream.length - capacity)));
      expect(ring.totalBytes).toBe(stream.length);
    }
    expect(Buffer.concat(heard)).toEqual(Buffer.concat(all));
    stop();
    ring.push(Buffer.from('after'));
    expect(Buffer.concat(heard)).toEqual(Buffer.concat(all));
  });

  it('gives a copy: what it returned does not change as more comes', () => {
    const ring = new OutputRing(4);
    ring.push(Buffer.from('abcd'));
    const kept = ring.kept();
    ring.push(Buffer.from('ef'));
    expect(kept.toString()).toBe('abcd');
    expect(ring.kept().toString()).toBe('cdef');
  });
});

describe('the stdout / stderr option', () => {
  it('takes pipe, ignore and { keep } within bounds, and refuses the rest naming the option', () => {
    expect(parseOutputMode('stdout', undefined)).toBe('pipe');
    expect(parseOutputMode('stdout', 'pipe')).toBe('pipe');
    expect(parseOutputMode('stderr', 'ignore')).toBe('ignore');
    expect(parseOutputMode('stdout', { keep: 1 })).toEqual({ keep: 1 });
    expect(parseOutputMode('stdout', { keep: MAX_KEEP_BYTES })).toEqual({ keep: MAX_KEEP_BYTES });
    for (const bad of ['inherit', null, 3, [], { keep: 0 }, { keep: MAX_KEEP_BYTES + 1 }, { keep: 1.5 }, { keep: '1' }, { keep: 1, kep: 2 }, { kep: 1 }, {}]) {
      expect(() => parseOutputMode('stderr', bad)).toThrow(InvalidOptionError);
      try {
        parseOutputMode('stderr', bad);
      } catch (e) {
        expect((e as InvalidOptionError).option).toBe('stderr');
      }
    }
  });
});
