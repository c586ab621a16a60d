// Backing files: named, created and removed so that none outlives its VM. Real files, no KVM.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { backingFilePath, createBackingFile, removeBackingFile } from '../../src/memory/backing-file';

describe('backing files', () => {
  let dir: string;
  beforeEach(() => (dir = mkdtempSync(join(tmpdir(), 'pvisor-backing-'))));
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  it('a new one removes those a dead process left in the directory, and only those', () => {
    // A pid that cannot be alive (above pid_max), one that is (ours), and a file not pvisor's.
    const dead = join(dir, 'pvisor-vm-1-99999999-0123abcd.ram');
    const alive = join(dir, `pvisor-vm-2-${process.pid}-0123abcd.zframes`);
    const other = join(dir, 'pvisor-notes.txt');
    for (const p of [dead, alive, other]) writeFileSync(p, 'x');
    const path = backingFilePath(dir, 'vm-3', 'ram');
    createBackingFile(path);
    expect(existsSync(dead)).toBe(false);
    expect(existsSync(alive)).toBe(true);
    expect(existsSync(other)).toBe(true);
    expect(existsSync(path)).toBe(true);
  });

  it('removal frees the path at once, and a process that exits right after leaves no file', () => {
    const script = `
      const { writeFileSync } = require('node:fs');
      const { removeBackingFile, backingFilePath } = require(${JSON.stringify(require.resolve('../../src/memory/backing-file'))});
      const path = backingFilePath(${JSON.stringify(dir)}, 'vm', 'ram');
      writeFileSync(path, Buffer.alloc(32 * 1024 * 1024, 1));
      removeBackingFile(path);
      if (require('node:fs').existsSync(path)) process.exit(3);
      process.exit(0); // before libuv's unlink can run`;
    const r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8' });
    expect(r.status).toBe(0);
    expect(readdirSync(dir)).toEqual([]);
  });

  it('removing a file that is already gone is fine', () => {
    expect(() => removeBackingFile(join(dir, 'pvisor-vm-1-1-00000000.ram'))).not.toThrow();
  });
});
