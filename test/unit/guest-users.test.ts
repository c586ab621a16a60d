// Commands and file calls as a user (issue 26), with the real agent on this host (../host-agent.ts:
// agent.c under ASan and UBSan over a socketpair) serving the real LinuxGuest: the agent resolves
// the user from passwd and group, its child drops to it before exec, and file calls run under its
// file credentials, so the kernel itself refuses what the user may not do. Needs root (the agent
// changes ids) and a C compiler; skipped, saying so, without either.
import { chmodSync, mkdirSync, mkdtempSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GuestFeatureError, GuestRequestError, InvalidOptionError, UnknownUserError } from '../../src';
import { LinuxGuest } from '../../src/guest/linux-client';
import { AgentClient, CommonOp } from '../../src/protocol/agent-client';
import { FileOp } from '../../src/guest/file-wire';
import { isUserSpec } from '../../src/guest/guest-user';
import { encodeFrame, FrameType } from '../../src/protocol/frame';
import { buildAgent, findCompiler, startHostAgent, useHostAgent, type HostAgent } from '../host-agent';

const compiler = findCompiler();
const root = process.getuid?.() === 0;
if (!compiler) console.log('guest users: SKIPPED, no C compiler found ($CC, gcc, clang or cc): the agent was not run on the host');
else if (!root) console.log('guest users: SKIPPED, not root: the agent cannot change ids');
const describeAsRoot = compiler && root ? describe : describe.skip;

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function rejection(p: Promise<unknown>): Promise<GuestRequestError> {
  const e = await p.then(() => undefined, (err: unknown) => err);
  expect(e).toBeInstanceOf(GuestRequestError);
  return e as GuestRequestError;
}

/** A request frame with raw flags and payload, as a hostile host would send it. */
function rawRequest(id: number, op: number, flags: number, payload: Buffer): Buffer {
  return encodeFrame({ type: FrameType.Request, id, op, flags, payload });
}

function str(s: string | Buffer): Buffer {
  const b = Buffer.from(s);
  const len = Buffer.alloc(4);
  len.writeUInt32LE(b.length, 0);
  return Buffer.concat([len, b]);
}

describe('user specs the host accepts (as the agent does)', () => {
  it('takes names and uid:gid, refuses the rest', () => {
    for (const ok of ['nobody', 'www-data', '_apt', 'a', 'x'.repeat(32), 'machine$', '0:0', '65534:65534', '4294967294:1']) expect(isUserSpec(ok)).toBe(true);
    for (const bad of ['', '-x', 'x'.repeat(33), 'a b', 'a:b', '1:', ':1', '01:1', '4294967295:0', '1:2:3', 'r\u00e9mi', '$', 'a$b', '../root']) expect(isUserSpec(bad)).toBe(false);
  });
});

describe('an agent whose HELLO lacks USERS or PTY (an initramfs built before them)', () => {
  it('is sent nothing as a user and no terminal: a GuestFeatureError says to rebuild', async () => {
    const sent: Buffer[] = [];
    const client = new AgentClient((b) => sent.push(b), () => {}, () => {});
    // The HELLO of an agent with stream credit only (features = 1).
    const hello = Buffer.alloc(36);
    hello.writeUInt32LE(1, 0);
    hello.writeUInt32LE(2, 4);
    hello.writeUInt32LE(1, 32);
    client.receive(encodeFrame({ type: FrameType.Event, id: 0, op: CommonOp.Hello, payload: hello }));
    const linux = new LinuxGuest(client);
    const e = await linux.exec('id -u', { user: 'nobody' }).catch((err: unknown) => err);
    expect(e).toBeInstanceOf(GuestFeatureError);
    expect(e).toMatchObject({ feature: 'users' });
    expect((e as Error).message).toMatch(/rebuild it/);
    expect(() => linux.spawn('id', { user: '1:1' })).toThrow(GuestFeatureError);
    await expect(linux.files.read('/x', { user: 'nobody' })).rejects.toBeInstanceOf(GuestFeatureError);
    let pty: unknown;
    try {
      linux.pty.create({ cols: 80, rows: 24 });
    } catch (err) {
      pty = err;
    }
    expect(pty).toBeInstanceOf(GuestFeatureError);
    expect(pty).toMatchObject({ feature: 'pty' });
    expect(sent).toHaveLength(0);
    client.close();
  });
});

