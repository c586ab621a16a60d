// Where Offload and CompressedOffload put guest RAM, on real KVM, and what goes wrong there: a
// directory that would keep it in RAM, something planted at the file's path, a missing or
// read-only directory, a disk that fills up during the write-out. Each is a typed error, the VM
// runs on (or stays suspended and resumes) with every byte intact, and nothing of pvisor's is
// left behind. Needs /dev/kvm; the full disk also needs root (a loop-mounted ext4).
import { spawnSync } from 'node:child_process';
import nodeCrypto from 'node:crypto';
import { chmodSync, closeSync, existsSync, lstatSync, mkdirSync, mkdtempSync, openSync, readdirSync, readFileSync, readlinkSync, rmSync, statfsSync, symlinkSync, truncateSync, writeFileSync, writeSync } from 'node:fs';
import { basename, join } from 'node:path';
import { BackingFileError, CompressedOffload, InvalidOptionError, Offload, Vm, type MemoryStrategy } from '../../src';
import type { ProbeWorkingSet } from '../../src/guest/probe-content';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import * as C from '../../src/sys/constants';
import { ioctl, mmap, munmap, viewAt } from '../../src/sys/libc';
import { processThreads } from '../process-threads';
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
    await vm.stop();
  }
}

const openFds = () => readdirSync('/proc/self/fd').length;
const openFdTargets = () =>
  readdirSync('/proc/self/fd').map((fd) => {
    try {
      return readlinkSync(`/proc/self/fd/${fd}`);
    } catch {
      return ''; // closed while listing
    }
  });

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
      await vm.stop();
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

/**
 * FS_IOC_SHUTDOWN with FSOP_GOING_FLAGS_NOLOGFLUSH (<linux/fs.h>; the xfstests "godown"): from
 * here on every read, write, create and unlink on that ext4 fails with EIO, as on a disk that
 * died. What was made durable before is on the image; a fresh mount sees it again.
 */
function killFilesystem(mountPoint: string): void {
  const FS_IOC_SHUTDOWN = 0x8004587d; // _IOR('X', 125, __u32)
  const arg = mmap(0, C.PAGE_SIZE, C.PROT_READ | C.PROT_WRITE, C.MAP_PRIVATE | C.MAP_ANONYMOUS, -1, 0, 'shutdown flags');
  const fd = openSync(mountPoint, 'r');
  try {
    viewAt(arg, 4).writeUInt32LE(2, 0);
    ioctl(fd, FS_IOC_SHUTDOWN, arg, 'FS_IOC_SHUTDOWN');
  } finally {
    closeSync(fd);
    munmap(arg, C.PAGE_SIZE);
  }
}

