// Snapshot directories and restore on real KVM with the probe guest: a restored VM continues
// where the snapshot was taken (its digest is the host model's), clones of one snapshot are
// independent, a changed snapshot is refused before anything runs, and a clone does not need the
// directory once restored. Needs /dev/kvm.
import { chmodSync, closeSync, existsSync, fstatSync, ftruncateSync, mkdirSync, mkdtempSync, openSync, readdirSync, readFileSync, readSync, rmSync, statSync, truncateSync, writeFileSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ColdCompression, HostUnsupportedError, IdleRelease, InvalidOptionError, KsmAdvice, Offload, SharedSnapshot, SnapshotError, StrategyConflictError, Vm } from '../../src';
import { fileDataRuns } from '../../src/guest-ram/file-runs';
import { crc32c } from '../../src/native/crc32c';
import { hex32 } from '../../src/snapshot/ram-file';
import { hexOf } from '../probe-digest';

const MiB = 1024 * 1024;
const base = mkdtempSync(join(tmpdir(), 'pvisor-snapshot-test-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));

/**
 * A writable copy of a sealed snapshot, to damage. Sparse as the original: a plain copy writes a
 * RAM file's holes out, and a few 256 MiB copies filled the nested harness's /tmp.
 */
function copyOf(dir: string, name: string): string {
  const to = join(base, name);
  rmSync(to, { recursive: true, force: true });
  mkdirSync(to);
  for (const f of readdirSync(dir)) {
    sparseCopy(join(dir, f), join(to, f));
    chmodSync(join(to, f), 0o644);
  }
  return to;
}

function sparseCopy(from: string, to: string): void {
  const src = openSync(from, 'r');
  const dst = openSync(to, 'wx');
  try {
    const size = fstatSync(src).size;
    const piece = Buffer.allocUnsafe(MiB);
    for (const [start, end] of fileDataRuns(src, size)) {
      for (let at = start; at < end;) {
        const n = readSync(src, piece, 0, Math.min(piece.length, end - at), at);
        if (n === 0) break;
        writeSync(dst, piece, 0, n, at);
        at += n;
      }
    }
    ftruncateSync(dst, size);
  } finally {
    closeSync(src);
    closeSync(dst);
  }
}

/** Flips one byte of a snapshot's RAM inside the working set (chunk 4: bytes 8 to 10 MiB). */
function flipRamByte(snapshotDir: string): void {
  const at = 8 * MiB + 12345;
  const fd = openSync(join(snapshotDir, 'ram'), 'r+');
  const one = Buffer.alloc(1);
  readSync(fd, one, 0, 1, at);
  one[0] ^= 0xff;
  writeSync(fd, one, 0, 1, at);
  closeSync(fd);
}

describe('VM snapshots (probe guest)', () => {
  const ws = { content: 'random' as const, seed: 21, sizeBytes: 32 * MiB };
  let original: Vm;
  let dir: string;
  beforeAll(async () => {
    original = await Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 2, name: 'snap-original' });
    await original.probe.fill({ sizeMiB: 32, content: 'random', seed: 21 });
    dir = join(base, 'snap');
    const info = await original.snapshot(dir);
    expect(info.ramDataPageCount).toBeGreaterThanOrEqual((32 * MiB) / 4096);
  });
  afterAll(() => original?.stop());

  it('writes a sealed directory: a sparse RAM file, the state and a manifest, all 0444; the VM runs on', async () => {
    expect(readdirSync(dir).sort()).toEqual(['manifest.json', 'ram', 'state.json']);
    for (const f of readdirSync(dir)) expect(statSync(join(dir, f)).mode & 0o777).toBe(0o444);
    const ram = statSync(join(dir, 'ram'));
    expect(ram.size).toBe(256 * MiB);
    // Only the pages the guest wrote take disk space: the working set and the probe's own pages.
    expect(ram.blocks * 512).toBeLessThan(40 * MiB);
    expect(ram.blocks * 512).toBeGreaterThanOrEqual(32 * MiB);
    const manifest = JSON.parse(readFileSync(join(dir, 'manifest.json'), 'utf8'));
    expect(manifest.version).toBe(1);
    expect(manifest.ramChunkCrc32c).toHaveLength(128);
    expect(original.state).toBe('running');
    expect((await original.probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [] }));
  });

  it('a restored VM continues where the snapshot was taken: its digest is the host model\'s', async () => {
    const clone = await Vm.restore(dir, { name: 'snap-clone' });
    try {
      expect(clone.state).toBe('running');
      expect(clone.memoryBytes).toBe(256 * MiB);
      expect((await clone.probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [] }));
      // The guest client's memory of the working set came along: rewrite's default seed is fill's + 1.
      await clone.probe.rewrite({ fraction: 0.5 });
      expect((await clone.probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [{ permille: 500, seed: 22 }] }));
    } finally {
      await clone.stop();
    }
  });

  it('two clones of one snapshot run side by side; a rewrite in one leaves the other\'s digest unchanged', async () => {
    const [a, b] = await Promise.all([Vm.restore(dir, { name: 'clone-a' }), Vm.restore(dir, { name: 'clone-b' })]);
    try {
      await a.probe.rewrite({ fraction: 1, seed: 77 });
      expect((await a.probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [{ permille: 1000, seed: 77 }] }));
      expect((await b.probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [] }));
      expect((await original.probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [] }));
    } finally {
      await a.stop();
      await b.stop();
    }
  });

  it('a changed, truncated or newer snapshot is refused with SnapshotError, and nothing starts', async () => {
    const liveBefore = Vm.liveGuestRam().length;
    const manifest = JSON.parse(readFileSync(join(dir, 'manifest.json'), 'utf8'));
    // A byte inside the working set: it starts after the probe's own pages, somewhere in the first 16 MiB.
    const tampered = copyOf(dir, 'tampered');
    flipRamByte(tampered);
    const truncated = copyOf(dir, 'truncated');
    truncateSync(join(truncated, 'ram'), 128 * MiB);
    const wrongState = copyOf(dir, 'wrong-state');
    writeFileSync(join(wrongState, 'manifest.json'), JSON.stringify({ ...manifest, stateCrc32c: '0x00000000' }));
    const newer = copyOf(dir, 'newer');
    writeFileSync(join(newer, 'manifest.json'), JSON.stringify({ ...manifest, version: 2 }));
    const cases: [string, RegExp][] = [
      [tampered, /RAM chunk 4 \(bytes 8388608 to 10485760\) has CRC32C 0x[0-9a-f]{8}, the manifest says/],
      [truncated, /ram: 134217728 bytes, the manifest says 268435456/],
      [wrongState, /state\.json: \d+ bytes with CRC32C 0x[0-9a-f]{8}, the manifest says \d+ bytes with 0x00000000/],
      [newer, /the snapshot is of format 2, written by a newer pvisor/],
    ];
    for (const [d, message] of cases) {
      // verify: read and check all of RAM first (by default a restore loads it lazily: below).
      const err = await Vm.restore(d, { verify: true }).then(() => undefined, (e: unknown) => e);
      expect([d, err]).toEqual([d, expect.any(SnapshotError)]);
      expect((err as Error).message).toMatch(message);
      expect(Vm.liveGuestRam()).toHaveLength(liveBefore);
    }
  });

  it('by default RAM loads lazily: a changed chunk is never mapped, and the VM ends with SnapshotError', async () => {
    const liveBefore = Vm.liveGuestRam().length;
    const tampered = copyOf(dir, 'tampered-lazy');
    flipRamByte(tampered);
    const restored = await Vm.restore(tampered, { name: 'lazy-tampered' }).then(
      (vm) => ({ vm }),
      (e: unknown) => ({ e }),
    );
    let err: unknown;
    if ('vm' in restored) {
      const vm = restored.vm;
      expect(vm.restoreInfo!.ramLoad).toBe('lazy');
      // The background load reaches chunk 4 soon, or the digest touches it first: either way the
      // guest never reads the changed byte, so no digest comes back.
      const ended = new Promise<unknown>((resolve) => (vm.state === 'crashed' ? resolve(undefined) : vm.once('exit', (info) => resolve(info.error))));
      await expect(vm.probe.digest()).rejects.toThrow();
      err = await ended;
      await vm.stop();
    } else err = restored.e;
    expect(err).toBeInstanceOf(SnapshotError);
    expect((err as Error).message).toMatch(/the RAM chunk at byte 8388608 cannot be loaded \(CRC32C mismatch\)/);
    expect(Vm.liveGuestRam()).toHaveLength(liveBefore);
  });

  it('a lazily restored VM suspended at once with Offload waits for the load to finish, and keeps its digest', async () => {
    const clone = await Vm.restore(dir, { name: 'lazy-clone', strategies: [new Offload()] });
    try {
      expect(clone.restoreInfo!.ramLoad).toBe('lazy');
      await clone.suspend();
      await clone.resume();
      expect((await clone.probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [] }));
    } finally {
      await clone.stop();
    }
  });

  // A Linux snapshot cannot be taken here (kvm_pvm cannot run the Linux guest), so this one is a
  // probe snapshot that says it is of the Linux guest, its checksums made right.
  (existsSync('/sys/module/kvm_pvm') ? it : it.skip)('a Linux snapshot on a host whose KVM cannot run the Linux guest is refused as Vm.start is, before anything is built', async () => {
    const liveBefore = Vm.liveGuestRam().length;
    const linux = copyOf(dir, 'said-linux');
    const state = JSON.parse(readFileSync(join(linux, 'state.json'), 'utf8'));
    const bytes = Buffer.from(JSON.stringify({ ...state, guest: 'linux', guestClient: null }));
    writeFileSync(join(linux, 'state.json'), bytes);
    const manifest = JSON.parse(readFileSync(join(linux, 'manifest.json'), 'utf8'));
    writeFileSync(join(linux, 'manifest.json'), JSON.stringify({ ...manifest, stateBytes: bytes.length, stateCrc32c: hex32(crc32c(bytes)) }));
    const refused = Vm.restore(linux);
    await expect(refused).rejects.toThrow(HostUnsupportedError);
    await expect(refused).rejects.toThrow(/the linux guest cannot run on this host: its KVM is paravirtualised nested KVM \(kvm_pvm\)/);
    expect(Vm.liveGuestRam()).toHaveLength(liveBefore);
  });

  it('deleting the snapshot directory after a restore does not harm the clone', async () => {
    const own = copyOf(dir, 'to-delete');
    const clone = await Vm.restore(own, { name: 'orphan' });
    try {
      rmSync(own, { recursive: true, force: true });
      await clone.probe.rewrite({ fraction: 0.25, seed: 5 });
      expect((await clone.probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [{ permille: 250, seed: 5 }] }));
    } finally {
      await clone.stop();
    }
  });

  it('a VM snapshotted with leavePaused stays paused, and a snapshot goes only into an empty directory', async () => {
    const d = join(base, 'paused');
    await original.snapshot(d, { leavePaused: true });
    expect(original.state).toBe('paused');
    await original.resume();
    await expect(original.snapshot(d)).rejects.toThrow(/is not empty/);
    expect(original.state).toBe('running');
  });

  it('a request in flight at the snapshot finishes in the original; in a clone its answer is reported, not taken for another', async () => {
    const filling = original.probe.fill({ sizeMiB: 64, content: 'random', seed: 8 });
    await new Promise((r) => setTimeout(r, 40));
    const d = join(base, 'in-flight');
    await original.snapshot(d);
    const clone = await Vm.restore(d, { name: 'in-flight-clone' });
    const warnings: string[] = [];
    clone.on('warning', (m) => warnings.push(m));
    try {
      await filling;
      const fill64 = hexOf({ content: 'random', seed: 8, sizeBytes: 64 * MiB, rewrites: [] });
      expect((await original.probe.digest()).hex).toBe(fill64);
      // The clone's guest finishes the fill it was doing, and answers a request nobody there sent.
      expect((await clone.probe.digest()).hex).toBe(fill64);
      expect(warnings.join('\n')).toMatch(/was in flight when the snapshot was taken; its answer after the restore has no caller/);
    } finally {
      await clone.stop();
    }
  });
});

