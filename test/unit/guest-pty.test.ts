// Terminals (issue 26: `vm.pty.create`, resize, input, output), with the real agent on this host
// (../host-agent.ts: agent.c under ASan and UBSan over a socketpair) serving the real LinuxGuest:
// a real pseudo-terminal the agent opens, a real shell on it. A terminal nobody reads holds only
// itself; hostile RESIZE and EXEC frames are refused. Skipped, saying so, without a C compiler
// (the user case also needs root).
import { GuestRequestError, InvalidOptionError } from '../../src';
import type { GuestPty } from '../../src/guest/pty';
import { encodeFrame, FrameType } from '../../src/protocol/frame';
import { STREAM_WINDOW_BYTES } from '../../src/protocol/stream-window';
import { findCompiler, useHostAgent } from '../host-agent';

const compiler = findCompiler();
if (!compiler) console.log('guest pty: SKIPPED, no C compiler found ($CC, gcc, clang or cc): the agent was not run on the host');
const describeWithCompiler = compiler ? describe : describe.skip;
const root = process.getuid?.() === 0;

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Everything a terminal shows, and a wait for a pattern in it. */
function screen(pty: GuestPty): { text(): string; waitFor(re: RegExp, ms?: number): Promise<RegExpMatchArray> } {
  let text = '';
  pty.output.on('data', (b: Buffer) => (text += b.toString('utf8')));
  return {
    text: () => text,
    async waitFor(re, ms = 10_000) {
      for (let t = 0; t < ms / 10; t++) {
        const m = re.exec(text);
        if (m) return m;
        await sleep(10);
      }
      throw new Error(`${re} not seen within ${ms} ms; the terminal showed ${JSON.stringify(text.slice(-500))}`);
    },
  };
}

function u32s(...v: number[]): Buffer {
  const b = Buffer.alloc(4 * v.length);
  v.forEach((x, i) => b.writeUInt32LE(x, 4 * i));
  return b;
}
function str(s: string): Buffer {
  return Buffer.concat([u32s(Buffer.byteLength(s)), Buffer.from(s)]);
}

