// Commands as users expect (issue 26) on the Linux guest, on real KVM (the nested harness): one VM
// booted from the shipped initramfs (whose /etc/passwd has root and nobody) for every case.
// Users: `id -u` as nobody, a file written as nobody is nobody's, a root-only file refused to it,
// an unknown user named. A PTY running sh whose resize `stty size` sees. A background process
// with `{ keep }` listed by vm.processes() and found again by vm.process(pid).
import { GuestRequestError, UnknownUserError, Vm } from '../../src';
import type { GuestPty } from '../../src/guest/pty';

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Waits for `re` in what a terminal has shown. */
async function seen(text: () => string, re: RegExp, ms = 60_000): Promise<void> {
  for (let t = 0; t < ms / 20; t++) {
    if (re.test(text())) return;
    await sleep(20);
  }
  throw new Error(`${re} not seen within ${ms} ms; the terminal showed ${JSON.stringify(text().slice(-400))}`);
}

describe('commands as users expect on the Linux guest', () => {
  let vm: Vm;
  beforeAll(async () => {
    vm = await Vm.start({ memory: '256MiB', vcpus: 2, bootTimeoutMs: 180_000 });
  }, 200_000);
  afterAll(() => vm?.stop());

  it('users: id -u as nobody and as uid:gid, ownership of what nobody writes, a root-only file refused, an unknown user named', async () => {
    expect((await vm.exec('id -u; id -g; echo $HOME', { user: 'nobody' })).stdout).toBe('65534\n65534\n/nonexistent\n');
    expect((await vm.exec(['id', '-u'], { user: '1000:1000' })).stdout).toBe('1000\n');
    expect((await vm.exec('id -u')).stdout).toBe('0\n');

    await vm.files.write('/tmp/by-nobody.txt', 'mine', { user: 'nobody' });
    expect(await vm.files.stat('/tmp/by-nobody.txt')).toMatchObject({ uid: 65534, gid: 65534 });
    await vm.exec('echo x > /tmp/by-nobody-sh.txt', { user: 'nobody' });
    expect(await vm.files.stat('/tmp/by-nobody-sh.txt')).toMatchObject({ uid: 65534, gid: 65534 });

    await vm.files.write('/root/secret', 'root only', { mode: 0o600 });
    const read = await vm.files.read('/root/secret', { user: 'nobody' }).catch((e: unknown) => e);
    expect(read).toBeInstanceOf(GuestRequestError);
    expect(read).toMatchObject({ errno: 'EACCES' });
    const cat = await vm.exec('cat /root/secret', { user: 'nobody' });
    expect(cat.exitCode).not.toBe(0);
    expect(cat.stderr).toMatch(/Permission denied/);
    expect((await vm.files.read('/root/secret')).toString()).toBe('root only');

    const unknown = await vm.exec('true', { user: 'nosuchuser' }).catch((e: unknown) => e);
    expect(unknown).toBeInstanceOf(UnknownUserError);
    expect(unknown).toMatchObject({ user: 'nosuchuser' });
  }, 120_000);

  it('a PTY running sh: stty size before and after a resize, and its exit', async () => {
    const pty: GuestPty = vm.pty.create({ cols: 80, rows: 24, cmd: ['/bin/sh'] });
    let text = '';
    pty.output.on('data', (b: Buffer) => (text += b.toString('utf8')));
    await pty.write('stty size\r');
    await seen(() => text, /\b24 80\r\n/);
    await pty.resize({ cols: 120, rows: 40 });
    await pty.write('stty size; tty\r');
    await seen(() => text, /\b40 120\r\n/);
    await seen(() => text, /\/dev\/pts\/\d+\r\n/);
    await pty.write('exit 7\r');
    expect(await pty.wait()).toEqual({ exitCode: 7, signal: null });
  }, 120_000);

  it('a background process with { keep }: listed by vm.processes(), found by vm.process(pid), its tail then its live output', async () => {
    const p = vm.spawn('i=0; while [ $i -lt 2000 ]; do echo line-$i; i=$((i+1)); done; read x; echo "got $x"; sleep 600', { stdin: true, stdout: { keep: 100 } });
    const pid = await p.pid;
    for (let t = 0; !p.keptOutput().stdout.toString().includes('line-1999') && t < 3000; t++) await sleep(20);
    expect(vm.processes().find((i) => i.pid === pid)).toMatchObject({ state: 'running', exit: null });

    const found = vm.process(pid)!;
    expect(found).toBe(p);
    const kept = found.keptOutput();
    expect(kept.stdout.length).toBe(100);
    expect(kept.stdout.toString().endsWith('line-1999\n')).toBe(true);
    expect(kept.stdoutBytes).toBeGreaterThan(10_000);
    const heard: string[] = [];
    found.output({ onStdout: (c) => heard.push(c.toString()) });
    expect(heard.join('')).toBe(kept.stdout.toString());
    await found.write('hello\n');
    for (let t = 0; !heard.join('').includes('got hello') && t < 3000; t++) await sleep(20);
    expect(heard.join('').endsWith('line-1999\ngot hello\n')).toBe(true);
    await found.kill('SIGKILL');
    expect((await p.exited).signal).toBe('SIGKILL');
    expect(vm.processes().find((i) => i.pid === pid)).toMatchObject({ state: 'exited' });
  }, 120_000);
});
