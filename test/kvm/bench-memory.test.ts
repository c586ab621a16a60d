// `pvisor bench memory` as a user runs it: cells in their own processes and cgroups, real KVM.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { join } from 'node:path';

const main = join(__dirname, '..', '..', 'src', 'cli', 'main.js');
const MiB = 2 ** 20;

interface Cell {
  mode: string;
  groupPssBytes: number;
  guestRamPssBytes: number;
  groupMemoryBytes: number | null;
  backingBytes?: number;
  taskMs?: number;
  resumeAndTaskMs?: number;
}

describe('pvisor bench memory', () => {
  // On a disk (the repository's .cache), not the temp directory: /tmp may be tmpfs (it is in the
  // nested harness), where offloading saves nothing and the floors are refused.
  const cache = join(__dirname, '..', '..', '..', '.cache');
  mkdirSync(cache, { recursive: true });
  const dir = mkdtempSync(join(cache, 'pvisor-bench-test-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('measures each mode in a fresh process and prints the study beside it', () => {
    const json = join(dir, 'out.json');
    const r = spawnSync(
      process.execPath,
      [main, 'bench', 'memory', '--modes', 'default,offload', '--contents', 'random', '--working-set', '8MiB', '--shared-vms', '2', '--floor-runs', '2', '--backing-dir', join(dir, 'backing'), '--json', json],
      { encoding: 'utf8' },
    );
    expect(r.stderr).toMatch(/\[2\/2\] probe offload random: operation took/);
    expect(r.status).toBe(0);
    expect(r.stdout).toMatch(/^default\s+\| random\s+\| [\d.]+ \(179\.4\)/m);
    expect(r.stdout).toMatch(/^offload\s+\| random\s+\| [\d.]+ \(320\.1\)\s+\| [\d.]+ \(498\.2\)/m);
    // The floors of the same working set, measured in the same run, and pvisor's time against them.
    expect(r.stdout).toMatch(/^Physical floors for the same 8 MiB, measured in this run/m);
    expect(r.stdout).toMatch(/^offload\s+\| random\s+\|.*\| [\d.]+ \(178\.1\) = [\d.]+x c/m);
    const out = JSON.parse(readFileSync(json, 'utf8')) as { cells: Cell[]; sharedProcess: Cell & { vms: number } };
    const cells = out.cells;
    // Two offloaded VMs in one process: their guest RAM is gone. (Their PSS is not compared with
    // the lone VM's: the node binary's share moves with every other node process on the host.)
    expect(out.sharedProcess.vms).toBe(2);
    expect(out.sharedProcess.guestRamPssBytes).toBeLessThanOrEqual(2 * 8 * MiB * 0.01);
    expect(out.sharedProcess.groupPssBytes).toBeGreaterThan(10 * MiB);
    expect(r.stdout).toMatch(/^2 offloaded VMs in one process \(random\): group PSS [\d.]+ MiB, [\d.]+ MiB per VM/m);
    const [base, off] = cells;
    expect(base.mode).toBe('default');
    expect(base.guestRamPssBytes).toBeGreaterThanOrEqual(8 * MiB);
    // The group's PSS holds the guest RAM plus the whole Node process around it.
    expect(base.groupPssBytes).toBeGreaterThan(base.guestRamPssBytes + 10 * MiB);
    expect(off.mode).toBe('offload');
    expect(off.guestRamPssBytes).toBeLessThanOrEqual(base.guestRamPssBytes * 0.01);
    // Not compared with the default cell's group PSS: with an 8 MiB set the difference is within
    // the swing of the node binary's PSS share, which moves with every other node process on the
    // host (CI saw 25.1 vs 29.0 MiB). The group's own reading must still hold the process.
    expect(off.groupPssBytes).toBeGreaterThan(off.guestRamPssBytes + 10 * MiB);
    expect(off.backingBytes).toBeGreaterThanOrEqual(8 * MiB);
    expect(off.resumeAndTaskMs).toBeGreaterThan(0);
    // Where a memory cgroup can be made (root, v1 or v2 controller), group memory is read.
    const canCgroup = existsSync('/sys/fs/cgroup/memory/memory.usage_in_bytes') || existsSync('/sys/fs/cgroup/cgroup.controllers');
    if (canCgroup && process.getuid?.() === 0) expect(base.groupMemoryBytes).toBeGreaterThan(8 * MiB);
    // Backing files are gone once the cells end.
    expect(readdirSync(join(dir, 'backing'))).toEqual([]);
  });

  it('Table 3: four VM processes per cell in one cgroup; clones share the snapshot; KSM is put back as found', () => {
    const ksmDir = '/sys/kernel/mm/ksm';
    const ksmSettings = () => ['run', 'pages_to_scan', 'sleep_millisecs'].map((n) => readFileSync(join(ksmDir, n), 'utf8').trim());
    const root = process.getuid?.() === 0 && existsSync(ksmDir);
    const before = root ? ksmSettings() : [];
    const json = join(dir, 'table3.json');
    const schemes = `private,shared-snapshot,${root ? 'ksm,' : ''}daemon-pool,daemon-pool-arriving`;
    const r = spawnSync(
      process.execPath,
      [main, 'bench', 'memory', '--table', '3', '--working-sets', 'same-random', '--schemes', schemes, '--working-set', '8MiB', '--ksm-read-after', '4s', '--snapshot-dir', join(dir, 'snapshots'), '--json', json],
      { encoding: 'utf8' },
    );
    expect(r.stderr).toMatch(/\[2\/\d\] same-random shared-snapshot: each VM exited alone; the others' digests stayed right/);
    expect(r.status).toBe(0);
    expect(r.stdout).toMatch(/^same random \| private \(baseline\)\s+\| [\d.]+ \(132\.3\)/m);
    expect(r.stdout).toMatch(/^same random \| shared snapshot \+ COW\s+\| [\d.]+ \(42\.4\)\s+\| -?[\d.]+ \(67\.9\)/m);
    expect(r.stdout).toMatch(/^same random \| daemon pool\s+\| [\d.]+ \(80\.0\)/m);
    expect(r.stdout).toMatch(/^daemon pool, same-random: merge of four VMs \d+ \+ \d+ ms/m);
    expect(r.stdout).toMatch(/^same random \| daemon pool, VMs arriving one by one \| [\d.]+ \(80\.0\)/m);
    const out = JSON.parse(readFileSync(json, 'utf8')) as { rows: { scheme: string; vms?: number; after?: { guestRamPssBytes: number; guestRamAnonymousBytes: number; groupPssBytes: number }; exits?: unknown[]; ksm?: { guestRamMappings: number; advisedMappings: number }; pool?: { pagesShared: number[]; mergeMs: number[]; vmsKeptAfterDaemonKill: number; daemonPssBytes: number } }[] };
    const row = (scheme: string) => out.rows.find((x) => x.scheme === scheme)!;
    const priv = row('private');
    const shared = row('shared-snapshot');
    expect(priv.vms).toBe(4);
    // Four private copies of the working set, against one copy shared by four clones.
    expect(priv.after!.guestRamPssBytes).toBeGreaterThanOrEqual(4 * 8 * MiB);
    expect(shared.after!.guestRamPssBytes).toBeLessThan(2 * 8 * MiB);
    expect(shared.after!.guestRamAnonymousBytes).toBeLessThan(4 * MiB);
    // The group holds four processes, each with Node around its VM.
    expect(priv.after!.groupPssBytes).toBeGreaterThan(priv.after!.guestRamPssBytes + 4 * 10 * MiB);
    expect(shared.exits).toHaveLength(4);
    // The pool: one copy of the working set for the four, in the daemon, which is in the group.
    const pool = row('daemon-pool');
    expect(Math.min(...pool.pool!.pagesShared)).toBeGreaterThanOrEqual((8 * MiB) / 4096);
    expect(pool.after!.guestRamPssBytes).toBeLessThan(2 * 8 * MiB);
    expect(pool.pool!.daemonPssBytes).toBeGreaterThan(0);
    expect(pool.pool!.vmsKeptAfterDaemonKill).toBe(4);
    expect(pool.exits).toHaveLength(4);
    // Arriving one by one: a pass after each of the four fills, and one of all four at the end.
    const arriving = row('daemon-pool-arriving');
    expect(arriving.pool!.mergeMs).toHaveLength(5);
    expect(arriving.pool!.pagesShared).toHaveLength(4);
    expect(Math.min(...arriving.pool!.pagesShared)).toBeGreaterThanOrEqual((8 * MiB) / 4096);
    expect(arriving.after!.guestRamPssBytes).toBeLessThan(2 * 8 * MiB);
    expect(arriving.pool!.vmsKeptAfterDaemonKill).toBe(4);
    if (root) {
      const ksm = row('ksm');
      expect(ksm.ksm!.guestRamMappings).toBeGreaterThanOrEqual(4);
      expect(ksm.ksm!.advisedMappings).toBe(ksm.ksm!.guestRamMappings);
      expect(ksmSettings()).toEqual(before);
    }
    // The snapshots are gone once their cells end.
    expect(readdirSync(join(dir, 'snapshots'))).toEqual([]);
  }, 240_000);

  it('refuses an option the selected tables do not have, before starting anything', () => {
    const r = spawnSync(process.execPath, [main, 'bench', 'memory', '--table', '3', '--modes', 'offload'], { encoding: 'utf8' });
    expect(r.stderr).toMatch(/--modes.*is not an option of --table 3/);
    expect(r.stderr).not.toMatch(/VM processes/);
    expect(r.status).toBe(2);
  });

  it('rejects an unknown mode before starting anything', () => {
    const r = spawnSync(process.execPath, [main, 'bench', 'memory', '--modes', 'telepathy'], { encoding: 'utf8' });
    expect(r.stderr).toMatch(/unknown mode telepathy/);
    expect(r.stderr).not.toMatch(/fresh VM/);
    expect(r.status).toBe(2);
  });
});
