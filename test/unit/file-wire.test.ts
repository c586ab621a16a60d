// The files ops' wire format (src/guest/file-wire.ts): what the host sends is what the agent
// parses, and every guest answer that is not well formed is a GuestRequestError, never a wrong
// value or a RangeError out of the receive path.
import { GuestRequestError, InvalidOptionError } from '../../src';
import { decodeCount, decodeEntries, decodeStat, ENTRY_HEADER_BYTES, MAX_PATH_BYTES, modeField, pathField, type DirEntry } from '../../src/guest/file-wire';

/** One FILE_LIST entry as the agent's pv_entry_put writes it. */
function entry(name: string | Buffer, o: { type?: number; mode?: number; size?: bigint; mtimeNs?: bigint; nameLength?: number } = {}): Buffer {
  const raw = typeof name === 'string' ? Buffer.from(name) : name;
  const b = Buffer.alloc(ENTRY_HEADER_BYTES + raw.length);
  b.writeUInt16LE(o.nameLength ?? raw.length, 0);
  b[2] = o.type ?? 1;
  b.writeUInt32LE(o.mode ?? 0o644, 4);
  b.writeBigUInt64LE(o.size ?? 0n, 8);
  b.writeBigInt64LE(o.mtimeNs ?? 0n, 16);
  raw.copy(b, ENTRY_HEADER_BYTES);
  return b;
}

/** A FILE_STAT answer as the agent's op_file_stat writes it. */
function statReply(o: { type?: number; mode?: number; size?: bigint; mtimeNs?: bigint; target?: string; targetLength?: number } = {}): Buffer {
  const target = Buffer.from(o.target ?? '');
  const b = Buffer.alloc(36);
  b.writeUInt32LE(o.type ?? 1, 0);
  b.writeUInt32LE(o.mode ?? 0o644, 4);
  b.writeUInt32LE(1000, 8);
  b.writeUInt32LE(1001, 12);
  b.writeBigUInt64LE(o.size ?? 5n, 16);
  b.writeBigInt64LE(o.mtimeNs ?? 1_700_000_000_123_456_789n, 24);
  b.writeUInt32LE(o.targetLength ?? target.length, 32);
  return Buffer.concat([b, target]);
}

describe('files wire format', () => {
  it('a path goes as u32 length and its UTF-8 bytes; empty, NUL, too long and non-strings are refused', () => {
    const f = pathField('/tmp/é');
    expect(f.readUInt32LE(0)).toBe(Buffer.byteLength('/tmp/é'));
    expect(f.subarray(4).toString()).toBe('/tmp/é');
    expect(pathField('x'.repeat(MAX_PATH_BYTES)).length).toBe(4 + MAX_PATH_BYTES);
    for (const bad of ['', 'a\0b', 'x'.repeat(MAX_PATH_BYTES + 1), 'é'.repeat(2048), 7 as unknown as string]) {
      expect(() => pathField(bad, 'from')).toThrow(InvalidOptionError);
    }
    expect(() => pathField('', 'to')).toThrow(/^to: /);
  });

  it('a mode is a whole number from 0 to 0o7777', () => {
    expect(modeField('mode', undefined, 0o644)).toBe(0o644);
    expect(modeField('mode', 0o4755, 0)).toBe(0o4755);
    for (const bad of [-1, 0o10000, 1.5, NaN, '644', null]) expect(() => modeField('mode', bad, 0)).toThrow(InvalidOptionError);
  });

  it('entries decode with their fields; several per chunk; mtime in fractional ms', () => {
    const into: DirEntry[] = [];
    const n = decodeEntries(Buffer.concat([entry('a.txt', { size: 12n, mtimeNs: 1_500_000_250_000n }), entry('dir', { type: 2, mode: 0o755 }), entry('l', { type: 3, mode: 0o777 })]), into);
    expect(n).toBe(3);
    expect(into).toEqual([
      { name: 'a.txt', type: 'file', mode: 0o644, size: 12, mtimeMs: 1_500_000.25 },
      { name: 'dir', type: 'directory', mode: 0o755, size: 0, mtimeMs: 0 },
      { name: 'l', type: 'symlink', mode: 0o777, size: 0, mtimeMs: 0 },
    ]);
    expect(decodeEntries(Buffer.alloc(0), into)).toBe(0);
    const before = decodeEntries(entry('x', { mtimeNs: -1_000_000n }), into);
    expect(before).toBe(1);
    expect(into.at(-1)!.mtimeMs).toBe(-1);
  });

  it.each([
    ['a cut header', entry('abc').subarray(0, 10)],
    ['a name past the chunk', entry('abc').subarray(0, ENTRY_HEADER_BYTES + 2)],
    ['an empty name', entry('', { nameLength: 0 })],
    ['a 256-byte name', entry('n'.repeat(256))],
    ['a name with /', entry('a/b')],
    ['a name with NUL', entry(Buffer.from([0x61, 0, 0x62]))],
    ['"."', entry('.')],
    ['".."', entry('..')],
    ['type 8', entry('a', { type: 8 })],
    ['mode 0o10000', entry('a', { mode: 0o10000 })],
    ['a size beyond 2^53', entry('a', { size: 2n ** 53n })],
    ['trailing bytes after a good entry', Buffer.concat([entry('a'), Buffer.alloc(3)])],
  ])('a chunk with %s is a GuestRequestError', (_what, chunk) => {
    expect(() => decodeEntries(chunk, [])).toThrow(GuestRequestError);
  });

  it('a stat answer decodes; a symlink carries its target', () => {
    expect(decodeStat(statReply())).toEqual({ type: 'file', mode: 0o644, uid: 1000, gid: 1001, size: 5, mtimeMs: 1_700_000_000_123.4568 });
    expect(decodeStat(statReply({ type: 3, target: '../x' }))).toMatchObject({ type: 'symlink', target: '../x' });
    expect(decodeStat(statReply({ type: 3 })).target).toBeUndefined();
  });

  it.each([
    ['too short', statReply().subarray(0, 35)],
    ['a target length past the answer', statReply({ type: 3, target: 'ab', targetLength: 3 })],
    ['bytes after the target', Buffer.concat([statReply({ type: 3, target: 'ab' }), Buffer.alloc(1)])],
    ['a target over 4095 bytes', statReply({ type: 3, target: 'x'.repeat(4096) })],
    ['a target for a regular file', statReply({ type: 1, target: 'x' })],
    ['type 9', statReply({ type: 9 })],
    ['mode 0o17777', statReply({ mode: 0o17777 })],
    ['a size beyond 2^53', statReply({ size: 2n ** 63n })],
  ])('a stat answer with %s is a GuestRequestError', (_what, r) => {
    expect(() => decodeStat(r)).toThrow(GuestRequestError);
  });

  it('a count is exactly 8 bytes and a safe integer', () => {
    const b = Buffer.alloc(8);
    b.writeBigUInt64LE(123n);
    expect(decodeCount(b, 'FILE_LIST')).toBe(123);
    expect(() => decodeCount(Buffer.alloc(7), 'FILE_LIST')).toThrow(/FILE_LIST with 7 bytes, 8 expected/);
    expect(() => decodeCount(Buffer.alloc(9), 'FILE_LIST')).toThrow(GuestRequestError);
    b.writeBigUInt64LE(2n ** 60n);
    expect(() => decodeCount(b, 'FILE_READ')).toThrow(GuestRequestError);
  });
});
