// A sparse file's data runs found in one native call, as a snapshot's RAM file is read at restore.
import { closeSync, ftruncateSync, mkdtempSync, openSync, rmSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileDataRuns } from '../../src/guest-ram/file-runs';

describe('fileDataRuns', () => {
  const dir = mkdtempSync(join(tmpdir(), 'pvisor-file-runs-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('finds every data run of a sparse file, and none past the size asked for', () => {
    const fd = openSync(join(dir, 'sparse'), 'w+');
    try {
      const MiB = 1 << 20;
      ftruncateSync(fd, 64 * MiB);
      // Many one-page runs, holes between them.
      const pages = [...Array(3000).keys()].map((i) => i * 4 + 1);
      for (const p of pages) writeSync(fd, Buffer.alloc(4096, 1), 0, 4096, p * 4096);
      writeSync(fd, Buffer.alloc(8192, 2), 0, 8192, 60 * MiB);
      const runs = fileDataRuns(fd, 64 * MiB);
      // A file system may round a run out to its blocks; tmpfs and ext4 here keep 4 KiB.
      expect(runs.length).toBe(pages.length + 1);
      expect(runs[0]).toEqual([4096, 8192]);
      expect(runs[pages.length]).toEqual([60 * MiB, 60 * MiB + 8192]);
      expect(fileDataRuns(fd, 60 * MiB).length).toBe(pages.length);
      expect(fileDataRuns(fd, 60 * MiB + 4096).pop()).toEqual([60 * MiB, 60 * MiB + 4096]);
    } finally {
      closeSync(fd);
    }
  });

  it('a file without data is no run; a bad descriptor a SystemCallError', () => {
    const fd = openSync(join(dir, 'empty'), 'w+');
    try {
      ftruncateSync(fd, 1 << 20);
      expect(fileDataRuns(fd, 1 << 20)).toEqual([]);
    } finally {
      closeSync(fd);
    }
    expect(() => fileDataRuns(1 << 20, 4096)).toThrow(/lseek.*EBADF/);
  });
});
