/** Which filesystem holds a bench's files: a disk, or tmpfs, where "offloaded" pages stay in RAM. */
import { readFileSync } from 'node:fs';

/** The filesystem type holding `dir`, from /proc/mounts (longest mount point that contains it). */
export function filesystemOf(dir: string): string {
  let best = { point: '', type: 'unknown' };
  for (const line of readFileSync('/proc/mounts', 'utf8').split('\n')) {
    const [, point, type] = line.split(' ');
    if (point && (dir === point || dir.startsWith(point.endsWith('/') ? point : `${point}/`)) && point.length > best.point.length) best = { point, type };
  }
  return best.type;
}
