// `pvisor bench snapshot` as a user runs it, once, on real KVM: it times what it says and checks
// every clone's digest (a wrong one fails the bench), and the clone's offload holds its own pages.
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';

const main = join(__dirname, '..', '..', 'src', 'cli', 'main.js');
const MiB = 2 ** 20;

describe('pvisor bench snapshot', () => {
  // On a disk, where snapshots and backing files live: /tmp may be tmpfs (Offload refuses it), and
  // the repository may be on a file system whose private mappings are not the page cache's (the
  // nested harness: there a clone's every page read as its own, and its offload wrote them all).
  const dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-bench-snapshot-test-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('prints snapshot and restore times beside fresh starts, and the size of a clone\'s offload', () => {
    const json = join(dir, 'out.json');
    const r = spawnSync(process.execPath, [main, 'bench', 'snapshot', '--runs', '1', '--dir', dir, '--json', json], { encoding: 'utf8' });
    expect(r.stderr).toMatch(/run 1\/1: fresh \d+ ms, private restore \d+ ms/);
    expect(r.status).toBe(0);
    expect(r.stdout).toMatch(/^SharedSnapshot clone to ready, file checked before\s+\| [\d]+ \/ [\d]+ \/ [\d]+\s+\| [\d.]+/m);
    const out = JSON.parse(readFileSync(json, 'utf8'));
    // The RAM file holds the 64 MiB working set and the probe's pages, not 512 MiB.
    expect(out.ramFileBytes).toBeGreaterThanOrEqual(64 * MiB);
    expect(out.ramFileBytes).toBeLessThan(66 * MiB);
    // The clone rewrote 8 MiB: its offload holds those pages and its own few, not the shared base.
    expect(out.cloneOffloadBytes).toBeGreaterThanOrEqual(8 * MiB);
    expect(out.cloneOffloadBytes).toBeLessThan(10 * MiB);
  });
});
