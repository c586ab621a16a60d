#!/usr/bin/env node
// Measures how SnapshotReader.open (what Vm.restore does first) meets hostile snapshot directories
// (docs/snapshots.md): a FIFO or a device in place of a file, a 1 TiB or unaligned guest RAM, a
// manifest or a state far larger than a snapshot needs. Each directory is opened in a child process
// killed after 10 s; prints the time to the refusal, the child's RSS and the error. No KVM:
//   node scripts/measure-snapshot-refusals.js [DIST]
// DIST is a compiled tree (default this repository's dist/; `npx tsc -p tsconfig.json` first),
// e.g. one of an older commit, to compare. As root (mknod); directories go in /var/tmp.
'use strict';
const { spawnSync } = require('node:child_process');
const fs = require('node:fs');
const { join, resolve } = require('node:path');

const dist = resolve(process.argv[2] ?? join(__dirname, '..', 'dist'));
const { GuestMemory } = require(join(dist, 'src/backends/kvm/guest-memory'));
const { writeSnapshot } = require(join(dist, 'src/snapshot/snapshot-dir'));
const { crc32c } = require(join(dist, 'src/native/crc32c'));
const MIB = 2 ** 20;
const hex32 = (v) => `0x${(v >>> 0).toString(16).padStart(8, '0')}`;
const zeroChunk = hex32(crc32c(Buffer.alloc(2 * MIB)));

const base = fs.mkdtempSync('/var/tmp/pvisor-refusals-');
const mem = GuestMemory.map(2 * MIB);
const state = { version: 1, guest: 'probe', memoryBytes: 2 * MIB, vcpus: 1, machine: {}, devices: {}, agent: {}, guestClient: null };
let n = 0;
/** A good snapshot, its files writable. */
function fresh() {
  const d = join(base, `s${++n}`);
  writeSnapshot(d, mem, state);
  for (const f of ['manifest.json', 'state.json', 'ram']) fs.chmodSync(join(d, f), 0o644);
  return d;
}
/** A good snapshot with `file` replaced by what `make` puts at its path. */
function replaced(file, make) {
  const d = fresh();
  fs.rmSync(join(d, file));
  make(join(d, file));
  return d;
}
/** A good snapshot with its manifest changed, and its state and RAM file's size if given (checksum made right). */
function withManifest(change, newState, ramBytes) {
  const d = fresh();
  const m = JSON.parse(fs.readFileSync(join(d, 'manifest.json'), 'utf8'));
  if (newState !== undefined) {
    const b = Buffer.from(typeof newState === 'string' ? newState : JSON.stringify(newState));
    fs.writeFileSync(join(d, 'state.json'), b);
    m.stateBytes = b.length;
    m.stateCrc32c = hex32(crc32c(b));
  }
  if (ramBytes !== undefined) fs.truncateSync(join(d, 'ram'), ramBytes);
  change(m);
  fs.writeFileSync(join(d, 'manifest.json'), JSON.stringify(m, null, 1));
  return d;
}

try {
  const cases = {
    'a FIFO as manifest.json': replaced('manifest.json', (p) => spawnSync('mkfifo', [p])),
    '/dev/zero (symlink) as manifest.json': replaced('manifest.json', (p) => fs.symlinkSync('/dev/zero', p)),
    '/dev/zero (mknod) as state.json': replaced('state.json', (p) => spawnSync('mknod', [p, 'c', '1', '5'])),
    '/dev/urandom (symlink) as state.json': replaced('state.json', (p) => fs.symlinkSync('/dev/urandom', p)),
    'a 1 TiB manifest (524288 CRCs, a sparse 1 TiB ram)': withManifest((m) => {
      m.ramBytes = 2 ** 40;
      m.ramChunkCrc32c = Array(2 ** 19).fill(zeroChunk);
    }, { ...state, memoryBytes: 2 ** 40 }, 2 ** 40),
    '64 MiB + 1 byte of RAM': withManifest((m) => {
      m.ramBytes = 64 * MIB + 1;
      m.ramChunkCrc32c = Array(33).fill(zeroChunk);
    }, { ...state, memoryBytes: 64 * MIB + 1 }, 64 * MIB + 1),
    'a 63 MiB manifest (4M CRCs)': withManifest((m) => { m.ramChunkCrc32c = Array(4e6).fill(zeroChunk); }),
    'a 200 MiB state.json of valid JSON, its CRC right': withManifest(() => {}, `[${'0,'.repeat(100 * MIB - 1)}0]`),
  };
  for (const [name, dir] of Object.entries(cases)) {
    const script = `
      const { SnapshotReader } = require(${JSON.stringify(join(dist, 'src/snapshot/snapshot-dir'))});
      const t0 = performance.now();
      let what;
      try { const r = SnapshotReader.open(${JSON.stringify(dir)}); r.close?.(); what = 'opened'; }
      catch (e) { what = e.constructor.name + ': ' + e.message.slice(${JSON.stringify(dir).length - 1}); }
      console.log(JSON.stringify({ ms: Math.round(performance.now() - t0), rssMiB: Math.round(process.memoryUsage().rss / 2 ** 20), what: what.slice(0, 160) }));`;
    const r = spawnSync(process.execPath, ['-e', script], { timeout: 10000, killSignal: 'SIGKILL', encoding: 'utf8' });
    console.log(`${name}: ${r.signal ? 'still blocked after 10 s (killed)' : r.stdout.trim() || r.stderr.trim().split('\n').slice(-3).join(' ')}`);
  }
} finally {
  mem.unmap();
  fs.rmSync(base, { recursive: true, force: true });
}
