// How guest RAM comes back from a snapshot's RAM file is the memory layer's decision: pure logic
// over a stub composition and a stub RAM file (a real file only where SharedSnapshot checks one).
import { chmodSync, closeSync, mkdtempSync, openSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { IdleRelease, InvalidOptionError, SharedSnapshot, SnapshotError, type PvisorError } from '../../src';
import type { GuestRam, MemoryComposition } from '../../src/memory/composition';
import type { RamBacking } from '../../src/guest-ram/ram-backing';
import { planSnapshotRam, refuseRestoreOnlyStrategies, type SnapshotRamFile } from '../../src/snapshot/ram-restore';

type Ram = GuestRam & { readonly backing: RamBacking };

const ram = (backing: RamBacking): Ram => ({ hostAddr: 0, sizeBytes: 8192, backing, hostView: () => Buffer.alloc(0), advise: () => {}, discard: () => {}, discardHost: () => {}, discardHostRuns: () => {}, hostOffset: () => -1, mapFileRuns: () => ({ mapped: 0 }) });

/** A composition and a RAM file that write down what is done to them, in order. */
function stubs(canLoadLazily: boolean, ramFd = 7) {
  const calls: string[] = [];
  let failure: ((why: string, offset: number) => PvisorError) | undefined;
  const memory = {
    canLoadLazily,
    attach: () => calls.push('attach'),
    loadLazily: async (fd: number, ranges: readonly unknown[], f: (why: string, offset: number) => PvisorError) => {
      calls.push(`loadLazily ${fd} ${ranges.length}`);
      failure = f;
    },
  } as unknown as MemoryComposition;
  const file: SnapshotRamFile<Ram> = {
    ramPath: '/snap/ram',
    ramFd,
    readRam: () => calls.push('readRam'),
    openRamForLazyLoad: () => (calls.push('openRamForLazyLoad'), { fd: ramFd, ranges: [{ offset: 0, length: 4096, fileOffset: 0 }] }),
    checkMappedRam: (fd, again) => (calls.push(`checkMappedRam ${fd} ${again}`), { checkedBefore: false, chunksRead: 2, ms: 1, holes: [] }),
  };
  return { calls, memory, file, failure: () => failure };
}

describe('guest RAM from a snapshot', () => {
  it('loads lazily by default where the composition allows it: strategies map first, nothing is read up front', async () => {
    const s = stubs(true);
    expect(await planSnapshotRam([], s.file, { verify: false }).load(s.memory, ram({ kind: 'anonymous' }))).toBe('lazy');
    expect(s.calls).toEqual(['openRamForLazyLoad', 'attach', 'loadLazily 7 1']);
    const e = s.failure()!('crc32c mismatch', 4096);
    expect(e).toBeInstanceOf(SnapshotError);
    expect(e.message).toMatch(/^\/snap\/ram: the RAM chunk at byte 4096 cannot be loaded \(crc32c mismatch\)/);
  });

  it('reads and checks all of RAM before the strategies map with verify, or where a lazy load cannot be', async () => {
    for (const [verify, canLoadLazily] of [[true, true], [false, false]]) {
      const s = stubs(canLoadLazily);
      expect(await planSnapshotRam([new IdleRelease()], s.file, { verify }).load(s.memory, ram({ kind: 'anonymous' }))).toBe('read');
      expect(s.calls).toEqual(['readRam', 'attach']);
    }
  });

  describe('with SharedSnapshot', () => {
    let dir: string;
    let fd: number;
    beforeAll(() => {
      dir = mkdtempSync(join(tmpdir(), 'pvisor-snapshot-ram-'));
      writeFileSync(join(dir, 'ram'), Buffer.alloc(8192));
      chmodSync(join(dir, 'ram'), 0o444);
      fd = openSync(join(dir, 'ram'), 'r');
    });
    afterAll(() => {
      closeSync(fd);
      rmSync(dir, { recursive: true, force: true });
    });

    it('binds the file as guest RAM backing when planned, then checks the mapped file instead of reading it', async () => {
      const s = stubs(true, fd);
      const shared = new SharedSnapshot({ verify: true });
      const plan = planSnapshotRam([shared], { ...s.file, ramPath: join(dir, 'ram') }, { verify: false });
      expect(shared.ramBacking).toEqual({ kind: 'private-file', path: join(dir, 'ram'), fd });
      expect(await plan.load(s.memory, ram({ kind: 'private-file', fd: 42, path: join(dir, 'ram') }))).toBe('mapped');
      expect(s.calls).toEqual(['checkMappedRam 42 true', 'attach']);
    });

    it('is refused at a start', () => {
      expect(() => refuseRestoreOnlyStrategies([new IdleRelease(), new SharedSnapshot()])).toThrow(InvalidOptionError);
      expect(() => refuseRestoreOnlyStrategies([new IdleRelease()])).not.toThrow();
    });
  });
});
