// Backing files: named, created and removed so that none outlives its VM. Real files, no KVM.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, statfsSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { basename, join } from 'node:path';
import { BackingFileError, InvalidOptionError } from '../../src/errors';
import { backingDirOptions, backingFilePath, checkBackingDir, createBackingFile, DEFAULT_BACKING_DIR, removeBackingFile } from '../../src/memory/backing-file';
import { PACKAGE_ROOT } from '../../src/native';
import { TMPFS_MAGIC } from '../../src/sys/constants';

describe('backing files', () => {
  let dir: string;
  beforeEach(() => (dir = mkdtempSync(join(tmpdir(), 'pvisor-backing-'))));
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  it('a new one removes those a dead process left in the directory, and only those', () => {
    // A pid that cannot be alive (above pid_max), one that is (ours), and a file not pvisor's.
    const dead = join(dir, 'pvisor-vm-1-99999999-0123abcd.ram');
    const alive = join(dir, `pvisor-vm-2-${process.pid}-0123abcd.zframes`);
    const other = join(dir, 'pvisor-notes.txt');
    for (const p of [dead, alive, other]) writeFileSync(p, 'x');
    const path = backingFilePath(dir, 'vm-3', 'ram');
    createBackingFile(path);
    expect(existsSync(dead)).toBe(false);
    expect(existsSync(alive)).toBe(true);
    expect(existsSync(other)).toBe(true);
    expect(existsSync(path)).toBe(true);
  });

  it('a directory or fifo named like a dead process\'s file neither stops the sweep nor is removed by it', () => {
    const dirLike = join(dir, 'pvisor-vm-1-99999999-0123abcd.ram');
    const fifoLike = join(dir, 'pvisor-vm-1-99999999-4567cdef.zframes');
    const dead = join(dir, 'pvisor-vm-1-99999999-89abcdef.ram');
    mkdirSync(dirLike);
    expect(spawnSync('mkfifo', [fifoLike]).status).toBe(0);
    writeFileSync(dead, 'x');
    const path = backingFilePath(dir, 'vm-2', 'ram');
    createBackingFile(path);
    expect(readdirSync(dir).sort()).toEqual([basename(path), basename(dirLike), basename(fifoLike)].sort());
  });

  it('a file that cannot be created is a typed error carrying the system\'s', () => {
    const path = backingFilePath(dir, 'vm-1', 'ram');
    mkdirSync(path);
    const err = (() => {
      try {
        createBackingFile(path);
      } catch (e) {
        return e as BackingFileError;
      }
    })();
    expect(err).toBeInstanceOf(BackingFileError);
    expect(err!.path).toBe(path);
    expect(err!.message).toMatch(/cannot create the backing file \(EEXIST/);
    expect((err!.cause as NodeJS.ErrnoException).code).toBe('EEXIST');
    expect(() => createBackingFile(join(dir, 'missing', 'pvisor-vm-1-1-00000000.ram'))).toThrow(/ENOENT/);
  });

  it('removal frees the path at once, and a process that exits right after leaves no file', () => {
    const script = `
      const { writeFileSync } = require('node:fs');
      const { removeBackingFile, backingFilePath } = require(${JSON.stringify(require.resolve('../../src/memory/backing-file'))});
      const path = backingFilePath(${JSON.stringify(dir)}, 'vm', 'ram');
      writeFileSync(path, Buffer.alloc(32 * 1024 * 1024, 1));
      removeBackingFile(path);
      if (require('node:fs').existsSync(path)) process.exit(3);
      process.exit(0); // before libuv's unlink can run`;
    const r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8' });
    expect(r.status).toBe(0);
    expect(readdirSync(dir)).toEqual([]);
  });

  it('removing a file that is already gone is fine', () => {
    expect(() => removeBackingFile(join(dir, 'pvisor-vm-1-1-00000000.ram'))).not.toThrow();
  });

  it('a file that cannot be removed (a failing disk) does not throw, and the next file made in its directory removes it', () => {
    // An immutable file (chattr +i) refuses rename and unlink even to root, as a dead disk does
    // (test/kvm/backing-file.test.ts has the real one, an ext4 shut down: EIO).
    const path = backingFilePath(dir, 'vm-1', 'ram');
    writeFileSync(path, 'x');
    const chattr = spawnSync('chattr', ['+i', path], { encoding: 'utf8' });
    if (chattr.status !== 0) {
      console.log(`skipped: chattr +i does not work here (${(chattr.stderr || chattr.error?.message || '').trim()})`);
      return;
    }
    try {
      expect(() => removeBackingFile(path)).not.toThrow();
      expect(existsSync(path)).toBe(true);
      createBackingFile(backingFilePath(dir, 'vm-2', 'ram')); // still failing: tried, kept, no throw
      expect(existsSync(path)).toBe(true);
    } finally {
      spawnSync('chattr', ['-i', path]);
    }
    // The disk is back: the next file made there removes it (ours is alive, so only because it was remembered).
    createBackingFile(backingFilePath(dir, 'vm-3', 'ram'));
    expect(existsSync(path)).toBe(false);
  });
});

describe('backing directory', () => {
  // A directory on a disk (the repository's .cache), one on tmpfs (/dev/shm is tmpfs on Linux).
  const cache = join(PACKAGE_ROOT, '.cache');
  let diskDir: string;
  let shmDir: string;
  beforeAll(() => {
    mkdirSync(cache, { recursive: true });
    diskDir = mkdtempSync(join(cache, 'backing-dir-'));
    shmDir = mkdtempSync('/dev/shm/pvisor-backing-dir-');
  });
  afterAll(() => {
    rmSync(diskDir, { recursive: true, force: true });
    rmSync(shmDir, { recursive: true, force: true });
  });

  it('defaults to /var/tmp and refuses options that are not a path or a boolean', () => {
    expect(backingDirOptions({})).toEqual({ dir: DEFAULT_BACKING_DIR, allowMemoryBackedDir: false });
    expect(DEFAULT_BACKING_DIR).toBe('/var/tmp');
    expect(() => backingDirOptions({ dir: '' })).toThrow(/dir: expected a directory path, got ""/);
    expect(() => backingDirOptions({ dir: 7 as never })).toThrow(InvalidOptionError);
    expect(() => backingDirOptions({ allowMemoryBackedDir: 'yes' as never })).toThrow(/allowMemoryBackedDir: expected true or false, got "yes"/);
  });

  it('a directory on tmpfs is refused with a typed error that says why and what to do, unless allowed', () => {
    expect(statfsSync(shmDir).type).toBe(TMPFS_MAGIC);
    const err = (() => {
      try {
        checkBackingDir(backingDirOptions({ dir: shmDir }));
      } catch (e) {
        return e;
      }
    })();
    expect(err).toBeInstanceOf(InvalidOptionError);
    expect((err as InvalidOptionError).option).toBe('dir');
    expect((err as Error).message).toMatch(/is on tmpfs, so a backing file there would stay in host RAM.*a directory on a disk \(the default is \/var\/tmp\).*allowMemoryBackedDir/);
    expect(() => checkBackingDir(backingDirOptions({ dir: shmDir, allowMemoryBackedDir: true }))).not.toThrow();
  });

  it('a directory on a disk passes, and so does a missing one (creating the file says what is wrong)', () => {
    expect(() => checkBackingDir(backingDirOptions({ dir: diskDir }))).not.toThrow();
    expect(() => checkBackingDir(backingDirOptions({ dir: join(diskDir, 'missing') }))).not.toThrow();
  });

  it('a directory on ramfs is refused too (root only: it needs a mount)', () => {
    const mnt = mkdtempSync(join(diskDir, 'ramfs-'));
    const mount = spawnSync('mount', ['-t', 'ramfs', 'pvisor-test', mnt], { encoding: 'utf8' });
    if (mount.status !== 0) {
      console.log(`skipped: cannot mount a ramfs here (${(mount.stderr || mount.error?.message || '').trim()})`);
      return;
    }
    try {
      expect(() => checkBackingDir(backingDirOptions({ dir: mnt }))).toThrow(/is on ramfs/);
    } finally {
      spawnSync('umount', [mnt]);
    }
  });
});