describeWithCompiler('terminals with the real agent on the host', () => {
  const agent = useHostAgent(compiler!);

  it('a shell on a terminal: its size, a resize seen by stty size, its exit status', async () => {
    const pty = agent.linux.pty.create({ cols: 80, rows: 24 });
    const s = screen(pty);
    expect(await pty.pid).toBeGreaterThan(1);
    // (What is typed ahead is echoed at once, before the shell's prompt: patterns match the output, not the echo.)
    await pty.write('stty size; tty; echo "term=$TERM"\r');
    await s.waitFor(/\b24 80\r\n/);
    await s.waitFor(/\/dev\/pts\/\d+\r\n/);
    await s.waitFor(/term=xterm-256color\r\n/);
    await pty.resize({ cols: 132, rows: 43 });
    await pty.write('stty size\r');
    await s.waitFor(/\b43 132\r\n/);
    // The terminal's line discipline: Ctrl-C interrupts the foreground command, not the shell.
    await pty.write('sleep 30\r');
    await sleep(200);
    await pty.write('\x03');
    await pty.write('echo after-$((40+2))\r');
    await s.waitFor(/after-42\r\n/);
    await pty.write('exit 3\r');
    expect(await pty.wait()).toEqual({ exitCode: 3, signal: null });
  });

  it('a command given as cmd, through the input stream; kill hangs up an interactive shell', async () => {
    const cat = agent.linux.pty.create({ cols: 20, rows: 5, cmd: ['cat'] });
    const s = screen(cat);
    cat.input.write('hello\r');
    // Echoed by the terminal, then written back by cat.
    await s.waitFor(/hello\r\n(.*\r\n)?hello\r\n/);
    cat.input.end('\x04');
    expect(await cat.exited).toEqual({ exitCode: 0, signal: null });

    const sh = agent.linux.pty.create({ cols: 80, rows: 24, cmd: ['/bin/sh', '-i'] });
    sh.output.resume();
    await sh.pid;
    await sh.kill();
    expect((await sh.exited).signal).toBe('SIGHUP');
  });

  it('a terminal nobody reads holds only itself: other requests answer at once, the host holds at most a window of it', async () => {
    const flood = agent.linux.pty.create({ cols: 80, rows: 24, cmd: ['sh', '-c', 'head -c 4000000 /dev/zero | tr "\\0" x; echo; echo done'] });
    for (let t = 0; flood.output.readableLength < STREAM_WINDOW_BYTES - 64 * 1024 && t < 500; t++) await sleep(10);
    const started = Date.now();
    expect((await agent.linux.exec('echo hi', { timeoutMs: 5000 })).stdout).toBe('hi\n');
    await agent.linux.files.stat('/', { timeoutMs: 5000 });
    expect(Date.now() - started).toBeLessThan(2000);
    expect(flood.output.readableLength).toBeLessThanOrEqual(STREAM_WINDOW_BYTES);
    let bytes = 0;
    flood.output.on('data', (b: Buffer) => (bytes += b.length));
    expect(await flood.exited).toEqual({ exitCode: 0, signal: null });
    expect(bytes + STREAM_WINDOW_BYTES).toBeGreaterThan(4_000_000);
  });

  (root ? it : it.skip)('a terminal as a user: the command and the terminal are its', async () => {
    const pty = agent.linux.pty.create({ cols: 80, rows: 24, cmd: ['sh', '-c', 'id -u; stat -c %u "$(tty)"'], user: 'nobody' });
    const s = screen(pty);
    expect(await pty.exited).toEqual({ exitCode: 0, signal: null });
    expect(s.text()).toBe('65534\r\n65534\r\n');
  });

  it('options are checked before anything is sent', () => {
    expect(() => agent.linux.pty.create({ cols: 0, rows: 24 })).toThrow(InvalidOptionError);
    expect(() => agent.linux.pty.create({ cols: 80, rows: 65536 })).toThrow(InvalidOptionError);
    expect(() => agent.linux.pty.create({ cols: 80.5, rows: 24 })).toThrow(InvalidOptionError);
    expect(() => agent.linux.pty.create({ cols: 80, rows: 24, colz: 1 } as never)).toThrow(/colz/);
  });

  it('hostile RESIZE and EXEC frames are refused, and the agent goes on', async () => {
    const pty = agent.linux.pty.create({ cols: 80, rows: 24, cmd: ['sleep', '30'] });
    const plain = agent.linux.spawn(['sleep', '30']);
    await pty.pid;
    await plain.pid;
    const id = (p: unknown) => (p as { process: { requestId: number } }).process?.requestId ?? (p as { requestId: number }).requestId;
    const ptyId = id(pty);
    const plainId = id(plain);
    const before = agent.warnings.length;
    const base = 0xffe00000;
    const resize = (cols: number, rows: number) => Buffer.from([cols & 0xff, cols >> 8, rows & 0xff, rows >> 8]);
    const frames: [number, Buffer, RegExp][] = [
      [0x0205, u32s(ptyId), /payload shorter than 8 bytes/],
      [0x0205, Buffer.concat([u32s(ptyId), resize(80, 24), Buffer.alloc(1)]), /RESIZE payload is 8 bytes/],
      [0x0205, Buffer.concat([u32s(ptyId), resize(0, 24)]), /both must be 1 or more/],
      [0x0205, Buffer.concat([u32s(ptyId), resize(80, 0)]), /both must be 1 or more/],
      [0x0205, Buffer.concat([u32s(plainId), resize(80, 24)]), /has no terminal/],
      [0x0205, Buffer.concat([u32s(0x7fffffff), resize(80, 24)]), /no running process/],
      [0x0201, Buffer.concat([u32s(2, 1, 0, 0), str(''), str('true')]), /both must be 1 or more/],
      [0x0201, Buffer.concat([u32s(2, 1, 0, 80), str(''), str('true')]), /both must be 1 or more/],
      [0x0201, Buffer.concat([u32s(0, 1, 0, 80 + (24 << 16)), str(''), str('true')]), /without EXEC_PTY/],
      [0x0201, Buffer.concat([u32s(4, 1, 0, 0), str(''), str('true')]), /unknown EXEC flags 0x4/],
    ];
    frames.forEach(([op, payload], i) => agent.sendRaw(encodeFrame({ type: FrameType.Request, id: base + i, op, payload })));
    for (let t = 0; agent.warnings.length - before < frames.length && t < 500; t++) await sleep(10);
    const got = agent.warnings.slice(before);
    expect(got).toHaveLength(frames.length);
    frames.forEach(([, , re], i) => expect(got.find((w) => w.startsWith(`guest error for request ${base + i}:`))).toMatch(re));
    // The terminal still resizes; the resize of a process without one is a typed error.
    await pty.resize({ cols: 10, rows: 10 });
    await pty.kill('SIGKILL');
    await plain.kill('SIGKILL');
    expect((await pty.exited).signal).toBe('SIGKILL');
    await plain.exited;
    await expect(pty.resize({ cols: 10, rows: 10 })).rejects.toBeInstanceOf(GuestRequestError);
  });
});
