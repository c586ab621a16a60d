/**
 * A host-local, content-addressed cache of chunks fetched from an object store: one file per
 * chunk, named by its SHA-256, so that restores of a template and of its children, in any process
 * that uses the same directory, fetch each chunk once. Its size is bounded: past the bound, the
 * chunks used least recently (by modification time, which a use sets) are removed, except those
 * a restore of this process is using. Entries are written to a temporary name and renamed once
 * whole and checked, and checked again when read (a damaged entry is removed and fetched again):
 * the cache's files are not trusted more than the store's.
 */
import { createHash, randomBytes } from 'node:crypto';
import { mkdirSync, readdirSync, renameSync, rmSync, statSync, utimesSync, writeFileSync } from 'node:fs';
import { homedir } from 'node:os';
import { join } from 'node:path';
import { SnapshotError } from '../errors';
import { closeSnapshotFiles, openSnapshotFile, readSnapshotFile } from '../snapshot/snapshot-file';
import { pageHashesOf, pagesIn, PAGE_HASH_BYTES } from './chunk-delta';
import { listSharedEntries, removeSharedEntry } from './shared-entry';

/** The default bound of a chunk cache: 4 GiB. */
export const DEFAULT_CACHE_MAX_BYTES = 4 * 1024 * 1024 * 1024;

/** `$PVISOR_CHUNK_CACHE`, else `$XDG_CACHE_HOME/pvisor/chunks`, else `~/.cache/pvisor/chunks`. */
export function defaultCacheDir(env: NodeJS.ProcessEnv = process.env): string {
  if (env.PVISOR_CHUNK_CACHE) return env.PVISOR_CHUNK_CACHE;
  return join(env.XDG_CACHE_HOME || join(homedir(), '.cache'), 'pvisor', 'chunks');
}

const SHA256_HEX = /^[0-9a-f]{64}$/;

/** What {@link ChunkCache.evict} removed. */
export interface Eviction {
  chunksRemoved: number;
  /** Shared snapshots (shared-entry.ts) removed: none that a clone maps. */
  sharedSnapshotsRemoved: number;
  bytesRemoved: number;
  /** Bytes the cache holds afterwards. */
  bytesKept: number;
}

/**
 * A chunk cache directory: `chunks/<sha256>`, `pages/<sha256>` for a chunk's page hashes (what a
 * child snapshot's page deltas are found by: chunk-delta.ts), `tmp/` for entries being written,
 * `work/` for snapshots being sent or assembled, `snapshots/<key>/` for snapshots that
 * SharedSnapshot clones map (shared-entry.ts).
 */
export class ChunkCache {
  private readonly pins = new Map<string, number>();

  private constructor(readonly dir: string, readonly maxBytes: number) {}

  /** Opens (creating, 0700) the cache in `dir`, bounded to `maxBytes`. */
  static open(dir: string, maxBytes: number = DEFAULT_CACHE_MAX_BYTES): ChunkCache {
    for (const sub of ['', 'chunks', 'pages', 'tmp', 'work']) mkdirSync(join(dir, sub), { recursive: true, mode: 0o700 });
    return new ChunkCache(dir, maxBytes);
  }

  /** A new, empty directory to write or assemble a snapshot in; the caller removes it. */
  newWorkDir(): string {
    const dir = this.newWorkPath();
    mkdirSync(dir, { mode: 0o700 });
    return dir;
  }

  /** A new name in `work/`, not made: eviction renames a shared snapshot there to remove it. */
  private newWorkPath(): string {
    return join(this.dir, 'work', `${process.pid}-${randomBytes(6).toString('hex')}`);
  }

  /**
   * The chunk `sha256` of `sizeBytes`, if the cache has it whole and with that hash; its use
   * makes it the most recently used. A damaged entry is removed. `into`: read into this buffer if
   * it is large enough (the result is then a view of it, valid until the caller reuses it).
   */
  read(sha256: string, sizeBytes: number, into?: Buffer): Buffer | undefined {
    const path = this.pathOf(sha256);
    let file;
    try {
      file = openSnapshotFile(path);
    } catch {
      return undefined;
    }
    try {
      // Of another size: whoever asks is wrong about it (a manifest is hostile), or the entry is;
      // either way it is not this chunk, and a good entry is not removed for a bad question.
      if (file.sizeBytes !== sizeBytes) return undefined;
      const bytes = readSnapshotFile(file, sizeBytes, 'the chunk has', into);
      if (sha256Hex(bytes) === sha256) {
        const now = new Date();
        utimesSync(path, now, now);
        return bytes;
      }
    } catch (e) {
      if (!(e instanceof SnapshotError)) throw e;
    } finally {
      closeSnapshotFiles(file);
    }
    rmSync(path, { force: true });
    return undefined;
  }

  /** Adds `bytes`, whose SHA-256 the caller has checked to be `sha256`. */
  write(sha256: string, bytes: Buffer): void {
    const tmp = join(this.dir, 'tmp', `${sha256}.${process.pid}.${randomBytes(4).toString('hex')}`);
    writeFileSync(tmp, bytes, { mode: 0o400, flag: 'wx' });
    renameSync(tmp, this.pathOf(sha256));
  }

