// The CLI's conventions, on the built commands: --help on stdout with exit 0 for every command,
// --version, usage errors exit 2 before anything is started or printed about a VM, and each
// bench's usage names exactly the options it accepts. No KVM needed: nothing here starts a VM.
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { BENCH_FLEET_OPTIONS, BENCH_FLOORS_OPTIONS, BENCH_LINUX_OPTIONS, BENCH_SNAPSHOT_OPTIONS, BENCH_SOAK_OPTIONS, BENCH_VMM_OPTIONS, TABLE12_OPTIONS, TABLE3_OPTIONS } from '../../src/cli/bench-args';
import { PVISOR_NODE_ENV, PVISOR_NODE_FLAGS } from '../../src/node-flags';
import { BENCH_USAGE, PVISOR_USAGE } from '../../src/cli/usage';

const root = join(__dirname, '..', '..', '..');
const bin = (name: string) => join(__dirname, '..', '..', 'src', 'cli', name);
const run = (program: string, ...args: string[]) => spawnSync(process.execPath, [bin(program), ...args], { encoding: 'utf8', env: { ...process.env, PVISOR_RUNTIME_DIR: '/nonexistent/pvisor-usage-test' } });
const pvisor = (...args: string[]) => run('main.js', ...args);
const daemon = (...args: string[]) => run('daemon-main.js', ...args);
const version = (JSON.parse(readFileSync(join(root, 'package.json'), 'utf8')) as { version: string }).version;

describe('the bins\' #! lines', () => {
  it.each([
    ['main.js', PVISOR_NODE_ENV, PVISOR_NODE_FLAGS],
    // It only checks its options before it execs the native pool daemon: no flags to tune.
    ['daemon-main.js', {}, []],
  ] as const)('%s runs node with its environment and flags through env -S, as the kernel starts it', (program, env, flags) => {
    const first = readFileSync(bin(program), 'utf8').split('\n')[0];
    const words = [...Object.entries(env).map(([k, v]) => `${k}=${v}`), 'node', ...flags];
    expect(first).toBe(`#!/usr/bin/env -S ${words.join(' ')}`);
    // The kernel hands env everything after the interpreter as one argument.
    const r = spawnSync('/usr/bin/env', [first.slice('#!/usr/bin/env '.length), bin(program), '--version'], { encoding: 'utf8' });
    expect(r.stderr).toBe('');
    expect(r.stdout.trim()).toContain(version);
  });
});

describe('--help and --version', () => {
  it.each(Object.keys(PVISOR_USAGE))('pvisor %s --help prints its usage on stdout and exits 0', (command) => {
    const r = pvisor(...command.split(' '), '--help');
    expect(r.status).toBe(0);
    expect(r.stderr).toBe('');
    expect(r.stdout).toContain(`pvisor ${command}`);
    expect(r.stdout).toBe(`Usage:\n${PVISOR_USAGE[command]}`);
  });

  it('pvisor --help lists the user commands and points to pvisor bench --help for the benches; -h and help too', () => {
    for (const flag of ['--help', '-h', 'help']) {
      const r = pvisor(flag);
      expect(r.status).toBe(0);
      for (const command of ['run', 'suspend', 'resume', 'snapshot', 'stop', 'ps', 'bench NAME']) expect(r.stdout).toContain(`pvisor ${command}`);
      expect(r.stdout).toContain('pvisor bench --help lists them');
      expect(r.stdout).not.toContain('pvisor bench vmm');
      // Short enough to read: the benches' 50 lines are bench --help's.
      expect(r.stdout.split('\n').length).toBeLessThan(100);
    }
    const bench = pvisor('bench', '--help');
    expect(bench.status).toBe(0);
    for (const name of ['vmm', 'linux', 'memory', 'snapshot', 'floors', 'soak', 'fleet']) expect(bench.stdout).toContain(`pvisor bench ${name}`);
  });

  it('--help after -- belongs to the guest command, not to pvisor run', () => {
    // Not help: the command is parsed, and --vcpus 0 is then a usage error.
    const r = pvisor('run', '--vcpus', '0', '--', 'sh', '--help');
    expect(r.status).toBe(2);
    expect(r.stdout).toBe('');
  });

  it('pvisor --version and pvisor-daemon --version print the package version', () => {
    for (const flag of ['--version', '-v', '-V']) expect(pvisor(flag)).toMatchObject({ status: 0, stdout: `pvisor ${version}\n` });
    expect(daemon('--version')).toMatchObject({ status: 0, stdout: `pvisor-daemon ${version}\n` });
  });

  it.each(['serve', 'status'])('pvisor-daemon %s --help prints its usage and exits 0', (command) => {
    const r = daemon(command, '--help');
    expect(r.status).toBe(0);
    expect(r.stdout).toContain(`pvisor-daemon ${command}`);
  });

  it('pvisor-daemon --help lists its commands', () => {
    const r = daemon('--help');
    expect(r.status).toBe(0);
    expect(r.stdout).toMatch(/pvisor-daemon serve --memory-pool/);
    expect(r.stdout).toMatch(/pvisor-daemon status/);
  });
});

