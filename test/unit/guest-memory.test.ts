import { GuestAddressError, GuestMemory } from '../../src/backends/kvm/guest-memory';

// Real guest RAM a little over 1 GiB (NORESERVE: untouched pages cost nothing), so that GPA 1 GiB
// is the seam between two of GuestMemory's Buffer views.
describe('guest memory across the 1 GiB view seam', () => {
  const SEAM = 2 ** 30;
  let mem: GuestMemory;
  beforeAll(() => {
    mem = GuestMemory.map(SEAM + 2 ** 20);
  });
  afterAll(() => mem.unmap());

  const widths = [
    { len: 2, write: (gpa: number) => mem.writeU16(gpa, 0xbeef), read: (gpa: number) => mem.readU16(gpa), expected: 0xbeef },
    { len: 4, write: (gpa: number) => mem.writeU32(gpa, 0xdeadbeef), read: (gpa: number) => mem.readU32(gpa), expected: 0xdeadbeef },
    { len: 8, write: (gpa: number) => mem.writeU64(gpa, 0x0123456789abcdefn), read: (gpa: number) => mem.read(gpa, 8).readBigUInt64LE(0), expected: 0x0123456789abcdefn },
  ];

  it.each(widths.map((w) => [w.len, w]))('a %i-byte field at every offset that straddles the seam is written whole, and nothing beside it', (len, w) => {
    for (let before = 1; before < len; before++) {
      const gpa = SEAM - before;
      // A known pattern around the field, to see that only its bytes change.
      mem.write(gpa - 16, Buffer.alloc(len + 32, 0xa5));
      w.write(gpa);
      expect(w.read(gpa)).toBe(w.expected);
      const around = mem.read(gpa - 16, len + 32);
      expect(around.subarray(0, 16).every((b) => b === 0xa5)).toBe(true);
      expect(around.subarray(16 + len).every((b) => b === 0xa5)).toBe(true);
    }
  });

  it('a buffer that spans the seam is written and read back whole', () => {
    const data = Buffer.from(Array.from({ length: 8192 }, (_, i) => (i * 7) & 0xff));
    mem.write(SEAM - 4096, data);
    expect(mem.read(SEAM - 4096, data.length).equals(data)).toBe(true);
    // The two views hold their halves (the copy read() made is not the only place it exists).
    expect(mem.read(SEAM - 4096, 4096).equals(data.subarray(0, 4096))).toBe(true);
    expect(mem.read(SEAM, 4096).equals(data.subarray(4096))).toBe(true);
  });

  it('a field that runs past the end of RAM is a GuestAddressError, never a RangeError', () => {
    const end = mem.sizeBytes;
    for (const [fn, len] of [[(g: number) => mem.writeU16(g, 1), 2], [(g: number) => mem.writeU32(g, 1), 4], [(g: number) => mem.writeU64(g, 1n), 8]] as const) {
      expect(() => fn(end - len + 1)).toThrow(GuestAddressError);
      expect(() => fn(end)).toThrow(GuestAddressError);
    }
    expect(() => mem.write(end - 1, Buffer.alloc(2))).toThrow(GuestAddressError);
  });
});