describe('SharedSnapshot: clones share the snapshot\'s RAM file copy-on-write (probe guest)', () => {
  const ws = { content: 'random' as const, seed: 31, sizeBytes: 32 * MiB };
  const filled = hexOf({ ...ws, rewrites: [] });
  let dir: string;
  beforeAll(async () => {
    const source = await Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 2, name: 'shared-source' });
    try {
      await source.probe.fill({ sizeMiB: 32, content: 'random', seed: 31 });
      dir = join(base, 'shared');
      await source.snapshot(dir);
    } finally {
      await source.stop();
    }
  });

  it('four clones read the same pages: each digest is right, each pays a quarter of the working set, a rewrite stays in its clone', async () => {
    const clones = await Promise.all([0, 1, 2, 3].map((i) => Vm.restore(dir, { name: `shared-${i}`, strategies: [new SharedSnapshot()] })));
    try {
      for (const c of clones) expect((await c.probe.digest()).hex).toBe(filled);
      for (const c of clones) {
        const u = c.memoryUsage();
        // The digest read every page of the working set: it is resident, and the file's.
        expect(u.guestRamSharedBytes).toBeGreaterThanOrEqual(31 * MiB);
        // What the clone wrote itself: the probe's stack and bookkeeping, not the working set.
        expect(u.guestRamPrivateBytes).toBeLessThan(2 * MiB);
        // Four mappings of the same page-cache pages: each is charged a quarter of them.
        expect(u.guestRamPssBytes).toBeLessThan(0.3 * 32 * MiB);
      }
      await clones[0].probe.rewrite({ fraction: 1, seed: 77 });
      expect((await clones[0].probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [{ permille: 1000, seed: 77 }] }));
      expect(clones[0].memoryUsage().guestRamPrivateBytes).toBeGreaterThanOrEqual(32 * MiB);
      for (const c of clones.slice(1)) expect((await c.probe.digest()).hex).toBe(filled);
      // The first clone checked the file in full; the others found it checked and unchanged.
      const checks = clones.map((c) => c.memoryUsage().strategies.find((s) => s.strategy === 'shared-snapshot')!);
      expect(checks.filter((s) => s.figures.ramChunksChecked > 0)).toHaveLength(1);
      expect(checks.filter((s) => s.notes.some((n) => /checked in full for an earlier clone/.test(n)))).toHaveLength(3);
    } finally {
      for (const c of clones) await c.stop();
    }
  });

  it('verify: true checks the file again; a changed RAM file is refused with SnapshotError before anything runs', async () => {
    const again = await Vm.restore(dir, { strategies: [new SharedSnapshot({ verify: true })] });
    try {
      expect(again.memoryUsage().strategies.find((s) => s.strategy === 'shared-snapshot')!.figures.ramChunksChecked).toBeGreaterThanOrEqual(16);
    } finally {
      await again.stop();
    }
    const tampered = copyOf(dir, 'shared-tampered');
    const fd = openSync(join(tampered, 'ram'), 'r+');
    writeSync(fd, Buffer.from([0x5a]), 0, 1, 20 * MiB + 7);
    closeSync(fd);
    const liveBefore = Vm.liveGuestRam().length;
    const err = await Vm.restore(tampered, { strategies: [new SharedSnapshot()] }).then(() => undefined, (e: unknown) => e);
    expect(err).toBeInstanceOf(SnapshotError);
    expect((err as Error).message).toMatch(/RAM chunk 10 \(bytes 20971520 to 23068672\) has CRC32C/);
    expect(Vm.liveGuestRam()).toHaveLength(liveBefore);
  });

  it('is refused where it cannot work: in Vm.start, given to two VMs, beside ColdCompression', async () => {
    await expect(Vm.start({ guest: 'probe', strategies: [new SharedSnapshot()] })).rejects.toThrow(InvalidOptionError);
    const once = new SharedSnapshot();
    const vm = await Vm.restore(dir, { strategies: [once] });
    try {
      await expect(Vm.restore(dir, { strategies: [once] })).rejects.toThrow(/already serves a VM/);
    } finally {
      await vm.stop();
    }
    await expect(Vm.restore(dir, { strategies: [new SharedSnapshot(), new ColdCompression()] })).rejects.toThrow(StrategyConflictError);
  });

  it('composes with KsmAdvice: the clone\'s file mapping is advised mergeable, so its written copies can merge', async () => {
    const clone = await Vm.restore(dir, { strategies: [new SharedSnapshot(), new KsmAdvice()] });
    try {
      await clone.probe.rewrite({ fraction: 0.5, seed: 3 });
      const ksm = clone.memoryUsage().strategies.find((s) => s.strategy === 'ksm-advice')!;
      expect(ksm.notes.filter((n) => /not \(or no longer\) advised/.test(n))).toEqual([]);
      expect(ksm.figures.advisedMappings).toBeGreaterThanOrEqual(1);
      expect((await clone.probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [{ permille: 500, seed: 3 }] }));
    } finally {
      await clone.stop();
    }
  });

  it('clones outlive the snapshot directory', async () => {
    const own = copyOf(dir, 'shared-to-delete');
    const clones = await Promise.all([0, 1].map(() => Vm.restore(own, { strategies: [new SharedSnapshot()] })));
    try {
      rmSync(own, { recursive: true, force: true });
      await clones[0].probe.rewrite({ fraction: 0.5, seed: 9 });
      expect((await clones[0].probe.digest()).hex).toBe(hexOf({ ...ws, rewrites: [{ permille: 500, seed: 9 }] }));
      expect((await clones[1].probe.digest()).hex).toBe(filled);
    } finally {
      for (const c of clones) await c.stop();
    }
  });

  // Without the guard, the host's read of a truncated page (a device model reading its ring on
  // Node's main thread) is a SIGBUS that ends the whole process, the bystander with it.
  it('a RAM file truncated under running clones ends each of them with SnapshotError; the process and a bystander VM run on', async () => {
    const bystander = await Vm.restore(dir, { name: 'bystander', strategies: [new SharedSnapshot()] });
    // One file truncated to nothing: the host finds the clone's rings gone when it next sends.
    const toNothing = copyOf(dir, 'shared-truncated-host');
    // One truncated past the probe's own pages: the guest finds its working set gone (KVM_RUN).
    const toHalf = copyOf(dir, 'shared-truncated-vcpu');
    const host = await Vm.restore(toNothing, { name: 'truncated-host', strategies: [new SharedSnapshot()] });
    const vcpu = await Vm.restore(toHalf, { name: 'truncated-vcpu', strategies: [new SharedSnapshot()] });
    const ended = (vm: Vm) => new Promise<unknown>((resolve) => (vm.state === 'crashed' ? resolve(vm.error) : vm.once('exit', (info) => resolve(info.error))));
    try {
      expect((await host.probe.digest()).hex).toBe(filled);
      const hostEnded = ended(host);
      const vcpuEnded = ended(vcpu);
      truncateSync(join(toNothing, 'ram'), 0);
      truncateSync(join(toHalf, 'ram'), 16 * MiB);
      await expect(host.probe.digest()).rejects.toThrow();
      await expect(vcpu.probe.digest()).rejects.toThrow();
      const [hostError, vcpuError] = await Promise.all([hostEnded, vcpuEnded]);
      expect(hostError).toBeInstanceOf(SnapshotError);
      expect((hostError as Error).message).toMatch(/guest RAM lost its page at offset 0x[0-9a-f]+ when the host read it: .*shared-truncated-host\/ram is now 0 bytes, guest RAM 268435456: the file was truncated under the VM/);
      expect(vcpuError).toBeInstanceOf(SnapshotError);
      expect((vcpuError as Error).message).toMatch(/shared-truncated-vcpu\/ram is now 16777216 bytes, guest RAM 268435456: the file was truncated under the VM, and a vCPU found a page of it gone/);
      expect([host.state, vcpu.state]).toEqual(['crashed', 'crashed']);
      // The bystander, another clone in the same process, answers right.
      expect((await bystander.probe.digest()).hex).toBe(filled);
      expect(bystander.state).toBe('running');
    } finally {
      await host.stop();
      await vcpu.stop();
      await bystander.stop();
    }
  });

  it('Offload of a clone writes only the pages it wrote, and resume puts them back over the shared base', async () => {
    const offload = new Offload();
    const clone = await Vm.restore(dir, { strategies: [new SharedSnapshot(), offload] });
    try {
      await clone.probe.rewrite({ fraction: 0.25, seed: 12 }); // 8 MiB of its own
      const rewritten = hexOf({ ...ws, rewrites: [{ permille: 250, seed: 12 }] });
      expect((await clone.probe.digest()).hex).toBe(rewritten);
      await clone.suspend();
      await clone.memoryReleased();
      const during = clone.memoryUsage();
      const st = during.strategies.find((s) => s.strategy === 'offload')!;
      expect(st.figures.pagesWritten * 4096).toBeGreaterThanOrEqual(8 * MiB);
      expect(st.figures.pagesWritten * 4096).toBeLessThan(10 * MiB);
      expect(during.guestRamPrivateBytes).toBeLessThan(MiB);
      await clone.resume();
      expect((await clone.probe.digest()).hex).toBe(rewritten);
    } finally {
      await clone.stop();
    }
  });

  it('with IdleRelease, a page the clone frees goes back to the file\'s shared page; a snapshot without reporting says why it cannot', async () => {
    await expect(Vm.restore(dir, { strategies: [new SharedSnapshot(), new IdleRelease()] })).rejects.toThrow(/did not set up free page reporting/);
    const source = await Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 2, strategies: [new IdleRelease()] });
    const reporting = join(base, 'shared-reporting');
    try {
      await source.probe.fill({ sizeMiB: 32, content: 'random', seed: 31 });
      await source.snapshot(reporting);
    } finally {
      await source.stop();
    }
    const clone = await Vm.restore(reporting, { strategies: [new SharedSnapshot(), new IdleRelease()] });
    // A clone without IdleRelease takes the guest's reports and keeps its pages.
    const keeper = await Vm.restore(reporting, { strategies: [new SharedSnapshot()] });
    try {
      await clone.probe.rewrite({ fraction: 1, seed: 4 });
      expect(clone.memoryUsage().guestRamPrivateBytes).toBeGreaterThanOrEqual(32 * MiB);
      await clone.probe.release();
      expect(clone.memoryUsage().guestRamPrivateBytes).toBeLessThan(2 * MiB);
      await keeper.probe.rewrite({ fraction: 1, seed: 4 });
      await keeper.probe.release();
      expect(keeper.memoryUsage().guestRamPrivateBytes).toBeGreaterThanOrEqual(32 * MiB);
      expect(keeper.state).toBe('running');
    } finally {
      await clone.stop();
      await keeper.stop();
    }
  });
});