describe('usage errors exit 2 before anything is started or printed', () => {
  const cases: [string, string[], RegExp][] = [
    ['no command', [], /which command\?/],
    ['an unknown command', ['frobnicate'], /unknown command "frobnicate"/],
    ['--vcpus 99', ['run', '--guest', 'probe', '--vcpus', '99', '--', 'digest'], /vcpus: must be a whole number from 1 to 8, got 99/],
    ['--vcpus two', ['run', '--guest', 'probe', '--vcpus', 'two', '--', 'digest'], /vcpus: must be a whole number from 1 to 8, got "two"/],
    ['--memory 5000', ['run', '--guest', 'probe', '--memory', '5000', '--', 'digest'], /memory: must be a non-zero multiple of 4 KiB/],
    ['--guest windows', ['run', '--guest', 'windows', '--', 'digest'], /guest: expected "linux" or "probe", got "windows"/],
    ['--executor docker', ['run', '--executor', 'docker', '--memory', '512MiB', '--', 'claude'], /--executor: expected vm \(pvisor runs commands only in a VM\), got "docker"/],
    ['an unknown option', ['run', '--memroy', '1GiB', '--', 'digest'], /Unknown option '--memroy'/],
    ['a bad probe step', ['run', '--guest', 'probe', '--', 'fly 3'], /unknown step "fly"/],
    ['no command to run', ['run', '--guest', 'probe'], /nothing to run/],
    ['a bad --name', ['run', '--guest', 'probe', '--name', '../x', '--', 'digest'], /is not a VM id/],
    ['suspend without an id', ['suspend'], /which VM\?/],
    ['stop with two ids', ['stop', 'A', 'B'], /one VM at a time/],
    ['ps with an argument it does not take', ['ps', '--all'], /Unknown option '--all'/],
    ['bench without a bench', ['bench'], /which bench\?/],
    ['an unknown bench', ['bench', 'everything'], /unknown bench "everything"/],
    ['bench vmm --runs 0', ['bench', 'vmm', '--runs', '0'], /--runs: expected 1 to 100/],
    ['bench soak --strategy nope', ['bench', 'soak', '--strategy', 'nope'], /unknown strategy nope/],
    ['bench floors --size 1KiB', ['bench', 'floors', '--size', '1KiB'], /--size: expected whole MiB/],
    ['bench linux --execs 0', ['bench', 'linux', '--execs', '0'], /--execs: wants a whole number >= 1/],
    ['bench snapshot --runs x', ['bench', 'snapshot', '--runs', 'x'], /--runs: expected 1 to 100/],
    ['bench memory --modes nope', ['bench', 'memory', '--modes', 'nope', '--floor-runs', '0'], /unknown mode nope/],
    ['bench memory --table 4', ['bench', 'memory', '--table', '4'], /--table: expected a list of 1, 2 and 3/],
    ['bench memory --schemes with table 1', ['bench', 'memory', '--schemes', 'ksm'], /--schemes: is not an option of --table 1,2/],
    ['bench memory --table 3 --guest nope', ['bench', 'memory', '--table', '3', '--guest', 'nope'], /--guest: expected probe or linux/],
  ];
  it.each(cases)('%s', (_, args, message) => {
    const r = pvisor(...args);
    expect(r.stderr).toMatch(message);
    expect(r.stderr).toMatch(/--help says what it accepts/);
    expect(r.stderr).not.toMatch(/starting|control socket|bench: /);
    expect(r.stdout).toBe('');
    expect(r.status).toBe(2);
  });

  it('pvisor-daemon: serve without --memory-pool, an unknown option, an unknown command', () => {
    for (const args of [['serve'], ['status', '--bogus'], ['nope'], []]) {
      const r = daemon(...args);
      expect(r.status).toBe(2);
      expect(r.stdout).toBe('');
    }
  });
});

