// The host's model of pvisor-workset's memory (probe-content.ts, through LinuxWorkingSet) against
// the tool's own C code (native-prebuilds/linux-guest/workset.c with the probe's content.h),
// built here for the host with its C compiler and driven through the real client: seeded fills,
// rewrites, zeroed and freed ranges must digest in the C code exactly as the host predicts. The
// holder and its commands run as host processes instead of guest ones; the client cannot tell
// (it sees a spawned process's output and each command's stdout and exit status). Without a
// compiler the test is skipped, and says so.
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GuestRequestError } from '../../src/errors';
import type { GuestProcess } from '../../src/guest/guest-process';
import type { ExecResult } from '../../src/guest/guest-types';
import { LinuxWorkingSet, WORKSET_PATH, type WorkingSetGuest } from '../../src/guest/linux-workset';
import { PROBE_CONTENTS } from '../../src/guest/probe-content';
import { property } from '../fuzz-seed';

const GUEST_DIR = join(__dirname, '..', '..', '..', 'native-prebuilds', 'linux-guest');

function findCompiler(): string | undefined {
  for (const cc of [process.env.CC, 'gcc', 'clang', 'cc']) {
    if (cc && spawnSync(cc, ['--version'], { stdio: 'ignore' }).status === 0) return cc;
  }
  return undefined;
}

const compiler = findCompiler();
if (!compiler) console.log("linux-workset: SKIPPED, no C compiler found ($CC, gcc, clang or cc): the host's digest model was not checked against workset.c");

/** This host standing in for the guest: `bin` wherever the client names the guest's tool. */
function hostGuest(bin: string): WorkingSetGuest {
  const argvOf = (command: string[]) => command.map((a) => (a === WORKSET_PATH ? bin : a));
  return {
    spawn: (command) => {
      const [cmd, ...args] = argvOf(command);
      const child = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'] });
      const exited = new Promise((resolve) => child.on('exit', (exitCode, signal) => resolve({ exitCode, signal })));
      return { stdout: child.stdout, stderr: child.stderr, exited } as unknown as GuestProcess;
    },
    exec: async (command) => {
      const [cmd, ...args] = argvOf(command);
      const r = spawnSync(cmd, args, { encoding: 'utf8' });
      return { exitCode: r.status, signal: r.signal, stdout: r.stdout, stderr: r.stderr } as ExecResult;
    },
  };
}

describe('pvisor-workset against the host model', () => {
  let dir: string;
  let bin: string;
  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-workset-'));
    bin = join(dir, 'pvisor-workset');
    if (compiler) execFileSync(compiler, ['-O2', '-Wall', '-Wextra', '-Werror', '-std=gnu11', '-Dworkset_main=main', '-o', bin, join(GUEST_DIR, 'workset.c')], { stdio: 'pipe' });
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  const digests = compiler ? property : (name: string) => it.skip(name, () => {});
  digests('fills, rewrites, zeroed and freed ranges digest in the C code as the host model predicts', 10, async (rng, run) => {
    const ws = await LinuxWorkingSet.start(hostGuest(bin), { socket: join(dir, `run-${run}.sock`) });
    try {
      const pages = rng.between(0, 96);
      const mib = (n: number) => (n * 4096) / 2 ** 20;
      await ws.fill({ sizeMiB: mib(pages), content: rng.pick(PROBE_CONTENTS), seed: rng.u32() });
      await ws.check();
      for (let step = rng.between(1, 6); step > 0; step--) {
        const first = rng.int(pages + 1);
        const count = rng.between(0, pages - first);
        const op = rng.int(3);
        if (op === 0) await ws.rewrite({ fraction: rng.between(0, 1000) / 1000, seed: rng.u32() });
        else if (op === 1) await ws.zero({ offsetMiB: mib(first), sizeMiB: mib(count) });
        else await ws.release({ offsetMiB: mib(first), sizeMiB: mib(count) });
        await ws.check();
      }
      // A second client of the same holder, with a copy of the model (as a restored VM's is).
      const again = LinuxWorkingSet.attach(hostGuest(bin), ws.model, { socket: ws.socket });
      await again.check();
      expect((await again.release()).bytes).toBe(pages * 4096);
      // An empty working set digests to the two lanes' starting values.
      expect((await again.check()).hex).toBe('01000193811c9dc5');
    } finally {
      await ws.close();
    }
  });

  (compiler ? it : it.skip)('a working set changed behind the model is caught, and bad commands are errors the holder survives', async () => {
    const guest = hostGuest(bin);
    const ws = await LinuxWorkingSet.start(guest, { socket: join(dir, 'bad.sock') });
    try {
      await ws.fill({ sizeMiB: 1, content: 'random', seed: 42 });
      await expect(ws.touch({ hotMiB: 2 })).rejects.toThrow(GuestRequestError);
      // Pages rewritten behind the model's back: the digest must not pass.
      expect((await guest.exec([WORKSET_PATH, ws.socket, 'rewrite', '10', '99'], {})).exitCode).toBe(0);
      await expect(ws.check()).rejects.toThrow(/host's model/);
      const long = await guest.exec([WORKSET_PATH, ws.socket, 'fill', 'x'.repeat(600)], {});
      expect(long.exitCode).toBe(1);
      expect(long.stdout).toMatch(/at most/);
      const unknown = await guest.exec([WORKSET_PATH, ws.socket, 'grow'], {});
      expect(unknown.stdout).toMatch(/^error unknown command grow/);
      expect((await ws.touch({ hotMiB: 1, rounds: 2 })).pagesTouched).toBe(512);
    } finally {
      await ws.close();
    }
  });
});
