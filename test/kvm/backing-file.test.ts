// Where Offload and CompressedOffload put guest RAM, on real KVM, and what goes wrong there: a
// directory that would keep it in RAM, something planted at the file's path, a missing or
// read-only directory, a disk that fills up during the write-out. Each is a typed error, the VM
// runs on (or stays suspended and resumes) with every byte intact, and nothing of pvisor's is
// left behind. Needs /dev/kvm; the full disk also needs root (a loop-mounted ext4).
import { spawnSync } from 'node:child_process';
import nodeCrypto from 'node:crypto';
import { chmodSync, closeSync, existsSync, lstatSync, mkdirSync, mkdtempSync, openSync, readdirSync, rmSync, statfsSync, symlinkSync, truncateSync, writeFileSync, writeSync } from 'node:fs';
import { basename, join } from 'node:path';
import { BackingFileError, CompressedOffload, InvalidOptionError, Offload, Vm, type MemoryStrategy } from '../../src';
import type { ProbeWorkingSet } from '../../src/guest/probe-content';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { hexOf } from '../probe-digest';

const MiB = 2 ** 20;

/** A probe VM with `sizeMiB` of known content; stopped whatever the body does. */
async function withVm(strategy: MemoryStrategy, body: (vm: Vm, digest: string) => Promise<void>, { memory = '64MiB', sizeMiB = 4 } = {}): Promise<void> {
  const ws: ProbeWorkingSet = { content: 'random', seed: 11, sizeBytes: sizeMiB * MiB, rewrites: [] };
  const vm = await Vm.start({ guest: 'probe', memory, vcpus: 1, strategies: [strategy] });
  try {
    await vm.probe.fill({ sizeMiB, content: ws.content, seed: ws.seed });
    await body(vm, hexOf(ws));
  } finally {
    vm.stop();
  }
}

const openFds = () => readdirSync('/proc/self/fd').length;

/** The names in `dir` once every backing file being removed in the background is gone. */
async function settledNames(dir: string): Promise<string[]> {
  for (;;) {
    const names = readdirSync(dir).sort();
    if (!names.some((n) => n.startsWith('pvisor-removed-'))) return names;
    await new Promise((r) => setTimeout(r, 10));
  }
}

describe('a backing directory on tmpfs', () => {
  let shmDir: string;
  beforeEach(() => (shmDir = mkdtempSync('/dev/shm/pvisor-backing-')));
  afterEach(() => rmSync(shmDir, { recursive: true, force: true }));

  it.each([
    ['Offload', (dir: string) => new Offload({ dir })],
    ['CompressedOffload', (dir: string) => new CompressedOffload({ dir })],
  ])('%s: the suspend is refused with a typed error naming the option; the VM runs on, every byte intact', (_name, make) =>
    withVm(make(shmDir), async (vm, digest) => {
      const err = await vm.suspend().catch((e: unknown) => e);
      expect(err).toBeInstanceOf(InvalidOptionError);
      expect((err as InvalidOptionError).option).toBe('dir');
      expect((err as Error).message).toMatch(/is on tmpfs.*allowMemoryBackedDir/);
      expect(vm.state).toBe('running');
      expect(readdirSync(shmDir)).toEqual([]);
      expect((await vm.probe.digest()).hex).toBe(digest);
    }));

  it('allowMemoryBackedDir: the user insists, and the suspend goes there', () =>
    withVm(new Offload({ dir: shmDir, allowMemoryBackedDir: true }), async (vm, digest) => {
      await vm.suspend();
      await vm.memoryReleased();
      expect(readdirSync(shmDir)).toHaveLength(1);
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(digest);
    }));
});