describeAsRoot('commands and files as a user, with the real agent on the host', () => {
  const agent = useHostAgent(compiler!);
  let work: string;
  beforeAll(async () => {
    work = mkdtempSync(join(tmpdir(), 'pvisor-guest-users-'));
    chmodSync(work, 0o755);
  }, 120_000);
  afterAll(async () => {
    rmSync(work, { recursive: true, force: true });
  });

  it('a command run as nobody prints its uid, gid and groups, with its HOME and USER', async () => {
    const r = await agent.linux.exec('id -u; id -g; id -G; echo "$HOME $USER $LOGNAME"', { user: 'nobody' });
    expect(r.stdout).toBe('65534\n65534\n65534\n/nonexistent nobody nobody\n');
    expect(r.exitCode).toBe(0);
    // The request's own env still wins over the user's.
    expect((await agent.linux.exec('echo $HOME', { user: 'nobody', env: { HOME: '/tmp' } })).stdout).toBe('/tmp\n');
    // Root is what runs without a user.
    expect((await agent.linux.exec('id -u')).stdout).toBe('0\n');
  });

  it('uid:gid runs under exactly those ids, no other group, HOME /', async () => {
    const r = await agent.linux.exec(['sh', '-c', 'id -u; id -g; id -G; echo $HOME'], { user: '1234:5678' });
    expect(r.stdout).toBe('1234\n5678\n5678\n/\n');
    const p = agent.linux.spawn(['sh', '-c', 'cat; id -u'], { user: '4321:4321', stdin: true });
    const out: Buffer[] = [];
    p.stdout.on('data', (b: Buffer) => out.push(b));
    await p.write('in ');
    await p.end();
    await p.exited;
    expect(Buffer.concat(out).toString()).toBe('in 4321\n');
  });

  it("a root-only file is refused to nobody, by exec and by the file calls, and root's call still works", async () => {
    const secret = join(work, 'secret');
    writeFileSync(secret, 'root only', { mode: 0o600 });
    const cat = await agent.linux.exec(['cat', secret], { user: 'nobody' });
    expect(cat.exitCode).not.toBe(0);
    expect(cat.stderr).toContain('Permission denied');
    const read = await rejection(agent.linux.files.read(secret, { user: 'nobody' }));
    expect(read).toMatchObject({ errno: 'EACCES', op: FileOp.Read });
    expect(read.message).toBe(`files.read('${secret}'): EACCES: Permission denied: ${secret}`);
    await expect(agent.linux.files.write(secret, 'x', { user: 'nobody' })).rejects.toMatchObject({ errno: 'EACCES' });
    await expect(agent.linux.files.remove(secret, { user: 'nobody' })).rejects.toMatchObject({ errno: 'EACCES' });
    const hidden = join(work, 'hidden');
    mkdirSync(hidden, { mode: 0o700 });
    await expect(agent.linux.files.stat(join(hidden, 'x'), { user: 'nobody' })).rejects.toMatchObject({ errno: 'EACCES' });
    await expect(agent.linux.files.list(hidden, { user: 'nobody' })).rejects.toMatchObject({ errno: 'EACCES' });
    // A cwd the user cannot enter is refused as that user's.
    await expect(agent.linux.exec(['true'], { user: 'nobody', cwd: hidden })).rejects.toMatchObject({ errno: 'EACCES' });
    // Nothing of nobody's credentials stayed with the agent: root reads it all.
    expect((await agent.linux.files.read(secret)).toString()).toBe('root only');
    expect(await agent.linux.files.list(hidden)).toEqual([]);
  });

  it('what a user writes, creates or makes is owned by it', async () => {
    const shared = join(work, 'shared');
    mkdirSync(shared);
    chmodSync(shared, 0o1777);
    await agent.linux.files.write(join(shared, 'a.txt'), 'by nobody', { user: 'nobody' });
    await agent.linux.files.mkdir(join(shared, 'd'), { user: 'nobody' });
    const ws = agent.linux.files.writeStream(join(shared, 'd', 'b.bin'), { user: '1234:5678' });
    const refused = new Promise<void>((resolve, reject) => {
      ws.on('error', reject);
      ws.end(Buffer.alloc(1000, 1), (err?: Error | null) => (err ? reject(err) : resolve()));
    });
    await expect(refused).rejects.toMatchObject({ errno: 'EACCES' });
    expect(statSync(join(shared, 'a.txt'))).toMatchObject({ uid: 65534, gid: 65534 });
    expect(statSync(join(shared, 'd'))).toMatchObject({ uid: 65534, gid: 65534 });
    // 1234 may not write into nobody's 0755 directory.
    expect(() => statSync(join(shared, 'd', 'b.bin'))).toThrow();
    const ok = agent.linux.files.writeStream(join(shared, 'c.bin'), { user: '1234:5678' });
    await new Promise<void>((resolve, reject) => {
      ok.on('error', reject);
      ok.end(Buffer.alloc(10, 2), () => resolve());
    });
    expect(statSync(join(shared, 'c.bin'))).toMatchObject({ uid: 1234, gid: 5678, size: 10 });
    await agent.linux.exec(['sh', '-c', `echo hi > ${join(shared, 'e.txt')}`], { user: 'nobody' });
    expect(statSync(join(shared, 'e.txt'))).toMatchObject({ uid: 65534, gid: 65534 });
    expect((await agent.linux.files.stat(join(shared, 'e.txt'), { user: 'nobody' })).uid).toBe(65534);
  });

  it('an unknown user is an UnknownUserError naming it, and nothing runs', async () => {
    const marker = join(work, 'ran');
    const e = await rejection(agent.linux.exec(['touch', marker], { user: 'no-such-user-pv' }));
    expect(e).toBeInstanceOf(UnknownUserError);
    expect(e).toMatchObject({ user: 'no-such-user-pv', guestCode: 11, call: `exec('touch ${marker}')` });
    expect(e.message).toContain('unknown user no-such-user-pv');
    expect(() => statSync(marker)).toThrow();
    await expect(agent.linux.files.read('/etc/hostname', { user: 'no-such-user-pv' })).rejects.toBeInstanceOf(UnknownUserError);
    const p = agent.linux.spawn('true', { user: 'no-such-user-pv' });
    await expect(p.exited).rejects.toBeInstanceOf(UnknownUserError);
    await expect(p.pid).rejects.toBeInstanceOf(UnknownUserError);
  });

  it('a malformed user is refused before anything is sent', async () => {
    expect(() => agent.linux.spawn('true', { user: 'root; rm -rf /' })).toThrow(InvalidOptionError);
    await expect(agent.linux.exec('true', { user: '0:-1' })).rejects.toBeInstanceOf(InvalidOptionError);
    await expect(agent.linux.files.read('/etc/hostname', { user: 7 as unknown as string })).rejects.toBeInstanceOf(InvalidOptionError);
    await expect(agent.linux.exec('true', { user: 'x', usr: 'y' } as never)).rejects.toThrow(/usr/);
  });

  it('hostile request frames: malformed users, unknown flags, ops that take no user', async () => {
    const warningsBefore = agent.warnings.length;
    const base = 0xfff00000;
    const frames: [number, number, Buffer][] = [
      [FileOp.Stat, 1, Buffer.alloc(2)], // no room for the user's length
      [FileOp.Stat, 1, Buffer.concat([Buffer.from([0xff, 0xff, 0xff, 0x7f]), Buffer.alloc(8)])], // length overruns
      [FileOp.Stat, 1, str('')], // empty
      [FileOp.Stat, 1, str('x'.repeat(65))], // over 64 bytes
      [FileOp.Stat, 1, str(Buffer.from('nob\0ody'))], // NUL inside
      [FileOp.Stat, 1, Buffer.concat([str('no/body'), Buffer.alloc(4), str('/')])], // not a name
      [FileOp.Stat, 1, Buffer.concat([str('99999999999:0'), Buffer.alloc(4), str('/')])], // id out of range
      [0x0002, 1, str('nobody')], // PING runs as nobody? no
      [0x0220, 1, str('nobody')], // MEMINFO
      [FileOp.Cancel, 1, Buffer.concat([str('nobody'), Buffer.alloc(4)])], // names a stream: no user
      [FileOp.Stat, 2, Buffer.concat([Buffer.alloc(4), str('/')])], // unknown flag
      [FileOp.Stat, 0x8001, Buffer.concat([str('nobody'), Buffer.alloc(4), str('/')])],
    ];
    frames.forEach(([op, flags, payload], i) => agent.sendRaw(rawRequest(base + i, op, flags, payload)));
    for (let t = 0; agent.warnings.length - warningsBefore < frames.length && t < 500; t++) await sleep(10);
    const got = agent.warnings.slice(warningsBefore);
    expect(got).toHaveLength(frames.length);
    for (const w of got) expect(w).toMatch(/^guest error for request \d+: /);
    const text = (i: number) => got.find((w) => w.startsWith(`guest error for request ${base + i}:`)) ?? '';
    for (const i of [0, 1, 2, 3, 4]) expect(text(i)).toContain('user malformed');
    expect(text(5)).toContain('neither a user name nor uid:gid');
    expect(text(6)).toContain('neither a user name nor uid:gid');
    for (const i of [7, 8, 9]) expect(text(i)).toContain('does not run as a user');
    for (const i of [10, 11]) expect(text(i)).toContain('unknown request flags');
    // The agent goes on, as root.
    expect((await agent.linux.exec('id -u')).stdout).toBe('0\n');
  });
});

