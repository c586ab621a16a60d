// The Linux guest's files API (list, stat, mkdir, remove, rename, streamed write and read) and the
// timeoutMs / signal of files calls and spawn, on real KVM with the shipped agent. One VM for all
// of it: the nested harness boots slowly. Needs a /dev/kvm that runs guest kernel code.
import { createHash, randomBytes } from 'node:crypto';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { setFlagsFromString } from 'node:v8';
import { runInNewContext } from 'node:vm';
import { AbortError, GuestRequestError, OutputLimitError, TimeoutError, Vm } from '../../src';

const KiB = 1024;
const MiB = 1024 * KiB;
const NESTED = process.env.PVISOR_NESTED === '1';
const SLOW = NESTED ? 10 : 1;

// Live host memory, not garbage waiting for a collection: V8 collects external buffers only past
// tens of MiB, so without a gc() first a bounded transfer could look like one that holds the file.
// Twice: one gc() leaves ArrayBuffers to a concurrent sweep, still counted when it returns (on the
// host agent over a pty, 64 MiB written: 24.6 MiB "live" after one gc(), 1.5 MiB after two).
setFlagsFromString('--expose-gc');
const gc = runInNewContext('gc') as () => void;

/**
 * Peak growth of the host's live Buffer memory (after a gc) while `work` runs. A sample is two full
 * collections, which the VMM's devices (in this same event loop) wait for: the next one comes
 * after four times as long as the last took, so sampling costs the transfer at most a fifth of the
 * loop (every 100 ms, nested, it starved the console until a frame timed out).
 */
async function peakLiveBuffers<T>(work: () => Promise<T>): Promise<{ result: T; peakBytes: number; samples: number }> {
  gc();
  gc();
  const base = process.memoryUsage().arrayBuffers;
  let peak = 0;
  let samples = 0;
  let timer: NodeJS.Timeout | undefined;
  const sample = () => {
    const t0 = performance.now();
    gc();
    gc();
    peak = Math.max(peak, process.memoryUsage().arrayBuffers - base);
    samples++;
    return performance.now() - t0;
  };
  const next = (ms: number) => (timer = setTimeout(() => next(4 * sample()), Math.max(20, ms)));
  next(20);
  try {
    const result = await work();
    return { result, peakBytes: peak, samples };
  } finally {
    clearTimeout(timer);
  }
}

/** The paths the agent (PID 1) holds open, from /proc/1/fd. */
async function agentOpenPaths(vm: Vm): Promise<string[]> {
  const r = await vm.exec('for f in /proc/1/fd/*; do readlink "$f"; done');
  return r.stdout.split('\n').filter(Boolean);
}

