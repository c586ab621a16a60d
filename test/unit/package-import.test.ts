// Importing pvisor loads no native code: an application that only imports it (for types, errors,
// or to reach a VM of another process) neither loads nor needs ffi-rs or zstd-napi. Checked in a
// fresh process, both by what Node's module cache holds and by what the dynamic loader mapped.
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';

const index = join(__dirname, '..', '..', 'src', 'index.js');

/** Requires `what` in a fresh process; returns the modules it loaded and the shared objects mapped. */
function loadedBy(code: string): { modules: string[]; sharedObjects: string[] } {
  const r = spawnSync(process.execPath, ['-e', `${code}; process.stdout.write(JSON.stringify({ modules: Object.keys(require.cache), sharedObjects: process.report.getReport().sharedObjects }))`], { encoding: 'utf8' });
  if (r.status !== 0) throw new Error(r.stderr);
  return JSON.parse(r.stdout) as { modules: string[]; sharedObjects: string[] };
}

const native = (paths: string[]) => paths.filter((p) => p.endsWith('.node') || /node_modules\/(ffi-rs|zstd-napi|@yuuang)\//.test(p) || /libpvisor-/.test(p));

describe('importing pvisor', () => {
  it('loads no native addon and no native helper', () => {
    const { modules, sharedObjects } = loadedBy(`const p = require(${JSON.stringify(index)}); new p.Offload(); new p.IdleRelease()`);
    expect(modules).toContain(index);
    expect(native(modules)).toEqual([]);
    expect(native(sharedObjects)).toEqual([]);
  });

  it('loads ffi-rs on the first libc call (so the check above could fail)', () => {
    const libc = join(__dirname, '..', '..', 'src', 'sys', 'libc.js');
    const { modules, sharedObjects } = loadedBy(`require(${JSON.stringify(libc)}).createEventFd()`);
    expect(native(modules).some((m) => m.includes('node_modules/ffi-rs/'))).toBe(true);
    expect(native(sharedObjects).some((s) => s.endsWith('.node'))).toBe(true);
  });
});
