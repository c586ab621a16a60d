// What clients can make the page pool's daemon hold: connections, unread answers, and the
// references of processes whose clients have gone. Each bound is tested against the real daemon
// with real connections, measured in its /proc/PID/smaps_rollup; no KVM.
import { chmodSync, closeSync, mkdtempSync, rmSync } from 'node:fs';
import { connect, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { MAX_OFFER_ENTRIES, PoolOp } from '../../src/daemon/pool-protocol';
import { poolStatus, type PoolLink } from '../../src/memory/pool-link';
import { encodeOffer } from '../pool-wire';
import { hello, keyOf, offer, page, PeerAs, put, request, residentOf, startDaemon, stopDaemon, until, type Credentials } from '../pool-daemon-run';

const dir = mkdtempSync(join(tmpdir(), 'pvisor-pool-bounds-test-'));
chmodSync(dir, 0o755);
afterAll(() => rmSync(dir, { recursive: true, force: true }));
let sockets = 0;
const socketPath = () => join(dir, `pool-${++sockets}.sock`);
const MiB = 2 ** 20;
const nobody: Credentials = { uid: 65534, gid: 65534, groups: [] };

function closeLink(l: PoolLink): void {
  l.close();
  closeSync(l.poolFd);
}

describe('the references of disconnected clients', () => {
  it('a process that connects, puts and disconnects over and over has one orphan, and the daemon does not grow', async () => {
    const d = await startDaemon(socketPath(), '16MiB');
    try {
      const cycle = async () => {
        const l = await hello(d.socket, 'churn');
        await put(l, [page(1)]);
        closeLink(l);
      };
      for (let i = 0; i < 20; i++) await cycle();
      await until('the first cycles to be orphaned', async () => (await poolStatus(d.socket, 5000)).references === 20);
      const before = residentOf(d.process.pid!);
      for (let i = 0; i < 900; i++) await cycle();
      await until('the last cycles to be orphaned', async () => (await poolStatus(d.socket, 5000)).references === 920);
      // Each process keeps one orphan per scope, however often its clients came and went: before,
      // each disconnect left one (8.8 KiB), and each disconnect walked them all.
      expect(await poolStatus(d.socket, 5000)).toMatchObject({ orphanedClients: 1, pagesUsed: 1, references: 920 });
      expect(residentOf(d.process.pid!).pssBytes - before.pssBytes).toBeLessThan(1 * MiB);
    } finally {
      await stopDaemon(d);
    }
  });

  it('at most --max-clients-per-uid processes and scopes of a uid keep references; its next Hello waits until one ends', async () => {
    const d = await startDaemon(socketPath(), '16MiB', ['--group', '65534', '--max-clients-per-uid', '3']);
    let peer = new PeerAs();
    try {
      for (let i = 0; i < 3; i++) {
        const c = await peer.hello(d.socket, nobody, `scope ${i}`);
        await peer.ask({ op: 'put', client: c.client, text: `page ${i}` });
        await peer.ask({ op: 'close', client: c.client });
      }
      await until('three orphans', async () => (await poolStatus(d.socket, 5000)).orphanedClients === 3);
      expect((await peer.hello(d.socket, nobody, 'scope 3')).error).toBe('the pool refused: uid 65534 keeps the references of 3 disconnected clients whose processes run on, its most (--max-clients-per-uid)');
      // Other uids are served.
      const other = await hello(d.socket, 'root');
      expect(await offer(other, [keyOf(page(2))])).toHaveLength(1);
      closeLink(other);
      // Its process ends: its orphans go at once, and the uid is served again.
      await peer.end();
      await until('the orphans to go', async () => (await poolStatus(d.socket, 5000)).orphanedClients === 0);
      expect(await poolStatus(d.socket, 5000)).toMatchObject({ references: 0, pagesUsed: 0 });
      peer = new PeerAs();
      expect(await peer.hello(d.socket, nobody, 'scope 3')).toMatchObject({ ok: true });
    } finally {
      await peer.end();
      await stopDaemon(d);
    }
  });
});

describe('connections', () => {
  it('32 connections that send Offers and never read: the daemon stops reading them and holds little of them; the others are served', async () => {
    const d = await startDaemon(socketPath(), '64MiB');
    const slow: Socket[] = [];
    const bystander = await hello(d.socket, 'reader');
    try {
      const before = residentOf(d.process.pid!);
      // One frame, written 24 times on each connection: 12 MiB of answers each, if all were made.
      const entries = Array.from({ length: MAX_OFFER_ENTRIES }, (_, k) => ({ page: k, key: { lo: k, hi: 1 } }));
      const offers = request(PoolOp.Offer, encodeOffer(entries), 2);
      for (let i = 0; i < 32; i++) {
        const s = connect(d.socket);
        // Paused: Node reads nothing of what comes.
        s.pause();
        s.on('error', () => {});
        s.write(request(PoolOp.Hello, Buffer.from(`{"version":1,"scope":"slow","name":"slow ${i}"}`)));
        for (let k = 0; k < 24; k++) s.write(offers);
        slow.push(s);
      }
      await until('the slow clients to say hello', async () => (await poolStatus(d.socket, 5000)).clients.length === 33);
      let peak = 0;
      for (let t = 0; t < 30; t++) {
        peak = Math.max(peak, residentOf(d.process.pid!).pssBytes - before.pssBytes);
        expect(await offer(bystander, [keyOf(page(1))])).toHaveLength(1);
        await new Promise((r) => setTimeout(r, 100));
      }
      // Before, each held up to 16 MiB of answers (32 of them: +452 MiB); now what one read makes.
      expect(peak).toBeLessThan(4 * MiB);
      // Not read, not dropped: they are there when they read again.
      expect((await poolStatus(d.socket, 5000)).clients.filter((c) => c.scope === 'slow')).toHaveLength(32);
    } finally {
      for (const s of slow) s.destroy();
      closeLink(bystander);
      await stopDaemon(d);
    }
  });

  it('refuses a connection over --max-clients-per-uid or --max-clients with an Error frame, and serves the others', async () => {
    const d = await startDaemon(socketPath(), '16MiB', ['--group', '65534', '--max-clients', '6', '--max-clients-per-uid', '4']);
    const peer = new PeerAs();
    const roots: PoolLink[] = [];
    try {
      for (let i = 0; i < 4; i++) roots.push(await hello(d.socket, 'root', `root ${i}`));
      await expect(hello(d.socket, 'root', 'root 4')).rejects.toThrow('the pool refused: uid 0 has 4 connections to the pool, its most (--max-clients-per-uid)');
      const others = [await peer.hello(d.socket, nobody, 'n', 'nobody 0'), await peer.hello(d.socket, nobody, 'n', 'nobody 1')];
      expect(others.map((o) => o.ok)).toEqual([true, true]);
      expect((await peer.hello(d.socket, nobody, 'n', 'nobody 2')).error).toBe('the pool refused: the pool serves 6 connections, its most (--max-clients)');
      for (const l of roots) expect(await offer(l, [keyOf(page(3))])).toHaveLength(1);
      // A connection that ends makes room.
      closeLink(roots.pop()!);
      let again: PoolLink | undefined;
      await until('a slot for root', async () => {
        again = await hello(d.socket, 'root', 'root again').catch(() => undefined);
        return again !== undefined;
      });
      roots.push(again!);
      const seen = (await peer.ask<{ status: { clients: { name: string }[] } }>({ op: 'status', socket: d.socket, as: nobody })).error;
      // A status is a connection too: nobody's third is over the total.
      expect(seen).toBe('the pool serves 6 connections, its most (--max-clients)');
    } finally {
      for (const l of roots) closeLink(l);
      await peer.end();
      await stopDaemon(d);
    }
  });
});
