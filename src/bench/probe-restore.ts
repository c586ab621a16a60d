/**
 * What the restore benches (snapshot, fleet) time alike: a probe VM from its start or restore to
 * its first answered request, with the snapshot's RAM file out of the page cache before a
 * restore that reads it, so the read is the disk's and not memory's.
 */
import { closeSync, openSync } from 'node:fs';
import { dropFileCache } from '../sys/libc';
import type { Vm } from '../vm';

/** Time from `start` to its VM answering a first request, ms; the VM is returned running. */
export async function toReady(start: () => Promise<Vm>): Promise<{ vm: Vm; ms: number }> {
  const t0 = performance.now();
  const vm = await start();
  await vm.probe.exitStorm(1);
  return { vm, ms: performance.now() - t0 };
}

/** Drops `path`'s pages from the page cache. */
export function dropCache(path: string): void {
  const fd = openSync(path, 'r');
  try {
    dropFileCache(fd);
  } finally {
    closeSync(fd);
  }
}
