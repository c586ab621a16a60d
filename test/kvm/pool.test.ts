// The page pool on real KVM with the probe guest: pvisor-daemon is a real separate process, VMs
// run in this process and in a second one (test/pool-peer.ts). Needs /dev/kvm.
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { chmodSync, mkdtempSync, rmSync } from 'node:fs';
import { connect } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { IdleRelease, KsmAdvice, Offload, PoolClient, SharedSnapshot, Vm } from '../../src';
import { encodeFrame, FrameType } from '../../src/protocol/frame';
import { poolStatus } from '../../src/memory/pool-link';
import { hexOf } from '../probe-digest';

const MiB = 2 ** 20;
// Under the nested harness's emulation the merges of 32 MiB that race a rewrite, and the composed
// cases, ran past the default 120 s with the host busy (the suspend/resume soak beside them).
if (process.env.PVISOR_NESTED === '1') jest.setTimeout(600_000);
const daemonMain = join(__dirname, '..', '..', 'src', 'cli', 'daemon-main.js');
const dir = mkdtempSync(join(tmpdir(), 'pvisor-pool-test-'));
const socket = join(dir, 'pool.sock');
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** Starts pvisor-daemon and resolves once it listens. */
async function startDaemon(): Promise<ChildProcess> {
  // With the flags its bin runs node with, as a user's `pvisor-daemon serve` would run.
  const d = spawn(process.execPath, [daemonMain, 'serve', '--memory-pool', '--socket', socket, '--max-pool', '512MiB'], { stdio: ['ignore', 'ignore', 'pipe'] });
  await new Promise<void>((resolve, reject) => {
    let err = '';
    d.stderr!.on('data', (b: Buffer) => {
      err += b.toString();
      if (/page pool of up to/.test(err)) resolve();
    });
    d.once('exit', (code) => reject(new Error(`pvisor-daemon exited with ${code}: ${err}`)));
  });
  return d;
}

/** The second VM process. */
class Peer {
  private readonly child = spawn(process.execPath, [join(__dirname, '..', 'pool-peer.js')], { stdio: ['pipe', 'pipe', 'inherit'] });
  private readonly lines = createInterface({ input: this.child.stdout! })[Symbol.asyncIterator]();
  async ask<T = Record<string, unknown>>(m: object): Promise<T> {
    this.child.stdin!.write(`${JSON.stringify(m)}\n`);
    const r = JSON.parse((await this.lines.next()).value as string);
    if (!r.ok) throw new Error(`peer: ${r.error}`);
    return r as T;
  }
  end(): void {
    this.child.stdin!.end();
  }
}

