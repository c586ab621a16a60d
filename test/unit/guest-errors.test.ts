// The guest's refusals as errors a caller can act on (issue 26): each names the call and its path
// or command, carries the errno name and keeps the op code as a field; a command that does not
// exist is a CommandNotFoundError with exit status 127. The real agent on this host
// (../host-agent.ts), serving the real LinuxGuest. Skipped, saying so, without a C compiler.
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { CommandNotFoundError, GuestRequestError } from '../../src';
import { FileOp } from '../../src/guest/file-wire';
import { findCompiler, useHostAgent } from '../host-agent';

const compiler = findCompiler();
if (!compiler) console.log('guest errors: SKIPPED, no C compiler found ($CC, gcc, clang or cc): the agent was not run on the host');
const describeWithCompiler = compiler ? describe : describe.skip;

async function rejection(p: Promise<unknown>): Promise<GuestRequestError> {
  const e = await p.then(() => undefined, (err: unknown) => err);
  expect(e).toBeInstanceOf(GuestRequestError);
  return e as GuestRequestError;
}

describeWithCompiler('errors of guest requests', () => {
  const agent = useHostAgent(compiler!);
  let work: string;
  beforeAll(async () => {
    work = mkdtempSync(join(tmpdir(), 'pvisor-guest-errors-'));
  }, 120_000);
  afterAll(async () => {
    rmSync(work, { recursive: true, force: true });
  });

  it('a file call names itself and its path, with the errno name and the op code as fields', async () => {
    const missing = join(work, 'nope.txt');
    const read = await rejection(agent.linux.files.read(missing));
    expect(read.message).toBe(`files.read('${missing}'): ENOENT: No such file or directory: ${missing}`);
    expect(read).toMatchObject({ errno: 'ENOENT', op: FileOp.Read, call: `files.read('${missing}')` });
    const stat = await rejection(agent.linux.files.stat(missing));
    expect(stat).toMatchObject({ errno: 'ENOENT', op: FileOp.Stat, call: `files.stat('${missing}')` });
    const mkdir = await rejection(agent.linux.files.mkdir(work));
    expect(mkdir.message).toMatch(/^files\.mkdir\('.*'\): EEXIST: /);
    const rename = await rejection(agent.linux.files.rename(missing, join(work, 'b')));
    expect(rename.message).toMatch(/^files\.rename\('.*nope\.txt', '.*\/b'\): ENOENT: /);
  });

  it("a path's quotes and control characters cannot forge the message", async () => {
    const odd = join(work, "it's\nfake");
    const e = await rejection(agent.linux.files.stat(odd));
    expect(e.call).toBe(`files.stat('${join(work, "it\\'s?fake")}')`);
    expect(e.message).not.toContain('\n');
  });

  it('a command that does not exist is a CommandNotFoundError with exit status 127; a shell line gets the shell\'s 127', async () => {
    const e = await rejection(agent.linux.exec(['no-such-command-pvisor', '-x']));
    expect(e).toBeInstanceOf(CommandNotFoundError);
    expect(e).toMatchObject({ command: 'no-such-command-pvisor', exitCode: 127, errno: 'ENOENT', call: "exec('no-such-command-pvisor -x')" });
    expect(e.message).toBe("exec('no-such-command-pvisor -x'): no-such-command-pvisor: command not found (ENOENT); exit status 127");
    const p = agent.linux.spawn(['/etc/passwd']);
    const notExecutable = await rejection(p.exited);
    expect(notExecutable).toBeInstanceOf(CommandNotFoundError);
    expect(notExecutable).toMatchObject({ errno: 'EACCES', call: "spawn('/etc/passwd')" });
    await expect(p.pid).rejects.toBe(notExecutable);
    const viaShell = await agent.linux.exec('no-such-command-pvisor');
    expect(viaShell.exitCode).toBe(127);
    // A missing working directory is not a missing command.
    const cwd = await rejection(agent.linux.exec(['true'], { cwd: join(work, 'no-dir') }));
    expect(cwd).not.toBeInstanceOf(CommandNotFoundError);
    expect(cwd.message).toMatch(/^exec\('true'\): ENOENT: .*no-dir$/);
  });
});
