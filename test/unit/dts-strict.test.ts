// The shipped .d.ts type-checks in a user's project with the strictest settings users have
// (strict, exactOptionalPropertyTypes, noUncheckedIndexedAccess, no skipLibCheck), reached the way
// a user reaches it: `import ... from 'pvisor'` through package.json's exports. The program is
// test/user-program/orchestrator.ts; a typo in an option must still be caught by the compiler.
import { spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const root = join(__dirname, '..', '..', '..');
const tsc = join(root, 'node_modules', 'typescript', 'bin', 'tsc');
const program = readFileSync(join(root, 'test', 'user-program', 'orchestrator.ts'), 'utf8');

/** Compiles `source` as a user's app.ts against the built package; returns tsc's exit code and output. */
function compileAsUser(source: string): { status: number | null; output: string } {
  const dir = mkdtempSync(join(tmpdir(), 'pvisor-dts-'));
  try {
    mkdirSync(join(dir, 'node_modules', '@types'), { recursive: true });
    symlinkSync(root, join(dir, 'node_modules', 'pvisor'));
    symlinkSync(join(root, 'node_modules', '@types', 'node'), join(dir, 'node_modules', '@types', 'node'));
    writeFileSync(join(dir, 'app.ts'), source);
    const compilerOptions = {
      strict: true,
      exactOptionalPropertyTypes: true,
      noUncheckedIndexedAccess: true,
      skipLibCheck: false,
      module: 'node16',
      moduleResolution: 'node16',
      target: 'es2022',
      lib: ['es2022', 'esnext.disposable'],
      types: ['node'],
      noEmit: true,
    };
    writeFileSync(join(dir, 'tsconfig.json'), JSON.stringify({ compilerOptions, files: ['app.ts'] }));
    const r = spawnSync(process.execPath, [tsc, '-p', dir], { encoding: 'utf8', timeout: 120_000 });
    return { status: r.status, output: r.stdout + r.stderr };
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

describe('the shipped .d.ts in a strict user project', () => {
  it('type-checks a program using the public API under strict + exactOptionalPropertyTypes + noUncheckedIndexedAccess', () => {
    const r = compileAsUser(program);
    expect(r.output).toBe('');
    expect(r.status).toBe(0);
  });

  it('still catches a typo in an option (so the check above could fail)', () => {
    const r = compileAsUser(program.replace("memory: '512MiB'", "memroy: '512MiB'"));
    expect(r.status).not.toBe(0);
    expect(r.output).toMatch(/memroy/);
  });
});