describe('a disk that fails with EIO (an ext4 shut down under the VM)', () => {
  let base: string;
  let image: string;
  let mnt: string;
  let unavailable: string | undefined;
  const mount = () => spawnSync('mount', ['-o', 'loop', image, mnt], { encoding: 'utf8' });
  /** Unmounts the dead filesystem and mounts the image again: the disk "comes back". */
  const remount = () => {
    const u = spawnSync('umount', [mnt], { encoding: 'utf8' });
    if (u.status !== 0) throw new Error(`umount ${mnt}: ${u.stderr.trim()} (does something of pvisor's still hold a file there?)`);
    const m = mount();
    if (m.status !== 0) throw new Error(`mount ${mnt}: ${m.stderr.trim()}`);
  };
  beforeAll(() => {
    base = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-eio-'));
    image = join(base, 'fs.img');
    mnt = join(base, 'mnt');
    mkdirSync(mnt);
    writeFileSync(image, '');
    truncateSync(image, 128 * MiB);
    const mkfs = spawnSync('mkfs.ext4', ['-q', '-F', '-m', '0', '-O', '^has_journal', image], { encoding: 'utf8' });
    const m = mkfs.status === 0 ? mount() : mkfs;
    if (m.status !== 0) unavailable = `cannot make and loop-mount an ext4 here (${(m.stderr || m.error?.message || '').trim()})`;
  });
  afterAll(() => {
    if (!unavailable && spawnSync('umount', [mnt]).status !== 0) spawnSync('umount', ['-l', mnt]);
    rmSync(base, { recursive: true, force: true });
  });

  it('Offload: suspend and resume fail with a typed error and change nothing, the VM keeps every byte, and teardown completes', async () => {
    if (unavailable) {
      console.log(`skipped: ${unavailable}`);
      return;
    }
    const threadsBefore = processThreads();
    const fdsBefore = openFds();
    await withVm(new Offload({ dir: mnt }), async (vm, digest) => {
      // 1. The disk is dead when the suspend begins: the backing file cannot be made. The suspend
      // fails, typed, and the VM runs on as it was.
      killFilesystem(mnt);
      const atSuspend = await vm.suspend().catch((e: unknown) => e);
      expect(atSuspend).toBeInstanceOf(BackingFileError);
      expect((atSuspend as Error).message).toMatch(/EIO/);
      expect(vm.state).toBe('running');
      expect((await vm.probe.digest()).hex).toBe(digest);
      remount();

      // 2. The disk dies once part of RAM is in the file and dropped: the rest of the write-out
      // fails, what was not written stays resident; the resume cannot read back what was dropped,
      // fails typed, and the VM stays suspended, nothing lost.
      const before = vm.memoryUsage().guestRamRssBytes;
      await vm.suspend();
      for (let i = 0; i < 2000 && before - vm.memoryUsage().guestRamRssBytes < 16 * MiB; i++) await new Promise((r) => setTimeout(r, 5));
      expect(before - vm.memoryUsage().guestRamRssBytes).toBeGreaterThanOrEqual(16 * MiB); // a batch left RAM
      killFilesystem(mnt);
      const released = await vm.memoryReleased().then(() => undefined, (e: unknown) => e);
      // Unless the whole write-out was through before the disk died, its rest failed with EIO.
      if (released !== undefined) {
        expect(released).toBeInstanceOf(BackingFileError);
        expect((released as Error).message).toMatch(/EIO/);
      }
      const atResume = await vm.resume().catch((e: unknown) => e);
      expect(atResume).toBeInstanceOf(BackingFileError);
      expect((atResume as Error).message).toMatch(/EIO.*the VM stays suspended$/);
      expect((atResume as Error).message).not.toMatch(/missing/); // the file is there: the disk failed
      expect(vm.state).toBe('suspended');
      console.log(`EIO: at suspend: ${(atSuspend as Error).message}\nduring the write-out: ${released === undefined ? 'all written before the disk died' : (released as Error).message}\nat resume: ${(atResume as Error).message}`);
      // The disk comes back with what was made durable: the resume brings every byte back.
      remount();
      await vm.resume();
      expect(vm.state).toBe('running');
      expect((await vm.probe.digest()).hex).toBe(digest);

      // 3. The disk dies while the VM is suspended and it is stopped there: teardown completes.
      await vm.suspend();
      await vm.memoryReleased();
      killFilesystem(mnt);
      await vm.stop();
      expect(vm.state).toBe('stopped');
    }, { memory: '128MiB', sizeMiB: 48 });
    await new Promise((r) => setTimeout(r, 50)); // a stopped VM's socket handle closes on the next tick
    expect(processThreads()).toBe(threadsBefore);
    expect(openFds()).toBeLessThanOrEqual(fdsBefore + 1);
    remount(); // nothing of the VM's holds a file there any more, or this would be EBUSY
  });

  it("Offload, lazy reload: the disk dies after the resume; the guest's first touch of a piece still in the file ends the VM with a typed error, and nothing of it is left", async () => {
    if (unavailable) {
      console.log(`skipped: ${unavailable}`);
      return;
    }
    const threadsBefore = processThreads();
    const fdsBefore = openFds();
    const offload = new Offload({ dir: mnt, reload: 'lazy', prefetch: false });
    let ramRange = '';
    let path = '';
    const crashes: Error[] = [];
    const exits: unknown[] = [];
    await withVm(offload, async (vm) => {
      const [ram] = Vm.liveGuestRam().slice(-1);
      ramRange = `${ram.start.toString(16)}-${(ram.start + ram.length).toString(16)} `;
      vm.on('crash', (e) => crashes.push(e));
      vm.on('exit', (e) => exits.push(e));
      await vm.suspend();
      await vm.memoryReleased();
      path = offload.backingPath!;
      await vm.resume(); // lazy, no prefetch: the working set waits in the file for a touch
      expect(vm.state).toBe('running');
      expect(openFdTargets().filter((t) => /userfaultfd/.test(t))).toHaveLength(1);
      killFilesystem(mnt);
      // The digest reads the whole working set: the server's read of the first piece it needs
      // fails with EIO, the faulting vCPU never gets a byte, and the VM ends.
      const err = await vm.probe.digest().then(
        (d) => new Error(`the digest answered ${d.hex}`),
        (e: unknown) => e,
      );
      expect(err).toBeInstanceOf(BackingFileError);
      expect((err as Error).message).toMatch(/cannot be loaded \(read failed: EIO\) during a lazy reload; the VM cannot go on/);
      expect(vm.state).toBe('crashed');
      expect(vm.error).toBe(err);
      expect(crashes).toEqual([err]);
      expect(exits).toEqual([{ state: 'crashed', error: err }]);
      console.log(`EIO during a lazy reload: ${(err as Error).message}`);
    }, { memory: '128MiB', sizeMiB: 48 });
    await new Promise((r) => setTimeout(r, 50)); // a stopped VM's socket handle closes on the next tick
    // The process goes on: no vCPU or server thread, no fd (the userfaultfd, the file's), no guest RAM.
    expect(processThreads()).toBe(threadsBefore);
    expect(openFdTargets().some((t) => /userfaultfd/.test(t))).toBe(false);
    expect(openFds()).toBeLessThanOrEqual(fdsBefore + 1); // Node may open its own once
    expect(readFileSync('/proc/self/maps', 'utf8')).not.toContain(ramRange);
    remount(); // nothing holds a file there any more, or this would be EBUSY
    // The file could not be removed while the disk was dead. The disk back, the next backing file
    // made there (by any VM of this process) removes it first, and the host runs VMs there again.
    expect(existsSync(path)).toBe(true);
    await withVm(new Offload({ dir: mnt, reload: 'lazy' }), async (vm, digest) => {
      await vm.suspend();
      expect(existsSync(path)).toBe(false);
      await vm.memoryReleased();
      await vm.resume();
      expect((await vm.probe.digest()).hex).toBe(digest);
    });
    expect(await settledNames(mnt)).toEqual(['lost+found']);
  });
});
