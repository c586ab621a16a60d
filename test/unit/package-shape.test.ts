// What a user installs: the packed file list (npm pack --dry-run), its entry points, source maps
// that point at shipped sources, the examples written against the package's own name, and a
// package without its optional dependency (zstd-napi really absent, not mocked away).
import { execFileSync, spawnSync } from 'node:child_process';
import { cpSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, symlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, normalize } from 'node:path';

const root = join(__dirname, '..', '..', '..');
const pkg = JSON.parse(readFileSync(join(root, 'package.json'), 'utf8')) as {
  name: string;
  engines: { node: string };
  exports: Record<string, { types: string; default: string } | string>;
  bin: Record<string, string>;
  dependencies: Record<string, string>;
  optionalDependencies: Record<string, string>;
  devDependencies: Record<string, string>;
};

let packed: Set<string>;
beforeAll(() => {
  const out = execFileSync('npm', ['pack', '--dry-run', '--json', '--ignore-scripts'], { cwd: root, encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] });
  packed = new Set((JSON.parse(out) as { files: { path: string }[] }[])[0].files.map((f) => f.path));
}, 60_000);

describe('the packed package', () => {
  it('holds the entry points, the native prebuilds, the licences and no tests', () => {
    for (const f of ['package.json', 'README.md', 'LICENSE', 'NOTICE.md', 'dist/src/index.js', 'dist/src/index.d.ts', 'src/index.ts']) expect(packed).toContain(f);
    for (const f of ['vmlinuz', 'initramfs.cpio.gz', 'probe.bin', 'libpvisor-vcpu.so', 'libpvisor-memory.so']) {
      expect(packed).toContain(`native-prebuilds/linux-x64/${f}`);
      expect(packed).toContain(`native-prebuilds/linux-x64/${f}.sha256`);
    }
    // The GPL'd parts' build scripts ship beside them (NOTICE.md points at them).
    for (const f of ['native-prebuilds/linux-guest/build-kernel.sh', 'native-prebuilds/linux-guest/config', 'native-prebuilds/linux-guest/build-initramfs.sh']) expect(packed).toContain(f);
    const stray = [...packed].filter((f) => /^(dist\/)?(test|examples|scripts)\/|^\.ci\/|^docs\//.test(f));
    expect(stray).toEqual([]);
  });

  it('exports, types and bins point at packed files; bins are node scripts', () => {
    // '.' for users, './strategy' for a strategy's author (issue 25).
    for (const entry of ['.', './strategy']) {
      const e = pkg.exports[entry] as { types: string; default: string };
      expect(packed).toContain(normalize(e.types));
      expect(packed).toContain(normalize(e.default));
    }
    for (const [name, path] of Object.entries(pkg.bin)) {
      expect([name, packed.has(normalize(path))]).toEqual([name, true]);
      // node itself, or node with flags through env -S (test/unit/cli-usage.test.ts checks which).
      expect(readFileSync(join(root, path), 'utf8')).toMatch(/^#!\/usr\/bin\/env (-S ([A-Z_]+=\S+ )*)?node[ \n]/);
    }
  });

  it('every compiled file has its source, and every source map points at a packed source', () => {
    const js = [...packed].filter((f) => f.startsWith('dist/src/') && f.endsWith('.js'));
    expect(js.length).toBeGreaterThan(50);
    // A stale file of a removed source would ship otherwise (prepack clears dist/ for this).
    expect(js.filter((f) => !packed.has(f.replace(/^dist\//, '').replace(/\.js$/, '.ts')))).toEqual([]);
    for (const f of js) {
      expect(packed).toContain(`${f}.map`);
      const map = JSON.parse(readFileSync(join(root, `${f}.map`), 'utf8')) as { sources: string[] };
      for (const s of map.sources) expect(packed).toContain(normalize(join(dirname(f), s)));
    }
  });

  it('declares what the code needs: Node >= 20.15 (zlib.crc32), @types/node for the .d.ts, zstd-napi optional, lz4-napi for tests only', () => {
    expect(pkg.engines.node).toBe('>=20.15.0');
    // Node 20's types, not the newest major: ">=20.15.0" installed @types/node 26 into a Node 20
    // project, whose types then offered APIs its Node does not have (issue 26).
    expect(pkg.dependencies['@types/node']).toBe('^20.15.0');
    expect(pkg.dependencies).not.toHaveProperty('zstd-napi');
    expect(pkg.optionalDependencies).toHaveProperty('zstd-napi');
    expect(pkg.dependencies).not.toHaveProperty('lz4-napi');
    expect(pkg.devDependencies).toHaveProperty('lz4-napi');
    const dts = readFileSync(join(root, 'dist/src/errors.d.ts'), 'utf8') + readFileSync(join(root, 'dist/src/guest/linux-client.d.ts'), 'utf8');
    expect(dts).toMatch(/\bNodeJS\.|\bBuffer\b/);
  });
});

describe('the examples', () => {
  const examples = readdirSync(join(root, 'examples')).filter((f) => f.endsWith('.ts'));

  it("import only 'pvisor' and Node's modules, so they can be copied as they are", () => {
    expect(examples.length).toBeGreaterThan(3);
    for (const f of examples) {
      const specifiers = [...readFileSync(join(root, 'examples', f), 'utf8').matchAll(/from '([^']+)'/g)].map((m) => m[1]);
      expect([f, specifiers.filter((s) => s !== 'pvisor' && !s.startsWith('node:'))]).toEqual([f, []]);
      expect(specifiers).toContain('pvisor');
    }
  });

  it("resolve 'pvisor' to the package's own build (self-reference through exports)", () => {
    const r = spawnSync(process.execPath, ['-e', "process.stdout.write(require.resolve('pvisor'))"], { cwd: join(root, 'dist', 'examples'), encoding: 'utf8' });
    expect(r.stdout).toBe(join(root, 'dist', 'src', 'index.js'));
  });
});

describe('installed without the optional zstd-napi', () => {
  let project: string;
  beforeAll(() => {
    // The package as npm lays it out when zstd-napi failed to build: its files, and its required
    // dependencies only (the real ones, linked), so zstd-napi resolves nowhere.
    project = mkdtempSync(join(tmpdir(), 'pvisor-no-zstd-'));
    const modules = join(project, 'node_modules');
    const installed = join(modules, 'pvisor');
    mkdirSync(installed, { recursive: true });
    for (const f of ['package.json', 'dist/src']) cpSync(join(root, f), join(installed, f), { recursive: true });
    const real = dirname(require.resolve('ffi-rs/package.json', { paths: [root] }));
    for (const dep of ['ffi-rs', 'eventemitter3', '@yuuang']) {
      mkdirSync(dirname(join(modules, dep)), { recursive: true });
      symlinkSync(join(dirname(real), dep), join(modules, dep));
    }
  });
  afterAll(() => rmSync(project, { recursive: true, force: true }));

  const inProject = (code: string) => spawnSync(process.execPath, ['-e', code], { cwd: project, encoding: 'utf8' });

  it('is really absent there', () => {
    expect(existsSync(join(project, 'node_modules', 'zstd-napi'))).toBe(false);
    expect(inProject("require.resolve('zstd-napi/binding')").status).not.toBe(0);
  });

  it('CompressedOffload is an OptionalDependencyError naming zstd-napi and how to get it; the rest works', () => {
    const r = inProject(`
      const p = require('pvisor');
      new p.Offload(); new p.IdleRelease(); new p.KsmAdvice(); new p.ColdCompression();
      try { new p.CompressedOffload(); console.log('no error'); }
      catch (e) { console.log(JSON.stringify({ cls: e instanceof p.OptionalDependencyError, code: e.code, dependency: e.dependency, feature: e.feature, message: e.message })); }`);
    expect(r.stderr).toBe('');
    const e = JSON.parse(r.stdout) as { cls: boolean; code: string; dependency: string; feature: string; message: string };
    expect(e).toMatchObject({ cls: true, code: 'PVISOR_OPTIONAL_DEPENDENCY', dependency: 'zstd-napi', feature: 'CompressedOffload' });
    expect(e.message).toMatch(/npm install zstd-napi/);
    expect(e.message).toMatch(/python3, make and g\+\+/);
  });

  it('the CLI answers, and --vm-ram-compression fails as pvisor (125) with that message', () => {
    const main = join(project, 'node_modules', 'pvisor', 'dist', 'src', 'cli', 'main.js');
    expect(spawnSync(process.execPath, [main, '--version'], { encoding: 'utf8' }).status).toBe(0);
    const r = spawnSync(process.execPath, [main, 'run', '--guest', 'probe', '--vm-ram-compression', '--', 'digest'], { encoding: 'utf8' });
    expect(r.stderr).toMatch(/CompressedOffload needs the optional dependency zstd-napi/);
    expect(r.stderr).not.toMatch(/starting/);
    expect(r.status).toBe(125);
  });
});