describe('faults on the backing path', () => {
  let dir: string;
  beforeEach(() => (dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-faults-'))));
  afterEach(() => {
    jest.restoreAllMocks();
    rmSync(dir, { recursive: true, force: true });
  });

  /**
   * The path of `vm`'s next backing file: its random part is made `deadbeef` until the mock is
   * restored, so that a test can plant something there first, as someone who guessed it would.
   */
  function nextBackingPath(vm: Vm, extension: string): string {
    jest.spyOn(nodeCrypto, 'randomBytes').mockImplementation((() => Buffer.from('deadbeef', 'hex')) as never);
    return join(dir, `pvisor-${vm.name}-${process.pid}-deadbeef.${extension}`);
  }

  const plant = {
    directory: (path: string) => mkdirSync(path),
    // Dangling: a create that followed it would make the target.
    symlink: (path: string) => symlinkSync(join(dir, 'target'), path),
    fifo: (path: string) => expect(spawnSync('mkfifo', [path]).status).toBe(0),
  };
  const kindOf = (path: string) => {
    const st = lstatSync(path);
    return st.isDirectory() ? 'directory' : st.isSymbolicLink() ? 'symlink' : st.isFIFO() ? 'fifo' : 'other';
  };

  it.each([
    ['Offload', 'directory', 'ram'],
    ['Offload', 'symlink', 'ram'],
    ['Offload', 'fifo', 'ram'],
    ['CompressedOffload', 'directory', 'zframes'],
    ['CompressedOffload', 'fifo', 'zframes'],
  ] as const)('%s: a %s planted at the backing path is a typed error at suspend; the VM runs on intact, the plant is left alone, nothing of ours stays', (strategy, kind, extension) => {
    const fds = openFds();
    return withVm(strategy === 'Offload' ? new Offload({ dir }) : new CompressedOffload({ dir }), async (vm, digest) => {
      const path = nextBackingPath(vm, extension);
      plant[kind](path);
      const err = await vm.suspend().catch((e: unknown) => e);
      jest.restoreAllMocks();
      expect(err).toBeInstanceOf(BackingFileError);
      expect((err as Error).message).toMatch(/cannot create the backing file \(EEXIST/);
      expect(vm.state).toBe('running');
      expect((await vm.probe.digest()).hex).toBe(digest);
      // Stopping cleans up what is ours, which the plant is not.
      vm.stop();
      await new Promise((r) => setTimeout(r, 50)); // the closed socket's handle goes on the next tick
      expect(kindOf(path)).toBe(kind);
      expect(await settledNames(dir)).toEqual([basename(path)]); // no target, no file of ours
      expect(openFds()).toBeLessThanOrEqual(fds + 1); // Node may open one of its own
    });
  });

  it.each([
    ['missing', (d: string) => join(d, 'missing'), /ENOENT/],
    ['read-only', readOnlyDir, /EROFS|EACCES/],
  ] as const)('a %s directory is a typed error at suspend; the VM runs on intact', (_what, make, code) => {
    const target = make(dir);
    return withVm(new Offload({ dir: target }), async (vm, digest) => {
      const err = await vm.suspend().catch((e: unknown) => e);
      expect(err).toBeInstanceOf(BackingFileError);
      expect((err as Error).message).toMatch(code);
      expect(vm.state).toBe('running');
      expect((await vm.probe.digest()).hex).toBe(digest);
      if (existsSync(target)) expect(readdirSync(target)).toEqual([]);
    }).finally(() => spawnSync('umount', [target]));
  });
});

/**
 * A directory in `parent` that this process cannot create files in: a read-only bind mount of
 * itself for root (which ignores permissions), else mode 0500.
 */
function readOnlyDir(parent: string): string {
  const path = join(parent, 'read-only');
  mkdirSync(path);
  if (process.getuid?.() === 0) {
    const bind = spawnSync('mount', ['--bind', path, path], { encoding: 'utf8' });
    const ro = spawnSync('mount', ['-o', 'remount,ro,bind', path], { encoding: 'utf8' });
    if (bind.status !== 0 || ro.status !== 0) throw new Error(`cannot make a read-only bind mount: ${bind.stderr}${ro.stderr}`);
  } else {
    chmodSync(path, 0o500);
  }
  return path;
}

describe('a disk that fills up during the write-out', () => {
  // A small ext4 of its own on a loop device: filling it harms nothing else, and its space can be
  // given back. tmpfs with size= would do, but backing files on tmpfs are refused.
  let base: string;
  let mnt: string;
  let unavailable: string | undefined;
  beforeAll(() => {
    base = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-enospc-'));
    const image = join(base, 'fs.img');
    mnt = join(base, 'mnt');
    mkdirSync(mnt);
    writeFileSync(image, '');
    truncateSync(image, 96 * MiB);
    const mkfs = spawnSync('mkfs.ext4', ['-q', '-F', '-m', '0', '-O', '^has_journal', image], { encoding: 'utf8' });
    const mount = mkfs.status === 0 ? spawnSync('mount', ['-o', 'loop', image, mnt], { encoding: 'utf8' }) : mkfs;
    if (mount.status !== 0) unavailable = `cannot make and loop-mount an ext4 here (${(mount.stderr || mount.error?.message || '').trim()})`;
  });
  afterAll(() => {
    // Lazily if a failed test left a file open there: the next run must not find it mounted.
    if (!unavailable && spawnSync('umount', [mnt]).status !== 0) spawnSync('umount', ['-l', mnt]);
    rmSync(base, { recursive: true, force: true });
  });

  // Offload reads back what it dropped without writing anything, so it resumes even with no space
  // left at all; CompressedOffload first writes the frame table, so it resumes once space returns.
  it.each([
    ['Offload', () => new Offload({ dir: mnt }), true],
    ['CompressedOffload', () => new CompressedOffload({ dir: mnt }), false],
  ])('%s: release fails with a typed error, the VM stays suspended and resumes intact; once space returns, a suspend releases everything', async (_name, make, resumesWhileFull) => {
    if (unavailable) {
      console.log(`skipped: ${unavailable}`);
      return;
    }
    // 28 MiB left: the first 16 MiB batch becomes durable and leaves RAM, the second cannot.
    const st = statfsSync(mnt);
    const filler = join(mnt, 'filler');
    writeFileSync(filler, Buffer.alloc(st.bavail * st.bsize - 28 * MiB));
    try {
      await withVm(make(), async (vm, digest) => {
        const before = vm.memoryUsage().guestRamRssBytes;
        await vm.suspend();
        expect(vm.state).toBe('suspended');
        const err = await vm.memoryReleased().catch((e: unknown) => e);
        expect(err).toBeInstanceOf(BackingFileError);
        expect((err as Error).message).toMatch(/ENOSPC/);
        expect(vm.state).toBe('suspended');
        // The first batch left RAM (it is in the file), the rest stayed. A batch is 16 MiB of
        // guest RAM, not all of it resident (the probe's own pages are sparse).
        const during = vm.memoryUsage().guestRamRssBytes;
        expect(before - during).toBeGreaterThanOrEqual(8 * MiB);
        expect(during).toBeGreaterThan(16 * MiB);
        if (resumesWhileFull) fillUp(join(mnt, 'filler-2'));
        else rmSync(filler);
        await vm.resume();
        expect((await vm.probe.digest()).hex).toBe(digest);
        for (const f of [filler, join(mnt, 'filler-2')]) rmSync(f, { force: true });
        await vm.suspend();
        await vm.memoryReleased();
        expect(vm.memoryUsage().guestRamRssBytes).toBeLessThan(2 * MiB);
        await vm.resume();
        expect((await vm.probe.digest()).hex).toBe(digest);
      }, { memory: '128MiB', sizeMiB: 48 });
      expect(await settledNames(mnt)).toEqual(['lost+found']);
    } finally {
      for (const f of [filler, join(mnt, 'filler-2')]) rmSync(f, { force: true });
    }
  });
});

/** Writes `path` until the filesystem has no space left. */
function fillUp(path: string): void {
  const fd = openSync(path, 'w');
  const chunk = Buffer.alloc(MiB, 1);
  try {
    for (;;) writeSync(fd, chunk);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'ENOSPC') throw e;
  } finally {
    closeSync(fd);
  }
}
