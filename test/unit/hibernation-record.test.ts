// The record a hibernated VM of the CLI leaves beside its control socket, and the directory it
// names: real files in a temporary directory. What another user planted, or what was edited into
// something else, is refused before anything is read from it. No KVM needed.
import { chmodSync, chownSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { execFileSync } from 'node:child_process';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import {
  checkHibernatedDir,
  discardHibernated,
  hibernatedIds,
  hibernationDirFor,
  logPathFor,
  MAX_RECORD_BYTES,
  readHibernationRecord,
  recordPathFor,
  writeHibernationRecord,
  type HibernationRecord,
} from '../../src/snapshot/hibernation-record';
import { SnapshotError } from '../../src/errors';

const asRoot = process.getuid?.() === 0;
const itAsRoot = asRoot ? it : it.skip;

describe('hibernation records', () => {
  let base: string;
  let state: string;
  let record: HibernationRecord;
  const path = () => join(base, 'T1.hibernated');
  beforeEach(() => {
    base = mkdtempSync(join(tmpdir(), 'pvisor-record-test-'));
    state = join(base, 'pvisor-hibernated-T1-0011aabb');
    mkdirSync(state, { mode: 0o700 });
    record = {
      format: 'pvisor-hibernated',
      version: 1,
      id: 'T1',
      dir: state,
      hibernatedAt: new Date().toISOString(),
      guest: 'probe',
      memoryBytes: 64 * 2 ** 20,
      vcpus: 1,
      bytesOnDisk: 16 * 2 ** 20,
      flags: ['--vm-idle-release', '--vm-backing-dir=/var/tmp'],
      steps: 'wait',
    };
  });
  afterEach(() => rmSync(base, { recursive: true, force: true }));

  /** Writes `value` as the record, as a hand (or another program) might. */
  const plant = (value: unknown, mode = 0o600) => {
    writeFileSync(path(), typeof value === 'string' ? value : JSON.stringify(value), { mode });
    chmodSync(path(), mode);
  };

  it('sits beside the control socket, with the log; its directory has a fresh name under the backing directory', () => {
    expect(recordPathFor('/run/pvisor/T1.sock')).toBe('/run/pvisor/T1.hibernated');
    expect(logPathFor('/run/pvisor/T1.sock')).toBe('/run/pvisor/T1.log');
    expect(recordPathFor('/x/custom')).toBe('/x/custom.hibernated');
    expect(hibernationDirFor('/var/tmp', 'T1')).toMatch(/^\/var\/tmp\/pvisor-hibernated-T1-[0-9a-f]{8}$/);
    expect(hibernationDirFor('/var/tmp', 'T1')).not.toBe(hibernationDirFor('/var/tmp', 'T1'));
  });

  it('is written 0600, whole, and read back as it was; no record is undefined', () => {
    expect(readHibernationRecord(path(), 'T1')).toBeUndefined();
    writeHibernationRecord(path(), record);
    expect(statSync(path()).mode & 0o777).toBe(0o600);
    expect(readHibernationRecord(path(), 'T1')).toEqual(record);
    // A Linux guest's record carries CMD instead of steps.
    const linux: HibernationRecord = { ...record, guest: 'linux', steps: undefined, command: ['sh', '-c', 'sleep 1000'] };
    delete linux.steps;
    writeHibernationRecord(path(), linux);
    expect(readHibernationRecord(path(), 'T1')).toEqual(linux);
    expect(hibernatedIds(base)).toEqual(['T1']);
    expect(hibernatedIds(join(base, 'none'))).toEqual([]);
  });

  it('a record too long to carry is not written', () => {
    expect(() => writeHibernationRecord(path(), { ...record, steps: 'digest, '.repeat(MAX_RECORD_BYTES / 8) })).toThrow(/too long to carry/);
    expect(existsSync(path())).toBe(false);
  });

  itAsRoot('a record of another user is refused', () => {
    writeHibernationRecord(path(), record);
    chownSync(path(), 12345, 12345);
    expect(() => readHibernationRecord(path(), 'T1')).toThrow(/belongs to uid 12345, not to this user \(0\): refused as a hibernated VM's/);
  });

  it.each([['640', 0o640], ['604', 0o604], ['666', 0o666], ['700', 0o700]])('a record others may read or write, or executable (mode %s), is refused', (_, mode) => {
    writeHibernationRecord(path(), record);
    chmodSync(path(), mode);
    expect(() => readHibernationRecord(path(), 'T1')).toThrow(SnapshotError);
  });

  it('a symbolic link, a directory or a fifo in its place is refused, without waiting on the fifo', () => {
    const real = join(base, 'real');
    writeHibernationRecord(real, record);
    symlinkSync(real, path());
    expect(() => readHibernationRecord(path(), 'T1')).toThrow(/it is a symbolic link/);
    rmSync(path());
    mkdirSync(path(), { mode: 0o700 });
    expect(() => readHibernationRecord(path(), 'T1')).toThrow(SnapshotError);
    rmSync(path(), { recursive: true });
    execFileSync('mkfifo', ['-m', '600', path()]);
    expect(() => readHibernationRecord(path(), 'T1')).toThrow(/is not a regular file/);
  });

  it.each<[string, (r: Record<string, unknown>) => unknown]>([
    ['not JSON', () => '{"format":'],
    ['an array', () => [1]],
    ['another format', (r) => ({ ...r, format: 'pvisor-snapshot' })],
    ['another version', (r) => ({ ...r, version: 2 })],
    ['another id than its name', (r) => ({ ...r, id: 'T2' })],
    ['a relative directory', (r) => ({ ...r, dir: 'var/tmp/x' })],
    ['a directory with ..', (r) => ({ ...r, dir: '/var/tmp/../etc' })],
    ['the root as its directory', (r) => ({ ...r, dir: '/' })],
    ['a NUL in the directory', (r) => ({ ...r, dir: '/var/tmp/a\0b' })],
    ['no date', (r) => ({ ...r, hibernatedAt: 'yesterday' })],
    ['another guest', (r) => ({ ...r, guest: 'windows' })],
    ['99 vCPUs', (r) => ({ ...r, vcpus: 99 })],
    ['a fractional memory size', (r) => ({ ...r, memoryBytes: 1.5 })],
    ['negative bytes on disk', (r) => ({ ...r, bytesOnDisk: -1 })],
    ['flags that are not strings', (r) => ({ ...r, flags: [1] })],
    ['a probe guest without steps', (r) => ({ ...r, steps: undefined })],
    ['a Linux guest without a command', (r) => ({ ...r, guest: 'linux', command: 'sh' })],
  ])('a record with %s is refused', (_, edit) => {
    plant(edit({ ...record }));
    expect(() => readHibernationRecord(path(), 'T1')).toThrow(SnapshotError);
  });

  it('a record larger than a record can be is refused before it is parsed', () => {
    plant(`{"format":"pvisor-hibernated","pad":"${'x'.repeat(MAX_RECORD_BYTES)}"}`);
    expect(() => readHibernationRecord(path(), 'T1')).toThrow(/more than a hibernation record's 65536/);
  });

  it('its directory must be a directory of this user that nobody else may enter', () => {
    expect(checkHibernatedDir(state)).toBe('ok');
    expect(checkHibernatedDir(join(base, 'gone'))).toBe('missing');
    chmodSync(state, 0o755);
    expect(() => checkHibernatedDir(state)).toThrow(/has mode 755, more open than 700/);
    chmodSync(state, 0o700);
    const link = join(base, 'link');
    symlinkSync(state, link);
    expect(() => checkHibernatedDir(link)).toThrow(/is not a directory/);
    if (asRoot) {
      chownSync(state, 12345, 12345);
      expect(() => checkHibernatedDir(state)).toThrow(/belongs to uid 12345/);
      chownSync(state, 0, 0);
    }
  });

  it('discarding removes the directory, then the record; a record whose directory is gone goes too', () => {
    writeFileSync(join(state, 'ram'), 'x', { mode: 0o400 });
    writeHibernationRecord(path(), record);
    discardHibernated(path(), record);
    expect(existsSync(state)).toBe(false);
    expect(existsSync(path())).toBe(false);
    writeHibernationRecord(path(), record);
    discardHibernated(path(), record);
    expect(existsSync(path())).toBe(false);
  });

  itAsRoot('discarding refuses a directory of another user, and leaves it and the record', () => {
    writeHibernationRecord(path(), record);
    chownSync(state, 12345, 12345);
    expect(() => discardHibernated(path(), record)).toThrow(/belongs to uid 12345/);
    expect(existsSync(state)).toBe(true);
    expect(JSON.parse(readFileSync(path(), 'utf8')).id).toBe('T1');
  });
});
