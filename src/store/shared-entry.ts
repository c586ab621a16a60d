/**
 * The chunk cache's shared snapshots: `snapshots/<key>/`, a whole local snapshot directory
 * (`state.json`, `manifest.json`, `ram`) assembled once from a store snapshot whose manifest's
 * SHA-256 is `<key>`, that every {@link SharedSnapshot} clone of it on this host maps, in any
 * process that uses the same cache, so that the clones share the RAM file's page cache.
 *
 * An entry is never changed once published: it is assembled in `work/`, its files made read-only
 * and fsynced, and the directory renamed into place whole. A process that restores from an entry
 * holds a shared flock on its RAM file (first its own descriptor for the restore, then, for as long
 * as guest RAM maps the file, the descriptor SharedSnapshot maps it through); eviction takes an
 * exclusive flock without waiting, and removes only an entry it got, renaming it out of place
 * first. A restore that locks an entry checks, once locked, that the entry still holds that very
 * file: eviction may have taken it between the open and the lock.
 *
 * The cache directory is hostile input as any snapshot directory is (another user, a symbolic
 * link, a file truncated or replaced): an entry or directory that anyone but this process's user
 * (or root) could change is refused with a {@link SnapshotError} before it is used, as
 * SharedSnapshot refuses such a RAM file; the files are opened as snapshot files are
 * (snapshot-file.ts), and the restore checks the RAM file's chunks against the manifest.
 */
import { closeSync, constants, fchmodSync, fstatSync, fsyncSync, lstatSync, mkdirSync, openSync, readdirSync, renameSync, rmSync, utimesSync, type Stats } from 'node:fs';
import { join } from 'node:path';
import { SnapshotError } from '../errors';
import { checkSharedRamFile } from '../memory/strategies/shared-snapshot';
import { openSnapshotFile } from '../snapshot/snapshot-file';
import { tryLockFile } from '../sys/libc';

/** The cache's subdirectory of shared snapshots. */
export const SHARED_SNAPSHOTS_DIR = 'snapshots';
const KEY = /^[0-9a-f]{64}$/;
const FILES = ['state.json', 'manifest.json', 'ram'] as const;

/** A shared snapshot held for a restore: {@link holdSharedEntry}, {@link publishSharedEntry}. */
export interface SharedEntryHold {
  /** The entry's snapshot directory, for {@link Vm.restore}. */
  dir: string;
  /** Lets go of the hold (its flock); the entry stays, kept from eviction by whoever maps it. */
  release(): void;
}

/** An entry as eviction weighs it. */
export interface SharedEntryUse {
  key: string;
  /** Bytes it takes on disk (the RAM file is sparse). */
  sizeBytes: number;
  /** When a restore last used it (the directory's modification time, which a use sets). */
  usedMs: number;
}

function entryDir(cacheDir: string, key: string): string {
  if (!KEY.test(key)) throw new SnapshotError(`not a shared snapshot key: ${key.slice(0, 80)}`);
  return join(cacheDir, SHARED_SNAPSHOTS_DIR, key);
}

/**
 * Refuses a directory of the cache that someone other than this process's user (or root) could
 * change: a symbolic link or no directory, one owned by another user, or one writable by its
 * group or others (they could swap a file of an entry). A {@link SnapshotError}.
 */
export function checkCacheDir(path: string, st: Stats = lstatSync(path)): void {
  if (st.isSymbolicLink()) throw new SnapshotError(`${path}: a symbolic link; a chunk cache directory is refused unless it is a directory of its own`);
  if (!st.isDirectory()) throw new SnapshotError(`${path}: not a directory`);
  const euid = process.geteuid?.() ?? st.uid;
  if (st.uid !== euid && st.uid !== 0) throw new SnapshotError(`${path}: owned by uid ${st.uid}, not by this process's user (${euid}) or root: its owner could change the snapshots that clones map; use a chunk cache of your own (store.cacheDir)`);
  if ((st.mode & 0o022) !== 0) throw new SnapshotError(`${path}: mode ${(st.mode & 0o777).toString(8)}, writable by ${st.mode & 0o002 ? 'others' : 'its group'}: they could change the snapshots that clones map; make it 0700 or 0755`);
}

/**
 * Checks the cache directory and its `snapshots/` (creating the latter, 0700): both must be
 * {@link checkCacheDir}'s.
 */
export function checkSharedDirs(cacheDir: string): void {
  checkCacheDir(cacheDir);
  const dir = join(cacheDir, SHARED_SNAPSHOTS_DIR);
  mkdirSync(dir, { mode: 0o700, recursive: true });
  checkCacheDir(dir);
}

/**
 * Holds the entry `key` for a restore, if the cache has it: its directory and files checked (see
 * the module), its RAM file `ramBytes` long, locked shared; its use makes it the most recently
 * used. Undefined if there is none, or if eviction is removing it. A hostile entry is a
 * {@link SnapshotError}.
 */
