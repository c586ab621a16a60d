// Background processes (issue 26): `stdout` / `stderr` as 'pipe', 'ignore' or { keep: bytes }, and
// the registry behind `vm.processes()` / `vm.process(pid)`, with the real agent on this host
// (../host-agent.ts: agent.c under ASan and UBSan over a socketpair) serving the real LinuxGuest.
// A kept stream is drained as it comes (it never holds its writer), keeps only its tail, and a
// reattach gets that tail, then what comes. Skipped, saying so, without a C compiler.
import { STREAM_WINDOW_BYTES } from '../../src/protocol/stream-window';
import { findCompiler, useHostAgent } from '../host-agent';

const compiler = findCompiler();
if (!compiler) console.log('guest processes: SKIPPED, no C compiler found ($CC, gcc, clang or cc): the agent was not run on the host');
const describeWithCompiler = compiler ? describe : describe.skip;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describeWithCompiler('background processes with the real agent on the host', () => {
  const agent = useHostAgent(compiler!);

  it('a kept stream is drained past many windows, keeps only its last bytes, and its process is listed, found and ended', async () => {
    // 8 windows of output nobody reads: with 'pipe' it would stop after one.
    const total = 8 * STREAM_WINDOW_BYTES;
    const p = agent.linux.spawn(['sh', '-c', `head -c ${total - 3} /dev/zero | tr '\\0' a; printf END; echo oops >&2; exec sleep 30`], { stdout: { keep: 1000 }, stderr: 'ignore' });
    const pid = await p.pid;
    for (let t = 0; p.keptOutput().stdoutBytes < total && t < 1000; t++) await sleep(10);
    const kept = p.keptOutput();
    expect(kept.stdoutBytes).toBe(total);
    expect(kept.stdout.length).toBe(1000);
    expect(kept.stdout.toString()).toBe(`${'a'.repeat(997)}END`);
    expect(kept.stderr.length).toBe(0);
    // 'ignore' and 'keep' give an empty stream to the caller.
    expect(await p.stdout.toArray()).toEqual([]);
    expect(await p.stderr.toArray()).toEqual([]);

    const listed = agent.linux.processes().find((i) => i.pid === pid);
    expect(listed).toMatchObject({ pid, state: 'running', exit: null });
    expect(listed!.command).toContain('head -c');
    expect(agent.linux.process(pid)).toBe(p);

    // A reattach: the tail first, then what comes live.
    const heard: string[] = [];
    const stop = agent.linux.process(pid)!.output({ onStdout: (c) => heard.push(c.toString()) });
    expect(heard).toEqual([kept.stdout.toString()]);
    stop();
    await agent.linux.process(pid)!.kill('SIGKILL');
    expect((await p.exited).signal).toBe('SIGKILL');
    // Ended with output kept: still listed, with its exit, and its tail still readable.
    expect(agent.linux.processes().find((i) => i.pid === pid)).toMatchObject({ state: 'exited', exit: { exitCode: null, signal: 'SIGKILL' } });
    expect(agent.linux.process(pid)!.keptOutput().stdout.toString().endsWith('END')).toBe(true);
  });

  it('a follower gets live output as it comes, and one that throws is dropped without ending the process', async () => {
    const p = agent.linux.spawn(['sh', '-c', 'echo one; read x; echo "two $x"; echo err >&2'], { stdin: true, stdout: { keep: 64 }, stderr: { keep: 64 } });
    const pid = await p.pid;
    for (let t = 0; p.keptOutput().stdoutBytes < 4 && t < 500; t++) await sleep(10);
    const out: string[] = [];
    const err: string[] = [];
    agent.linux.process(pid)!.output({ onStdout: (c) => out.push(c.toString()), onStderr: (c) => err.push(c.toString()) });
    agent.linux.process(pid)!.output({
      onStdout: () => {
        throw new Error('a careless follower');
      },
    });
    await p.write('live\n');
    expect(await p.exited).toEqual({ exitCode: 0, signal: null });
    expect(out.join('')).toBe('one\ntwo live\n');
    expect(err.join('')).toBe('err\n');
  });

  it("a 'pipe' process is listed while it runs and forgotten when it ends; exec is not listed", async () => {
    const p = agent.linux.spawn(['sleep', '30']);
    const pid = await p.pid;
    expect(agent.linux.processes().map((i) => i.pid)).toContain(pid);
    expect(agent.linux.process(pid)!.keptOutput()).toEqual({ stdout: Buffer.alloc(0), stderr: Buffer.alloc(0), stdoutBytes: 0, stderrBytes: 0 });
    await p.kill('SIGKILL');
    await p.exited;
    await sleep(0);
    expect(agent.linux.process(pid)).toBeUndefined();
    const before = agent.linux.processes().length;
    await agent.linux.exec('true');
    expect(agent.linux.processes().length).toBe(before);
    expect(agent.linux.process(1)).toBeUndefined();
  });

  it('a command that never started is never listed', async () => {
    const p = agent.linux.spawn(['no-such-command-pvisor'], { stdout: { keep: 10 } });
    await expect(p.exited).rejects.toThrow(/command not found/);
    expect(agent.linux.processes().some((i) => i.command === 'no-such-command-pvisor')).toBe(false);
  });
});
