// The host's model of pvisor-workset's memory (probe-content.ts, through LinuxWorkingSet) against
// the tool's own C code (native-prebuilds/linux-guest/workset.c with the probe's content.h),
// built here for the host with its C compiler and driven through the real client: seeded fills,
// rewrites and zeroed ranges must digest in the C code exactly as the host predicts. The process
// runs on the host instead of in a guest; the client cannot tell (it only sees stdin, stdout and
// an exit). Without a compiler the test is skipped, and says so.
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GuestRequestError } from '../../src/errors';
import type { GuestProcess } from '../../src/guest/linux-client';
import { LinuxWorkingSet, type SpawnInGuest } from '../../src/guest/linux-workset';
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

/** Runs `bin` as the client's guest process. */
function hostProcess(bin: string): SpawnInGuest {
  return () => {
    const child = spawn(bin, [], { stdio: ['pipe', 'pipe', 'pipe'] });
    const exited = new Promise<{ exitCode: number | null; signal: NodeJS.Signals | null }>((resolve) => child.on('exit', (exitCode, signal) => resolve({ exitCode, signal })));
    const p = {
      stdout: child.stdout,
      stderr: child.stderr,
      exited,
      write: (data: string) => new Promise<void>((resolve, reject) => child.stdin.write(data, (e) => (e ? reject(e) : resolve()))),
      kill: async (signal: NodeJS.Signals) => void child.kill(signal),
    };
    return p as unknown as GuestProcess;
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
  digests('fills, rewrites and zeroed ranges digest in the C code as the host model predicts', 12, async (rng) => {
    const ws = LinuxWorkingSet.start(hostProcess(bin));
    try {
      const pages = rng.between(0, 96);
      await ws.fill({ sizeMiB: (pages * 4096) / 2 ** 20, content: rng.pick(PROBE_CONTENTS), seed: rng.u32() });
      await ws.check();
      for (let step = rng.between(1, 5); step > 0; step--) {
        if (rng.chance(0.5)) await ws.rewrite({ fraction: rng.between(0, 1000) / 1000, seed: rng.u32() });
        else if (pages > 0) {
          const first = rng.int(pages);
          await ws.zero({ offsetMiB: (first * 4096) / 2 ** 20, sizeMiB: (rng.between(0, pages - first) * 4096) / 2 ** 20 });
        }
        await ws.check();
      }
      expect((await ws.task(join(dir, `task-${rng.u32()}`))).hex).toBe(ws.expectedDigest());
      expect((await ws.release()).bytes).toBe(pages * 4096);
      // An empty working set digests to the two lanes' starting values.
      expect((await ws.check()).hex).toBe('01000193811c9dc5');
    } finally {
      await ws.close();
    }
  });

  (compiler ? it : it.skip)('a working set changed behind the model is caught, and bad commands are errors the tool survives', async () => {
    const ws = LinuxWorkingSet.start(hostProcess(bin));
    try {
      await ws.fill({ sizeMiB: 1, content: 'random', seed: 42 });
      await expect(ws.touch({ hotMiB: 2 })).rejects.toThrow(GuestRequestError);
      // The tool rewrites pages the model does not know of: the digest must not pass.
      await (ws as unknown as { command(line: string, verb: string): Promise<unknown> }).command('rewrite 10 99', 'rewrite');
      await expect(ws.check()).rejects.toThrow(/host's model/);
      await expect((ws as unknown as { command(line: string, verb: string): Promise<unknown> }).command('x'.repeat(600), 'fill')).rejects.toThrow(/at most/);
      expect((await ws.touch({ hotMiB: 1, rounds: 2 })).pagesTouched).toBe(512);
    } finally {
      await ws.close();
    }
  });
});
