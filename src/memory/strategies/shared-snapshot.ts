/**
 * SharedSnapshot: a VM restored from a snapshot maps the snapshot's RAM file MAP_PRIVATE as its
 * guest RAM instead of reading it into private memory. Every clone of one snapshot, in this
 * process or another, then reads the same page-cache pages, and a page the clone writes becomes
 * its own private copy: a clone costs the host what it wrote, plus its share of what it read.
 *
 * It only chooses guest RAM's backing; the rest is the memory layer's: IdleRelease gives a freed
 * page back to the file's shared page, KsmAdvice may merge the clones' private copies, and Offload
 * writes only a clone's own pages (a private file mapping's unwritten pages are the file's).
 */
import { fstatSync } from 'node:fs';
import { InvalidOptionError, SnapshotError } from '../../errors';
import { tryLockFile } from '../../sys/libc';
import { booleanOption } from '../../units';
import { roundMs, type MemoryStrategy, type PageRun, type RamBackingRequest, type StrategyContext, type StrategyStats } from '../strategy';

/** Holes of the RAM file mapped anonymous at most: each mapping may split guest RAM's VMA in three. */
const MAX_HOLE_MAPPINGS = 4096;

/**
 * Options of {@link SharedSnapshot}.
 * @category Strategies
 */
export interface SharedSnapshotOptions {
  /**
   * Check every RAM chunk against the snapshot's manifest even if this process has already checked
   * the same, unchanged file for an earlier clone. Default false: the first clone of a snapshot in
   * a process checks the file in full (reading only its data, not its holes), later ones reuse
   * that check while the file's device, inode, size and times are unchanged.
   */
  verify?: boolean;
}

/**
 * Guest RAM of a restored VM shared copy-on-write with every other clone of its snapshot. Give a
 * new one to each {@link Vm.restore}: `Vm.restore(dir, { strategies: [new SharedSnapshot()] })`.
 *
 * The snapshot's RAM file must stay as it is while clones run, so it must be owned by this
 * process's effective user or by root, and writable by neither its group nor others: anyone else
 * who could write it could change or truncate it under the clones. {@link Vm.restore} refuses
 * another file with a {@link SnapshotError} before anything is built. Deleting the directory
 * harms no clone (the file lives on while mapped). A file truncated under a running clone anyway
 * (by its owner, or root) ends that clone with a {@link SnapshotError}, never the process or
 * another VM (docs/snapshots.md says how).
 * @category Strategies
 */
export class SharedSnapshot implements MemoryStrategy {
  readonly name = 'shared-snapshot';
  readonly needs = [] as const;
  readonly exclusive = [] as const;
  /** Whether to check the RAM file even when this process has checked it before. */
  readonly verifyAgain: boolean;
  private ramPath: string | undefined;
  /** The reader's descriptor of the RAM file, which the memory layer duplicates to map it. */
  private ramFd: number | undefined;
  private check: { checkedBefore: boolean; chunksRead: number; ms: number } | undefined;
  private holes: PageRun[] = [];
  private holesMapped = 0;

  constructor(options: SharedSnapshotOptions = {}) {
    this.verifyAgain = booleanOption('verify', options.verify, false);
  }

  /** The snapshot's RAM file mapped privately, once {@link Vm.restore} has given it one. */
  get ramBacking(): RamBackingRequest | undefined {
    return this.ramPath === undefined ? undefined : { kind: 'private-file', path: this.ramPath, fd: this.ramFd };
  }

  /**
   * @internal Binds this strategy to the RAM file of the snapshot being restored, open as `fd`
   * (by {@link Vm.restore}, before the composition is planned), after checking who may change it
   * (see {@link checkSharedRamFile}). One strategy serves one VM.
   *
   * It also takes a shared flock on `fd`, if it can: guest RAM maps a duplicate of `fd`, which
   * shares the lock, so the lock lasts as long as the mapping. A chunk cache's shared snapshot
   * (src/store/shared-entry.ts) is not evicted while any process holds one; a local snapshot's
   * RAM file is locked by nobody else, and losing the lock there harms nothing.
   */
  useRamFile(path: string, fd: number): void {
    if (this.ramPath !== undefined) throw new InvalidOptionError('strategies', 'this SharedSnapshot already serves a VM: give each Vm.restore a new one');
    checkSharedRamFile(fd, path);
    tryLockFile(fd, false);
    this.ramPath = path;
    this.ramFd = fd;
  }

  /** @internal What the check of the RAM file found: for {@link stats}, and its holes for {@link map}. */
  noteCheck(check: { checkedBefore: boolean; chunksRead: number; ms: number; holes: PageRun[] }): void {
    this.check = check;
    this.holes = check.holes;
  }

  /**
   * Maps anonymous memory over the RAM file's holes (the largest first, up to a budget of
   * mappings): they read zero either way, but a write into a hole of the file would first read a
   * zero page into the page cache and then copy it, so a clone would pay twice for what it writes
   * there.
   */
  map(ctx: StrategyContext): void {
    const holes = [...this.holes].sort((a, b) => b.length - a.length).slice(0, MAX_HOLE_MAPPINGS);
    ctx.ram.discardHostRuns(holes, 'zero');
    this.holesMapped = holes.reduce((n, h) => n + h.length, 0);
    this.holes = [];
  }

  stats(): StrategyStats {
    const notes: string[] = [];
    if (this.check?.checkedBefore) notes.push('the RAM file was checked in full for an earlier clone in this process and is unchanged since');
    return {
      strategy: this.name,
      figures: { ramChunksChecked: this.check?.chunksRead ?? 0, ramCheckMs: roundMs(this.check?.ms ?? 0), holeBytesAnonymous: this.holesMapped },
      notes,
    };
  }
}

/**
 * Refuses a RAM file, open as `fd`, that someone other than this process's effective user (or
 * root) could change while clones map it: one owned by another user (who can make it writable
 * and truncate it), or writable by its group or by others. A {@link SnapshotError}.
 */
export function checkSharedRamFile(fd: number, path: string): void {
  const st = fstatSync(fd);
  const euid = process.geteuid?.() ?? st.uid;
  if (st.uid !== euid && st.uid !== 0) {
    throw new SnapshotError(`${path}: owned by uid ${st.uid}, not by this process's user (${euid}) or root: its owner could truncate it under every clone that maps it; copy the snapshot, or restore it without SharedSnapshot`);
  }
  if ((st.mode & 0o022) !== 0) {
    throw new SnapshotError(`${path}: mode ${(st.mode & 0o777).toString(8)}, writable by ${st.mode & 0o002 ? 'others' : 'its group'}: they could change or truncate it under every clone that maps it; make it read-only (0444, as Vm.snapshot leaves it)`);
  }
}