export function holdSharedEntry(cacheDir: string, key: string, ramBytes: number): SharedEntryHold | undefined {
  const dir = entryDir(cacheDir, key);
  let st: Stats;
  try {
    st = lstatSync(dir);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
    throw e;
  }
  checkCacheDir(dir, st);
  const ram = openSnapshotFile(join(dir, 'ram'));
  try {
    checkSharedRamFile(ram.fd, ram.path);
    // Held exclusively: eviction is removing it.
    if (!tryLockFile(ram.fd, false)) return closed(ram.fd);
    // Eviction may have removed it between the open and the lock: then the path names another file or none.
    const held = fstatSync(ram.fd);
    let now: Stats | undefined;
    try {
      now = lstatSync(ram.path);
    } catch {
      // Gone: as below.
    }
    if (!now || now.ino !== held.ino || now.dev !== held.dev) return closed(ram.fd);
    if (held.size !== ramBytes) throw new SnapshotError(`${ram.path}: ${held.size} bytes, the snapshot's RAM is ${ramBytes}: a shared snapshot of the chunk cache was truncated or grown; remove ${dir}`);
    for (const name of FILES.slice(0, 2)) {
      const f = openSnapshotFile(join(dir, name));
      try {
        checkSharedRamFile(f.fd, f.path);
      } finally {
        closeSync(f.fd);
      }
    }
    const t = new Date();
    utimesSync(dir, t, t);
  } catch (e) {
    closeSync(ram.fd);
    throw e;
  }
  return { dir, release: once(() => closeSync(ram.fd)) };
}

/**
 * Makes the snapshot directory `workDir` (assembled in the cache's `work/`, holding exactly a
 * snapshot's three files) the entry `key`, held: the files are made read-only (0400) and fsynced,
 * the RAM file locked shared, then the directory renamed into place whole. If another process
 * published `key` meanwhile, `workDir` is removed and that entry is held instead.
 */
export function publishSharedEntry(cacheDir: string, key: string, workDir: string, ramBytes: number): SharedEntryHold {
  const target = entryDir(cacheDir, key);
  const ramFd = openSync(join(workDir, 'ram'), constants.O_RDONLY | constants.O_NOFOLLOW);
  try {
    for (const name of FILES) {
      const fd = name === 'ram' ? ramFd : openSync(join(workDir, name), constants.O_RDONLY | constants.O_NOFOLLOW);
      try {
        fsyncSync(fd);
      } finally {
        if (fd !== ramFd) closeSync(fd);
      }
    }
    // After the fsyncs: a read-only file can still be fsynced through a read-only descriptor, but
    // the mode must be set before anyone can see the entry.
    for (const name of FILES) chmodNoFollow(join(workDir, name), 0o400);
    if (!tryLockFile(ramFd, false)) throw new SnapshotError(`${workDir}/ram: locked by another process while it was being assembled`);
    try {
      renameSync(workDir, target);
    } catch (e) {
      const code = (e as NodeJS.ErrnoException).code;
      if (code !== 'ENOTEMPTY' && code !== 'EEXIST') throw e;
      // Published by another process first: theirs is used, so that clones share one file.
      closeSync(ramFd);
      rmSync(workDir, { recursive: true, force: true });
      const theirs = holdSharedEntry(cacheDir, key, ramBytes);
      if (!theirs) throw new SnapshotError(`${target}: published by another process and evicted at once; the chunk cache's bound (store.cacheMaxBytes) is too small for this snapshot`);
      return theirs;
    }
    syncDir(join(cacheDir, SHARED_SNAPSHOTS_DIR));
  } catch (e) {
    try {
      closeSync(ramFd);
    } catch {
      // Closed above already.
    }
    throw e;
  }
  return { dir: target, release: once(() => closeSync(ramFd)) };
}

/** The cache's shared snapshots, for eviction; an entry that vanishes meanwhile is left out. */
export function listSharedEntries(cacheDir: string): SharedEntryUse[] {
  let names: string[];
  try {
    names = readdirSync(join(cacheDir, SHARED_SNAPSHOTS_DIR));
  } catch {
    return [];
  }
  const out: SharedEntryUse[] = [];
  for (const key of names) {
    if (!KEY.test(key)) continue;
    const dir = entryDir(cacheDir, key);
    try {
      const st = lstatSync(dir);
      if (!st.isDirectory()) continue;
      let sizeBytes = 0;
      for (const name of readdirSync(dir)) sizeBytes += lstatSync(join(dir, name)).blocks * 512;
      out.push({ key, sizeBytes, usedMs: st.mtimeMs });
    } catch {
      // Removed meanwhile by another process sharing the cache.
    }
  }
  return out;
}

/**
 * Removes the entry `key` unless a restore or a clone holds it (a shared flock on its RAM file):
 * true if it was removed. It is first renamed to `trashDir` (a new name in the cache's `work/`,
 * which a later eviction removes if this process dies half-way).
 */
export function removeSharedEntry(cacheDir: string, key: string, trashDir: string): boolean {
  const dir = entryDir(cacheDir, key);
  let fd: number | undefined;
  try {
    fd = openSync(join(dir, 'ram'), constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK);
  } catch {
    // No RAM file (a half-removed or foreign entry): nobody can map it.
  }
  try {
    if (fd !== undefined && !tryLockFile(fd, true)) return false;
    renameSync(dir, trashDir);
    rmSync(trashDir, { recursive: true, force: true });
    return true;
  } finally {
    if (fd !== undefined) closeSync(fd);
  }
}

function closed(fd: number): undefined {
  closeSync(fd);
  return undefined;
}

function once(f: () => void): () => void {
  let done = false;
  return () => {
    if (done) return;
    done = true;
    f();
  };
}

/** chmod of a file this process assembled, refusing a symbolic link put in its place. */
function chmodNoFollow(path: string, mode: number): void {
  const fd = openSync(path, constants.O_RDONLY | constants.O_NOFOLLOW);
  try {
    if (!fstatSync(fd).isFile()) throw new SnapshotError(`${path}: not a regular file`);
    // fchmod: the file opened, not whatever the path names by now.
    fchmodSync(fd, mode);
  } finally {
    closeSync(fd);
  }
}

/** fsync of a directory, so that a rename in it survives a crash. */
function syncDir(path: string): void {
  const fd = openSync(path, constants.O_RDONLY | constants.O_DIRECTORY);
  try {
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}
