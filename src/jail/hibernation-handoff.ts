/**
 * A jailed VM's hibernation, handed back to its launcher. The jailed VMM hibernates into its own
 * backing directory (the only one it can write) and writes its record there; once it has ended,
 * the launcher copies the hibernated VM out into a directory of its own beside the run's other
 * hibernations, as a snapshot is copied out (./snapshot-handoff.ts: every file read as hostile
 * input, never through a link, bounded), and makes it private as a hibernation is (0700, files
 * 0400). The record is read as the jail uid's, checked whole. `pvisor resume` later moves the
 * directory into the new jail's backing directory (./launcher.ts, JailPlan.moveIn), where the
 * jailed restore consumes it.
 * @module
 */
import { chmodSync, readdirSync } from 'node:fs';
import { basename, dirname, join } from 'node:path';
import { SnapshotError } from '../errors';
import { syncDir } from '../snapshot/hibernation-dir';
import { hibernationDirFor, readHibernationRecord, recordPathFor, type HibernationRecord } from '../snapshot/hibernation-record';
import { discardTarget, prepareTarget, takeSnapshot, type SnapshotJail } from './snapshot-handoff';

/** Where a jailed VMM with backing directory `backingDir` writes VM `id`'s hibernation record (as if its socket were there). */
export function jailedRecordPathFor(backingDir: string, id: string): string {
  return recordPathFor(join(backingDir, `${id}.sock`));
}

/**
 * Takes VM `id`'s hibernation out of its ended jail: `jailedDir` is where the VMM said it went
 * (its word: checked to be a hibernation directory directly in its backing directory, and the one
 * its record names). Copies it into a new directory under `hostBackingDir`; resolves with that
 * directory and the VMM's record. Throws a {@link SnapshotError}, leaving nothing behind.
 */
export async function takeHibernation(jail: SnapshotJail, id: string, ramBytes: number, jailedDir: string, hostBackingDir: string): Promise<{ dir: string; record: HibernationRecord }> {
  if (dirname(jailedDir) !== jail.backingDir || !/^pvisor-hibernated-[A-Za-z0-9_.-]{1,80}$/.test(basename(jailedDir))) {
    throw new SnapshotError(`${id}: the jailed VMM said it hibernated into ${JSON.stringify(jailedDir)}, not a hibernation directory in its backing directory ${jail.backingDir}`);
  }
  const record = readHibernationRecord(jailedRecordPathFor(jail.backingDir, id), id, jail.uid);
  if (!record) throw new SnapshotError(`${id}: the jailed VMM wrote no hibernation record`);
  if (record.dir !== jailedDir) throw new SnapshotError(`${id}: the jailed VMM's record names ${record.dir}, its answer ${jailedDir}`);
  const dir = hibernationDirFor(hostBackingDir, id);
  const made = prepareTarget(dir);
  try {
    await takeSnapshot(jailedDir, dir, jail.uid, ramBytes);
    // As Vm.hibernate leaves it: the VM's only copy, private.
    for (const name of readdirSync(dir)) chmodSync(join(dir, name), 0o400);
    chmodSync(dir, 0o700);
    syncDir(dir);
  } catch (e) {
    discardTarget(dir, made);
    throw e;
  }
  return { dir, record };
}