describe('an id with no VM, running or hibernated, is a refused request: exit 1', () => {
  it.each([['resume'], ['resume', '--foreground'], ['stop'], ['suspend', '--hibernate']])('pvisor %s NOPE', (command, ...flags) => {
    const r = pvisor(command, 'NOPE', ...flags);
    expect(r.stderr).toMatch(/^pvisor: (no VM named NOPE is running or hibernated|NOPE is not hibernated)/);
    expect(r.stdout).toBe('');
    expect(r.status).toBe(1);
  });
});

describe('failures of pvisor itself exit 125', () => {
  it('a missing rootfs image: the run is well formed, the host cannot do it', () => {
    const r = pvisor('run', '--rootfs', '/no/such/rootfs.img', '--', 'true');
    expect(r.stderr).toMatch(/rootfs: cannot use \/no\/such\/rootfs\.img/);
    expect(r.status).toBe(125);
  });

  it("the reference CLI's line, --executor vm included, is well formed: only the missing image fails it", () => {
    const r = pvisor('run', '--executor', 'vm', '--memory', '512MiB', '--rootfs', '/no/such/agent.img', '--', 'node', '/opt/agent/agent.js');
    expect(r.stderr).toMatch(/rootfs: cannot use \/no\/such\/agent\.img/);
    expect(r.status).toBe(125);
  });
});

// A KVM device that opens (here /dev/null) on a kvm_pvm host: the Linux guest cannot run there.
const onPvm = existsSync('/sys/module/kvm_pvm');
if (!onPvm) console.log('pvisor run on kvm_pvm: SKIPPED, this host has no kvm_pvm module');
(onPvm ? describe : describe.skip)('pvisor run of the Linux guest on a kvm_pvm host', () => {
  it('is refused before anything is claimed or printed, in the words of the CLI', () => {
    const r = spawnSync(process.execPath, [bin('main.js'), 'run', '--', 'true'], { encoding: 'utf8', env: { ...process.env, PVISOR_KVM_DEVICE: '/dev/null', PVISOR_RUNTIME_DIR: '/nonexistent/pvisor-usage-test' } });
    expect(r.stderr).toMatch(/^pvisor: the linux guest cannot run on this host: its KVM is paravirtualised nested KVM \(kvm_pvm\).*--guest probe.*scripts\/with-kvm\.js --linux/s);
    expect(r.stderr).not.toMatch(/starting|control socket|guest: "probe"/);
    expect(r.stderr.trim().split('\n')).toHaveLength(1);
    expect(r.stdout).toBe('');
    expect(r.status).toBe(125);
  });
});

describe("each bench's usage names exactly the options it accepts", () => {
  const accepted: Record<keyof typeof BENCH_USAGE, string[]> = {
    vmm: Object.keys(BENCH_VMM_OPTIONS),
    linux: Object.keys(BENCH_LINUX_OPTIONS),
    memory: ['table', 'json', ...Object.keys(TABLE12_OPTIONS), ...Object.keys(TABLE3_OPTIONS)],
    snapshot: Object.keys(BENCH_SNAPSHOT_OPTIONS),
    floors: Object.keys(BENCH_FLOORS_OPTIONS),
    soak: Object.keys(BENCH_SOAK_OPTIONS),
    fleet: Object.keys(BENCH_FLEET_OPTIONS),
  };
  it.each(Object.keys(accepted) as (keyof typeof BENCH_USAGE)[])('bench %s', (name) => {
    const named = new Set([...BENCH_USAGE[name].matchAll(/\[--([a-z][a-z-]*)/g)].map((m) => m[1]));
    expect([...named].sort()).toEqual([...new Set(accepted[name])].sort());
  });
});
