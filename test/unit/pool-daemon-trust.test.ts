// Whom the page pool's daemon trusts with what: scopes belong to the credentials the kernel gives
// for a peer (SO_PEERCRED, SO_PEERGROUPS), not to the names a client says. Clients of other uids
// and groups are real processes (test/pool-peer-as.ts) connecting with those credentials; no KVM.
import { chmodSync, closeSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ANSWER_NONE, ANSWER_SEND } from '../../src/daemon/pool-protocol';
import { poolStatus } from '../../src/memory/pool-link';
import { property, same, type Rng } from '../fuzz-seed';
import { hello, PeerAs, put, startDaemon, stopDaemon, textPage, type Credentials, type Daemon } from '../pool-daemon-run';

const dir = mkdtempSync(join(tmpdir(), 'pvisor-pool-trust-test-'));
// Other uids reach the sockets inside.
chmodSync(dir, 0o755);
afterAll(() => rmSync(dir, { recursive: true, force: true }));
let sockets = 0;
const socketPath = () => join(dir, `pool-${++sockets}.sock`);

const nobody: Credentials = { uid: 65534, gid: 65534, groups: [] };
interface StatusAnswer {
  clients: { id: number; scope: string; name: string; uid: number; references: number }[];
  scopes: number;
  pagesUsed: number;
  references: number;
  orphanedClients: number;
}