  /**
   * The page hashes (chunk-delta.ts) of chunk `sha256` of `sizeBytes`: kept in `pages/`, else
   * computed from the chunk if the cache holds it (and kept); undefined if neither. A kept file
   * carries a SHA-256 of the name and hashes, so a damaged one is removed, not used: a wrong
   * hash would leave a changed page out of a delta, which the restore would then refuse.
   */
  pageHashes(sha256: string, sizeBytes: number): Buffer | undefined {
    const path = this.pagesPathOf(sha256);
    const want = pagesIn(sizeBytes) * PAGE_HASH_BYTES;
    let file;
    try {
      file = openSnapshotFile(path);
    } catch {
      file = undefined;
    }
    if (file) {
      try {
        if (file.sizeBytes === want + 32) {
          const bytes = readSnapshotFile(file, want + 32, 'page hashes have');
          const hashes = bytes.subarray(0, want);
          if (pageHashesSeal(sha256, hashes).equals(bytes.subarray(want))) return hashes;
        }
      } catch (e) {
        if (!(e instanceof SnapshotError)) throw e;
      } finally {
        closeSnapshotFiles(file);
      }
      rmSync(path, { force: true });
    }
    const chunk = this.read(sha256, sizeBytes);
    if (!chunk) return undefined;
    const hashes = pageHashesOf(chunk);
    this.writePageHashes(sha256, hashes);
    return hashes;
  }

  /** Whether `pages/` holds page hashes of `sha256` (not checked). */
  hasPageHashes(sha256: string): boolean {
    try {
      statSync(this.pagesPathOf(sha256));
      return true;
    } catch {
      return false;
    }
  }

  /** Keeps `hashes`, the page hashes of chunk `sha256` computed from bytes the caller has checked. */
  writePageHashes(sha256: string, hashes: Buffer): void {
    const tmp = join(this.dir, 'tmp', `${sha256}.pages.${process.pid}.${randomBytes(4).toString('hex')}`);
    writeFileSync(tmp, Buffer.concat([hashes, pageHashesSeal(sha256, hashes)]), { mode: 0o400, flag: 'wx' });
    renameSync(tmp, this.pagesPathOf(sha256));
  }

  /** Keeps `sha256` from eviction by this process until as many {@link unpin}s. */
  pin(sha256: string): void {
    this.pins.set(sha256, (this.pins.get(sha256) ?? 0) + 1);
  }

  unpin(sha256: string): void {
    const n = (this.pins.get(sha256) ?? 0) - 1;
    if (n > 0) this.pins.set(sha256, n);
    else this.pins.delete(sha256);
  }

  /**
   * Removes the least recently used unpinned chunks until the cache holds at most
   * {@link maxBytes}, and any temporary entry or work directory left by a process that is gone.
   */
  evict(): Eviction {
    this.removeStaleTemporaries();
    // Chunks, their page hashes, and shared snapshots (shared-entry.ts) by the bytes they take on disk: one bound for all.
    const entries: { sizeBytes: number; usedMs: number; kind: 'chunks' | 'pages' | 'shared'; remove(): boolean }[] = [];
    let total = 0;
    for (const sub of ['chunks', 'pages'] as const) {
      for (const name of readdirSync(join(this.dir, sub))) {
        if (!SHA256_HEX.test(name)) continue;
        const path = join(this.dir, sub, name);
        try {
          const st = statSync(path);
          const remove = () => !this.pins.has(name) && (rmSync(path, { force: true }), true);
          entries.push({ sizeBytes: st.size, usedMs: st.mtimeMs, kind: sub, remove });
          total += st.size;
        } catch {
          // Removed meanwhile by another process sharing the cache.
        }
      }
    }
    for (const e of listSharedEntries(this.dir)) {
      // Kept while a clone in any process maps it (its flock).
      entries.push({ sizeBytes: e.sizeBytes, usedMs: e.usedMs, kind: 'shared', remove: () => removeSharedEntry(this.dir, e.key, this.newWorkPath()) });
      total += e.sizeBytes;
    }
    const out: Eviction = { chunksRemoved: 0, sharedSnapshotsRemoved: 0, bytesRemoved: 0, bytesKept: total };
    if (total <= this.maxBytes) return out;
    entries.sort((a, b) => a.usedMs - b.usedMs);
    for (const e of entries) {
      if (out.bytesKept <= this.maxBytes) break;
      if (!e.remove()) continue;
      if (e.kind === 'shared') out.sharedSnapshotsRemoved++;
      else if (e.kind === 'chunks') out.chunksRemoved++;
      out.bytesRemoved += e.sizeBytes;
      out.bytesKept -= e.sizeBytes;
    }
    return out;
  }

  private pathOf(sha256: string, sub: 'chunks' | 'pages' = 'chunks'): string {
    if (!SHA256_HEX.test(sha256)) throw new SnapshotError(`not a SHA-256: ${sha256.slice(0, 80)}`);
    return join(this.dir, sub, sha256);
  }

  private pagesPathOf(sha256: string): string {
    return this.pathOf(sha256, 'pages');
  }

  private removeStaleTemporaries(): void {
    for (const name of readdirSync(join(this.dir, 'tmp'))) {
      const pid = Number(/\.(\d+)\.[0-9a-f]+$/.exec(name)?.[1]);
      if (pid && pid !== process.pid && !processAlive(pid)) rmSync(join(this.dir, 'tmp', name), { force: true });
    }
    for (const name of readdirSync(join(this.dir, 'work'))) {
      const pid = Number(/^(\d+)-[0-9a-f]+$/.exec(name)?.[1]);
      if (pid && pid !== process.pid && !processAlive(pid)) rmSync(join(this.dir, 'work', name), { recursive: true, force: true });
    }
  }
}

/** What a kept page-hash file ends with: the SHA-256 of the chunk's name and its page hashes. */
function pageHashesSeal(sha256: string, hashes: Buffer): Buffer {
  return createHash('sha256').update(sha256).update(hashes).digest();
}

/** SHA-256 of `bytes`, lower-case hex. */
export function sha256Hex(bytes: Uint8Array): string {
  return createHash('sha256').update(bytes).digest('hex');
}

function processAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'EPERM';
  }
}
