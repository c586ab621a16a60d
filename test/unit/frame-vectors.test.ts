// The frame test vectors: the C programs' one frame layout (native-prebuilds/include/pv_frame.h,
// which the agent, the probe and the pool daemon build and read their frames with) held against
// src/protocol/frame.ts both ways. A small driver of the header (test/native/frame-vectors.c),
// built here with the host's C compiler under ASan and UBSan, encodes frames and reads byte
// streams; TypeScript encodes the same frames and reads the same streams; the bytes and verdicts
// must be the same, and for the fixed vectors also what the layout says they are. Without a
// compiler the tests are skipped, and say so.
import { execFileSync, spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { encodeFrame, FRAME_HEADER_BYTES, FrameDecoder, FrameError, FrameType, MAX_PAYLOAD_BYTES, type Frame } from '../../src/protocol/frame';
import { property, Rng, FUZZ_SEED, same } from '../fuzz-seed';
import { randomFrame, summary } from '../fuzz-frames';
import { findCompiler } from '../host-agent';

const ROOT = join(__dirname, '..', '..', '..');
const INCLUDE = join(ROOT, 'native-prebuilds', 'include');
const DRIVER = join(ROOT, 'test', 'native', 'frame-vectors.c');

const compiler = findCompiler();
if (!compiler) console.log('frame vectors: SKIPPED, no C compiler found ($CC, gcc, clang or cc): pv_frame.h was not checked against frame.ts');
const describeWithCompiler = compiler ? describe : describe.skip;

/** pv_frame_verdict's values, and FrameError's reason for each. */
const VERDICT = { magic: 1, version: 2, length: 3 } as const;

/** What a reader made of a byte stream: its whole frames, then how it stopped. */
interface Reading {
  frames: ReturnType<typeof summary>[];
  end: { more: number } | { bad: number };
}

/** frame.ts's reading: FrameDecoder over the whole stream at once. */
function tsRead(bytes: Buffer): Reading {
  const d = new FrameDecoder();
  const frames: Reading['frames'] = [];
  try {
    d.pushEach(bytes, (f) => frames.push(summary(f)));
  } catch (e) {
    if (!(e instanceof FrameError)) throw e;
    return { frames, end: { bad: VERDICT[e.reason] } };
  }
  return { frames, end: { more: d.pendingBytes().length } };
}

const hex = (b: Buffer) => (b.length ? b.toString('hex') : '-');
const unhex = (s: string) => Buffer.from(s === '-' ? '' : s, 'hex');
const encodeLine = (f: Frame) => `E ${f.type} ${f.id} ${f.op} ${f.flags} ${hex(f.payload)}`;

/** Runs the driver on `lines`; its answer to each. */
function driver(bin: string, lines: string[]): string[] {
  const r = spawnSync(bin, [], { input: `${lines.join('\n')}\n`, encoding: 'utf8', maxBuffer: 256 * 2 ** 20, env: { ...process.env, ASAN_OPTIONS: 'detect_leaks=1', UBSAN_OPTIONS: 'print_stacktrace=1' } });
  if (r.status !== 0) throw new Error(`frame-vectors failed (exit ${r.status ?? r.signal}): ${r.stderr.slice(0, 4000)}`);
  const out = r.stdout.split('\n');
  expect(out.pop()).toBe('');
  expect(out).toHaveLength(lines.length);
  return out;
}

/** The driver's answer to a D line, as a Reading. */
function cReading(line: string): Reading {
  const t = line.split(' ');
  const frames: Reading['frames'] = [];
  let at = 0;
  while (t[at] === 'F') {
    frames.push({ type: Number(t[at + 1]) as FrameType, id: Number(t[at + 2]), op: Number(t[at + 3]), flags: Number(t[at + 4]), payload: unhex(t[at + 5]).toString('hex') });
    at += 6;
  }
  if (t[at] === 'MORE') return { frames, end: { more: Number(t[at + 1]) } };
  if (t[at] === 'BAD') return { frames, end: { bad: Number(t[at + 1]) } };
  throw new Error(`frame-vectors: unexpected answer ${line.slice(0, 200)}`);
}

/** A valid frame's header with some of its bytes replaced (for headers frame.ts would not write). */
function header(f: { type?: number; id?: number; op?: number; flags?: number; length: number }, bytes: Record<number, number> = {}): Buffer {
  const h = Buffer.alloc(FRAME_HEADER_BYTES);
  h.write('PV', 0, 'latin1');
  h[2] = 1;
  h[3] = f.type ?? FrameType.Request;
  h.writeUInt32LE(f.id ?? 0, 4);
  h.writeUInt16LE(f.op ?? 0, 8);
  h.writeUInt16LE(f.flags ?? 0, 10);
  h.writeUInt32LE(f.length, 12);
  for (const [at, v] of Object.entries(bytes)) h[Number(at)] = v;
  return h;
}

describeWithCompiler('frame test vectors: pv_frame.h against frame.ts', () => {
  let dir: string;
  let bin: string;
  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-frame-vectors-'));
    bin = join(dir, 'frame-vectors');
    execFileSync(compiler!, ['-std=c11', '-O1', '-g', '-Wall', '-Wextra', '-Werror', '-fsanitize=address,undefined', '-fno-sanitize-recover=all', '-o', bin, DRIVER], { stdio: 'pipe' });
  }, 60_000);
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('pv_frame.h is freestanding: it builds with -ffreestanding and its code calls nothing outside itself', () => {
    // What the probe needs, which has no libc: an object that uses every function has no undefined symbol.
    const src = join(dir, 'use.c');
    writeFileSync(src, [
      '#include "pv_frame.h"',
      'int use(uint8_t *h, size_t n) {',
      '  struct pv_frame f;',
      '  pv_frame_header_put(h, PV_T_REQUEST, 1, 2, 3, 4);',
      '  return (int)pv_frame_header_get(h, &f) + (int)pv_frame_scan(h, n, &f, 0);',
      '}',
      '',
    ].join('\n'));
    const obj = join(dir, 'use.o');
    execFileSync(compiler!, ['-std=c11', '-pedantic', '-ffreestanding', '-fno-builtin', '-O0', '-Wall', '-Wextra', '-Werror', '-I', INCLUDE, '-c', '-o', obj, src], { stdio: 'pipe' });
    const undefinedSymbols = execFileSync('nm', ['-u', obj], { encoding: 'utf8' }).trim();
    expect(undefinedSymbols).toBe('');
    expect(execFileSync('nm', ['--defined-only', obj], { encoding: 'utf8' })).toMatch(/ pv_frame_header_get\n/);
  });

  // Fixed vectors: each a stream, what both readers must make of it, and the frames (if any)
  // whose encoding both sides must write byte for byte.
  const big = new Rng(0xf4a3e).bytes(MAX_PAYLOAD_BYTES);
  const frameA: Frame = { type: FrameType.Request, id: 7, op: 0x0101, flags: 0, payload: Buffer.from([1, 2, 3]) };
  const frameB: Frame = { type: FrameType.Response, id: 0xfffffffe, op: 0x0104, flags: 2, payload: Buffer.alloc(700, 0xab) };
  const fixed: { name: string; encode?: Frame[]; golden?: string; stream?: Buffer; reading: Reading }[] = [
    {
      name: 'an empty payload',
      encode: [{ type: FrameType.Request, id: 0, op: 0, flags: 0, payload: Buffer.alloc(0) }],
      golden: '50560101' + '00000000' + '0000' + '0000' + '00000000',
      reading: { frames: [{ type: FrameType.Request, id: 0, op: 0, flags: 0, payload: '' }], end: { more: 0 } },
    },
    {
      name: 'little-endian fields',
      encode: [{ type: FrameType.Event, id: 0x01020304, op: 0x0506, flags: 0x0708, payload: Buffer.from('abc') }],
      golden: '50560105' + '04030201' + '0605' + '0807' + '03000000' + '616263',
      reading: { frames: [{ type: FrameType.Event, id: 0x01020304, op: 0x0506, flags: 0x0708, payload: '616263' }], end: { more: 0 } },
    },
    {
      name: 'every field at its largest',
      encode: [{ type: 0xff as FrameType, id: 0xffffffff, op: 0xffff, flags: 0xffff, payload: Buffer.from([0x5a]) }],
      golden: '505601ff' + 'ffffffff' + 'ffff' + 'ffff' + '01000000' + '5a',
      reading: { frames: [{ type: 0xff as FrameType, id: 0xffffffff, op: 0xffff, flags: 0xffff, payload: '5a' }], end: { more: 0 } },
    },
    {
      name: 'the largest payload (1 MiB)',
      encode: [{ type: FrameType.StreamChunk, id: 9, op: 0x0201, flags: 1, payload: big }],
      reading: { frames: [{ type: FrameType.StreamChunk, id: 9, op: 0x0201, flags: 1, payload: big.toString('hex') }], end: { more: 0 } },
    },
    {
      name: 'two frames, then the start of a third',
      encode: [frameA, frameB],
      stream: Buffer.concat([encodeFrame(frameA), encodeFrame(frameB), encodeFrame(frameA).subarray(0, 17)]),
      reading: { frames: [summary(frameA), summary(frameB)], end: { more: 17 } },
    },
    { name: 'no bytes', stream: Buffer.alloc(0), reading: { frames: [], end: { more: 0 } } },
    ...Array.from({ length: FRAME_HEADER_BYTES - 1 }, (_, k) => ({
      name: `a header truncated to ${k + 1} bytes`,
      stream: header({ length: 0 }).subarray(0, k + 1),
      reading: { frames: [], end: { more: k + 1 } },
    })),
    { name: 'a payload truncated', stream: Buffer.concat([header({ length: 10 }), Buffer.alloc(9)]), reading: { frames: [], end: { more: 25 } } },
    { name: 'a length one over the largest (said before any payload)', stream: header({ length: MAX_PAYLOAD_BYTES + 1 }), reading: { frames: [], end: { bad: VERDICT.length } } },
    { name: 'a length of 2^32 - 1', stream: header({ length: 0xffffffff }), reading: { frames: [], end: { bad: VERDICT.length } } },
    { name: 'magic "PX"', stream: header({ length: 0 }, { 1: 0x58 }), reading: { frames: [], end: { bad: VERDICT.magic } } },
    { name: 'magic "XV"', stream: header({ length: 0 }, { 0: 0x58 }), reading: { frames: [], end: { bad: VERDICT.magic } } },
    { name: 'version 0', stream: header({ length: 0 }, { 2: 0 }), reading: { frames: [], end: { bad: VERDICT.version } } },
    { name: 'version 2', stream: header({ length: 0 }, { 2: 2 }), reading: { frames: [], end: { bad: VERDICT.version } } },
    { name: 'version 255', stream: header({ length: 0 }, { 2: 255 }), reading: { frames: [], end: { bad: VERDICT.version } } },
    { name: 'bad magic, version and length: magic is said', stream: header({ length: 0xffffffff }, { 0: 0, 2: 9 }), reading: { frames: [], end: { bad: VERDICT.magic } } },
    { name: 'bad version and length: version is said', stream: header({ length: 0xffffffff }, { 2: 9 }), reading: { frames: [], end: { bad: VERDICT.version } } },
    {
      name: 'two frames, then a bad header',
      stream: Buffer.concat([encodeFrame(frameA), encodeFrame(frameA), header({ length: 0 }, { 2: 2 }), encodeFrame(frameA)]),
      reading: { frames: [summary(frameA), summary(frameA)], end: { bad: VERDICT.version } },
    },
    {
      name: 'types no protocol uses (0, 7, 255) are frames all the same',
      stream: Buffer.concat([0, 7, 255].map((type) => header({ type, length: 0 }))),
      reading: { frames: [0, 7, 255].map((type) => ({ type: type as FrameType, id: 0, op: 0, flags: 0, payload: '' })), end: { more: 0 } },
    },
  ];

  it.each(fixed.map((v) => [v.name, v] as const))('%s: both sides write and read it as the layout says', (_, v) => {
    const frames = v.encode ?? [];
    const tsBytes = frames.map((f) => encodeFrame(f));
    const stream = v.stream ?? Buffer.concat(tsBytes);
    const out = driver(bin, [...frames.map(encodeLine), `D ${hex(stream)}`]);
    // C encodes -> the same bytes as TS, which TS reads back.
    for (let i = 0; i < frames.length; i++) {
      const cBytes = unhex(out[i]);
      same(cBytes.toString('hex'), tsBytes[i].toString('hex'));
      same(tsRead(cBytes), { frames: [summary(frames[i])], end: { more: 0 } });
    }
    if (v.golden) same(tsBytes[0].toString('hex'), v.golden);
    // TS (or the vector) encodes -> C reads what frame.ts reads, and what the vector says.
    same(cReading(out[frames.length]), v.reading);
    same(tsRead(stream), v.reading);
  });

  it('frame.ts refuses to write a payload over the largest, which pv_frame.h leaves to its caller', () => {
    expect(() => encodeFrame({ type: FrameType.Request, id: 1, op: 1, payload: Buffer.alloc(MAX_PAYLOAD_BYTES + 1) })).toThrow(RangeError);
  });

  // Random frames, and streams of them cut short or with a header byte changed: each side writes
  // what the other reads, and both read every stream alike.
  property(`random frames and streams: pv_frame.h and frame.ts write the same bytes and read them alike (seed ${FUZZ_SEED})`, 30, (rng) => {
    const frames = Array.from({ length: rng.between(1, 6) }, () => randomFrame(rng));
    const tsBytes = frames.map((f) => encodeFrame(f));
    let stream = Buffer.concat(tsBytes);
    const headerAt: number[] = [];
    tsBytes.reduce((at, b) => (headerAt.push(at), at + b.length), 0);
    const mutation = rng.pick(['none', 'cut', 'header byte'] as const);
    if (mutation === 'cut') stream = stream.subarray(0, rng.int(stream.length + 1));
    if (mutation === 'header byte') {
      stream = Buffer.from(stream);
      // The magic, the version or the length's top byte: what the checks look at.
      stream[rng.pick(headerAt) + rng.pick([0, 1, 2, 15])] ^= 1 + rng.int(255);
    }
    const out = driver(bin, [...frames.map(encodeLine), `D ${hex(stream)}`]);
    for (let i = 0; i < frames.length; i++) {
      same(out[i], tsBytes[i].toString('hex'));
      same(tsRead(unhex(out[i])).frames, [summary(frames[i])]);
    }
    const ts = tsRead(stream);
    same(cReading(out[frames.length]), ts);
    if (mutation === 'none') same(ts, { frames: frames.map(summary), end: { more: 0 } });
  });
});
