// The snapshot directory's state as SnapshotReader reads it back: the guest kind and a Linux
// guest's rootfs. Written by writeSnapshot over real guest memory (an anonymous mapping, no KVM);
// state.json is then rewritten with its manifest checksum fixed, so that each malformed value
// reaches the parser (a changed checksum alone is refused before it). No KVM.
import { chmodSync, mkdtempSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { SnapshotError } from '../../src';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { crc32c } from '../../src/memory/uffd-server';
import { hex32 } from '../../src/snapshot/ram-file';
import { SnapshotReader, writeSnapshot, type SnapshotState } from '../../src/snapshot/snapshot-dir';

describe('snapshot state: guest kind and rootfs', () => {
  let base: string;
  let mem: GuestMemory;
  let n = 0;
  beforeAll(() => {
    base = mkdtempSync(join(tmpdir(), 'pvisor-snapshot-dir-'));
    mem = GuestMemory.map(2 * 1024 * 1024);
  });
  afterAll(() => {
    mem.unmap();
    rmSync(base, { recursive: true, force: true });
  });

  const linux: SnapshotState = {
    version: 1,
    guest: 'linux',
    memoryBytes: 2 * 1024 * 1024,
    vcpus: 2,
    rootfs: { path: '/images/rootfs.img', readOnly: true },
    machine: {},
    devices: {},
    agent: {},
    guestClient: null,
  };

  /** A snapshot directory whose state.json is `state`, with the manifest's checksum of it right. */
  function snapshotWith(state: unknown): string {
    const dir = join(base, `s${++n}`);
    writeSnapshot(dir, mem, linux);
    const bytes = Buffer.from(JSON.stringify(state));
    const manifestPath = join(dir, 'manifest.json');
    const manifest = JSON.parse(readFileSync(manifestPath, 'utf8'));
    manifest.stateBytes = bytes.length;
    manifest.stateCrc32c = hex32(crc32c(bytes));
    for (const f of ['state.json', 'manifest.json']) chmodSync(join(dir, f), 0o644);
    writeFileSync(join(dir, 'state.json'), bytes);
    writeFileSync(manifestPath, JSON.stringify(manifest));
    return dir;
  }

  it('a Linux snapshot reads back with its read-only rootfs; one without a rootfs has none', () => {
    const dir = join(base, 'plain');
    writeSnapshot(dir, mem, linux);
    expect(SnapshotReader.open(dir).state).toMatchObject({ guest: 'linux', rootfs: { path: '/images/rootfs.img', readOnly: true } });
    const { rootfs: _, ...initramfs } = linux;
    expect(SnapshotReader.open(snapshotWith(initramfs)).state.rootfs).toBeUndefined();
  });

  it('a malformed guest kind or rootfs is a SnapshotError naming the field', () => {
    const cases: [unknown, RegExp][] = [
      [{ ...linux, guest: 'windows' }, /snapshot\.guest: expected one of probe, linux, got "windows"/],
      [{ ...linux, guest: 'probe' }, /snapshot\.rootfs: only the Linux guest has a root filesystem, the snapshot is of the probe guest/],
      [{ ...linux, rootfs: { path: '/images/rootfs.img', readOnly: false } }, /snapshot\.rootfs\.readOnly: a snapshot's rootfs is read-only/],
      [{ ...linux, rootfs: { path: '/images/rootfs.img' } }, /snapshot\.rootfs\.readOnly: expected true or false, got nothing/],
      [{ ...linux, rootfs: { path: '', readOnly: true } }, /snapshot\.rootfs\.path: expected a string of 1 to 4096 characters, got ""/],
      [{ ...linux, rootfs: { path: 'x'.repeat(4097), readOnly: true } }, /snapshot\.rootfs\.path: expected a string of 1 to 4096 characters, got a string of 4097/],
      [{ ...linux, rootfs: { path: 7, readOnly: true } }, /snapshot\.rootfs\.path: expected a string/],
      [{ ...linux, rootfs: '/images/rootfs.img' }, /snapshot\.rootfs: expected an object/],
      [{ ...linux, rootfs: null }, /snapshot\.rootfs: expected an object, got null/],
    ];
    for (const [state, message] of cases) {
      const dir = snapshotWith(state);
      expect(() => SnapshotReader.open(dir)).toThrow(SnapshotError);
      expect(() => SnapshotReader.open(dir)).toThrow(message);
    }
  });

  it("a hibernated VM's state says its name, checked as a VM name; its files may be 0400", () => {
    const dir = join(base, 'hibernated');
    writeSnapshot(dir, mem, { ...linux, hibernated: { name: 'job-7' } }, { fileMode: 0o400 });
    for (const f of ['ram', 'state.json', 'manifest.json']) expect(statSync(join(dir, f)).mode & 0o777).toBe(0o400);
    expect(SnapshotReader.open(dir).state.hibernated).toEqual({ name: 'job-7' });
    expect(SnapshotReader.open(snapshotWith(linux)).state.hibernated).toBeUndefined();
    const cases: [unknown, RegExp][] = [
      [{ ...linux, hibernated: { name: '../etc' } }, /snapshot\.hibernated\.name: "\.\.\/etc" is not a VM id/],
      [{ ...linux, hibernated: { name: '' } }, /snapshot\.hibernated\.name: expected a string/],
      [{ ...linux, hibernated: 'job-7' }, /snapshot\.hibernated: expected an object/],
    ];
    for (const [state, message] of cases) expect(() => SnapshotReader.open(snapshotWith(state))).toThrow(message);
  });
});
