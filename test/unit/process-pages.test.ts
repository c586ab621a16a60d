// The VMM process's idle pages (src/sys/process-pages.ts): which mappings count as code, and that
// giving them back really empties them. No KVM needed.
import { spawnSync } from 'node:child_process';
import { copyFileSync, mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { codeMappings } from '../../src/sys/process-pages';

describe('codeMappings', () => {
  const maps = [
    '00400000-00b6f000 r--p 00000000 fe:00 260689                             /usr/bin/node',
    '00b72000-025fe000 r-xp 00772000 fe:00 260689                             /usr/bin/node',
    '0563a000-0563e000 rw-p 05239000 fe:00 260689                             /usr/bin/node',
    '7f0000000000-7f0020000000 rw-s 00000000 00:01 1234                       /memfd:pvisor-ram (deleted)',
    '7f1000000000-7f1020000000 r--p 00000000 fe:00 99                         /var/tmp/snap/ram.bin',
    '7f2000000000-7f2000100000 r-xp 00000000 fe:00 77                         /usr/lib/x86_64-linux-gnu/libc.so.6',
    '7f2000200000-7f2000300000 r-xp 00000000 fe:00 78                         /opt/app/node_modules/ffi-rs/ffi-rs.linux-x64-gnu.node',
    '7f3000000000-7f3000021000 rw-p 00000000 00:00 0                          [heap]',
    '7f4000000000-7f4000001000 r-xp 00000000 00:00 0 ',
  ].join('\n');

  it('takes the read-only and executable mappings of executables, libraries and addons, nothing writable, anonymous or of another file', () => {
    const paths = codeMappings(maps.replaceAll('/usr/bin/node', process.execPath)).map((m) => [m.start.toString(16), m.path]);
    expect(paths).toEqual([
      ['400000', process.execPath],
      ['b72000', process.execPath],
      ['7f2000000000', '/usr/lib/x86_64-linux-gnu/libc.so.6'],
      ['7f2000200000', '/opt/app/node_modules/ffi-rs/ffi-rs.linux-x64-gnu.node'],
    ]);
  });
});

describe('releaseIdleProcessPages', () => {
  it('empties the clean pages of an executable only this process maps', () => {
    // A copy of node no other process maps, on a disk (MADV_PAGEOUT keeps tmpfs pages without
    // swap): the child's own text pages are private to it, as the VMM process's startup code is.
    const dir = mkdtempSync('/var/tmp/pvisor-pages-');
    try {
      const node = join(dir, 'node');
      copyFileSync(process.execPath, node);
      const script = `
        const { readFileSync } = require('node:fs');
        const pages = require(${JSON.stringify(join(__dirname, '..', '..', 'src', 'sys', 'process-pages.js'))});
        const privateClean = () => {
          let kib = 0, mine = false;
          for (const line of readFileSync('/proc/self/smaps', 'utf8').split('\\n')) {
            if (/^[0-9a-f]+-/.test(line)) mine = line.endsWith(process.execPath);
            else if (mine && line.startsWith('Private_Clean:')) kib += Number(line.split(/\\s+/)[1]);
          }
          return kib;
        };
        const before = privateClean();
        const advised = pages.releaseIdleProcessPages();
        console.log(JSON.stringify({ before, after: privateClean(), advised }));`;
      const r = spawnSync(node, ['-e', script], { encoding: 'utf8' });
      expect(r.stderr).toBe('');
      const { before, after, advised } = JSON.parse(r.stdout) as { before: number; after: number; advised: number };
      expect(advised).toBeGreaterThan(0);
      expect(before).toBeGreaterThan(4096);
      expect(after).toBeLessThan(before / 2);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
