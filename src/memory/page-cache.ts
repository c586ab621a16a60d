/**
 * A backing file's pages sit in the page cache after it is written, and the kernel charges them
 * to the VM's cgroup: its group memory would read as if nothing had been offloaded. Written back
 * in the background, its clean pages can be dropped.
 */
import { closeSync, constants, fdatasync, openSync } from 'node:fs';
import { dropFileCache } from '../sys/libc';

/**
 * Writes `path` back to disk in the background (on the libuv pool, where file I/O belongs) and
 * then asks the kernel to drop its cached pages. Best effort: a file already gone is fine.
 */
export function releaseFileCache(path: string): void {
  let fd: number;
  try {
    fd = openSync(path, constants.O_RDONLY);
  } catch {
    return;
  }
  fdatasync(fd, (err) => {
    if (!err) dropFileCache(fd);
    closeSync(fd);
  });
}
