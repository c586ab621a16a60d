// A jailed VM's hibernation taken out of its jail (src/jail/hibernation-handoff.ts), on real
// files: the launcher copies the hibernated directory the jailed VMM names into a private one of
// its own, and refuses a directory outside the VMM's backing directory, a record that names
// another, or none, leaving nothing behind.
import { closeSync, ftruncateSync, mkdirSync, mkdtempSync, openSync, readdirSync, rmSync, statSync, writeFileSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { SnapshotError } from '../../src/errors';
import { jailedRecordPathFor, takeHibernation } from '../../src/jail/hibernation-handoff';
import { writeHibernationRecord, type HibernationRecord } from '../../src/snapshot/hibernation-record';

const MiB = 1024 * 1024;
const uid = process.getuid!();

describe('a jailed hibernation taken out of its jail', () => {
  let work: string;
  let backing: string;
  let host: string;
  let hibernated: string;
  const record = (dir: string): HibernationRecord => ({ format: 'pvisor-hibernated', version: 1, id: 'J1', dir, hibernatedAt: new Date().toISOString(), guest: 'probe', memoryBytes: 4 * MiB, vcpus: 1, bytesOnDisk: MiB, flags: ['--vm-offload'], steps: 'wait' });
  beforeEach(() => {
    work = mkdtempSync(join(tmpdir(), 'pvisor-hib-handoff-'));
    backing = join(work, 'pvisor-jail-J1');
    host = join(work, 'host');
    mkdirSync(host);
    hibernated = join(backing, 'pvisor-hibernated-J1-0011aabb');
    mkdirSync(hibernated, { recursive: true });
    writeFileSync(join(hibernated, 'manifest.json'), '{"format":"pvisor-snapshot"}');
    writeFileSync(join(hibernated, 'state.json'), '{"version":1}');
    const fd = openSync(join(hibernated, 'ram'), 'w');
    ftruncateSync(fd, 4 * MiB);
    writeSync(fd, Buffer.alloc(MiB, 9), 0, MiB, MiB);
    closeSync(fd);
  });
  afterEach(() => rmSync(work, { recursive: true, force: true }));

  it('copies it into a private directory of its own (0700, files 0400) and returns the VMM\'s record', async () => {
    writeHibernationRecord(jailedRecordPathFor(backing, 'J1'), record(hibernated));
    const got = await takeHibernation({ backingDir: backing, uid }, 'J1', 4 * MiB, hibernated, host);
    expect(got.record).toMatchObject({ id: 'J1', dir: hibernated, steps: 'wait' });
    expect(got.dir.startsWith(join(host, 'pvisor-hibernated-J1-'))).toBe(true);
    expect(statSync(got.dir).mode & 0o777).toBe(0o700);
    expect(readdirSync(got.dir).sort()).toEqual(['manifest.json', 'ram', 'state.json']);
    for (const f of readdirSync(got.dir)) expect(statSync(join(got.dir, f)).mode & 0o777).toBe(0o400);
    expect(readdirSync(backing).filter((f) => f.startsWith('pvisor-hibernated-'))).toEqual([]);
  });

  it('refuses a directory outside its backing directory, a record naming another, and no record, leaving nothing in the host directory', async () => {
    writeHibernationRecord(jailedRecordPathFor(backing, 'J1'), record(hibernated));
    for (const named of [join(work, 'pvisor-hibernated-J1-0011aabb'), join(backing, '..', 'host'), join(backing, 'snapshot-1')]) {
      await expect(takeHibernation({ backingDir: backing, uid }, 'J1', 4 * MiB, named, host)).rejects.toThrow(SnapshotError);
    }
    writeHibernationRecord(jailedRecordPathFor(backing, 'J1'), record(join(backing, 'pvisor-hibernated-J1-ffffffff')));
    await expect(takeHibernation({ backingDir: backing, uid }, 'J1', 4 * MiB, hibernated, host)).rejects.toThrow(/record names .*, its answer/);
    rmSync(jailedRecordPathFor(backing, 'J1'));
    await expect(takeHibernation({ backingDir: backing, uid }, 'J1', 4 * MiB, hibernated, host)).rejects.toThrow(/wrote no hibernation record/);
    // A record of another uid's (the jail's is not this one): refused as the jail's.
    writeHibernationRecord(jailedRecordPathFor(backing, 'J1'), record(hibernated));
    await expect(takeHibernation({ backingDir: backing, uid: uid + 1 }, 'J1', 4 * MiB, hibernated, host)).rejects.toThrow(SnapshotError);
    expect(readdirSync(host)).toEqual([]);
  });
});