describe('Linux guest files', () => {
  let vm: Vm;
  beforeAll(async () => {
    vm = await Vm.start({ memory: '512MiB', vcpus: 2, bootTimeoutMs: 180_000 });
  }, 200_000);
  afterAll(() => vm?.stop());

  it('mkdir, stat, list, rename and remove round trip', async () => {
    const f = vm.files;
    await f.mkdir('/tmp/t/a/b', { recursive: true });
    await f.mkdir('/tmp/t/a/b', { recursive: true }); // existing: done
    await expect(f.mkdir('/tmp/t/a/b')).rejects.toThrow(/EEXIST/);
    await f.mkdir('/tmp/t/private', { mode: 0o700 });
    await f.write('/tmp/t/a/file.txt', 'twelve bytes');
    expect((await vm.exec('ln -s file.txt /tmp/t/a/link && mkfifo /tmp/t/a/fifo')).exitCode).toBe(0);

    expect(await f.stat('/tmp/t/private')).toMatchObject({ type: 'directory', mode: 0o700, uid: 0, gid: 0 });
    const file = await f.stat('/tmp/t/a/file.txt');
    expect(file).toMatchObject({ type: 'file', mode: 0o644, size: 12 });
    // The guest's clock and the host's agree to within a minute (the VM booted just now).
    expect(Math.abs(file.mtimeMs - Date.now())).toBeLessThan(60_000 * SLOW);
    expect(await f.stat('/tmp/t/a/link')).toMatchObject({ type: 'symlink', target: 'file.txt', size: 8 });
    expect(await f.stat('/tmp/t/a/link', { followSymlinks: true })).toMatchObject({ type: 'file', size: 12 });
    expect((await f.stat('/tmp/t/a/link', { followSymlinks: true })).target).toBeUndefined();

    const listed = await f.list('/tmp/t/a');
    expect(listed.map((e) => [e.name, e.type]).sort()).toEqual([
      ['b', 'directory'],
      ['fifo', 'fifo'],
      ['file.txt', 'file'],
      ['link', 'symlink'],
    ]);
    expect(listed.find((e) => e.name === 'file.txt')).toMatchObject({ size: 12, mode: 0o644 });
    await expect(f.list('/tmp/t/a', { maxEntries: 3 })).rejects.toThrow(OutputLimitError);
    await expect(f.list('/tmp/t/a/file.txt')).rejects.toThrow(/ENOTDIR/);

    await f.rename('/tmp/t/a/file.txt', '/tmp/t/renamed.txt');
    expect((await f.read('/tmp/t/renamed.txt')).toString()).toBe('twelve bytes');
    await expect(f.stat('/tmp/t/a/file.txt')).rejects.toThrow(/ENOENT/);

    await expect(f.remove('/tmp/t/a')).rejects.toThrow(/ENOTEMPTY/);
    await f.remove('/tmp/t/renamed.txt');
    // A symlink to a directory is removed, never followed: the directory it names stays whole.
    await f.mkdir('/tmp/keep');
    await f.write('/tmp/keep/kept', 'x');
    expect((await vm.exec('ln -s /tmp/keep /tmp/t/a/b/to-keep')).exitCode).toBe(0);
    await f.remove('/tmp/t', { recursive: true });
    await expect(f.stat('/tmp/t')).rejects.toThrow(GuestRequestError);
    expect((await f.read('/tmp/keep/kept')).toString()).toBe('x');
    await f.remove('/tmp/keep', { recursive: true });
  }, 120_000);

  it('lists a directory of 5000 entries, which comes in several chunks', async () => {
    expect((await vm.exec('mkdir /tmp/many && cd /tmp/many && seq -w 1 5000 | xargs touch')).exitCode).toBe(0);
    const entries = await vm.files.list('/tmp/many');
    expect(entries).toHaveLength(5000);
    expect(new Set(entries.map((e) => e.name)).size).toBe(5000);
    expect(entries.every((e) => e.type === 'file' && e.size === 0)).toBe(true);
    await vm.files.remove('/tmp/many', { recursive: true });
  }, 120_000);

  it('streams 16 MiB in and out with the host holding a bounded part of it; sha256 checked in the guest', async () => {
    const size = 16 * MiB;
    const hash = createHash('sha256');
    // Generated as it is sent: the host never has the file whole.
    async function* source() {
      for (let sent = 0; sent < size; sent += 64 * KiB) {
        const chunk = randomBytes(64 * KiB);
        hash.update(chunk);
        yield chunk;
      }
    }
    const written = await peakLiveBuffers(() => pipeline(Readable.from(source()), vm.files.writeStream('/tmp/stream/big.bin', { mode: 0o600, timeoutMs: 30_000 * SLOW })));
    const expected = hash.digest('hex');
    const sum = await vm.exec(['sha256sum', '/tmp/stream/big.bin']);
    expect(sum.stdout.split(' ')[0]).toBe(expected);
    expect(await vm.files.stat('/tmp/stream/big.bin')).toMatchObject({ size, mode: 0o600 });

    const back = createHash('sha256');
    const read = await peakLiveBuffers(async () => {
      for await (const chunk of vm.files.readStream('/tmp/stream/big.bin', { timeoutMs: 30_000 * SLOW })) back.update(chunk as Buffer);
    });
    expect(back.digest('hex')).toBe(expected);
    console.log(`16 MiB streamed: peak live host buffers ${(written.peakBytes / MiB).toFixed(1)} MiB writing (${written.samples} samples), ${(read.peakBytes / MiB).toFixed(1)} MiB reading (${read.samples} samples)`);
    // The stream buffers (the write stream's 1 MiB, the read stream's 256 KiB credit window), a
    // frame or two in flight and their copies.
    expect(written.peakBytes).toBeLessThan(size / 2);
    expect(read.peakBytes).toBeLessThan(size / 2);
    await vm.files.remove('/tmp/stream', { recursive: true });
  }, 300_000);

  it('timeoutMs and signal end files calls that the guest cannot finish, and the agent closes what they opened', async () => {
    const f = vm.files;
    expect((await vm.exec('mkfifo /tmp/nobody-writes /tmp/nobody-reads')).exitCode).toBe(0);
    // A FIFO nobody writes: the read waits in the agent's poll loop until the host gives up.
    await expect(f.read('/tmp/nobody-writes', { timeoutMs: 1000 })).rejects.toThrow(TimeoutError);
    const ac = new AbortController();
    const reading = f.read('/tmp/nobody-writes', { signal: ac.signal });
    setTimeout(() => ac.abort(), 200);
    await expect(reading).rejects.toThrow(AbortError);
    const stream = f.readStream('/tmp/nobody-writes', { signal: AbortSignal.timeout(300) });
    await expect((async () => { for await (const _ of stream) void _; })()).rejects.toThrow(AbortError);

    // A FIFO whose only reader never reads: the write fills the pipe, then waits.
    const holder = vm.spawn('exec 3<>/tmp/nobody-reads; echo ready; exec sleep 600');
    await new Promise((resolve) => holder.stdout.once('data', resolve));
    await expect(pipeline(Readable.from([randomBytes(2 * MiB)]), f.writeStream('/tmp/nobody-reads', { timeoutMs: 1000 }))).rejects.toThrow(TimeoutError);
    await holder.kill('SIGKILL');

    // Nothing sent for a signal aborted already.
    await expect(f.stat('/', { signal: AbortSignal.abort() })).rejects.toThrow(AbortError);
    // The cancels went before this exec: the agent serves in order, so they are done.
    expect((await agentOpenPaths(vm)).filter((p) => p.includes('/tmp/nobody'))).toEqual([]);
    await f.remove('/tmp/nobody-writes');
    await f.remove('/tmp/nobody-reads');
  }, 120_000);

  it('spawn with timeoutMs or signal kills the process and rejects exited', async () => {
    const timed = vm.spawn(['sleep', '600'], { timeoutMs: 1000 });
    const timedPid = await timed.pid;
    await expect(timed.exited).rejects.toThrow(TimeoutError);
    const ac = new AbortController();
    const aborted = vm.spawn(['sleep', '600'], { signal: ac.signal });
    const abortedPid = await aborted.pid;
    ac.abort();
    await expect(aborted.exited).rejects.toThrow(AbortError);
    // Both processes are gone from the guest.
    expect((await vm.exec(['sh', '-c', `test -e /proc/${timedPid} || test -e /proc/${abortedPid}; echo $?`])).stdout.trim()).toBe('1');
    await expect(vm.spawn(['true'], { signal: AbortSignal.abort() }).exited).rejects.toThrow(AbortError);
  }, 120_000);
});
