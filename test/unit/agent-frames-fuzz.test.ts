// The Linux guest agent's frame reading (native-prebuilds/agent/agent-frames.h, the code agent.c
// runs on every byte the host sends) under its seeded fuzz driver (fuzz-frames.c), built here with
// the host's C compiler under AddressSanitizer and UndefinedBehaviorSanitizer. Without a compiler
// the test is skipped, and says so.
import { execFileSync, spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { FUZZ_SEED, fuzzRuns } from '../fuzz-seed';

const AGENT_DIR = join(__dirname, '..', '..', '..', 'native-prebuilds', 'agent');
const SANITIZE = ['-fsanitize=address,undefined', '-fno-sanitize-recover=all'];

/** $CC, else the first of gcc, clang and cc that runs. */
function findCompiler(): string | undefined {
  for (const cc of [process.env.CC, 'gcc', 'clang', 'cc']) {
    if (!cc) continue;
    if (spawnSync(cc, ['--version'], { stdio: 'ignore' }).status === 0) return cc;
  }
  return undefined;
}

const compiler = findCompiler();
if (!compiler) console.log('agent-frames fuzz: SKIPPED, no C compiler found ($CC, gcc, clang or cc): the agent\'s frame parser was not fuzzed');

describe("the guest agent's frame parser under ASan and UBSan", () => {
  let dir: string;
  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-agent-fuzz-'));
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  (compiler ? it : it.skip)('valid streams come whole and in order however cut; hostile streams and payload strings stay inside their bytes; CREDIT frames read as the protocol says and a stream never sends beyond its credit; user specs, passwd and group texts are read within their bytes (seeded)', () => {
    const bin = join(dir, 'fuzz-frames');
    execFileSync(compiler!, ['-O1', '-g', '-Wall', '-Wextra', '-Werror', ...SANITIZE, '-o', bin, join(AGENT_DIR, 'fuzz-frames.c')], { stdio: 'pipe' });
    // 40 rounds take about 2 s on the two shared cores; PVISOR_FUZZ_RUNS runs more.
    const rounds = fuzzRuns(40);
    const r = spawnSync(bin, [String(FUZZ_SEED), String(rounds)], { encoding: 'utf8', env: { ...process.env, ASAN_OPTIONS: 'detect_leaks=1:abort_on_error=0', UBSAN_OPTIONS: 'print_stacktrace=1' } });
    console.log(`agent-frames fuzz (${compiler}, ASan+UBSan): ${r.stdout.trim().split('\n').join('; ')}`);
    if (r.status !== 0) throw new Error(`fuzz-frames failed (exit ${r.status ?? r.signal}); reproduce with PVISOR_FUZZ_SEED=${FUZZ_SEED} PVISOR_FUZZ_RUNS=${rounds}\n${r.stdout}\n${r.stderr.slice(0, 8000)}`);
    expect(r.stdout).toContain(`fuzz-frames: seed ${FUZZ_SEED}, ${rounds} rounds`);
    expect(r.stdout).toContain(`fuzz-frames: ok, ${rounds} rounds of each property`);
  });

  (compiler ? it : it.skip)('the agent itself builds against agent-frames.h with warnings as errors', () => {
    execFileSync(compiler!, ['-fsyntax-only', '-Wall', '-Wextra', '-Werror', join(AGENT_DIR, 'agent.c')], { stdio: 'pipe' });
  });
});
