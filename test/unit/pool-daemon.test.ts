// The page pool's daemon as what users run: `pvisor-daemon serve --memory-pool`, which becomes the
// native daemon (native-prebuilds/helpers/pool_daemon.c), a real process on a real socket, driven
// over the wire protocol by real clients. No KVM needed: nothing here starts a VM.
import { spawn, spawnSync } from 'node:child_process';
import { chmodSync, closeSync, lstatSync, mkdtempSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { connect } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ANSWER_FULL, ANSWER_NONE, ANSWER_SEND, MAX_OFFER_ENTRIES, PoolOp } from '../../src/daemon/pool-protocol';
import { decodeAnswers, encodeOffer, encodePut, poolRequest } from '../pool-wire';
import { PoolUnavailableError } from '../../src/errors';
import { PoolLink, poolStatus } from '../../src/memory/pool-link';
import { encodeFrame, FrameDecoder, FrameType } from '../../src/protocol/frame';
import { daemonMain, exchange, hello, keyOf, offer, page, put, readPoolPage, request, settle, startDaemon as start, stopDaemon as stop, until, type Daemon } from '../pool-daemon-run';

const dir = mkdtempSync(join(tmpdir(), 'pvisor-pool-daemon-test-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
let sockets = 0;

/** `pvisor-daemon serve --memory-pool` on a fresh socket; resolves once it listens. */
const answers = (p: Buffer, max: number) => decodeAnswers(p, max).map((a) => a.answer);
const startDaemon = (maxPool: string, extra: string[] = [], socket = join(dir, `pool-${++sockets}.sock`)): Promise<Daemon> => start(socket, maxPool, extra);

describe('pvisor-daemon serve --memory-pool (the native daemon)', () => {
  let d: Daemon;
  beforeAll(async () => {
    d = await startDaemon('16KiB');
  });
  afterAll(async () => {
    if (d) await stop(d);
  });

  it('is the process that was started (no Node process stays), and its status has PoolStatus\'s shape', async () => {
    expect(d.stderr()).toBe(`pvisor-daemon: page pool of up to 16384 bytes on ${d.socket} (pid ${d.process.pid})\n`);
    const s = await poolStatus(d.socket, 5000);
    expect(Object.keys(s).sort()).toEqual(['candidates', 'clients', 'orphanedClients', 'pagesUsed', 'pid', 'poolBytes', 'pssBytes', 'references', 'scopes'].sort());
    expect(s).toMatchObject({ pid: d.process.pid, poolBytes: 16384, pagesUsed: 0, references: 0, clients: [], orphanedClients: 0 });
    expect(s.pssBytes).toBeGreaterThan(0);
    // What the daemon was made native for: a Node process is 15 MiB and more.
    expect(s.pssBytes).toBeLessThan(4 * 2 ** 20);
    expect(lstatSync(d.socket).mode & 0o777).toBe(0o600);
  });

  it('keeps one copy per content and scope: a second offer of a key asks for the page, Put shares equal bytes, the last release punches it out', async () => {
    const [a, b, other] = [await hello(d.socket, 'one', 'vm a'), await hello(d.socket, 'one', 'vm b'), await hello(d.socket, 'two')];
    try {
      const seven = page(7);
      const k = keyOf(seven);
      expect(await offer(a, [k])).toEqual([ANSWER_NONE]);
      expect(await offer(a, [k])).toEqual([ANSWER_NONE]); // the same client again: nothing to share
      expect(await offer(b, [k])).toEqual([ANSWER_SEND]);
      const [p] = await put(b, [seven]);
      expect(p).toBeLessThan(4);
      expect(await put(a, [Buffer.from(seven)])).toEqual([p]); // the same bytes: the same page
      expect(readPoolPage(a.poolFd, p).equals(seven)).toBe(true);
      expect(await offer(other, [k])).toEqual([ANSWER_NONE]); // scopes never share
      expect(readPoolPage(other.poolFd, p).equals(page(0))).toBe(true); // nor see each other's pages
      const s = await poolStatus(d.socket, 5000);
      expect(s).toMatchObject({ pagesUsed: 1, references: 2, scopes: 2 });
      expect(s.clients.map((c) => [c.name, c.scope, c.references])).toEqual([['vm a', 'one', 1], ['vm b', 'one', 1], ['two', 'two', 0]]);
      await settle(a, [p]);
      await settle(b, [p]);
      expect(readPoolPage(a.poolFd, p).equals(page(0))).toBe(true); // punched out: a hole
      expect((await poolStatus(d.socket, 5000)).pagesUsed).toBe(0);
    } finally {
      for (const l of [a, b, other]) {
        l.close();
        closeSync(l.poolFd);
      }
    }
  });

  it('compares content byte for byte, not by key: two pages of one key (CRC32C collides) get two pool pages', async () => {
    const a = await hello(d.socket, 'collide');
    try {
      const first = Buffer.alloc(4096);
      for (let i = 0; i < 4096; i++) first[i] = (i * 131 + 7) & 0xff;
      // A difference that is the CRC32C polynomial leaves each half's checksum as it was.
      const second = Buffer.from(first);
      [0xf1, 0x76, 0xec, 0x05, 0x01].forEach((x, i) => (second[100 + i] ^= x));
      expect(keyOf(second)).toEqual(keyOf(first));
      const [p, q] = await put(a, [first, second]);
      expect(q).not.toBe(p);
      expect(readPoolPage(a.poolFd, p).equals(first)).toBe(true);
      expect(readPoolPage(a.poolFd, q).equals(second)).toBe(true);
      expect(await put(a, [Buffer.from(second)])).toEqual([q]);
      await settle(a, [p, q, q]);
      expect((await poolStatus(d.socket, 5000)).pagesUsed).toBe(0);
    } finally {
      a.close();
      closeSync(a.poolFd);
    }
  });

  it('hands out consecutive pages for pages put together, says when it is full (over all scopes), and reuses a freed slot', async () => {
    const [s, t] = [await hello(d.socket, 's'), await hello(d.socket, 't')];
    try {
      const pages = await put(s, [1, 2, 3, 4].map(page));
      expect(pages).toEqual([0, 1, 2, 3]);
      expect(await put(s, [page(5)])).toEqual([ANSWER_FULL]);
      expect(await put(t, [page(5)])).toEqual([ANSWER_FULL]);
      await settle(s, [2]);
      expect(await put(s, [page(6)])).toEqual([2]);
      expect(readPoolPage(s.poolFd, 2).equals(page(6))).toBe(true);
      // Dropping a page the client does not hold breaks the protocol: that client is disconnected.
      await expect(settle(t, [0])).rejects.toThrow(PoolUnavailableError);
      expect(t.closed).toBe(true);
    } finally {
      for (const l of [s, t]) {
        l.close();
        closeSync(l.poolFd);
      }
    }
    // s disconnected and its process (this one) lives on: it may still map what it was granted.
    const st = await poolStatus(d.socket, 5000);
    expect(st).toMatchObject({ orphanedClients: 1, pagesUsed: 4, references: 4 });
  });

  it('hands a read-only descriptor of a 0400 memfd: a client of another uid can neither write nor reopen it to write', async () => {
    const l = await hello(d.socket, 'perm');
    try {
      const script = `const fs = require('fs'); const out = [];
        for (const [what, f] of [['write', () => fs.writeSync(3, Buffer.alloc(4096, 0xee), 0, 4096, 0)], ['reopen', () => fs.openSync('/proc/self/fd/3', 'r+')], ['chmod', () => fs.fchmodSync(3, 0o666)]]) {
          try { f(); out.push(what + ' ok'); } catch (e) { out.push(what + ' ' + e.code); }
        }
        const got = Buffer.alloc(4096); fs.readSync(3, got, 0, 4096, 0); out.push('read ' + got[0]);
        process.stdout.write(out.join(','));`;
      const r = spawnSync(process.execPath, ['-e', script], { uid: 65534, gid: 65534, stdio: ['ignore', 'pipe', 'pipe', l.poolFd], encoding: 'utf8' });
      expect(r.stdout).toBe('write EBADF,reopen EACCES,chmod EPERM,read 0');
      expect(statSync(`/proc/self/fd/${l.poolFd}`).mode & 0o777).toBe(0o400);
    } finally {
      l.close();
      closeSync(l.poolFd);
    }
  });
});

describe('the native daemon against hostile clients', () => {
  let d: Daemon;
  beforeAll(async () => {
    d = await startDaemon('64MiB');
  });
  afterAll(async () => {
    if (d) await stop(d);
  });

  const garbage: [string, Buffer[]][] = [
    ['text', [Buffer.from('GET / HTTP/1.1\r\n\r\n')]],
    ['a bad version', [Buffer.from(request(PoolOp.Status, Buffer.alloc(0))).fill(2, 2, 3)]],
    ['an oversized length', [Buffer.from(request(PoolOp.Offer, Buffer.alloc(0))).fill(0xff, 12, 16)]],
    ['a response, not a request', [encodeFrame({ type: FrameType.Response, id: 1, op: PoolOp.Status, payload: Buffer.alloc(0) })]],
    ['an Offer before Hello', [request(PoolOp.Offer, Buffer.alloc(12))]],
    ['an unknown op', [request(PoolOp.Hello, Buffer.from('{"version":1,"scope":"x","name":"y"}')), request(77, Buffer.alloc(0), 2)]],
    ['an Offer of 13 bytes', [request(PoolOp.Hello, Buffer.from('{"version":1,"scope":"x","name":"y"}')), request(PoolOp.Offer, Buffer.alloc(13), 2)]],
    ['too many Offer entries', [request(PoolOp.Hello, Buffer.from('{"version":1,"scope":"x","name":"y"}')), request(PoolOp.Offer, Buffer.alloc(12 * (MAX_OFFER_ENTRIES + 1)), 2)]],
    ['a Put of 4 bytes', [request(PoolOp.Hello, Buffer.from('{"version":1,"scope":"x","name":"y"}')), request(PoolOp.Put, Buffer.alloc(4), 2)]],
    ['a Put whose count lies', [request(PoolOp.Hello, Buffer.from('{"version":1,"scope":"x","name":"y"}')), request(PoolOp.Put, Buffer.concat([Buffer.from([2, 0, 0, 0, 0, 0, 0, 0]), page(1)]), 2)]],
    ['a Settle keeping more than it names', [request(PoolOp.Hello, Buffer.from('{"version":1,"scope":"x","name":"y"}')), request(PoolOp.Settle, Buffer.from([5, 0, 0, 0, 1, 0, 0, 0]), 2)]],
    ['a second Hello', [request(PoolOp.Hello, Buffer.from('{"version":1,"scope":"x","name":"y"}')), request(PoolOp.Hello, Buffer.from('{"version":1,"scope":"x","name":"y"}'), 2)]],
  ];
  const hellos: [string, string | Buffer][] = [
    ['not JSON', '{"version":1,"scope":"x"'],
    ['an array', '[1,2]'],
    ['a string', '"hello"'],
    ['empty', ''],
    ['version 2', '{"version":2,"scope":"x","name":"y"}'],
    ['version "1"', '{"version":"1","scope":"x","name":"y"}'],
    ['no version', '{"scope":"x","name":"y"}'],
    ['no name', '{"version":1,"scope":"x"}'],
    ['an empty scope', '{"version":1,"scope":"","name":"y"}'],
    ['a numeric scope', '{"version":1,"scope":7,"name":"y"}'],
    ['a control character', '{"version":1,"scope":"a\\u0000b","name":"y"}'],
    ['a newline', '{"version":1,"scope":"x","name":"a\\nb"}'],
    ['a name of 257 bytes', `{"version":1,"scope":"x","name":"${'n'.repeat(257)}"}`],
    ['a lone surrogate', '{"version":1,"scope":"\\ud800","name":"y"}'],
    ['bad UTF-8', Buffer.concat([Buffer.from('{"version":1,"scope":"'), Buffer.from([0xc0, 0x80]), Buffer.from('","name":"y"}')])],
    ['deep nesting', `{"x":${'['.repeat(3000)}${']'.repeat(3000)},"version":1,"scope":"x","name":"y"}`],
    ['a truncated escape', '{"version":1,"scope":"\\u12'],
    ['trailing bytes', '{"version":1,"scope":"x","name":"y"} x'],
    ['4097 bytes', `{"version":1,"scope":"x","name":"y","pad":"${'p'.repeat(4060)}"}`],
  ];

  it.each(garbage)('%s: an Error frame, the connection closed, the others served', async (_, bytes) => {
    const bystander = await hello(d.socket, 'bystander');
    try {
      const r = await exchange(d.socket, bytes);
      expect(r.closed).toBe(true);
      expect(r.frames.filter((f) => f.type === FrameType.Error)).toHaveLength(1);
      expect(await offer(bystander, [keyOf(page(1))])).toHaveLength(1);
    } finally {
      bystander.close();
      closeSync(bystander.poolFd);
    }
  });

  it.each(hellos)('a Hello that is %s is refused with an Error frame', async (_, json) => {
    const r = await exchange(d.socket, [request(PoolOp.Hello, Buffer.isBuffer(json) ? json : Buffer.from(json))]);
    expect(r.closed).toBe(true);
    expect(r.frames.map((f) => f.type)).toEqual([FrameType.Error]);
    expect((await poolStatus(d.socket, 5000)).pid).toBe(d.process.pid);
  });

  it('random bytes and frames cut anywhere, on many connections at once: the daemon serves on', async () => {
    let seed = 12345;
    const rand = () => (seed = (seed * 1103515245 + 12345) & 0x7fffffff) / 0x80000000;
    const valid = [request(PoolOp.Hello, Buffer.from('{"version":1,"scope":"fuzz","name":"f"}')), request(PoolOp.Offer, encodeOffer([{ page: 1, key: keyOf(page(3)) }]), 2), request(PoolOp.Put, encodePut([{ page: 1, bytes: page(3) }]), 3)];
    const runs = Array.from({ length: 40 }, (_, i) => {
      const stream = Buffer.concat(valid);
      const bytes = Buffer.from(stream.subarray(0, Math.floor(rand() * stream.length)));
      // Some streams are cut only; others have bytes flipped too, or random bytes after.
      if (i % 3 === 1) for (let k = 0; k < 4; k++) bytes[Math.floor(rand() * bytes.length)] ^= 1 + Math.floor(rand() * 255);
      const tail = i % 3 === 2 ? Buffer.from(Array.from({ length: 64 }, () => Math.floor(rand() * 256))) : Buffer.alloc(0);
      // A connection that sends a cut frame and stays would hold the test: the client ends it.
      return exchange(d.socket, [bytes, tail], 500);
    });
    await Promise.all(runs);
    const l = await hello(d.socket, 'fuzz', 'after');
    try {
      expect(await put(l, [page(9)])).toHaveLength(1);
      const s = await poolStatus(d.socket, 5000);
      expect(s.clients.map((c) => c.name)).toEqual(['after']);
    } finally {
      l.close();
      closeSync(l.poolFd);
    }
  });

  it('reads valid Hello JSON whatever its form: escapes, surrogate pairs, repeated and extra members', async () => {
    const json = ' { "name" : "first", "extra": {"a":[1,2.5e-3,true,false,null,"\\"]"]}, "version" : 1.0e0, "scope": "\\u00e9t\\u00E9 \\ud83d\\ude00 \\"q\\" \\\\", "name": "caf\\u00e9\\/\\u007f" } ';
    const r = await new Promise<Buffer>((resolve, reject) => {
      // The answer to Hello, read by Node's net: the memfd that comes with it is closed unread.
      const s = connect(d.socket, () => s.write(request(PoolOp.Hello, Buffer.from(json))));
      const decoder = new FrameDecoder();
      s.on('data', (b: Buffer) => {
        const [f] = decoder.push(b);
        if (f) {
          s.destroy();
          if (f.type === FrameType.Response) resolve(f.payload);
          else reject(new Error(f.payload.toString()));
        }
      });
    });
    expect(JSON.parse(r.toString())).toEqual({ version: 1, poolBytes: 64 * 2 ** 20, clientId: expect.any(Number) });
    // Named as JSON.parse would have it, and written back so that JSON.parse reads it the same.
    const l = await PoolLink.connect(d.socket, JSON.parse(json) as { scope: string; name: string }, 5000);
    try {
      const c = (await poolStatus(d.socket, 5000)).clients.find((x) => x.id === l.clientId)!;
      expect([c.scope, c.name]).toEqual(['été 😀 "q" \\', 'café/\u007f']);
    } finally {
      l.close();
      closeSync(l.poolFd);
    }
  });

  it('remembers at most 2^20 keys offered once: the oldest are forgotten', async () => {
    const l = await hello(d.socket, 'many-keys');
    try {
      // 17 Offers of 65536 distinct keys: 1.1 million.
      for (let i = 0; i < 17; i++) {
        const entries = Array.from({ length: MAX_OFFER_ENTRIES }, (_, k) => ({ page: k, key: { lo: k, hi: i + 1 } }));
        expect(answers(await poolRequest(l, PoolOp.Offer, encodeOffer(entries), 10_000), MAX_OFFER_ENTRIES).every((a) => a === ANSWER_NONE)).toBe(true);
      }
      expect((await poolStatus(d.socket, 5000)).candidates).toBe(2 ** 20);
    } finally {
      l.close();
      closeSync(l.poolFd);
    }
  });

  it('keeps a disconnected client\'s references while its process lives, and gives them back once it is gone', async () => {
    // A client process that puts a page, disconnects, and stays until its stdin closes.
    const script = `const net = require('net');
      const frame = (op, id, payload) => { const h = Buffer.alloc(16); h.write('PV'); h[2] = 1; h[3] = 1; h.writeUInt32LE(id, 4); h.writeUInt16LE(op, 8); h.writeUInt32LE(payload.length, 12); return Buffer.concat([h, payload]); };
      const put = Buffer.alloc(4 + 4 + 4096, 0x5a); put.writeUInt32LE(1, 0); put.writeUInt32LE(0, 4);
      const s = net.connect(process.argv[1], () => { s.write(frame(1, 1, Buffer.from('{"version":1,"scope":"orphan","name":"o"}'))); s.write(frame(3, 2, put)); });
      let got = 0; s.on('data', (b) => { got += b.length; if (got >= 16 + 40 + 16 + 8) { s.destroy(); process.stdout.write('done\\n'); } });
      process.stdin.resume();`;
    const before = await poolStatus(d.socket, 5000);
    const child = spawn(process.execPath, ['-e', script, d.socket], { stdio: ['pipe', 'pipe', 'inherit'] });
    await new Promise<void>((resolve) => child.stdout!.once('data', () => resolve()));
    await until('the client to be orphaned', async () => (await poolStatus(d.socket, 5000)).orphanedClients === before.orphanedClients + 1);
    expect(await poolStatus(d.socket, 5000)).toMatchObject({ references: before.references + 1, pagesUsed: before.pagesUsed + 1 });
    child.stdin!.end();
    await new Promise((r) => child.once('exit', r));
    await until('its references to come back', async () => (await poolStatus(d.socket, 5000)).references === before.references);
    expect(await poolStatus(d.socket, 5000)).toMatchObject({ orphanedClients: before.orphanedClients, pagesUsed: before.pagesUsed });
  });
});

describe('the native daemon\'s socket', () => {
  it('replaces a stale socket file, refuses a live daemon\'s and any other file, and removes its own on SIGTERM', async () => {
    // A socket file nobody listens on: what a SIGKILLed daemon leaves.
    const stale = join(dir, 'stale.sock');
    const child = spawn(process.execPath, ['-e', `require('net').createServer().listen(${JSON.stringify(stale)}, () => process.stdout.write('up'))`], { stdio: ['ignore', 'pipe', 'inherit'] });
    await new Promise((r) => child.stdout!.once('data', r));
    child.kill('SIGKILL');
    await new Promise((r) => child.once('exit', r));
    expect(lstatSync(stale).isSocket()).toBe(true);
    const d = await startDaemon('1MiB', [], stale);
    const again = spawnSync(process.execPath, [daemonMain, 'serve', '--memory-pool', '--socket', stale], { encoding: 'utf8' });
    expect([again.status, again.stderr]).toEqual([125, `pvisor-daemon: a daemon already serves ${stale}\n`]);
    expect((await poolStatus(stale, 5000)).pid).toBe(d.process.pid);
    expect(await stop(d)).toBe(0);
    expect(() => lstatSync(stale)).toThrow(/ENOENT/);
    const file = join(dir, 'not-a-socket');
    writeFileSync(file, 'x');
    const refused = spawnSync(process.execPath, [daemonMain, 'serve', '--memory-pool', '--socket', file], { encoding: 'utf8' });
    expect([refused.status, refused.stderr]).toEqual([125, `pvisor-daemon: ${file} exists and is not a socket\n`]);
  });

  it('with --group, is 0660 and of that group, and serves its members', async () => {
    const d = await startDaemon('1MiB', ['--group', '65534']);
    const st = lstatSync(d.socket);
    expect([st.mode & 0o777, st.gid]).toEqual([0o660, 65534]);
    chmodSync(dir, 0o755);
    const script = `const {poolStatus} = require(${JSON.stringify(join(__dirname, '..', '..', 'src', 'memory', 'pool-link.js'))}); poolStatus(process.argv[1], 5000).then((s) => process.stdout.write(String(s.pid)), (e) => process.stdout.write(e.message));`;
    const r = spawnSync(process.execPath, ['-e', script, d.socket], { uid: 65534, gid: 65534, encoding: 'utf8', timeout: 10_000 });
    expect(r.stdout).toBe(String(d.process.pid));
    expect(await stop(d)).toBe(0);
  });

  it('refuses a socket path a Unix socket cannot have, and bad groups, as usage errors', () => {
    for (const args of [['--socket', 'x'.repeat(108)], ['--group', '4294967295'], ['--group', 'no-such-group-pvisor']]) {
      const r = spawnSync(process.execPath, [daemonMain, 'serve', '--memory-pool', ...args], { encoding: 'utf8' });
      expect([r.status, r.stdout]).toEqual([2, '']);
    }
  });

  it('a missing daemon program is a clear error, not a crash', () => {
    // Checked before this process becomes the daemon: a copy of the package without the program.
    const r = spawnSync(process.execPath, ['-e', `require('fs').accessSync = () => { throw new Error('ENOENT: no such file'); }; process.argv.splice(1, 0, 'x'); require(${JSON.stringify(daemonMain)})`, 'serve', '--memory-pool', '--socket', join(dir, 'never.sock')], { encoding: 'utf8' });
    expect(r.stderr).toMatch(/pvisor-daemon: the page pool's daemon .*pvisor-pool-daemon is missing or not executable/);
    expect(r.status).toBe(125);
  });
});
