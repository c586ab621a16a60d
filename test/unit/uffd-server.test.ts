// The native userfaultfd server (libpvisor-memory.so) over an anonymous mapping of this process:
// a real userfaultfd, real files, and this test's own thread as the faulting one (it is Node's
// main thread, whose faults are never left pending). No KVM needed.
import { randomBytes } from 'node:crypto';
import { closeSync, constants, fstatSync, ftruncateSync, mkdtempSync, openSync, readdirSync, readlinkSync, readSync, rmSync, write, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { SystemCallError } from '../../src/errors';
import { MAP_ANONYMOUS, MAP_NORESERVE, MAP_PRIVATE, PAGE_SIZE, PROT_READ, PROT_WRITE } from '../../src/sys/constants';
import { mmap, munmap, viewAt } from '../../src/sys/libc';
import { RangeState, UffdServer, type FileRange, type UffdSource, type UffdSourceEvent } from '../../src/memory/uffd-server';
import { FetchFailure, fetchFailureWhy, FetchRecord } from '../../src/memory/fetch-protocol';
import { RecordChannel, type NativeRecord } from '../../src/native/record-channel';
import { crc32c, crc32cPortable } from '../../src/native/crc32c';
import { processThreads } from '../process-threads';

const MiB = 2 ** 20;
const RAM_BYTES = 64 * MiB; // MAP_NORESERVE: only what a test touches costs memory

/** Bitwise CRC32C straight from the definition (reflected 0x82F63B78). */
function referenceCrc32c(data: Buffer): number {
  let c = 0xffffffff;
  for (const byte of data) {
    c ^= byte;
    for (let k = 0; k < 8; k++) c = c & 1 ? (c >>> 1) ^ 0x82f63b78 : c >>> 1;
  }
  return (c ^ 0xffffffff) >>> 0;
}

const userfaultfds = () =>
  readdirSync('/proc/self/fd').filter((fd) => {
    try {
      return readlinkSync(`/proc/self/fd/${fd}`) === 'anon_inode:[userfaultfd]';
    } catch {
      return false; // closed while listing
    }
  }).length;
const openFds = () => readdirSync('/proc/self/fd').length;
const tick = (ms = 10) => new Promise((r) => setTimeout(r, ms));

async function until<T>(what: () => T | undefined, timeoutMs = 5000): Promise<T> {
  for (const end = Date.now() + timeoutMs; Date.now() < end; await tick()) {
    const v = what();
    if (v !== undefined) return v;
  }
  throw new Error('timed out');
}

describe('CRC32C', () => {
  it('gives the standard check value on both paths', () => {
    const check = Buffer.from('123456789');
    expect(crc32c(check)).toBe(0xe3069283);
    expect(crc32cPortable(check)).toBe(0xe3069283);
    expect(referenceCrc32c(check)).toBe(0xe3069283);
    expect(crc32c(Buffer.alloc(0))).toBe(0);
  });

  it('agrees with the portable path on random buffers of every shape, and in place on native memory', () => {
    const big = randomBytes(4 * MiB + 64);
    // Lengths around the three-stream blocks (3 x 8 KiB, 3 x 256 B) and unaligned starts.
    for (const [start, len] of [[0, 1], [3, 7], [1, 255], [5, 768], [7, 769], [0, 24575], [9, 24576], [1, 24576 * 3 + 5], [0, 4 * MiB], [13, 4 * MiB + 51]]) {
      const slice = big.subarray(start, start + len);
      expect(crc32c(slice)).toBe(crc32cPortable(slice));
    }
    const small = randomBytes(1000);
    expect(crc32c(small)).toBe(referenceCrc32c(small));
    const addr = mmap(0, 4 * MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, 'crc test');
    try {
      big.copy(viewAt(addr, 4 * MiB), 0, 0, 4 * MiB);
      expect(crc32c({ addr: addr + 3, length: 4 * MiB - 3 })).toBe(crc32c(big.subarray(3, 4 * MiB)));
    } finally {
      munmap(addr, 4 * MiB);
    }
  });

  it('sees a single flipped bit', () => {
    const data = randomBytes(MiB);
    const before = crc32c(data);
    data[777777] ^= 0x10;
    expect(crc32c(data)).not.toBe(before);
  });
});

describe('userfaultfd server', () => {
  let dir: string;
  let ramAddr: number;
  let ram: Buffer;
  let server: UffdServer | undefined;
  const fds: number[] = [];

  /** A file of random bytes; returns its fd (closed after the test) and its content. */
  function randomFile(bytes: number): { fd: number; content: Buffer } {
    const content = randomBytes(bytes);
    const fd = openSync(join(dir, `f${fds.length}`), 'w+');
    writeSync(fd, content, 0, bytes, 0);
    fds.push(fd);
    return { fd, content };
  }

  /** File ranges at these RAM offsets and lengths, laid end to end in the file, with checksums. */
  function fileRanges(content: Buffer, layout: [number, number][]): FileRange[] {
    let at = 0;
    return layout.map(([offset, length]) => {
      const r = { offset, length, fileOffset: at, checksum: crc32c(content.subarray(at, at + length)) };
      at += length;
      return r;
    });
  }

  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-uffd-'));
    ramAddr = mmap(0, RAM_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0, 'test RAM');
    ram = viewAt(ramAddr, RAM_BYTES);
    server = UffdServer.create(ramAddr, RAM_BYTES);
  });

  afterEach(() => {
    server?.destroy(); // before the unmap: it releases any thread still waiting in a fault
    munmap(ramAddr, RAM_BYTES);
    for (const fd of fds.splice(0)) closeSync(fd);
    rmSync(dir, { recursive: true, force: true });
  });

  it('a fault loads its whole range from the file, every byte right, and is counted and ordered', () => {
    const { fd, content } = randomFile(7 * MiB);
    const ranges = fileRanges(content, [[0, MiB], [2 * MiB, 2 * MiB], [8 * MiB, 4 * MiB]]);
    const source = server!.addSource({ kind: 'file', fd, ranges, checksum: true }, () => {});
    expect(ram[8 * MiB + 5 * PAGE_SIZE + 7]).toBe(content[3 * MiB + 5 * PAGE_SIZE + 7]);
    expect(source.rangeStates()).toEqual(new Uint8Array([RangeState.Missing, RangeState.Missing, RangeState.Loaded]));
    expect(ram.subarray(8 * MiB, 12 * MiB).equals(content.subarray(3 * MiB, 7 * MiB))).toBe(true);
    expect(source.figures()).toEqual({ faultsServed: 1, rangesLoadedByFault: 1, rangesPrefetched: 0, bytesLoaded: 4 * MiB });
    expect(ram[MiB - 1]).toBe(content[MiB - 1]);
    expect(source.touchOrder()).toEqual([2, 0]);
    expect(server!.figures().faultsServed).toBe(2);
  });

  it('serves a memory source and a file source at once, and zeros in the holes', () => {
    const { fd, content } = randomFile(3 * MiB);
    const hostAddr = mmap(0, 2 * MiB, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, 'memory source');
    try {
      const host = viewAt(hostAddr, 2 * MiB);
      randomBytes(2 * MiB).copy(host);
      const fileLayout: [number, number][] = [[MiB, MiB], [4 * MiB, 2 * MiB]];
      server!.addSource({ kind: 'file', fd, ranges: fileRanges(content, fileLayout), checksum: true, punch: true }, () => {});
      server!.addSource({ kind: 'memory', ranges: [{ offset: 0, length: MiB, srcAddr: hostAddr }, { offset: 3 * MiB, length: 64 * 1024, srcAddr: hostAddr + MiB }] }, () => {});
      const zero = server!.addSource({ kind: 'zero', ranges: [{ offset: 7 * MiB, length: MiB }] }, () => {});
      const expected = Buffer.alloc(RAM_BYTES);
      host.copy(expected, 0, 0, MiB);
      host.copy(expected, 3 * MiB, MiB, MiB + 64 * 1024);
      content.copy(expected, MiB, 0, MiB);
      content.copy(expected, 4 * MiB, MiB, 3 * MiB);
      expect(ram.equals(expected)).toBe(true);
      expect(zero.figures().bytesLoaded).toBe(MiB);
      expect(fstatSync(fd).blocks * 512).toBeLessThan(MiB); // both file ranges punched out once loaded
      expect(server!.figures().zeroPagesFilled).toBeGreaterThan(0);
    } finally {
      munmap(hostAddr, 2 * MiB);
    }
  });

  it('refuses a range that overlaps another source, with nothing changed', () => {
    server!.addSource({ kind: 'zero', ranges: [{ offset: 0, length: MiB }] }, () => {});
    const overlapping = () => server!.addSource({ kind: 'zero', ranges: [{ offset: 2 * MiB, length: MiB }, { offset: MiB - PAGE_SIZE, length: 2 * PAGE_SIZE }] }, () => {});
    expect(overlapping).toThrow(SystemCallError);
    expect(overlapping).toThrow(/EINVAL/);
    expect(() => server!.addSource({ kind: 'zero', ranges: [{ offset: 2 * MiB, length: 8 * MiB }] }, () => {})).toThrow(/EINVAL/); // over 4 MiB
    expect(ram[2 * MiB]).toBe(0);
    expect(server!.figures().faultsServed).toBe(1); // a hole of the first source's: the refused one never served
  });

  it('prefetches in the given order, faults none, then reports the source done', async () => {
    const { fd, content } = randomFile(64 * MiB);
    const layout: [number, number][] = Array.from({ length: 16 }, (_, i) => [i * 4 * MiB, 4 * MiB]);
    const events: UffdSourceEvent[] = [];
    const source = server!.addSource({ kind: 'file', fd, ranges: fileRanges(content, layout), checksum: true }, (e) => events.push(e));
    const order = [9, 3, 15, 0, 1, 2, 14, 4, 5, 8, 6, 7, 13, 10, 11, 12];
    expect(source.prefetch(order)).toBe(16);
    expect(source.prefetch([9, 3])).toBe(0); // queued already
    // Whenever looked at, the loaded ranges are a prefix of the order.
    let partial = 0;
    for (;;) {
      const states = source.rangeStates();
      const loaded = states.reduce((n, st) => n + (st === RangeState.Loaded ? 1 : 0), 0);
      expect(order.slice(0, loaded).every((i) => states[i] === RangeState.Loaded)).toBe(true);
      if (loaded > 0 && loaded < 16) partial++;
      if (loaded === 16) break;
    }
    expect(partial).toBeGreaterThan(0);
    await until(() => (events.length ? events : undefined));
    expect(events).toEqual([{ kind: 'done', rangesLoaded: 16 }]);
    expect(source.touchOrder()).toEqual([]);
    expect(source.figures()).toEqual({ faultsServed: 0, rangesLoadedByFault: 0, rangesPrefetched: 16, bytesLoaded: 64 * MiB });
    expect(ram.equals(content)).toBe(true);
    expect(server!.figures().faultsServed).toBe(0);
  });

  it('serves a fault before the next prefetched range', () => {
    const { fd, content } = randomFile(64 * MiB);
    const layout: [number, number][] = Array.from({ length: 16 }, (_, i) => [i * 4 * MiB, 4 * MiB]);
    const source = server!.addSource({ kind: 'file', fd, ranges: fileRanges(content, layout), checksum: true }, () => {});
    source.loadAll();
    // The queue takes tens of ms; this fault waits for at most the range being loaded now.
    expect(ram[15 * 4 * MiB + 1]).toBe(content[15 * 4 * MiB + 1]);
    expect(source.touchOrder()).toEqual([15]);
    expect(source.figures().rangesLoadedByFault).toBe(1);
  });

  it('reads a file opened with O_DIRECT', () => {
    const { content } = randomFile(2 * MiB);
    const fd = openSync(join(dir, 'f0'), constants.O_RDONLY | constants.O_DIRECT);
    fds.push(fd);
    const source = server!.addSource({ kind: 'file', fd, ranges: fileRanges(content, [[4 * MiB, MiB], [6 * MiB, MiB]]), checksum: true }, () => {});
    expect(ram.subarray(4 * MiB, 5 * MiB).equals(content.subarray(0, MiB))).toBe(true);
    expect(ram.subarray(6 * MiB, 7 * MiB).equals(content.subarray(MiB, 2 * MiB))).toBe(true);
    expect(source.rangeStates()).toEqual(new Uint8Array([RangeState.Loaded, RangeState.Loaded]));
  });

  it('reports a corrupt range with its offset, and the main thread reads zeros there, not the file', async () => {
    const { fd, content } = randomFile(2 * MiB);
    const ranges = fileRanges(content, [[0, MiB], [4 * MiB, MiB]]);
    writeSync(fd, Buffer.from([content[MiB + 100] ^ 0xff]), 0, 1, MiB + 100);
    const events: UffdSourceEvent[] = [];
    const source = server!.addSource({ kind: 'file', fd, ranges, checksum: true }, (e) => events.push(e));
    const page = ram.subarray(4 * MiB, 4 * MiB + PAGE_SIZE);
    expect(page.equals(Buffer.alloc(PAGE_SIZE))).toBe(true);
    expect(page.equals(content.subarray(MiB, MiB + PAGE_SIZE))).toBe(false);
    await until(() => (events.length ? events : undefined));
    expect(events).toEqual([{ kind: 'error', why: 'CRC32C mismatch', offset: 4 * MiB, code: -1 }]);
    expect(source.rangeStates()).toEqual(new Uint8Array([RangeState.Missing, RangeState.Bad]));
    // The good range still loads.
    expect(ram.subarray(0, MiB).equals(content.subarray(0, MiB))).toBe(true);
  });

  it('leaves another thread\'s fault on a corrupt range pending until destroy releases it', async () => {
    const { fd, content } = randomFile(MiB);
    const ranges = fileRanges(content, [[2 * MiB, MiB]]);
    writeSync(fd, Buffer.from([content[5] ^ 1]), 0, 1, 5);
    const events: UffdSourceEvent[] = [];
    server!.addSource({ kind: 'file', fd, ranges, checksum: true }, (e) => events.push(e));
    // write(2) on a libuv pool thread: the kernel faults on the bad range there, as KVM would
    // for a vCPU.
    const out = openSync(join(dir, 'out'), 'w');
    fds.push(out);
    let written: number | undefined;
    write(out, ram, 2 * MiB, PAGE_SIZE, 0, (err, n) => (written = err ? -1 : n));
    await until(() => (events.length ? events : undefined));
    expect(events).toEqual([{ kind: 'error', why: 'CRC32C mismatch', offset: 2 * MiB, code: -1 }]);
    await tick(100);
    expect(written).toBeUndefined();
    server!.destroy();
    expect(await until(() => written)).toBe(PAGE_SIZE);
  });

  /** A deferred source over an empty file of `content`'s size, and a fetcher on this thread that answers as `answer` says. */
  function deferredSource(content: Buffer, layout: [number, number][], answer: (rec: NativeRecord, fetcher: RecordChannel) => void): { fd: number; source: UffdSource; fetcher: RecordChannel; events: UffdSourceEvent[] } {
    const fd = openSync(join(dir, `d${fds.length}`), 'w+');
    fds.push(fd);
    ftruncateSync(fd, content.length);
    const fetcher = new RecordChannel(server!.openFetchChannel(), (rec) => answer(rec, fetcher), { writable: true });
    const events: UffdSourceEvent[] = [];
    const source = server!.addSource({ kind: 'file', fd, ranges: fileRanges(content, layout), checksum: true, deferred: true, punch: true }, (e) => events.push(e));
    return { fd, source, fetcher, events };
  }

  it('a deferred source asks its fetcher for a range a fault waits in, serves it once it is in the file, and loads one it is given unasked', async () => {
    const content = randomBytes(4 * MiB);
    const wanted: number[] = [];
    const { fd, source, fetcher, events } = deferredSource(content, [[0, 2 * MiB], [2 * MiB, 2 * MiB]], (rec, f) => {
      expect(rec.kind).toBe(FetchRecord.want);
      wanted.push(rec.value);
      // The fetcher writes the chunk into the file, then says so.
      writeSync(fd, content, rec.value * 2 * MiB, 2 * MiB, rec.value * 2 * MiB);
      f.send({ kind: FetchRecord.ready, tag: source.id, err: 0, value: rec.value });
    });
    // write(2) on a libuv pool thread faults in range 1, as a vCPU would (Node's main thread is the fetcher here).
    const out = openSync(join(dir, 'out'), 'w+');
    fds.push(out);
    let written: number | undefined;
    write(out, ram, 2 * MiB + 3 * PAGE_SIZE, PAGE_SIZE, 0, (err, n) => (written = err ? -1 : n));
    expect(await until(() => written)).toBe(PAGE_SIZE);
    expect(wanted).toEqual([1]);
    const back = Buffer.alloc(PAGE_SIZE);
    readSync(out, back, 0, PAGE_SIZE, 0);
    expect(back.equals(content.subarray(2 * MiB + 3 * PAGE_SIZE, 2 * MiB + 4 * PAGE_SIZE))).toBe(true);
    expect(source.rangeStates()).toEqual(new Uint8Array([RangeState.Missing, RangeState.Loaded]));
    expect(source.touchOrder()).toEqual([1]);
    // Loaded ranges are punched out of the scratch file.
    expect(fstatSync(fd).blocks * 512).toBeLessThan(2 * MiB);
    // A range given unasked (a prefetch) loads too; then the source is done.
    writeSync(fd, content, 0, 2 * MiB, 0);
    fetcher.send({ kind: FetchRecord.ready, tag: source.id, err: 0, value: 0 });
    await until(() => (events.length ? events : undefined));
    expect(events).toEqual([{ kind: 'done', rangesLoaded: 2 }]);
    expect(ram.subarray(0, 4 * MiB).equals(content)).toBe(true);
    expect(wanted).toEqual([1]);
    expect(source.figures()).toMatchObject({ rangesLoadedByFault: 1, rangesPrefetched: 1, bytesLoaded: 4 * MiB });
    fetcher.destroy();
  });

  it('a deferred range the fetcher fails is bad, reported with its reason, never mapped; the fault stays pending until destroy', async () => {
    const content = randomBytes(2 * MiB);
    const { source, fetcher, events } = deferredSource(content, [[4 * MiB, 2 * MiB]], (rec, f) => f.send({ kind: FetchRecord.failed, tag: source.id, err: FetchFailure.corrupt, value: rec.value }));
    const out = openSync(join(dir, 'out'), 'w');
    fds.push(out);
    let written: number | undefined;
    write(out, ram, 4 * MiB, PAGE_SIZE, 0, (err, n) => (written = err ? -1 : n));
    await until(() => (events.length ? events : undefined));
    expect(events).toEqual([{ kind: 'error', why: fetchFailureWhy(FetchFailure.corrupt), offset: 4 * MiB, code: FetchFailure.corrupt }]);
    expect(source.rangeStates()).toEqual(new Uint8Array([RangeState.Bad]));
    await tick(100);
    expect(written).toBeUndefined();
    server!.destroy();
    expect(await until(() => written)).toBe(PAGE_SIZE);
    fetcher.destroy();
  });

  it('a fetcher that goes away makes every absent range bad, and a fault there does not wait for it', async () => {
    const content = randomBytes(4 * MiB);
    const { source, fetcher, events } = deferredSource(content, [[0, 2 * MiB], [2 * MiB, 2 * MiB]], () => {});
    fetcher.destroy();
    await until(() => (events.length ? events : undefined));
    expect(events).toEqual([{ kind: 'error', why: fetchFailureWhy(FetchFailure.gone), offset: 0, code: FetchFailure.gone }]);
    expect(source.rangeStates()).toEqual(new Uint8Array([RangeState.Bad, RangeState.Bad]));
    // Node's main thread reads a zero page on a bad range (it must read the report and end the VM).
    expect(ram[2 * MiB + 5]).toBe(0);
  });

  it('a deferred source needs the fetch channel first; the channel opens once', () => {
    const fd = openSync(join(dir, 'x'), 'w+');
    fds.push(fd);
    ftruncateSync(fd, 2 * MiB);
    expect(() => server!.addSource({ kind: 'file', fd, ranges: [{ offset: 0, length: 2 * MiB, fileOffset: 0 }], deferred: true }, () => {})).toThrow(/fetch channel/);
    const channel = server!.openFetchChannel();
    expect(() => server!.openFetchChannel()).toThrow(/opened already/);
    closeSync(channel);
  });

  it('remove returns how many ranges were loaded and unregisters RAM', () => {
    const { fd, content } = randomFile(3 * MiB);
    const source = server!.addSource({ kind: 'file', fd, ranges: fileRanges(content, [[0, MiB], [MiB, MiB], [2 * MiB, MiB]]) }, () => {});
    expect(ram[10]).toBe(content[10]);
    expect(ram[MiB + 10]).toBe(content[MiB + 10]);
    const served = server!.figures().faultsServed;
    expect(source.remove()).toBe(2);
    expect(source.touchOrder()).toEqual([0, 1]); // as it was just before
    expect(ram[2 * MiB + 10]).toBe(0); // never loaded: an ordinary anonymous page now
    expect(ram[12 * MiB]).toBe(0);
    expect(server!.figures().faultsServed).toBe(served); // nothing registered, nothing served
    expect(ram[MiB + 10]).toBe(content[MiB + 10]);
  });

  it('destroy leaves no userfaultfd, fd or thread behind', async () => {
    server!.destroy();
    await tick(50);
    const [uffds, fdCount, threads] = [userfaultfds(), openFds(), processThreads()];
    const s = UffdServer.create(ramAddr, RAM_BYTES);
    const { fd, content } = randomFile(MiB);
    s.addSource({ kind: 'file', fd, ranges: fileRanges(content, [[0, MiB]]) }, () => {});
    expect(ram[0]).toBe(content[0]);
    expect(userfaultfds()).toBe(uffds + 1);
    expect(processThreads()).toBe(threads + 1);
    s.destroy();
    await tick(50); // Node closes its end of the record socket on the next turn
    expect(userfaultfds()).toBe(uffds);
    expect(processThreads()).toBe(threads);
    expect(openFds()).toBe(fdCount + 1); // the test's own file
  });
});