const until = async (what: string, ok: () => boolean | Promise<boolean>, ms = 20_000) => {
  const deadline = Date.now() + ms;
  while (!(await ok())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
};

describe('PoolClient and pvisor-daemon (probe guest)', () => {
  const same = hexOf({ content: 'random', seed: 42, sizeBytes: 64 * MiB, rewrites: [] });
  let daemon: ChildProcess;
  let peer: Peer;
  const clients: PoolClient[] = [];
  const vms: Vm[] = [];
  const pool = (vm: Vm) => vm.memoryUsage().strategies.find((s) => s.strategy === 'pool-client')!;

  beforeAll(async () => {
    daemon = await startDaemon();
    peer = new Peer();
    await peer.ask({ op: 'start', count: 2, socket, sizeMiB: 64, seed: 42 });
    for (let i = 0; i < 2; i++) {
      const c = new PoolClient({ socket, intervalMs: 3_600_000 });
      const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 1, strategies: [c] });
      await vm.probe.fill({ sizeMiB: 64, content: 'random', seed: 42 });
      clients.push(c);
      vms.push(vm);
    }
  });
  afterAll(async () => {
    for (const vm of vms) await vm.stop();
    peer?.end();
    daemon?.kill('SIGKILL');
  });

  it('four VMs in two processes keep one copy of their common 64 MiB: each VM\'s PSS drops by more than half of it', async () => {
    const before = vms.map((vm) => vm.memoryUsage().guestRamPssBytes);
    for (const vm of vms) expect(vm.memoryUsage().guestRamPssBytes).toBeGreaterThanOrEqual(64 * MiB);
    // The first offers are remembered; a second offer of the same page makes the pool ask for it;
    // later offers find it pooled.
    for (const c of clients) await c.mergeNow();
    await peer.ask({ op: 'merge' });
    for (const c of clients) await c.mergeNow();
    // Reading the working set maps the pool's pages into each VM.
    expect((await Promise.all(vms.map((vm) => vm.probe.digest()))).map((d) => d.hex)).toEqual([same, same]);
    expect((await peer.ask<{ digests: string[] }>({ op: 'digests' })).digests).toEqual([same, same]);
    for (const [i, vm] of vms.entries()) {
      const u = vm.memoryUsage();
      expect(pool(vm).figures.pagesShared).toBeGreaterThanOrEqual((64 * MiB) / 4096);
      expect(u.guestRamPssBytes).toBeLessThan(before[i] - 32 * MiB);
      // Consecutive guest pages went to consecutive pool pages: a few mappings, not one per page.
      expect(pool(vm).figures.guestRamMappings).toBeLessThan(64);
    }
    const status = await poolStatus(socket, 5000);
    expect(status.pagesUsed).toBeGreaterThanOrEqual((64 * MiB) / 4096);
    expect(status.pagesUsed).toBeLessThan((66 * MiB) / 4096);
    expect(status.clients).toHaveLength(4);
  });

  it('a rewrite of 25% in one VM leaves the others\' digests unchanged, and its next pass gives the references back', async () => {
    const refsBefore = (await poolStatus(socket, 5000)).references;
    await vms[0].probe.rewrite({ fraction: 0.25, seed: 5 });
    expect((await vms[0].probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 42, sizeBytes: 64 * MiB, rewrites: [{ permille: 250, seed: 5 }] }));
    expect((await vms[1].probe.digest()).hex).toBe(same);
    expect((await peer.ask<{ digests: string[] }>({ op: 'digests' })).digests).toEqual([same, same]);
    await clients[0].mergeNow();
    expect(pool(vms[0]).figures.pagesUnshared).toBeGreaterThanOrEqual((16 * MiB) / 4096);
    expect((await poolStatus(socket, 5000)).references).toBeLessThanOrEqual(refsBefore - (16 * MiB) / 4096);
  });

  it('no guest write racing a merge is lost', async () => {
    // A fresh pair with the same content; one rewrites while both merge, over and over.
    const pair = [0, 1].map(() => new PoolClient({ socket, intervalMs: 3_600_000 }));
    const racers = await Promise.all(pair.map((c) => Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 2, strategies: [c] })));
    try {
      for (const vm of racers) await vm.probe.fill({ sizeMiB: 32, content: 'random', seed: 99 });
      const rewrites: { permille: number; seed: number }[] = [];
      for (let k = 0; k < 6; k++) {
        const seed = 1000 + k;
        rewrites.push({ permille: 300, seed });
        await Promise.all([racers[0].probe.rewrite({ fraction: 0.3, seed }), pair[0].mergeNow(), pair[1].mergeNow()]);
      }
      expect((await racers[0].probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 99, sizeBytes: 32 * MiB, rewrites }));
      expect((await racers[1].probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 99, sizeBytes: 32 * MiB, rewrites: [] }));
      expect(pool(racers[1]).figures.pagesShared).toBeGreaterThan(0);
    } finally {
      for (const vm of racers) await vm.stop();
    }
  });

  it('composes with KsmAdvice, IdleRelease (a freed page gives its reference back) and Offload (which writes only the VM\'s own pages)', async () => {
    const pair = [0, 1].map(() => new PoolClient({ socket, intervalMs: 3_600_000 }));
    const offload = new Offload();
    const vmsOf = await Promise.all(pair.map((c, i) => Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 1, strategies: [new KsmAdvice(), new IdleRelease(), c, ...(i === 1 ? [offload] : [])] })));
    try {
      for (const vm of vmsOf) await vm.probe.fill({ sizeMiB: 32, content: 'random', seed: 123 });
      for (let k = 0; k < 2; k++) for (const c of pair) await c.mergeNow();
      for (const vm of vmsOf) expect(pool(vm).figures.pagesShared).toBeGreaterThanOrEqual((32 * MiB) / 4096);
      const refs = (await poolStatus(socket, 5000)).references;
      const shared = pool(vmsOf[0]).figures.pagesShared;
      await vmsOf[0].probe.release();
      // What stays shared is the probe's own pages that both VMs have, not the working set.
      expect(pool(vmsOf[0]).figures.pagesShared).toBeLessThanOrEqual(shared - (32 * MiB) / 4096);
      expect(vmsOf[0].memoryUsage().guestRamRssBytes).toBeLessThan(2 * MiB); // anonymous zero, not the pool's pages
      await pair[0].mergeNow();
      expect((await poolStatus(socket, 5000)).references).toBeLessThanOrEqual(refs - (32 * MiB) / 4096);
      await vmsOf[1].suspend();
      await vmsOf[1].memoryReleased();
      // The pool's pages are not the VM's own: they stay mapped and are not written.
      expect(vmsOf[1].memoryUsage().strategies.find((s) => s.strategy === 'offload')!.figures.pagesWritten).toBeLessThan((4 * MiB) / 4096);
      await vmsOf[1].resume();
      expect((await vmsOf[1].probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 123, sizeBytes: 32 * MiB, rewrites: [] }));
    } finally {
      for (const vm of vmsOf) await vm.stop();
    }
  });

  it('composes with SharedSnapshot: what two clones wrote alike is pooled over the shared base', async () => {
    const snap = join(dir, 'snap');
    const source = await Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 1 });
    await source.probe.fill({ sizeMiB: 16, content: 'random', seed: 8 });
    await source.snapshot(snap);
    await source.stop();
    const pair = [0, 1].map(() => new PoolClient({ socket, intervalMs: 3_600_000 }));
    const clones = await Promise.all(pair.map((c) => Vm.restore(snap, { strategies: [new SharedSnapshot(), c] })));
    try {
      // Both clones rewrite the same way: 16 MiB of private copies each, alike.
      for (const vm of clones) await vm.probe.rewrite({ fraction: 1, seed: 31 });
      for (const vm of clones) expect(vm.memoryUsage().guestRamPrivateBytes).toBeGreaterThanOrEqual(16 * MiB);
      for (let k = 0; k < 2; k++) for (const c of pair) await c.mergeNow();
      const expected = hexOf({ content: 'random', seed: 8, sizeBytes: 16 * MiB, rewrites: [{ permille: 1000, seed: 31 }] });
      for (const vm of clones) {
        expect((await vm.probe.digest()).hex).toBe(expected);
        expect(pool(vm).figures.pagesShared).toBeGreaterThanOrEqual((16 * MiB) / 4096);
        expect(vm.memoryUsage().guestRamPrivateBytes).toBeLessThan(2 * MiB);
      }
    } finally {
      for (const vm of clones) await vm.stop();
    }
  });

  it('a client that sends garbage or an oversized frame is disconnected; the others go on', async () => {
    for (const bytes of [Buffer.from('GET / HTTP/1.1\r\n\r\n'), encodeFrame({ type: FrameType.Request, id: 1, op: 2, payload: Buffer.alloc(0) }).fill(0xff, 12, 16)]) {
      const closed = await new Promise<boolean>((resolve) => {
        const s = connect(socket, () => s.write(bytes));
        s.on('data', () => {});
        s.on('close', () => resolve(true));
        s.on('error', () => {});
        setTimeout(() => resolve(false), 5000);
      });
      expect(closed).toBe(true);
    }
    await clients[1].mergeNow();
    expect(pool(vms[1]).figures.connected).toBe(1);
    expect((await poolStatus(socket, 5000)).clients).toHaveLength(4);
  });

  it('refuses a peer of another uid', async () => {
    chmodSync(socket, 0o666); // past the file's permission: the daemon's own check must refuse it
    chmodSync(dir, 0o755);
    // The daemon refuses at once, before any request: the script only listens.
    const script = `const s=require('net').connect(${JSON.stringify(socket)});let out='';s.on('data',b=>out+=b.toString('latin1'));s.on('error',e=>out+=e.message);s.on('close',()=>{process.stdout.write(out);});`;
    const r = spawnSync(process.execPath, ['-e', script], { uid: 65534, gid: 65534, encoding: 'latin1', timeout: 10_000 });
    chmodSync(socket, 0o600);
    expect([r.stdout, r.stderr]).toEqual([expect.stringMatching(/uid 65534 may not use this pool/), '']);
    expect((await poolStatus(socket, 5000)).clients).toHaveLength(4);
  });

  it('a VM with content of its own shares nothing and costs no more than a private one', async () => {
    const alone = new PoolClient({ socket, intervalMs: 3_600_000 });
    const vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 1, strategies: [alone] });
    try {
      await vm.probe.fill({ sizeMiB: 64, content: 'random', seed: 4242 });
      const before = vm.memoryUsage().guestRamPssBytes;
      await alone.mergeNow();
      await alone.mergeNow();
      // Only the probe's own pages (its code and tables, alike in every VM), none of the working set.
      expect(pool(vm).figures.pagesShared).toBeLessThan(64);
      expect(vm.memoryUsage().guestRamPssBytes).toBeLessThanOrEqual(before + 2 * MiB);
    } finally {
      await vm.stop();
    }
  });

  it('a daemon that ends cleanly (SIGTERM) leaves every page the VMs map as it was', async () => {
    const digests = await Promise.all(vms.map(async (vm) => (await vm.probe.digest()).hex));
    const peerDigests = (await peer.ask<{ digests: string[] }>({ op: 'digests' })).digests;
    daemon.kill('SIGTERM');
    expect(await new Promise((r) => daemon.once('exit', r))).toBe(0);
    expect((await Promise.all(vms.map(async (vm) => (await vm.probe.digest()).hex)))).toEqual(digests);
    expect((await peer.ask<{ digests: string[] }>({ op: 'digests' })).digests).toEqual(peerDigests);
    daemon = await startDaemon();
    await until('every client to reconnect', () => vms.every((vm) => pool(vm).figures.connected === 1));
  });

  it('every VM survives a SIGKILL of the daemon, and reconnects to the next one', async () => {
    const reconnects = pool(vms[1]).figures.reconnects;
    const warnings: string[] = [];
    vms[1].on('warning', (m) => warnings.push(m));
    daemon.kill('SIGKILL');
    await new Promise((r) => daemon.once('exit', r));
    await until('the client to notice', () => pool(vms[1]).figures.connected === 0);
    expect(warnings.join('\n')).toMatch(/pool-client: .*reconnecting/);
    expect((await vms[1].probe.digest()).hex).toBe(same);
    expect((await peer.ask<{ digests: string[] }>({ op: 'digests' })).digests).toEqual([same, same]);
    await vms[1].probe.rewrite({ fraction: 0.5, seed: 6 });
    expect((await vms[1].probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 42, sizeBytes: 64 * MiB, rewrites: [{ permille: 500, seed: 6 }] }));
    daemon = await startDaemon();
    await until('every client to reconnect', () => vms.every((vm) => pool(vm).figures.connected === 1));
    expect(pool(vms[1]).figures.reconnects).toBe(reconnects + 1);
    // The new pool starts empty, and serves what the VMs have in common from now on.
    for (const vm of vms) await vm.probe.rewrite({ fraction: 1, seed: 77 });
    for (const c of clients) await c.mergeNow();
    for (const c of clients) await c.mergeNow();
    expect((await poolStatus(socket, 5000)).pagesUsed).toBeGreaterThanOrEqual((64 * MiB) / 4096);
    const rewritten = hexOf({ content: 'random', seed: 42, sizeBytes: 64 * MiB, rewrites: [{ permille: 1000, seed: 77 }] });
    expect((await Promise.all(vms.map((vm) => vm.probe.digest()))).map((d) => d.hex)).toEqual([rewritten, rewritten]);
  });
});
