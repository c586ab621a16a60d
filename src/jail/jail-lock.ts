/**
 * Which launcher holds a jail id: `<run dir>/ID.lock`, flock'ed exclusively for the launcher's
 * life. The kernel drops the lock when the process ends, however it ends, so a jail whose
 * directory or cgroup is still there while nobody holds its lock was left by a launcher that was
 * killed before it could take it down (SIGKILL, an OOM kill), and may be taken down by the next
 * launcher of that id rather than refuse it forever.
 * @module
 */
import { closeSync, fstatSync, ftruncateSync, mkdirSync, openSync, readFileSync, statSync, unlinkSync, writeSync } from 'node:fs';
import { join } from 'node:path';
import { JailUnavailableError } from '../errors';
import { tryLockFile } from '../sys/libc';

/** A held jail id: {@link release} lets it go. */
export class JailIdLock {
  private constructor(
    private readonly path: string,
    private fd: number | undefined,
  ) {}

  /**
   * Takes jail id `id` in `runDir` (made 0711 if missing). Throws a {@link JailUnavailableError}
   * naming the holder's pid if another live process holds it.
   */
  static take(runDir: string, id: string): JailIdLock {
    mkdirSync(runDir, { recursive: true, mode: 0o711 });
    const path = join(runDir, `${id}.lock`);
    // A holder that releases unlinks the file before it closes it: a lock taken on a file that is
    // no longer the one at the path is no lock, and is taken again on the new one.
    for (let attempt = 0; attempt < 16; attempt++) {
      const fd = openSync(path, 'a+', 0o600);
      let kept = false;
      try {
        if (!tryLockFile(fd, true)) {
          const holder = readFileSync(fd, 'utf8').trim().slice(0, 32);
          throw new JailUnavailableError(`another jailed run of ${id} is running${/^\d+$/.test(holder) ? ` (its launcher is pid ${holder})` : ''}: a jail id is one VM's on this host, whatever its runtime directory`);
        }
        if (statIno(path) !== fstatSync(fd).ino) continue;
        ftruncateSync(fd, 0);
        writeSync(fd, `${process.pid}\n`);
        kept = true;
        return new JailIdLock(path, fd);
      } finally {
        if (!kept) closeSync(fd);
      }
    }
    throw new JailUnavailableError(`cannot lock ${path}: it was replaced 16 times while it was being locked`);
  }

  /** Lets the id go: the file is removed first, so that nobody locks a file that is gone. Idempotent. */
  release(): void {
    if (this.fd === undefined) return;
    try {
      unlinkSync(this.path);
    } catch {
      // Gone already: nothing to unlink.
    }
    closeSync(this.fd);
    this.fd = undefined;
  }
}

function statIno(path: string): number | undefined {
  try {
    return statSync(path).ino;
  } catch {
    return undefined;
  }
}
