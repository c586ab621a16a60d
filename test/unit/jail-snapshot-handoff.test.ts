// A jailed VM's snapshot handed back (src/jail/snapshot-handoff.ts), on real files: the launcher
// copies what the jailed VMM staged into files of its own, and refuses a staging directory that is
// not a snapshot's (a symlink to a host file, a FIFO, an extra name, a file too large, another
// uid's directory), leaving nothing behind.
import { execFileSync } from 'node:child_process';
import { chownSync, closeSync, existsSync, ftruncateSync, lstatSync, mkdirSync, mkdtempSync, openSync, readdirSync, readFileSync, renameSync, rmSync, statSync, symlinkSync, writeFileSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { SnapshotError } from '../../src/errors';
import { handOffSnapshot, prepareTarget, takeSnapshot } from '../../src/jail/snapshot-handoff';

const MiB = 1024 * 1024;
const uid = process.getuid!();

describe('a jailed snapshot handed back', () => {
  let work: string;
  let staging: string;
  let target: string;
  beforeEach(() => {
    work = mkdtempSync(join(tmpdir(), 'pvisor-handoff-'));
    staging = join(work, 'backing', 'snapshot-1');
    target = join(work, 'out', 'snap');
    mkdirSync(staging, { recursive: true });
    writeFileSync(join(staging, 'manifest.json'), '{"format":"pvisor-snapshot"}');
    writeFileSync(join(staging, 'state.json'), '{"version":1}');
    // 4 MiB of guest RAM with data only in its second MiB: a sparse file.
    const fd = openSync(join(staging, 'ram'), 'w');
    ftruncateSync(fd, 4 * MiB);
    writeSync(fd, Buffer.alloc(MiB, 7), 0, MiB, MiB);
    closeSync(fd);
  });
  /** The VMM's part: what was staged above goes where handOffSnapshot asked (if anything was staged). */
  const stageInto = async (given: string) => {
    let there = true;
    try {
      lstatSync(staging);
    } catch {
      there = false;
    }
    if (there) renameSync(staging, given);
    staging = given;
    return { written: true, value: 'answer' };
  };
  afterEach(() => rmSync(work, { recursive: true, force: true }));

  it('copies the three files into new files of its own, 0444, zero blocks left as holes, and removes the staging directory', async () => {
    expect(prepareTarget(target)).toBe(true);
    await takeSnapshot(staging, target, uid, 4 * MiB);
    expect(existsSync(staging)).toBe(false);
    expect(readdirSync(target).sort()).toEqual(['manifest.json', 'ram', 'state.json']);
    expect(readFileSync(join(target, 'state.json'), 'utf8')).toBe('{"version":1}');
    const ram = readFileSync(join(target, 'ram'));
    expect(ram.length).toBe(4 * MiB);
    expect(ram.subarray(MiB, 2 * MiB).every((b) => b === 7)).toBe(true);
    expect(ram.subarray(0, MiB).every((b) => b === 0) && ram.subarray(2 * MiB).every((b) => b === 0)).toBe(true);
    const st = statSync(join(target, 'ram'));
    expect(st.mode & 0o777).toBe(0o444);
    expect(st.uid).toBe(uid);
    // Only the data MiB takes room (the file system's blocks, with a little slack).
    expect(st.blocks * 512).toBeLessThan(2 * MiB);
  });

  it('refuses a target that is not empty, before the VMM is asked', async () => {
    mkdirSync(target, { recursive: true });
    writeFileSync(join(target, 'x'), '');
    const write = jest.fn();
    await expect(handOffSnapshot({ backingDir: join(work, 'backing'), uid }, 4 * MiB, target, write)).rejects.toThrow(/is not empty/);
    expect(write).not.toHaveBeenCalled();
  });

  /** A directory the staging directory's link points to, with a file that must survive. */
  const elsewhere = () => {
    mkdirSync(join(work, 'elsewhere'));
    writeFileSync(join(work, 'elsewhere', 'keep'), 'kept');
    return join(work, 'elsewhere');
  };
  const hostile: [string, () => void, RegExp][] = [
    ['a symlink to a host file', () => (rmSync(join(staging, 'state.json')), symlinkSync('/etc/passwd', join(staging, 'state.json'))), /state\.json: a symbolic link/],
    ['a FIFO (which would hang a read)', () => (rmSync(join(staging, 'ram')), execFileSync('mkfifo', [join(staging, 'ram')])), /ram: not a regular file/],
    ['a directory in place of a file', () => (rmSync(join(staging, 'manifest.json')), mkdirSync(join(staging, 'manifest.json'))), /manifest\.json: not a regular file/],
    ['an extra file', () => writeFileSync(join(staging, 'extra'), ''), /expected exactly manifest\.json, ram, state\.json, found .*"extra"/],
    ['a missing file', () => rmSync(join(staging, 'state.json')), /expected exactly/],
    ['a RAM file larger than the VM', () => execFileSync('truncate', ['-s', String(4 * MiB + 4096), join(staging, 'ram')]), /ram: 4198400 bytes, more than the 4194304/],
    ['a state past what a restore reads', () => execFileSync('truncate', ['-s', String(5 * MiB), join(staging, 'state.json')]), /state\.json: 5242880 bytes, more than/],
    ['no staging directory at all', () => rmSync(staging, { recursive: true }), /wrote no snapshot directory/],
    ['the staging directory a symlink', () => (rmSync(staging, { recursive: true }), symlinkSync(elsewhere(), staging)), /not a directory of the jail's uid/],
  ];
  for (const [what, make, message] of hostile) {
    it(`refuses ${what}, leaving neither a copy nor the staging directory`, async () => {
      make();
      const p = handOffSnapshot({ backingDir: join(work, 'backing'), uid }, 4 * MiB, target, stageInto);
      await expect(p).rejects.toThrow(SnapshotError);
      await expect(p).rejects.toThrow(message);
      expect(existsSync(target)).toBe(false);
      expect(existsSync(staging)).toBe(false);
      // What a link pointed to is untouched.
      expect(readFileSync('/etc/passwd').length).toBeGreaterThan(0);
      if (existsSync(join(work, 'elsewhere'))) expect(readFileSync(join(work, 'elsewhere', 'keep'), 'utf8')).toBe('kept');
    });
  }

  (uid === 0 ? it : it.skip)("refuses a staging directory that is not the jail uid's", async () => {
    chownSync(staging, 65534, 65534);
    prepareTarget(target);
    await expect(takeSnapshot(staging, target, 65533, 4 * MiB)).rejects.toThrow(/not a directory of the jail's uid 65533/);
    expect(readdirSync(target)).toEqual([]);
  });

  it('leaves nothing when the VMM refused to write (its answer passed on as it is)', async () => {
    const answer = await handOffSnapshot({ backingDir: join(work, 'backing'), uid }, 4 * MiB, target, async () => ({ written: false, value: 'refused' }));
    expect(answer).toBe('refused');
    expect(existsSync(target)).toBe(false);
  });
});
