// The chunk cache's shared snapshots (src/store/shared-entry.ts), on real files and real processes:
// an entry is published whole and read-only, a second publisher of the same key uses the first's,
// eviction skips an entry that another process holds (its flock) and removes one nobody holds, and
// a hostile cache (another user's entry, a writable one, a symbolic link, a truncated RAM file) is
// refused with a SnapshotError. That two VM clones in two processes map the same file is the
// harness test test/kvm/store-clones.test.ts.
import { spawn, type ChildProcess } from 'node:child_process';
import { chownSync, chmodSync, existsSync, lstatSync, mkdirSync, mkdtempSync, readdirSync, rmSync, symlinkSync, truncateSync, unlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { SnapshotError } from '../../src/errors';
import { ChunkCache } from '../../src/store/chunk-cache';
import { checkSharedDirs, holdSharedEntry, publishSharedEntry, SHARED_SNAPSHOTS_DIR } from '../../src/store/shared-entry';

const RAM_BYTES = 4 * 1024 * 1024;
const KEY_A = 'a'.repeat(64);
const KEY_B = 'b'.repeat(64);

let base: string;
let cache: ChunkCache;
const children: ChildProcess[] = [];

beforeEach(() => {
  base = mkdtempSync(join(tmpdir(), 'pvisor-shared-entry-'));
  cache = ChunkCache.open(join(base, 'cache'), 0);
  checkSharedDirs(cache.dir);
});

afterEach(() => {
  for (const c of children.splice(0)) c.kill('SIGKILL');
  rmSync(base, { recursive: true, force: true });
});

/** A work directory holding a snapshot's three files, the RAM file with data in its first MiB. */
function assembled(fill: number): string {
  const dir = cache.newWorkDir();
  writeFileSync(join(dir, 'state.json'), '{}', { mode: 0o600 });
  writeFileSync(join(dir, 'manifest.json'), '{}', { mode: 0o600 });
  writeFileSync(join(dir, 'ram'), Buffer.alloc(1024 * 1024, fill), { mode: 0o600 });
  truncateSync(join(dir, 'ram'), RAM_BYTES);
  return dir;
}

function publish(key: string, fill = 1): string {
  const held = publishSharedEntry(cache.dir, key, assembled(fill), RAM_BYTES);
  held.release();
  return held.dir;
}

/** A node process that holds `key` (as a restoring process does) until it is killed. */
async function holdInChild(key: string): Promise<ChildProcess> {
  const mod = require.resolve('../../src/store/shared-entry');
  const child = spawn(process.execPath, ['-e', `
    const h = require(${JSON.stringify(mod)}).holdSharedEntry(${JSON.stringify(cache.dir)}, ${JSON.stringify(key)}, ${RAM_BYTES});
    process.stdout.write(h ? 'held\\n' : 'none\\n');
    setInterval(() => {}, 1000);
  `], { stdio: ['ignore', 'pipe', 'inherit'] });
  children.push(child);
  const line = await new Promise<string>((resolve, reject) => {
    child.stdout!.once('data', (d: Buffer) => resolve(d.toString().trim()));
    child.once('exit', (code) => reject(new Error(`the holding process exited ${code}`)));
  });
  expect(line).toBe('held');
  return child;
}

describe('shared snapshots of the chunk cache', () => {
  it('publishes an entry whole, read-only, and holds it again by its key', () => {
    const dir = publish(KEY_A);
    expect(dir).toBe(join(cache.dir, SHARED_SNAPSHOTS_DIR, KEY_A));
    for (const f of ['state.json', 'manifest.json', 'ram']) expect(lstatSync(join(dir, f)).mode & 0o777).toBe(0o400);
    expect(readdirSync(join(cache.dir, 'work'))).toEqual([]);
    const again = holdSharedEntry(cache.dir, KEY_A, RAM_BYTES);
    expect(again?.dir).toBe(dir);
    again!.release();
    expect(holdSharedEntry(cache.dir, KEY_B, RAM_BYTES)).toBeUndefined();
  });

  it('a second publisher of the same key holds the first one\'s entry, and its own work directory goes', () => {
    const first = publishSharedEntry(cache.dir, KEY_A, assembled(1), RAM_BYTES);
    const ino = lstatSync(join(first.dir, 'ram')).ino;
    const secondWork = assembled(2);
    const second = publishSharedEntry(cache.dir, KEY_A, secondWork, RAM_BYTES);
    expect(second.dir).toBe(first.dir);
    expect(lstatSync(join(second.dir, 'ram')).ino).toBe(ino);
    expect(existsSync(secondWork)).toBe(false);
    first.release();
    second.release();
  });

  it('eviction keeps an entry another process holds, removes one nobody holds, and the held one once let go', async () => {
    publish(KEY_A);
    publish(KEY_B);
    const child = await holdInChild(KEY_A);
    const e1 = cache.evict();
    expect(e1.sharedSnapshotsRemoved).toBe(1);
    expect(existsSync(join(cache.dir, SHARED_SNAPSHOTS_DIR, KEY_A, 'ram'))).toBe(true);
    expect(existsSync(join(cache.dir, SHARED_SNAPSHOTS_DIR, KEY_B))).toBe(false);
    // Counted in the bound while kept: the 1 MiB of data its RAM file holds, at least.
    expect(e1.bytesKept).toBeGreaterThanOrEqual(1024 * 1024);
    const exited = new Promise((r) => child.once('exit', r));
    child.kill('SIGKILL');
    await exited;
    const e2 = cache.evict();
    expect(e2.sharedSnapshotsRemoved).toBe(1);
    expect(readdirSync(join(cache.dir, SHARED_SNAPSHOTS_DIR))).toEqual([]);
    expect(readdirSync(join(cache.dir, 'work'))).toEqual([]);
  });

  it('eviction under the bound removes nothing, held or not', () => {
    const roomy = ChunkCache.open(cache.dir, 1024 * 1024 * 1024);
    publish(KEY_A);
    expect(roomy.evict()).toMatchObject({ sharedSnapshotsRemoved: 0, bytesRemoved: 0 });
    expect(existsSync(join(cache.dir, SHARED_SNAPSHOTS_DIR, KEY_A))).toBe(true);
  });

  describe('refuses a hostile cache', () => {
    const refused = (why: RegExp) => {
      expect(() => holdSharedEntry(cache.dir, KEY_A, RAM_BYTES)).toThrow(SnapshotError);
      expect(() => holdSharedEntry(cache.dir, KEY_A, RAM_BYTES)).toThrow(why);
    };

    it("another user's RAM file", () => {
      chownSync(join(publish(KEY_A), 'ram'), 1234, 1234);
      refused(/owned by uid 1234/);
    });

    it('a RAM file others may write', () => {
      chmodSync(join(publish(KEY_A), 'ram'), 0o666);
      refused(/writable by others/);
    });

    it("another user's state.json", () => {
      chownSync(join(publish(KEY_A), 'state.json'), 1234, 1234);
      refused(/state\.json: owned by uid 1234/);
    });

    it('an entry directory its group may write', () => {
      chmodSync(publish(KEY_A), 0o770);
      refused(/writable by its group/);
    });

    it('a symbolic link in place of the RAM file', () => {
      const dir = publish(KEY_A);
      const elsewhere = join(base, 'elsewhere');
      writeFileSync(elsewhere, Buffer.alloc(RAM_BYTES), { mode: 0o400 });
      unlinkSync(join(dir, 'ram'));
      symlinkSync(elsewhere, join(dir, 'ram'));
      refused(/symbolic link/);
    });

    it('a symbolic link in place of the entry', () => {
      const real = join(base, 'real');
      mkdirSync(real, { mode: 0o700 });
      symlinkSync(real, join(cache.dir, SHARED_SNAPSHOTS_DIR, KEY_A));
      refused(/symbolic link/);
    });

    it('a truncated RAM file', () => {
      truncateSync(join(publish(KEY_A), 'ram'), RAM_BYTES / 2);
      refused(/truncated or grown/);
    });

    it("a cache whose snapshots/ is another user's, or a symbolic link", () => {
      chownSync(join(cache.dir, SHARED_SNAPSHOTS_DIR), 1234, 1234);
      expect(() => checkSharedDirs(cache.dir)).toThrow(/owned by uid 1234/);
      rmSync(join(cache.dir, SHARED_SNAPSHOTS_DIR), { recursive: true });
      mkdirSync(join(base, 'other'), { mode: 0o700 });
      symlinkSync(join(base, 'other'), join(cache.dir, SHARED_SNAPSHOTS_DIR));
      expect(() => checkSharedDirs(cache.dir)).toThrow(/symbolic link/);
    });
  });
});
