// exec's output as an orchestrator wants it (issue 26): bytes with `encoding: 'buffer'`, each
// piece as it comes through onStdout/onStderr (a UTF-8 character never split), and a spawned
// process's stdin as a Writable that pipeline() can feed. The real agent on this host
// (../host-agent.ts) serving the real LinuxGuest. Skipped, saying so, without a C compiler.
import { randomBytes } from 'node:crypto';
import { Readable } from 'node:stream';
import { pipeline } from 'node:stream/promises';
import { InvalidOptionError } from '../../src';
import { parseEnvironment } from '../../src/guest/environment';
import { LinuxGuest } from '../../src/guest/linux-client';
import { findCompiler, useHostAgent } from '../host-agent';

const compiler = findCompiler();
if (!compiler) console.log('exec output: SKIPPED, no C compiler found ($CC, gcc, clang or cc): the agent was not run on the host');
const describeWithCompiler = compiler ? describe : describe.skip;

describeWithCompiler('exec output and stdin', () => {
  const agent = useHostAgent(compiler!);

  it("encoding 'buffer' gives the bytes as written, which a string would have mangled", async () => {
    const r = await agent.linux.exec(['printf', '\\377\\000\\200a'], { encoding: 'buffer' });
    expect(Buffer.isBuffer(r.stdout)).toBe(true);
    expect([...r.stdout]).toEqual([0xff, 0x00, 0x80, 0x61]);
    const s = await agent.linux.exec(['printf', '\\377a']);
    expect(s.stdout).toBe('\ufffda');
    await expect(agent.linux.exec('true', { encoding: 'latin1' } as never)).rejects.toThrow(InvalidOptionError);
  });

  it('onStdout and onStderr get each piece as it comes; together they are the output, a character split between writes given whole', async () => {
    const out: string[] = [];
    const err: string[] = [];
    // U+1F600 in two writes, 200 ms apart: two chunks from the guest.
    const r = await agent.linux.exec("printf 'one\\n\\360\\237'; sleep 0.2; printf '\\230\\200 two\\n'; echo oops >&2", { onStdout: (c) => out.push(c), onStderr: (c) => err.push(c) });
    expect(out.join('')).toBe(r.stdout);
    expect(r.stdout).toBe('one\n\u{1F600} two\n');
    expect(out.length).toBeGreaterThanOrEqual(2);
    expect(out.some((c) => c.includes('\ufffd'))).toBe(false);
    expect(err.join('')).toBe('oops\n');
    const bytes: Buffer[] = [];
    const b = await agent.linux.exec(['head', '-c', '300000', '/dev/urandom'], { encoding: 'buffer', onStdout: (c) => bytes.push(c) });
    expect(Buffer.concat(bytes).equals(b.stdout)).toBe(true);
    expect(b.stdout.length).toBe(300000);
    await expect(agent.linux.exec('true', { onStdout: 'log' } as never)).rejects.toThrow(/onStdout: expected a function, got string/);
    // A callback that throws ends its command with that error; the agent serves on.
    const t0 = performance.now();
    await expect(agent.linux.exec('echo first; sleep 30', { onStdout: () => { throw new Error('the consumer gave up'); } })).rejects.toThrow('the consumer gave up');
    expect(performance.now() - t0).toBeLessThan(10_000);
    expect((await agent.linux.exec(['echo', 'still here'])).stdout).toBe('still here\n');
  });

  it("a spawned process's stdin is a Writable: pipeline() feeds it and finishes once the guest has it all", async () => {
    const input = randomBytes(1536 * 1024);
    const p = agent.linux.spawn(['sha256sum'], { stdin: true });
    const out: Buffer[] = [];
    p.stdout.on('data', (b: Buffer) => out.push(b));
    await pipeline(Readable.from([input.subarray(0, 1000), input.subarray(1000)]), p.stdin!);
    expect(await p.exited).toEqual({ exitCode: 0, signal: null });
    const { createHash } = await import('node:crypto');
    expect(Buffer.concat(out).toString().split(' ')[0]).toBe(createHash('sha256').update(input).digest('hex'));
    expect(agent.linux.spawn(['true']).stdin).toBeNull();
  });

  it("the VM's env (Vm.start's env) is every command's, under the command's own, sent with each request", async () => {
    const sandboxed = new LinuxGuest(agent.client, parseEnvironment('env', { SANDBOX_A: 'sandbox', SANDBOX_B: 'sandbox' }));
    const r = await sandboxed.exec('echo "$SANDBOX_A $SANDBOX_B $OWN"', { env: { SANDBOX_B: 'own', OWN: 'own' } });
    expect(r.stdout).toBe('sandbox own own\n');
    expect((await sandboxed.exec('echo "$SANDBOX_A"')).stdout).toBe('sandbox\n');
    const p = sandboxed.spawn(['sh', '-c', 'echo "$SANDBOX_B"']);
    const out: Buffer[] = [];
    p.stdout.on('data', (b: Buffer) => out.push(b));
    await p.exited;
    expect(Buffer.concat(out).toString()).toBe('sandbox\n');
    // The agent keeps nothing of it: a guest client without it gives none.
    expect((await agent.linux.exec('echo "[$SANDBOX_A]"')).stdout).toBe('[]\n');
  });
});