describeAsRoot("the guest's passwd and group, untrusted", () => {
  let built: ReturnType<typeof buildAgent>;
  let etc: string;
  let agent: HostAgent | undefined;
  beforeAll(() => {
    built = buildAgent(compiler!);
    etc = mkdtempSync(join(tmpdir(), 'pvisor-guest-etc-'));
  }, 120_000);
  afterEach(async () => {
    await agent?.stop();
    agent = undefined;
  });
  afterAll(() => {
    built?.remove();
    rmSync(etc, { recursive: true, force: true });
  });

  it('groups come from every group line naming the user, once each; malformed entries of that user are refused', async () => {
    writeFileSync(
      join(etc, 'passwd'),
      [
        'root:x:0:0:root:/root:/bin/sh',
        'garbage line without fields',
        'alice:x:2001:2001:Alice:/home/alice:/bin/sh',
        'alice:x:9999:9999:second entry, ignored:/:/bin/sh',
        'badid:x:12x:0::/:/bin/sh',
        'shortline:x:1:1',
        'relhome:x:5:5::home:/bin/sh',
        'bigid:x:4294967295:0::/:/bin/sh',
        '',
      ].join('\n'),
    );
    writeFileSync(join(etc, 'group'), ['alice:x:2001:', 'dev:x:3000:bob,alice', 'ops:x:3001:alice', 'dup:x:3000:alice', 'junk line', 'other:x:3002:bob', 'broken:x:3x:carol', 'carolgroup:x:4000:carol', ''].join('\n'));
    agent = await startHostAgent(built.bin, { etcDir: etc });
    expect((await agent.linux.exec('id -u; id -g; id -G; echo $HOME', { user: 'alice' })).stdout).toBe('2001\n2001\n2001 3000 3001\n/home/alice\n');
    for (const user of ['badid', 'shortline', 'relhome', 'bigid']) {
      const e = await rejection(agent.linux.exec('id', { user }));
      expect(e).not.toBeInstanceOf(UnknownUserError);
      expect(e.guestCode).toBe(2);
      expect(e.message).toContain(`the /etc/passwd entry of user ${user} is malformed`);
    }
    writeFileSync(join(etc, 'passwd'), 'carol:x:3:3::/:/bin/sh\n');
    const carol = await rejection(agent.linux.exec('id', { user: 'carol' }));
    expect(carol.message).toContain('an /etc/group entry naming user carol is malformed');
    await expect(agent.linux.exec('id', { user: 'alice' })).rejects.toBeInstanceOf(UnknownUserError);
  });

  it('more than 64 groups, a passwd over 1 MiB and a missing group file', async () => {
    writeFileSync(join(etc, 'passwd'), 'many:x:10:10::/:/bin/sh\nlone:x:11:11::/:/bin/sh\n');
    writeFileSync(join(etc, 'group'), Array.from({ length: 70 }, (_, i) => `g${i}:x:${5000 + i}:many`).join('\n'));
    agent = await startHostAgent(built.bin, { etcDir: etc });
    expect((await rejection(agent.linux.exec('id', { user: 'many' }))).message).toContain('more than 64 groups');
    rmSync(join(etc, 'group'));
    expect((await agent.linux.exec('id -G', { user: 'lone' })).stdout).toBe('11\n');
    writeFileSync(join(etc, 'passwd'), `${'#'.repeat(1 << 20)}\nlone:x:11:11::/:/bin/sh\n`);
    const big = await rejection(agent.linux.exec('id', { user: 'lone' }));
    expect(big).toMatchObject({ errno: 'E2BIG', guestCode: 6 });
    rmSync(join(etc, 'passwd'));
    await expect(agent.linux.exec('id', { user: 'lone' })).rejects.toBeInstanceOf(UnknownUserError);
    // Numeric ids need no passwd at all.
    expect((await agent.linux.exec('id -u', { user: '77:77' })).stdout).toBe('77\n');
  });
});
