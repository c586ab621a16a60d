import { execFileSync } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { mkdtempSync, openSync, closeSync, readFileSync, rmSync, statSync, truncateSync, utimesSync, writeFileSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { InvalidOptionError, SnapshotError } from '../../src/errors';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import {
  BYTES_PER_TURN, MAX_REQUEST_BYTES, VirtioBlk, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_SIZE_MAX,
  VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
} from '../../src/backends/kvm/devices/virtio-blk';
import { SplitQueue } from '../../src/backends/kvm/virtio/queue';

// Real guest memory (an anonymous mapping, no KVM) and a real image file; the test writes
// requests into the rings as the guest's driver would.
describe('virtio-blk device', () => {
  const SIZE = 16;
  const DESC = 0x1000;
  const AVAIL = 0x2000;
  const USED = 0x3000;
  const HDR = 0x4000;
  const STATUS = 0x4100;
  const DATA = 0x10000;
  const SECTORS = 64;
  const NO_STATUS = -1;
  let dir: string;
  let image: string;
  let original: Buffer;
  let mem: GuestMemory;
  let q: SplitQueue;
  let availIdx: number;
  let errors: string[];
  let interrupts: number;
  let blk: VirtioBlk | undefined;

  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-blk-'));
    image = join(dir, 'disk.img');
    original = randomBytes(SECTORS * 512);
    writeFileSync(image, original);
    mem = GuestMemory.map(1024 * 1024);
    q = new SplitQueue(mem, { size: SIZE, descGpa: DESC, availGpa: AVAIL, usedGpa: USED });
    availIdx = 0;
    errors = [];
    interrupts = 0;
  });
  afterEach(() => {
    q.onBudgetRenewed = undefined; // a test that failed may leave the device work for a later turn
    blk?.close();
    blk = undefined;
    mem.unmap();
    rmSync(dir, { recursive: true, force: true });
  });

  function device(readOnly = false): VirtioBlk {
    blk = new VirtioBlk(mem, { path: image, readOnly, serial: 'test-serial' }, () => interrupts++, (m) => errors.push(m));
    blk.activate([q]);
    return blk;
  }

  interface Buf { gpa: number; len: number; writable: boolean }

  /** Submits one chain; returns the status byte (or NO_STATUS) and the used length. */
  function submit(bufs: Buf[]): { status: number; usedLen: number } {
    mem.write(STATUS, Buffer.of(0xff));
    bufs.forEach((b, i) => {
      const d = DESC + 16 * i;
      mem.writeU64(d, b.gpa);
      mem.writeU32(d + 8, b.len);
      mem.writeU16(d + 12, (i + 1 < bufs.length ? 1 : 0) | (b.writable ? 2 : 0));
      mem.writeU16(d + 14, i + 1);
    });
    mem.writeU16(AVAIL + 4 + 2 * (availIdx % SIZE), 0);
    availIdx++;
    mem.writeU16(AVAIL + 2, availIdx);
    q.renewBudget(); // as the transport does for each notification
    blk!.notify(0);
    expect(mem.readU16(USED + 2)).toBe(availIdx);
    const elem = USED + 4 + 8 * ((availIdx - 1) % SIZE);
    const usedLen = mem.readU32(elem + 4);
    const hasStatus = bufs.length > 0 && bufs[bufs.length - 1].writable && bufs[bufs.length - 1].gpa === STATUS;
    return { status: hasStatus ? mem.read(STATUS, 1)[0] : NO_STATUS, usedLen };
  }

  function header(type: number, sector: number | bigint): Buf {
    const h = Buffer.alloc(16);
    h.writeUInt32LE(type, 0);
    h.writeBigUInt64LE(BigInt(sector), 8);
    mem.write(HDR, h);
    return { gpa: HDR, len: 16, writable: false };
  }
  const status: Buf = { gpa: STATUS, len: 1, writable: true };
  const data = (len: number, writable: boolean, gpa = DATA): Buf => ({ gpa, len, writable });

  function read(sector: number, len: number): { status: number; bytes: Buffer } {
    mem.write(DATA, Buffer.alloc(len, 0xee));
    const r = submit([header(VIRTIO_BLK_T_IN, sector), data(len, true), status]);
    if (r.status === VIRTIO_BLK_S_OK) expect(r.usedLen).toBe(len + 1);
    return { status: r.status, bytes: Buffer.from(mem.read(DATA, len)) };
  }
  const sha = (b: Buffer) => createHash('sha256').update(b).digest('hex');
  const fileUnchanged = () => expect(sha(readFileSync(image))).toBe(sha(original));

  it('reports the capacity in 512-byte sectors and its features', () => {
    const d = device();
    expect(d.readConfig(0, 4)).toBe(SECTORS);
    expect(d.readConfig(4, 4)).toBe(0);
    expect(d.features & VIRTIO_BLK_F_FLUSH).toBe(VIRTIO_BLK_F_FLUSH);
    expect(d.features & VIRTIO_BLK_F_RO).toBe(0n);
    d.close();
    expect(device(true).features & VIRTIO_BLK_F_RO).toBe(VIRTIO_BLK_F_RO);
  });

  it('reads and writes sectors of the image, and flushes', () => {
    device();
    const r = read(3, 1024);
    expect(r.status).toBe(VIRTIO_BLK_S_OK);
    expect(r.bytes.equals(original.subarray(3 * 512, 5 * 512))).toBe(true);
    expect(interrupts).toBeGreaterThan(0);

    // A write split over two buffers, the header split over two as well: framing is free.
    const payload = randomBytes(1536);
    mem.write(DATA, payload.subarray(0, 512));
    mem.write(DATA + 0x8000, payload.subarray(512));
    const h = header(VIRTIO_BLK_T_OUT, 10);
    const w = submit([{ ...h, len: 5 }, { gpa: HDR + 5, len: 11, writable: false }, data(512, false), data(1024, false, DATA + 0x8000), status]);
    expect(w).toEqual({ status: VIRTIO_BLK_S_OK, usedLen: 1 });
    const file = readFileSync(image);
    expect(file.subarray(10 * 512, 13 * 512).equals(payload)).toBe(true);
    expect(file.subarray(0, 10 * 512).equals(original.subarray(0, 10 * 512))).toBe(true);
    expect(file.subarray(13 * 512).equals(original.subarray(13 * 512))).toBe(true);
    expect(statSync(image).size).toBe(SECTORS * 512);

    expect(read(10, 1536).bytes.equals(payload)).toBe(true);
    expect(submit([header(VIRTIO_BLK_T_FLUSH, 0), status]).status).toBe(VIRTIO_BLK_S_OK);
    expect(errors).toEqual([]);
  });

  it('answers GET_ID with its serial, NUL-padded to 20 bytes', () => {
    device();
    mem.write(DATA, Buffer.alloc(20, 0xee));
    const r = submit([header(VIRTIO_BLK_T_GET_ID, 0), data(20, true), status]);
    expect(r).toEqual({ status: VIRTIO_BLK_S_OK, usedLen: 21 });
    expect(mem.read(DATA, 20).toString('latin1')).toBe('test-serial'.padEnd(20, '\0'));
  });

  it('fails each malformed request alone: the image is untouched and the next request works', () => {
    device();
    mem.write(DATA, Buffer.alloc(4096, 0x5a));
    // Each case builds its chain when it runs: the header lives at one address.
    const cases: [string, () => Buf[], number][] = [
      ['short header', () => [{ gpa: HDR, len: 12, writable: false }, data(512, false), status], VIRTIO_BLK_S_IOERR],
      ['write past the end', () => [header(VIRTIO_BLK_T_OUT, SECTORS - 1), data(1024, false), status], VIRTIO_BLK_S_IOERR],
      ['write at a huge sector', () => [header(VIRTIO_BLK_T_OUT, 2n ** 64n - 1n), data(512, false), status], VIRTIO_BLK_S_IOERR],
      ['write of part of a sector', () => [header(VIRTIO_BLK_T_OUT, 0), data(100, false), status], VIRTIO_BLK_S_IOERR],
      ['read of part of a sector', () => [header(VIRTIO_BLK_T_IN, 0), data(700, true), status], VIRTIO_BLK_S_IOERR],
      ['read past the end', () => [header(VIRTIO_BLK_T_IN, SECTORS), data(512, true), status], VIRTIO_BLK_S_IOERR],
      ['unknown type (discard)', () => [header(11, 0), data(16, false), status], VIRTIO_BLK_S_UNSUPP],
      ['no status byte', () => [header(VIRTIO_BLK_T_OUT, 0), data(512, false)], NO_STATUS],
      ['readable after writable', () => [header(VIRTIO_BLK_T_OUT, 0), status, data(512, false)], NO_STATUS],
    ];
    for (const [name, bufs, expected] of cases) {
      const r = submit(bufs());
      expect({ name, status: r.status }).toEqual({ name, status: expected });
      if (expected === NO_STATUS) expect([r.usedLen, mem.read(STATUS, 1)[0]]).toEqual([0, 0xff]);
      fileUnchanged();
      const good = read(1, 512);
      expect({ name, ok: good.status === VIRTIO_BLK_S_OK && good.bytes.equals(original.subarray(512, 1024)) }).toEqual({ name, ok: true });
    }
    // Every malformed request but the unsupported type was reported.
    expect(errors).toHaveLength(cases.length - 1);
    // A chain through memory outside guest RAM is refused by the queue; the device goes on.
    const r = submit([header(VIRTIO_BLK_T_IN, 0), data(512, true, 1024 * 1024 - 256), status]);
    expect(r.usedLen).toBe(0);
    expect(read(2, 512).bytes.equals(original.subarray(1024, 1536))).toBe(true);
    fileUnchanged();
  });

  it('refuses writes to a read-only disk and still reads', () => {
    device(true);
    mem.write(DATA, Buffer.alloc(512, 0x11));
    expect(submit([header(VIRTIO_BLK_T_OUT, 0), data(512, false), status]).status).toBe(VIRTIO_BLK_S_IOERR);
    fileUnchanged();
    expect(read(0, 512).bytes.equals(original.subarray(0, 512))).toBe(true);
    expect(errors.join('\n')).toMatch(/read-only/);
  });

  it('a file truncated under the VM fails reads past its new end, not the host', () => {
    device();
    truncateSync(image, 8 * 512);
    expect(read(20, 512).status).toBe(VIRTIO_BLK_S_IOERR);
    expect(errors.join('\n')).toMatch(/was it truncated/);
    expect(read(2, 512).bytes.equals(original.subarray(1024, 1536))).toBe(true);
  });

  it('moves data across the 1 GiB seam between guest memory views', () => {
    // A bigger guest (untouched pages cost nothing) whose data buffer straddles GPA 1 GiB.
    mem.unmap();
    mem = GuestMemory.map(2 ** 30 + 2 ** 20);
    q = new SplitQueue(mem, { size: SIZE, descGpa: DESC, availGpa: AVAIL, usedGpa: USED });
    device();
    const seam = 2 ** 30 - 1024;
    const r = submit([header(VIRTIO_BLK_T_IN, 4), data(4096, true, seam), status]);
    expect(r).toEqual({ status: VIRTIO_BLK_S_OK, usedLen: 4097 });
    expect(mem.read(seam, 4096).equals(original.subarray(4 * 512, 12 * 512))).toBe(true);
    const payload = randomBytes(4096);
    mem.write(seam, payload);
    expect(submit([header(VIRTIO_BLK_T_OUT, 20), data(4096, false, seam), status]).status).toBe(VIRTIO_BLK_S_OK);
    expect(readFileSync(image).subarray(20 * 512, 28 * 512).equals(payload)).toBe(true);
  });

  describe('bounds on what the event loop waits for (issue 23, item 6)', () => {
    const MiB = 1024 * 1024;
    /** The image grown (sparse) past what the bounds cover, the original bytes first. */
    const grow = (bytes: number) => truncateSync(image, bytes);
    /** Each request here spends a turn's bytes: the next one waits for the next turn. */
    const nextTurn = () => new Promise((resolve) => setImmediate(resolve));

    it('offers seg_max and size_max, and fails a request of more data than they allow with IOERR, moving nothing', async () => {
      grow(8 * MiB);
      const d = device();
      expect(d.features & (VIRTIO_BLK_F_SEG_MAX | VIRTIO_BLK_F_SIZE_MAX)).toBe(VIRTIO_BLK_F_SEG_MAX | VIRTIO_BLK_F_SIZE_MAX);
      const sizeMax = d.readConfig(8, 4);
      const segMax = d.readConfig(12, 4);
      // Linux refuses a size_max below a page; its block layer never sends more than seg_max x size_max.
      expect(sizeMax).toBeGreaterThanOrEqual(4096);
      expect(segMax * sizeMax).toBe(MAX_REQUEST_BYTES);
      // Aliased buffers, as a hostile driver builds them: the data may be far more than guest RAM.
      const piece = MAX_REQUEST_BYTES / 4;
      const aliased = (pieces: number, writable: boolean): Buf[] => Array.from({ length: pieces }, () => data(piece, writable));
      mem.write(DATA, Buffer.alloc(piece, 0xee));
      // At the bound: served.
      const ok = submit([header(VIRTIO_BLK_T_IN, 0), ...aliased(4, true), status]);
      expect(ok).toEqual({ status: VIRTIO_BLK_S_OK, usedLen: MAX_REQUEST_BYTES + 1 });
      expect(errors).toEqual([]);
      // One sector more, read or written: IOERR, guest RAM and the image untouched.
      await nextTurn();
      mem.write(DATA, Buffer.alloc(piece + 512, 0xee));
      const over = submit([header(VIRTIO_BLK_T_IN, 0), ...aliased(4, true), data(512, true, DATA + piece), status]);
      expect(over).toEqual({ status: VIRTIO_BLK_S_IOERR, usedLen: 1 });
      expect(mem.read(DATA, piece + 512).every((b) => b === 0xee)).toBe(true);
      const before = sha(readFileSync(image));
      await nextTurn();
      const write = submit([header(VIRTIO_BLK_T_OUT, 0), ...aliased(4, false), data(512, false, DATA + piece), status]);
      expect(write).toEqual({ status: VIRTIO_BLK_S_IOERR, usedLen: 1 });
      expect(sha(readFileSync(image))).toBe(before);
      expect(errors).toHaveLength(2);
      expect(errors[0]).toMatch(new RegExp(`${MAX_REQUEST_BYTES + 512} bytes of data, more than the ${MAX_REQUEST_BYTES} a request may carry`));
      // The device goes on.
      await nextTurn();
      expect(read(1, 512).bytes.equals(original.subarray(512, 1024))).toBe(true);
    });

    it('one notification of aliased reads, each at the bound: at most a turn\'s bytes a turn, the rest in later turns, every one served', async () => {
      // A ring of 256 in 4 MiB of guest RAM: 64 chains of 3 descriptors each leave the queue's
      // own budget (a ring of descriptors) unspent, so only the device's bytes can stop it.
      mem.unmap();
      mem = GuestMemory.map(4 * MiB);
      const size = 256;
      q = new SplitQueue(mem, { size, descGpa: DESC, availGpa: AVAIL, usedGpa: USED });
      grow(4 * MiB);
      const d = device();
      // The transport's part: a queue the budget stopped goes on in a later turn, as if notified.
      q.onBudgetRenewed = () => {
        q.renewBudget();
        d.notify(0);
      };
      const chains = 64;
      const desc = (i: number, b: Buf, next: boolean) => {
        mem.writeU64(DESC + 16 * i, b.gpa);
        mem.writeU32(DESC + 16 * i + 8, b.len);
        mem.writeU16(DESC + 16 * i + 12, (next ? 1 : 0) | (b.writable ? 2 : 0));
        mem.writeU16(DESC + 16 * i + 14, i + 1);
      };
      desc(0, header(VIRTIO_BLK_T_IN, 0), true);
      desc(1, data(MAX_REQUEST_BYTES, true), true);
      desc(2, status, false);
      for (let i = 0; i < chains; i++) mem.writeU16(AVAIL + 4 + 2 * i, 0); // every entry names the same chain
      mem.writeU16(AVAIL + 2, chains);
      const used = () => mem.readU16(USED + 2);
      const requestsPerTurn = Math.ceil(BYTES_PER_TURN / MAX_REQUEST_BYTES);

      q.renewBudget();
      d.notify(0);
      const first = used();
      expect(first).toBeGreaterThan(0);
      expect(first).toBeLessThanOrEqual(requestsPerTurn);
      // The driver notifies again within the turn: the turn's bytes are spent all the same.
      q.renewBudget();
      d.notify(0);
      expect(used()).toBe(first);
      // The rest come by themselves, a turn's bytes each turn (the device's turn and ours follow
      // each other in one order: the queue's renewal was scheduled first).
      const perTurn: number[] = [];
      for (let turn = 0, before = first; turn < 4 * chains && used() < chains; turn++, before = used()) {
        await nextTurn();
        perTurn.push(used() - before);
      }
      expect(used()).toBe(chains);
      expect(Math.max(...perTurn)).toBeLessThanOrEqual(requestsPerTurn);
      for (let i = 0; i < chains; i++) expect(mem.readU32(USED + 4 + 8 * i + 4)).toBe(MAX_REQUEST_BYTES + 1);
      expect(mem.read(STATUS, 1)[0]).toBe(VIRTIO_BLK_S_OK);
      expect(mem.read(DATA, original.length).equals(original)).toBe(true);
      expect(errors).toEqual([]);
    });
  });

  it('closes the image on reset and reopens it when the driver comes back', () => {
    const d = device();
    d.reset();
    d.activate([q]);
    expect(read(5, 512).bytes.equals(original.subarray(5 * 512, 6 * 512))).toBe(true);
  });

  it('refuses an image that is missing or empty, naming it', () => {
    const onErr = () => {};
    expect(() => new VirtioBlk(mem, { path: join(dir, 'missing.img'), readOnly: false }, onErr, onErr)).toThrow(InvalidOptionError);
    writeFileSync(join(dir, 'empty.img'), '');
    expect(() => new VirtioBlk(mem, { path: join(dir, 'empty.img'), readOnly: true }, onErr, onErr)).toThrow(/empty\.img/);
  });

  describe('saved state', () => {
    const json = <T>(v: T): T => JSON.parse(JSON.stringify(v));
    /** A second device on the same image, as a restored machine builds it. */
    const restored = (readOnly = true, path = image) => new VirtioBlk(mem, { path, readOnly }, () => interrupts++, (m) => errors.push(m));
    /** Runs `change` on `path` and puts its mtime back to the nanosecond (utimes in JS rounds it). */
    const keepingMtime = (path: string, change: () => void) => {
      const ref = `${path}.mtime`;
      execFileSync('touch', ['-r', path, ref]);
      change();
      execFileSync('touch', ['-r', ref, path]);
    };

    it('a read-only disk saves its identity; a device on the unchanged image takes it and serves the queue', () => {
      const state = json(device(true).saveState());
      expect(state).toMatchObject({ version: 1, path: image, readOnly: true, sizeBytes: SECTORS * 512 });
      expect(state.mtimeNs).toMatch(/^\d+$/);
      expect(state.headSha256).toBe(sha(original)); // smaller than a MiB: both ends are the whole image
      const b = restored();
      try {
        b.restoreState(state, [q], 0n, 'disk');
        blk!.close();
        blk = b; // submit() notifies `blk`: the restored device serves the same ring
        expect(read(7, 512).bytes.equals(original.subarray(7 * 512, 8 * 512))).toBe(true);
      } finally {
        b.close();
      }
    });

    it('a writable disk cannot be saved: its image goes on changing', () => {
      expect(() => device(false).saveState()).toThrow(SnapshotError);
      expect(() => blk!.saveState()).toThrow(/attached read-write.*attach it read-only/);
    });

    it('a changed image, or a state of another disk, is refused with SnapshotError naming what differs', () => {
      const state = json(device(true).saveState());
      blk!.close();
      const refuse = (value: unknown, message: RegExp, readOnly = true, path = image) => {
        const b = restored(readOnly, path);
        try {
          expect(() => b.restoreState(value, [q], 0n, 'disk')).toThrow(SnapshotError);
          expect(() => b.restoreState(value, [q], 0n, 'disk')).toThrow(message);
        } finally {
          b.close();
        }
      };
      const other = join(dir, 'other.img');
      writeFileSync(other, original);
      refuse(state, /disk\.path: the state is of .*disk\.img, this device has .*other\.img/, true, other);
      refuse(state, /this device has .* read-write/, false);
      refuse({ ...state, readOnly: false }, /disk\.readOnly: a saved disk is read-only/);
      refuse({ ...state, version: 2 }, /disk\.version: this pvisor reads version 1/);
      refuse({ ...state, path: '' }, /disk\.path: expected a string of 1 to 4096 characters/);
      refuse({ ...state, sizeBytes: -1 }, /disk\.sizeBytes: expected an integer/);
      refuse({ ...state, mtimeNs: 1.5 }, /disk\.mtimeNs: expected a string matching/);
      refuse({ ...state, headSha256: 'ab' }, /disk\.headSha256: expected a string matching/);
      refuse(null, /disk: expected an object/);
      // Its mtime moved (touched, or written through).
      keepingMtime(image, () => {
        const st = statSync(image);
        utimesSync(image, st.atime, new Date(st.mtimeMs + 5000));
        refuse(state, /was modified after the snapshot/);
      });
      // The same mtime but other bytes in its first MiB (a replacement that kept the mtime).
      keepingMtime(image, () => {
        const fd = openSync(image, 'r+');
        writeSync(fd, Buffer.from('changed'), 0, 7, 100);
        closeSync(fd);
      });
      refuse(state, /differs in its first MiB/);
      // Grown by a sector.
      writeFileSync(image, Buffer.concat([original, Buffer.alloc(512)]));
      refuse(state, new RegExp(`is ${(SECTORS + 1) * 512} bytes, was ${SECTORS * 512}`));
    });

    it('checks the last MiB of a larger image as well as the first', () => {
      const big = join(dir, 'big.img');
      const bytes = randomBytes(4 * 1024 * 1024);
      writeFileSync(big, bytes);
      const a = restored(true, big);
      const state = json(a.saveState());
      a.close();
      expect(state.tailSha256).toBe(sha(bytes.subarray(3 * 1024 * 1024)));
      keepingMtime(big, () => {
        const fd = openSync(big, 'r+');
        writeSync(fd, Buffer.from('x'), 0, 1, bytes.length - 1);
        closeSync(fd);
      });
      const b = restored(true, big);
      try {
        expect(() => b.restoreState(state, [q], 0n, 'disk')).toThrow(/differs in its last MiB/);
      } finally {
        b.close();
      }
    });
  });

  it('a writer holds the image alone; readers share it', () => {
    const other = (readOnly: boolean) => new VirtioBlk(mem, { path: image, readOnly }, () => {}, () => {});
    device(false);
    expect(() => other(true)).toThrow(/in use by another VM/);
    expect(() => other(false)).toThrow(InvalidOptionError);
    blk!.close();
    const r1 = other(true);
    const r2 = other(true);
    try {
      expect(() => other(false)).toThrow(/in use by another VM/);
    } finally {
      r1.close();
      r2.close();
    }
    other(false).close(); // free again once the readers are gone
  });
});