// Figures for the closing note, not timed assertions: snapshot time of a 512 MiB VM with a 64 MiB
// working set, and restore to ready against a fresh start in the same run.
describe('snapshot figures (probe guest, 512 MiB, 64 MiB working set)', () => {
  it('measures snapshot, restore to ready and a fresh start', async () => {
    const t0 = performance.now();
    const fresh = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2 });
    await fresh.probe.digest();
    const freshMs = performance.now() - t0;
    await fresh.probe.fill({ sizeMiB: 64, content: 'random', seed: 3 });
    const d = join(base, 'figures');
    const info = await fresh.snapshot(d);
    const t1 = performance.now();
    const clone = await Vm.restore(d);
    const restoredMs = performance.now() - t1;
    const digest = await clone.probe.digest();
    const readyMs = performance.now() - t1;
    expect(digest.hex).toBe(hexOf({ content: 'random', seed: 3, sizeBytes: 64 * MiB, rewrites: [] }));
    const usage = clone.memoryUsage();
    const t2 = performance.now();
    const shared = await Vm.restore(d, { strategies: [new SharedSnapshot()] });
    await shared.probe.digest();
    const sharedMs = performance.now() - t2;
    const t3 = performance.now();
    const shared2 = await Vm.restore(d, { strategies: [new SharedSnapshot()] });
    await shared2.probe.digest();
    const shared2Ms = performance.now() - t3;
    await shared.stop();
    await shared2.stop();
    console.log(`snapshot of 512 MiB with 64 MiB written: ${info.ms.toFixed(0)} ms, ${info.ramDataPageCount} pages in the RAM file; ` +
      `restore: ${restoredMs.toFixed(0)} ms to running, ${readyMs.toFixed(0)} ms to the first digest answered; ` +
      `fresh start to the first digest: ${freshMs.toFixed(0)} ms (ratio ${(readyMs / freshMs).toFixed(2)}); clone guest RAM RSS ${(usage.guestRamRssBytes / MiB).toFixed(1)} MiB; ` +
      `SharedSnapshot clone to the first digest: ${sharedMs.toFixed(0)} ms (file checked), a second ${shared2Ms.toFixed(0)} ms (ratio to fresh ${(shared2Ms / freshMs).toFixed(2)})`);
    await clone.stop();
    await fresh.stop();
  });
});