describe('scopes belong to the peer\'s credentials', () => {
  let d: Daemon;
  let peer: PeerAs;
  beforeAll(async () => {
    d = await startDaemon(socketPath(), '16MiB', ['--group', '65534']);
    peer = new PeerAs();
  });
  afterAll(async () => {
    await peer?.end();
    if (d) await stopDaemon(d);
  });

  it('a client of another uid that names tenant A\'s scope gets a scope of its own: none of A\'s pages, content or clients', async () => {
    const secret = 'tenant-a secret: 7f3a9c0e';
    const a = await hello(d.socket, 'tenant-a', 'vm of A');
    try {
      const [p] = await put(a, [textPage(secret)]);
      const intruder = await peer.hello(d.socket, nobody, 'tenant-a', 'intruder');
      expect(intruder).toMatchObject({ ok: true });
      // What was measured in the review: the page, read through the memfd its own Hello brought.
      expect((await peer.ask<{ text: string }>({ op: 'read', client: intruder.client, page: p })).text).toBe('');
      expect((await peer.ask<{ answer: number }>({ op: 'offer', client: intruder.client, text: secret })).answer).toBe(ANSWER_NONE);
      const seen = (await peer.ask<{ status: StatusAnswer }>({ op: 'status', socket: d.socket, as: nobody })).status;
      expect(seen.clients.map((c) => [c.name, c.scope, c.uid])).toEqual([['intruder', 'tenant-a', 65534]]);
      expect(seen).toMatchObject({ scopes: 1, pagesUsed: 0, references: 0 });
      // Root sees both tenants' clients, each with its uid.
      const all = await poolStatus(d.socket, 5000);
      expect(all.clients.map((c) => [c.name, c.scope, c.uid])).toEqual([['vm of A', 'tenant-a', 0], ['intruder', 'tenant-a', 65534]]);
      expect(all).toMatchObject({ scopes: 2, pagesUsed: 1, references: 1 });
      await peer.ask({ op: 'close', client: intruder.client });
    } finally {
      a.close();
      closeSync(a.poolFd);
    }
  });

  it('gid:GID:NAME is one scope for every member of GID, primary or supplementary, and refused to others', async () => {
    const byPrimary = await peer.hello(d.socket, nobody, 'gid:65534:shared', 'primary');
    const bySupplementary = await peer.hello(d.socket, { uid: 4001, gid: 4001, groups: [65534] }, 'gid:65534:shared', 'supplementary');
    expect([byPrimary.ok, bySupplementary.ok]).toEqual([true, true]);
    const { page: p } = await peer.ask<{ page: number }>({ op: 'put', client: byPrimary.client, text: 'shared within 65534' });
    expect((await peer.ask<{ text: string }>({ op: 'read', client: bySupplementary.client, page: p })).text).toBe('shared within 65534');
    expect((await peer.ask<{ answer: number }>({ op: 'offer', client: bySupplementary.client, text: 'shared within 65534' })).answer).toBe(p);
    // Root may join any group's scope; the members see its client there, and nothing of root's own scopes.
    const rootThere = await hello(d.socket, 'gid:65534:shared', 'root there');
    const rootOwn = await hello(d.socket, 'own', 'root alone');
    try {
      const seen = (await peer.ask<{ status: StatusAnswer }>({ op: 'status', socket: d.socket, as: { uid: 4001, gid: 4001, groups: [65534] } })).status;
      expect(seen.clients.map((c) => [c.name, c.scope, c.uid])).toEqual([
        ['primary', 'gid:65534:shared', 65534],
        ['supplementary', 'gid:65534:shared', 4001],
        ['root there', 'gid:65534:shared', 0],
      ]);
      expect((await peer.hello(d.socket, nobody, 'gid:4242:x')).error).toBe('the pool refused: scope gid:4242:x: uid 65534 is not in group 4242');
      expect((await peer.hello(d.socket, nobody, 'gid:x:y')).error).toMatch(/^the pool refused: Hello.scope: a group's scope is gid:GID:NAME/);
    } finally {
      for (const l of [rootThere, rootOwn]) {
        l.close();
        closeSync(l.poolFd);
      }
      for (const c of [byPrimary, bySupplementary]) await peer.ask({ op: 'close', client: c.client });
    }
  });

  it('serves a member of --group by a supplementary group only (SO_PEERGROUPS), and refuses a peer in neither', async () => {
    const g = await startDaemon(socketPath(), '1MiB', ['--group', '4242']);
    try {
      // Open to all, so that the daemon's own check is what refuses.
      chmodSync(g.socket, 0o666);
      const member = await peer.hello(g.socket, { uid: 65534, gid: 65534, groups: [4243, 4242] }, 'x');
      expect(member).toMatchObject({ ok: true });
      await peer.ask({ op: 'close', client: member.client });
      expect((await peer.hello(g.socket, { uid: 65534, gid: 65534, groups: [4243] }, 'x')).error).toBe('the pool refused: uid 65534 may not use this pool');
    } finally {
      await stopDaemon(g);
    }
  });
});

describe('Hello under random credentials and scopes', () => {
  // The daemon runs as root with --group 4242; its socket is opened to all, so that the daemon's
  // checks, not the socket's mode, decide.
  const GROUP = 4242;
  let d: Daemon;
  let peer: PeerAs;
  beforeAll(async () => {
    d = await startDaemon(socketPath(), '16MiB', ['--group', String(GROUP)]);
    chmodSync(d.socket, 0o666);
    peer = new PeerAs();
  });
  afterAll(async () => {
    await peer?.end();
    if (d) await stopDaemon(d);
  });

  const identity = (rng: Rng): Credentials => ({
    uid: rng.pick([0, 65534, 4001, 4002]),
    gid: rng.pick([0, 65534, GROUP, GROUP, 4243, 4001]),
    groups: [GROUP, 4243, 4244].filter(() => rng.chance(0.3)),
  });
  const scopeOf = (rng: Rng): string =>
    rng.weighted<() => string>([
      [3, () => rng.pick(['a', 'b', 'gid', 'GID:4242:a', 'gid4242:a', 'été'])],
      [4, () => `gid:${rng.pick([GROUP, 4243, 4244, 0, 65534])}:${rng.pick(['a', 'b', ':', 'gid:1:a'])}`],
      [2, () => rng.pick(['gid:', 'gid::a', 'gid:01:a', 'gid:4242:', 'gid:4294967295:a', 'gid:99999999999:a', 'gid:-1:a', 'gid:+5:a', 'gid: 5:a', 'gid:4242'])],
      [1, () => String.fromCharCode(...Array.from({ length: rng.between(1, 12) }, () => rng.between(0x20, 0x7e)))],
    ])();
  const inGroup = (who: Credentials, gid: number) => who.gid === gid || who.groups.includes(gid);
  /** What the daemon should do with a Hello: a scope's key (owner and name), or the refusal. */
  function expected(who: Credentials, scope: string): { key: string } | { refusal: string } {
    if (who.uid !== 0 && !inGroup(who, GROUP)) return { refusal: `uid ${who.uid} may not use this pool` };
    if (!scope.startsWith('gid:')) return { key: `uid ${who.uid}: ${scope}` };
    const m = /^gid:(0|[1-9][0-9]{0,9}):(.+)$/s.exec(scope);
    if (!m || Number(m[1]) >= 0xffffffff) return { refusal: 'Hello.scope: a group\'s scope is gid:GID:NAME (GID a number below 4294967295, NAME not empty)' };
    if (who.uid !== 0 && !inGroup(who, Number(m[1]))) return { refusal: `scope ${scope}: uid ${who.uid} is not in group ${m[1]}` };
    return { key: `gid ${m[1]}: ${m[2]}` };
  }
  const sees = (viewer: Credentials, key: string, owner: Credentials) =>
    viewer.uid === 0 || (key.startsWith('uid ') ? owner.uid === viewer.uid : inGroup(viewer, Number(/^gid (\d+)/.exec(key)![1])));

  property('each client lands in the scope its credentials give, sees only its pages, and is listed only to who may see it', 10, async (rng, run) => {
    const clients: { who: Credentials; scope: string; key: string; client: number; clientId: number; page: number; text: string }[] = [];
    try {
      // A few identities and scopes per run, so that clients meet in scopes and fail to.
      const identities = Array.from({ length: 3 }, () => identity(rng));
      const scopes = Array.from({ length: 3 }, () => scopeOf(rng));
      for (let i = rng.between(2, 7); i > 0; i--) {
        const who = rng.chance(0.8) ? rng.pick(identities) : identity(rng);
        const scope = rng.chance(0.8) ? rng.pick(scopes) : scopeOf(rng);
        const want = expected(who, scope);
        const got = await peer.hello(d.socket, who, scope, `run ${run} client ${clients.length}`);
        if ('refusal' in want) {
          same([got.ok, got.error], [false, `the pool refused: ${want.refusal}`]);
          continue;
        }
        same([got.ok, got.error], [true, undefined]);
        const text = `run ${run} client ${clients.length}`;
        const { page } = await peer.ask<{ page: number }>({ op: 'put', client: got.client, text });
        clients.push({ who, scope, key: want.key, client: got.client!, clientId: got.clientId!, page, text });
      }
      for (const reader of clients) {
        for (const owner of clients) {
          const shared = reader.key === owner.key;
          const { text } = await peer.ask<{ text: string }>({ op: 'read', client: reader.client, page: owner.page });
          same({ reader: reader.key, owner: owner.key, sees: text === owner.text }, { reader: reader.key, owner: owner.key, sees: shared });
          const { answer } = await peer.ask<{ answer: number }>({ op: 'offer', client: reader.client, text: owner.text });
          if (shared) same(answer, owner.page);
          else same(answer === ANSWER_NONE || answer === ANSWER_SEND, true);
        }
      }
      for (let v = 0; v < 2; v++) {
        const viewer = identity(rng);
        const r = await peer.ask<{ status?: StatusAnswer }>({ op: 'status', socket: d.socket, as: viewer });
        if (viewer.uid !== 0 && !inGroup(viewer, GROUP)) {
          same(r.error, `uid ${viewer.uid} may not use this pool`);
          continue;
        }
        const ids = new Set(clients.map((c) => c.clientId));
        const listed = r.status!.clients.filter((c) => ids.has(c.id)).map((c) => [c.id, c.scope, c.uid]);
        const visible = clients.filter((c) => sees(viewer, c.key, c.who)).map((c) => [c.clientId, c.scope, c.who.uid]);
        same(listed, visible);
      }
    } finally {
      for (const c of clients) await peer.ask({ op: 'close', client: c.client });
    }
  });
});
