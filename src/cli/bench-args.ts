/**
 * The options of each `pvisor bench ...` (their usage in ./usage.ts names each), and their checks:
 * a command line becomes a bench's checked options before anything starts, or an error that
 * ./usage.ts's parseUsage turns into a usage error (exit 2).
 */
import { accessSync, constants as fsConstants, existsSync, statSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { AGENT_ROOTFS_SCRIPT, agentRootfsImage } from '../bench/agent-workload';
import type { FleetBenchOptions } from '../bench/fleet';
import type { FloorsBenchOptions } from '../bench/floors';
import { SIGNALLING_MODES, type LinuxBenchOptions } from '../bench/linux';
import { DEFAULT_COLD_CPU_SHARE, LINUX_MODES, MODES, SEEDS, type BenchGuest, type Content } from '../bench/memory-modes';
import type { SnapshotBenchOptions } from '../bench/snapshot';
import { MAX_WORKING_SET_MIB, SOAK_STRATEGIES, type SoakBenchOptions } from '../bench/soak';
import type { Tables12Options } from '../bench/tables12';
import { STUDY_WORKING_SET_MIB } from '../bench/study-figures';
import { KSM_READ_AFTER_MS, SCHEMES, WORKING_SETS, type Table3Guest, type Table3Options } from '../bench/table3-setup';
import type { VmmBenchOptions } from '../bench/vmm';
import { InvalidOptionError } from '../errors';
import { DEFAULT_BACKING_DIR } from '../memory/backing-file';
import { parseDurationMs, parseSize } from '../units';

const MiB = 2 ** 20;

/** A bench's checked options, and the file its JSON goes to (stdout without one). */
export type WithJson<T> = T & { json?: string };

/**
 * `--json FILE`, checked before the bench spends its minutes: its directory must exist and be
 * writable, and FILE must not be a directory. Absolute, as the bench may change directory.
 */
export function checkedJsonPath(file: string | undefined): string | undefined {
  if (file === undefined) return undefined;
  const path = resolve(file);
  try {
    if (statSync(path, { throwIfNoEntry: false })?.isDirectory()) throw new Error('it is a directory');
    accessSync(dirname(path), fsConstants.W_OK);
  } catch (e) {
    const why = (e as NodeJS.ErrnoException).code === 'ENOENT' ? `${dirname(path)} does not exist` : (e as Error).message;
    throw new InvalidOptionError('--json', `cannot write ${path}: ${why}`);
  }
  return path;
}

/** `pvisor bench vmm`'s options. */
export const BENCH_VMM_OPTIONS = { runs: { type: 'string', default: '5' }, exits: { type: 'string', default: '100000' }, json: { type: 'string' } } as const;

/** Checks `pvisor bench vmm`'s arguments. */
export function parseVmmArgs(argv: string[]): WithJson<VmmBenchOptions> {
  const { values } = parseArgs({ args: argv, options: BENCH_VMM_OPTIONS, strict: true });
  const runs = Number(values.runs);
  if (!Number.isInteger(runs) || runs < 1 || runs > 100) throw new InvalidOptionError('--runs', 'expected 1 to 100');
  const exits = Number(values.exits);
  if (!Number.isInteger(exits) || exits < 1) throw new InvalidOptionError('--exits', 'expected a whole number >= 1');
  return { runs, exits, json: checkedJsonPath(values.json) };
}

/** `pvisor bench linux`'s options. */
export const BENCH_LINUX_OPTIONS = {
  runs: { type: 'string', default: '3' },
  execs: { type: 'string', default: '20' },
  'file-mib': { type: 'string', default: '10' },
  signalling: { type: 'string', default: SIGNALLING_MODES.join(',') },
  restores: { type: 'string', default: '3' },
  json: { type: 'string' },
} as const;

/** Checks `pvisor bench linux`'s arguments. */
export function parseLinuxArgs(argv: string[]): WithJson<LinuxBenchOptions> {
  const { values } = parseArgs({ args: argv, options: BENCH_LINUX_OPTIONS, strict: true });
  const runs = Number(values.runs);
  const execs = Number(values.execs);
  const fileMib = Number(values['file-mib']);
  const restores = Number(values.restores);
  for (const [name, v] of [['--runs', runs], ['--execs', execs], ['--file-mib', fileMib]] as const) {
    if (!Number.isInteger(v) || v < 1) throw new InvalidOptionError(name, `wants a whole number >= 1, got ${v}`);
  }
  if (!Number.isInteger(restores) || restores < 0) throw new InvalidOptionError('--restores', `wants a whole number >= 0, got ${restores}`);
  const modes = values.signalling.split(',');
  for (const m of modes) if (!SIGNALLING_MODES.includes(m)) throw new InvalidOptionError('--signalling', `"${m}" is not one of ${SIGNALLING_MODES.join(', ')}`);
  return { runs, execs, fileMib, restores, modes, json: checkedJsonPath(values.json) };
}

/** Options of Tables 1 and 2 (`--table` and `--json` are `pvisor bench memory`'s own). */
export const TABLE12_OPTIONS = {
  // The probe guest (default), or the shipped Linux guest with pvisor-workset holding the data.
  guest: { type: 'string', default: 'probe' },
  // Default: every mode on the probe, the study's on Linux (LINUX_MODES).
  modes: { type: 'string' },
  // VMs per process of each Table 1 cell: 1 is the study's placement; the Linux guest also runs 8
  // in one process (an orchestrator embedding the SDK) by default.
  placements: { type: 'string' },
  contents: { type: 'string', default: 'repetitive,random' },
  'backing-dir': { type: 'string', default: join(DEFAULT_BACKING_DIR, 'pvisor-bench-backing') },
  // The study's cells use 64 MiB; a smaller set makes a quick check (the study's figures then
  // do not compare).
  'working-set': { type: 'string', default: `${STUDY_WORKING_SET_MIB}MiB` },
  // Also N offloaded VMs in one process (the SDK's case), read per VM; 0 skips it.
  'shared-vms': { type: 'string', default: '4' },
  // Runs of each physical floor, measured first in the same run (0 skips them).
  'floor-runs': { type: 'string', default: '5' },
  // ColdCompression's share of a CPU in the cold cells: the product's default, or more where the
  // host is much slower than hardware (the nested harness), so that compression keeps up within
  // the study's reading time as it does on hardware at the default (docs/cold-compression.md).
  'cold-cpu-share': { type: 'string', default: String(DEFAULT_COLD_CPU_SHARE) },
} as const;

/** Checks the arguments of Tables 1 and 2. */
export function parseTables12Args(argv: string[]): Tables12Options {
  const { values } = parseArgs({ args: argv, options: TABLE12_OPTIONS, strict: true });
  if (values.guest !== 'probe' && values.guest !== 'linux') throw new InvalidOptionError('--guest', `expected probe or linux, got ${JSON.stringify(values.guest)}`);
  const guest: BenchGuest = values.guest;
  const modes = (values.modes ?? (guest === 'linux' ? LINUX_MODES : MODES.map((m) => m.name)).join(',')).split(',').map((name) => {
    const m = MODES.find((x) => x.name === name);
    if (!m) throw new InvalidOptionError('--modes', `unknown mode ${name}; modes: ${MODES.map((x) => x.name).join(', ')}`);
    return m;
  });
  if (!modes.some((m) => m.name === 'default')) modes.unshift(MODES[0]); // savings need the baseline
  const contents = values.contents.split(',') as Content[];
  for (const c of contents) {
    if (c === 'agent') {
      if (guest !== 'linux') throw new InvalidOptionError('--contents', 'agent runs in the Linux guest: add --guest linux');
      if (!existsSync(agentRootfsImage())) throw new InvalidOptionError('--contents', `agent needs the agent rootfs ${agentRootfsImage()}: bash ${AGENT_ROOTFS_SCRIPT} builds it (as root, about 5 minutes)`);
    } else if (!(c in SEEDS)) throw new InvalidOptionError('--contents', `unknown working set ${c}; use repetitive, random, compressible or agent (--guest linux)`);
  }
  const workingSetMiB = parseSize('--working-set', values['working-set']) / MiB;
  if (!Number.isInteger(workingSetMiB) || workingSetMiB < 1) throw new InvalidOptionError('--working-set', 'expected whole MiB, at least 1MiB');
  const backingDir = resolve(values['backing-dir']);
  const sharedVms = Number(values['shared-vms']);
  if (!Number.isInteger(sharedVms) || sharedVms < 0 || sharedVms > 8) throw new InvalidOptionError('--shared-vms', 'expected 0 to 8');
  const floorRuns = Number(values['floor-runs']);
  if (!Number.isInteger(floorRuns) || floorRuns < 0 || floorRuns > 100) throw new InvalidOptionError('--floor-runs', 'expected 0 to 100');
  const placements = (values.placements ?? (guest === 'linux' ? '1,8' : '1')).split(',').map(Number);
  for (const n of placements) if (!Number.isInteger(n) || n < 1 || n > 8) throw new InvalidOptionError('--placements', 'expected a list of VMs per process, each 1 to 8');
  const coldCpuShare = Number(values['cold-cpu-share']);
  if (!(coldCpuShare >= 0.001 && coldCpuShare <= 1)) throw new InvalidOptionError('--cold-cpu-share', 'expected 0.001 to 1');
  return { guest, modes, placements, contents, workingSetMiB, backingDir, sharedVms, floorRuns, coldCpuShare };
}

/** Table 3's options (those of `pvisor bench memory --table 3`). */
export const TABLE3_OPTIONS = {
  // Shared with Tables 1-2: the same option, the same meaning.
  guest: { type: 'string', default: 'probe' },
  'working-sets': { type: 'string', default: WORKING_SETS.join(',') },
  schemes: { type: 'string', default: SCHEMES.join(',') },
  // The study's cells use 64 MiB; a smaller set makes a quick check (its figures then do not compare).
  'working-set': { type: 'string', default: `${STUDY_WORKING_SET_MIB}MiB` },
  // When KSM cells are read (after KSM is turned on, and again after the rewrite).
  'ksm-read-after': { type: 'string', default: `${KSM_READ_AFTER_MS / 1000}s` },
  'snapshot-dir': { type: 'string', default: '/var/tmp/pvisor-bench-snapshots' },
} as const;

/** Checks Table 3's arguments. */
export function parseTable3Args(argv: string[]): Table3Options {
  const { values } = parseArgs({ args: argv, options: TABLE3_OPTIONS, strict: true });
  const list = <T extends string>(option: string, text: string, known: readonly T[]): T[] => {
    const out = text.split(',').filter(Boolean);
    for (const x of out) if (!known.includes(x as T)) throw new InvalidOptionError(option, `unknown ${x}; expected ${known.join(', ')}`);
    return out as T[];
  };
  if (values.guest !== 'probe' && values.guest !== 'linux') throw new InvalidOptionError('--guest', `expected probe or linux, got ${JSON.stringify(values.guest)}`);
  const guest: Table3Guest = values.guest;
  const workingSets = list('--working-sets', values['working-sets'], WORKING_SETS);
  const schemes = list('--schemes', values.schemes, SCHEMES);
  if (!schemes.includes('private')) schemes.unshift('private'); // savings need the baseline
  const workingSetMiB = parseSize('--working-set', values['working-set']) / MiB;
  if (!Number.isInteger(workingSetMiB) || workingSetMiB < 1 || workingSetMiB > 256) throw new InvalidOptionError('--working-set', 'expected whole MiB, 1MiB to 256MiB');
  const ksmReadAfterMs = parseDurationMs('--ksm-read-after', values['ksm-read-after']);
  const snapshotDir = resolve(values['snapshot-dir']);
  return { guest, workingSets, schemes: SCHEMES.filter((s) => schemes.includes(s)), workingSetMiB, ksmReadAfterMs, snapshotDir };
}

/** What `pvisor bench memory` runs: Tables 1-2, Table 3, or both, each with its own options checked. */
export interface MemoryBenchArgs {
  tables12?: Tables12Options;
  table3?: Table3Options;
  json?: string;
}

/**
 * Checks `pvisor bench memory`'s arguments: `--table` selects the tables, and each table gets the
 * options it knows; one that the selected tables do not know is refused.
 */
export function parseMemoryArgs(argv: string[]): MemoryBenchArgs {
  const { values, tokens } = parseArgs({
    args: argv,
    options: { table: { type: 'string', default: '1,2' }, json: { type: 'string' }, ...TABLE12_OPTIONS, ...TABLE3_OPTIONS },
    strict: true,
    tokens: true,
  });
  const tables = new Set(values.table.split(','));
  for (const t of tables) if (!['1', '2', '3'].includes(t)) throw new InvalidOptionError('--table', `expected a list of 1, 2 and 3, got ${JSON.stringify(values.table)}`);
  // Tables 1 and 2 come from the same cells: either selects both.
  const want12 = tables.has('1') || tables.has('2');
  const want3 = tables.has('3');
  const given = tokens.filter((t) => t.kind === 'option' && t.name !== 'table' && t.name !== 'json');
  const argsOf = (names: object) => given.flatMap((t) => (t.kind === 'option' && t.name in names ? [`--${t.name}`, ...(t.value === undefined ? [] : [t.value])] : []));
  for (const t of given) {
    if (t.kind !== 'option') continue;
    if (!(want12 && t.name in TABLE12_OPTIONS) && !(want3 && t.name in TABLE3_OPTIONS)) throw new InvalidOptionError(`--${t.name}`, `is not an option of --table ${values.table}`);
  }
  return { table3: want3 ? parseTable3Args(argsOf(TABLE3_OPTIONS)) : undefined, tables12: want12 ? parseTables12Args(argsOf(TABLE12_OPTIONS)) : undefined, json: checkedJsonPath(values.json) };
}

/** `pvisor bench snapshot`'s options. */
export const BENCH_SNAPSHOT_OPTIONS = { runs: { type: 'string', default: '5' }, dir: { type: 'string', default: DEFAULT_BACKING_DIR }, json: { type: 'string' } } as const;

/** Checks `pvisor bench snapshot`'s arguments. */
export function parseSnapshotArgs(argv: string[]): WithJson<SnapshotBenchOptions> {
  const { values } = parseArgs({ args: argv, options: BENCH_SNAPSHOT_OPTIONS, strict: true });
  const runs = Number(values.runs);
  if (!Number.isInteger(runs) || runs < 1 || runs > 100) throw new InvalidOptionError('--runs', 'expected 1 to 100');
  return { runs, dir: values.dir, json: checkedJsonPath(values.json) };
}

/** `pvisor bench floors`' options. */
export const BENCH_FLOORS_OPTIONS = {
  // On a disk: the floors of writing and reading back are those of the disk under pvisor's
  // backing files, so by default where they go (tmpfs is refused by the program).
  dir: { type: 'string', default: join(DEFAULT_BACKING_DIR, 'pvisor-bench-floors') },
  size: { type: 'string', default: '64MiB' },
  runs: { type: 'string', default: '5' },
  json: { type: 'string' },
} as const;

/** Checks `pvisor bench floors`' arguments. */
export function parseFloorsArgs(argv: string[]): WithJson<FloorsBenchOptions> {
  const { values } = parseArgs({ args: argv, options: BENCH_FLOORS_OPTIONS, strict: true });
  const sizeMiB = parseSize('--size', values.size) / MiB;
  if (!Number.isInteger(sizeMiB) || sizeMiB < 1) throw new InvalidOptionError('--size', 'expected whole MiB, at least 1MiB');
  const runs = Number(values.runs);
  if (!Number.isInteger(runs) || runs < 1 || runs > 100) throw new InvalidOptionError('--runs', 'expected 1 to 100');
  return { dir: values.dir, sizeMiB, runs, json: checkedJsonPath(values.json) };
}

/** `pvisor bench soak`'s options. */
export const BENCH_SOAK_OPTIONS = {
  cycles: { type: 'string', default: '1000' },
  strategy: { type: 'string', default: Object.keys(SOAK_STRATEGIES).join(',') },
  vms: { type: 'string', default: '1' },
  'working-set': { type: 'string', default: '16MiB' },
  'backing-dir': { type: 'string', default: DEFAULT_BACKING_DIR },
  json: { type: 'string' },
} as const;

/** Checks `pvisor bench soak`'s arguments. */
export function parseSoakArgs(argv: string[]): WithJson<SoakBenchOptions> {
  const { values } = parseArgs({ args: argv, options: BENCH_SOAK_OPTIONS, strict: true });
  const cycles = Number(values.cycles);
  if (!Number.isInteger(cycles) || cycles < 1 || cycles > 1_000_000) throw new InvalidOptionError('--cycles', 'expected 1 to 1000000');
  const vms = Number(values.vms);
  if (!Number.isInteger(vms) || vms < 1 || vms > 16) throw new InvalidOptionError('--vms', 'expected 1 to 16');
  const strategies = values.strategy.split(',');
  for (const s of strategies) if (!(s in SOAK_STRATEGIES)) throw new InvalidOptionError('--strategy', `unknown strategy ${s}; strategies: ${Object.keys(SOAK_STRATEGIES).join(', ')}`);
  const workingSetMiB = parseSize('--working-set', values['working-set']) / MiB;
  if (!Number.isInteger(workingSetMiB) || workingSetMiB < 1 || workingSetMiB > MAX_WORKING_SET_MIB) throw new InvalidOptionError('--working-set', `expected whole MiB from 1MiB to ${MAX_WORKING_SET_MIB}MiB`);
  return { cycles, vms, strategies, workingSetMiB, dir: resolve(values['backing-dir']), json: checkedJsonPath(values.json) };
}

/** `pvisor bench fleet`'s options. */
export const BENCH_FLEET_OPTIONS = {
  runs: { type: 'string', default: '3' },
  guest: { type: 'string', default: 'probe' },
  clones: { type: 'string', default: '16' },
  'working-set': { type: 'string', default: '32MiB' },
  dir: { type: 'string', default: DEFAULT_BACKING_DIR },
  bucket: { type: 'string', default: 'pvisor' },
  json: { type: 'string' },
} as const;

/** Checks `pvisor bench fleet`'s arguments. */
export function parseFleetArgs(argv: string[]): WithJson<FleetBenchOptions> {
  const { values } = parseArgs({ args: argv, options: BENCH_FLEET_OPTIONS, strict: true });
  const runs = Number(values.runs);
  if (!Number.isInteger(runs) || runs < 1 || runs > 100) throw new InvalidOptionError('--runs', 'expected 1 to 100');
  const clones = Number(values.clones);
  if (!Number.isInteger(clones) || clones < 0 || clones > 16) throw new InvalidOptionError('--clones', 'expected 0 to 16');
  const workingSetMiB = parseSize('--working-set', values['working-set']) / MiB;
  // The VM has 128 MiB, and the child appends 8 MiB to the working set.
  if (!Number.isInteger(workingSetMiB) || workingSetMiB < 1 || workingSetMiB > 64) throw new InvalidOptionError('--working-set', 'expected whole MiB, 1MiB to 64MiB');
  // An S3 bucket name: 3 to 63 lower-case letters, digits, dots and hyphens.
  if (!/^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$/.test(values.bucket)) throw new InvalidOptionError('--bucket', `not a bucket name: ${JSON.stringify(values.bucket)}`);
  if (values.guest !== 'probe' && values.guest !== 'linux') throw new InvalidOptionError('--guest', 'expected probe or linux');
  return { guest: values.guest, runs, clones, workingSetMiB, dir: resolve(values.dir), bucket: values.bucket, json: checkedJsonPath(values.json) };
}
