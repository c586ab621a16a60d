// The frame file on real files: the format CompressedOffload writes at suspend and checks at
// resume, with real zstd, so each refusal below is one a real resume would make.
import { randomBytes } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync, statSync, truncateSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { CCtx, DCtx, compressBound } from 'zstd-napi/binding';
import { BackingFileError } from '../../src/errors';
import { unitsTouched as residentUnits } from '../../src/guest-ram/pages';
import { checkFrame, decodeFrame, encodeFrame, FrameFileReader, FrameFileWriter, HEADER_BYTES, type FrameEntry, type FrameFileHeader } from '../../src/memory/frame-file';

const FRAME = 64 * 1024;
const header: FrameFileHeader = { frameBytes: FRAME, guestRamBytes: 8 * FRAME };
const cctx = new CCtx();
const dctx = new DCtx();
let dir: string;

beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), 'pvisor-frame-file-'));
});
afterEach(() => rmSync(dir, { recursive: true, force: true }));

/** Guest RAM of 8 frames: 0 zero, 1 repetitive, 2 random, 3 half zero, the rest not resident. */
function ram(): Buffer {
  const b = Buffer.alloc(8 * FRAME);
  for (let i = 0; i < FRAME; i++) b[FRAME + i] = 'pvisor'.charCodeAt(i % 6);
  randomBytes(FRAME).copy(b, 2 * FRAME);
  randomBytes(FRAME / 2).copy(b, 3 * FRAME);
  return b;
}

function write(path: string, src: Buffer, units: number[]): FrameEntry[] {
  const w = new FrameFileWriter(path, header);
  const out = Buffer.alloc(compressBound(FRAME));
  // Appended out of order on purpose: the workers finish frames in any order.
  for (const off of [...units].reverse()) {
    const input = src.subarray(off, off + FRAME);
    const f = encodeFrame(cctx, 1, input, out);
    w.append(off, FRAME, f, (f.kind === 'raw' ? input : out).subarray(0, f.storedLength));
  }
  return w.finish().entries;
}

/** Reads every frame back as resume does: decode, then check the CRC against the table. */
async function load(path: string, entries: FrameEntry[]): Promise<Buffer> {
  const r = FrameFileReader.open(path, { header, entries });
  try {
    const back = Buffer.alloc(header.guestRamBytes);
    const stored = Buffer.alloc(compressBound(FRAME));
    const out = Buffer.alloc(FRAME);
    for (const [i, e] of entries.entries()) {
      const bytes = r.readStored(i, stored);
      await checkFrame(path, i, e, () => decodeFrame(dctx, e.kind, bytes, e.length, out));
      if (e.kind === 'raw') bytes.copy(back, e.guestOffset);
      if (e.kind === 'zstd') out.copy(back, e.guestOffset);
    }
    return back;
  } finally {
    r.close();
  }
}

describe('frame file', () => {
  it('round-trips; zero frames are a flag, random frames raw, repetitive ones zstd', async () => {
    const src = ram();
    const path = join(dir, 'a.zframes');
    const entries = write(path, src, [0, FRAME, 2 * FRAME, 3 * FRAME]);
    expect(entries.map((e) => [e.guestOffset / FRAME, e.kind])).toEqual([[0, 'zero'], [1, 'zstd'], [2, 'raw'], [3, 'zstd']]);
    expect(entries[0].storedLength).toBe(0);
    expect(entries[1].storedLength).toBeLessThan(FRAME / 50);
    expect(entries[2].storedLength).toBe(FRAME);
    expect(statSync(path).mode & 0o777).toBe(0o600);
    const stored = entries.reduce((n, e) => n + e.storedLength, 0);
    expect(statSync(path).size).toBe(HEADER_BYTES + stored + 4 * 32 + 32);
    expect((await load(path, entries)).equals(src.subarray(0, 8 * FRAME))).toBe(true);
    // Seekable: a reader without the writer's table finds the same frames from the file alone.
    const r = FrameFileReader.open(path);
    expect(r.entries).toEqual(entries);
    expect(r.header).toEqual(header);
    r.close();
  });

  it('refuses to overwrite an existing file', () => {
    const path = join(dir, 'b.zframes');
    writeFileSync(path, 'x');
    expect(() => new FrameFileWriter(path, header)).toThrow(/EEXIST/);
  });

  it('names the frame whose byte was flipped', async () => {
    const src = ram();
    for (const frame of [1, 2]) {
      const path = join(dir, `c${frame}.zframes`);
      const entries = write(path, src, [0, FRAME, 2 * FRAME, 3 * FRAME]);
      const e = entries[frame];
      const bytes = readFileSync(path);
      bytes[e.fileOffset + Math.floor(e.storedLength / 2)] ^= 0x40;
      writeFileSync(path, bytes);
      // A zstd frame may fail to decompress or decompress to other bytes; either way it is named.
      const err = await load(path, entries).catch((x: unknown) => x);
      expect(err).toBeInstanceOf(BackingFileError);
      expect((err as Error).message).toMatch(frame === 2 ? /frame 2 \(guest offset 0x20000, raw\) is corrupt \(CRC32 mismatch\)/ : /frame 1 \(guest offset 0x10000, zstd\) (is corrupt|cannot be decoded)/);
    }
  });

  it('refuses a truncated file and a bad header before reading any frame', () => {
    const src = ram();
    const path = join(dir, 'd.zframes');
    const entries = write(path, src, [FRAME, 2 * FRAME]);
    const original = readFileSync(path);
    truncateSync(path, original.length - 100);
    expect(() => FrameFileReader.open(path, { header, entries })).toThrow(BackingFileError);
    expect(() => FrameFileReader.open(path, { header, entries })).toThrow(/truncated/);
    expect(() => FrameFileReader.open(path)).toThrow(/bad footer/);
    const badMagic = Buffer.from(original);
    badMagic[0] ^= 1;
    writeFileSync(path, badMagic);
    expect(() => FrameFileReader.open(path, { header, entries })).toThrow(/bad header/);
    const otherSize = Buffer.from(original);
    otherSize.writeUInt32LE(2 * FRAME, 12);
    writeFileSync(path, otherSize);
    expect(() => FrameFileReader.open(path, { header, entries })).toThrow(/bad header: CRC32/);
    const badTable = Buffer.from(original);
    badTable[original.length - 32 - 32 + 24] ^= 1; // the last entry's CRC
    writeFileSync(path, badTable);
    expect(() => FrameFileReader.open(path)).toThrow(/bad frame table: CRC32 mismatch/);
    rmSync(path);
    expect(() => FrameFileReader.open(path, { header, entries })).toThrow(/missing/);
  });

  it('a unit with any resident page is one frame, stored once', () => {
    const P = 4096;
    expect(residentUnits([{ offset: 0, length: P }, { offset: 2 * P, length: P }, { offset: FRAME - P, length: 3 * P }], FRAME)).toEqual([0, FRAME]);
    expect(residentUnits([{ offset: 5 * FRAME, length: 2 * FRAME + P }], FRAME)).toEqual([5 * FRAME, 6 * FRAME, 7 * FRAME]);
    expect(residentUnits([], FRAME)).toEqual([]);
  });
});
