/**
 * The physical floors of pvisor's memory operations on this host: native-prebuilds/bench/
 * memory-floor.c, compiled with gcc and run in the same run as pvisor's own figures, times what
 * the host itself needs to move the same bytes (placing them into fresh memory, writing them to a
 * file, reading them back), so that each pvisor figure can be read as a ratio to its floor. The C
 * file's header says what each figure means and which operation it is the floor of.
 */
import { execFileSync, spawn } from 'node:child_process';
import { mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { HostUnsupportedError } from '../errors';
import { PACKAGE_ROOT } from '../native';
import { printTable, progress, stats } from './report';

const MiB = 2 ** 20;

/** Min, median and max of a figure's runs, ms, with the runs themselves. */
export interface FloorStats {
  min: number;
  median: number;
  max: number;
  runsMs: number[];
}

/** The floors for one size, as measured by memory-floor.c (see its header for each figure). */
export interface MemoryFloors {
  sizeMiB: number;
  runs: number;
  dir: string;
  /** Filesystem type of `dir` (from /proc/mounts). */
  filesystem: string;
  /** Placing the bytes into fresh guest-RAM-like memory. */
  a: { uffdCopy2M: FloorStats; uffdCopy64K: FloorStats; uffdCopy4K: FloorStats; copyFaults: FloorStats; copyFaultsHuge: FloorStats; copyResident: FloorStats };
  /** Writing them to a file and to disk; `writeDirect` is null where O_DIRECT is refused. */
  b: { writeCache: FloorStats; writeDirect: FloorStats | null };
  /** Reading the file back into fresh memory; `readColdDirect` is null where O_DIRECT is refused. */
  c: { readCold: FloorStats; readColdDirect: FloorStats | null; readColdUffd: FloorStats; readWarm: FloorStats };
  /** What the figures need to be read right (huge pages really used, O_DIRECT refused, ...). */
  notes: string[];
}

/** What the C program prints: per figure the list of per-run ms, or null. */
type Raw = Omit<MemoryFloors, 'a' | 'b' | 'c'> & Record<'a' | 'b' | 'c', Record<string, number[] | null>>;

/** Options of {@link measureMemoryFloors}. */
export interface MemoryFloorsOptions {
  /** Directory for the files written and read back: must be on the disk whose floor is wanted. */
  dir: string;
  sizeMiB: number;
  runs: number;
  /** Where the program's progress lines go. Default: the bench's progress lines on stderr. */
  onProgress?: (line: string) => void;
}

/** Compiles and runs memory-floor.c, returning min/median/max of each figure. */
export async function measureMemoryFloors(options: MemoryFloorsOptions): Promise<MemoryFloors> {
  const { sizeMiB, runs, onProgress = (line: string) => progress(`floors: ${line}`) } = options;
  const dir = resolve(options.dir);
  const build = mkdtempSync(join(tmpdir(), 'pvisor-floors-'));
  try {
    const exe = join(build, 'memory-floor');
    compile(join(PACKAGE_ROOT, 'native-prebuilds', 'bench', 'memory-floor.c'), exe);
    const raw = JSON.parse(await run(exe, [dir, String(sizeMiB), String(runs)], onProgress)) as Raw;
    const figures = <K extends 'a' | 'b' | 'c'>(k: K) =>
      Object.fromEntries(Object.entries(raw[k]).map(([name, ms]) => [name, ms && { ...stats(ms), runsMs: ms }])) as MemoryFloors[K];
    return { ...raw, a: figures('a'), b: figures('b'), c: figures('c') };
  } finally {
    rmSync(build, { recursive: true, force: true });
  }
}

/** Faults served per second by native-prebuilds/bench/uffd-fault-loop.c: min/median/max over its runs. */
export interface NativeFaultRate {
  sizeMiB: number;
  blockKiB: number;
  /** Min, median and max over the runs (in `runsMs`, although they are faults per second). */
  faultsPerSecond: FloorStats;
}

/**
 * Compiles and runs uffd-fault-loop.c: the native floor of serving faults of `blockKiB` blocks
 * through userfaultfd (a touching thread, a thread answering with UFFDIO_COPY), no VM involved.
 */
export async function measureNativeFaultRate(sizeMiB: number, blockKiB: number, runs: number): Promise<NativeFaultRate> {
  const build = mkdtempSync(join(tmpdir(), 'pvisor-floors-'));
  try {
    const exe = join(build, 'uffd-fault-loop');
    compile(join(PACKAGE_ROOT, 'native-prebuilds', 'bench', 'uffd-fault-loop.c'), exe, ['-pthread']);
    const raw = JSON.parse(await run(exe, [String(sizeMiB), String(blockKiB), String(runs)], (line) => progress(`fault loop: ${line}`))) as { faultsPerSecond: number[] };
    return { sizeMiB, blockKiB, faultsPerSecond: { ...stats(raw.faultsPerSecond), runsMs: raw.faultsPerSecond } };
  } finally {
    rmSync(build, { recursive: true, force: true });
  }
}

function compile(source: string, exe: string, flags: string[] = []): void {
  try {
    execFileSync('gcc', ['-O2', ...flags, '-o', exe, source], { stdio: ['ignore', 'ignore', 'pipe'] });
  } catch (e) {
    const err = e as NodeJS.ErrnoException & { stderr?: Buffer };
    if (err.code === 'ENOENT') throw new HostUnsupportedError('the memory floors are measured by a C program compiled at bench time: install gcc (apt-get install gcc)');
    throw new HostUnsupportedError(`gcc could not compile ${source}: ${err.stderr?.toString().trim() || err.message}`);
  }
}

/** Runs the program, its stderr lines passed on as progress (and kept for an error), its stdout returned. */
function run(exe: string, args: string[], onProgress: (line: string) => void): Promise<string> {
  return new Promise((resolveRun, reject) => {
    const child = spawn(exe, args, { stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    const errLines: string[] = [];
    child.stdout.setEncoding('utf8').on('data', (d: string) => (out += d));
    createInterface({ input: child.stderr }).on('line', (line) => {
      errLines.push(line);
      onProgress(line);
    });
    child.on('error', reject);
    child.on('close', (code) => {
      if (code === 0) return resolveRun(out);
      // The program's own error is its last line, prefixed with its name.
      const last = errLines.at(-1)?.replace(/^memory-floor: /, '') ?? 'no message';
      reject(new HostUnsupportedError(`memory-floor failed (exit ${code ?? 'by a signal'}): ${last}`));
    });
  });
}

const LABELS: Record<string, string> = {
  'a.uffdCopy2M': 'UFFDIO_COPY into fresh RAM, 2 MiB pieces',
  'a.uffdCopy64K': 'UFFDIO_COPY into fresh RAM, 64 KiB pieces',
  'a.uffdCopy4K': 'UFFDIO_COPY into fresh RAM, 4 KiB pieces',
  'a.copyFaults': 'memcpy into fresh RAM (page faults)',
  'a.copyFaultsHuge': 'memcpy into fresh RAM, MADV_HUGEPAGE',
  'a.copyResident': 'memcpy into resident RAM (copy alone)',
  'b.writeCache': 'pwrite 2 MiB pieces + fdatasync',
  'b.writeDirect': 'O_DIRECT pwrite + fdatasync',
  'c.readCold': 'cold pread into fresh RAM',
  'c.readColdDirect': 'cold O_DIRECT pread into fresh RAM',
  'c.readColdUffd': 'cold pread to bounce + UFFDIO_COPY',
  'c.readWarm': 'pread from page cache into fresh RAM',
};

/** Rows for {@link printTable}: each figure with its min/median/max ms and its MB/s at the median. */
export function floorRows(f: MemoryFloors): string[][] {
  const rows = [['figure', 'what', `ms for ${f.sizeMiB} MiB (min / median / max)`, 'MB/s at median']];
  for (const group of ['a', 'b', 'c'] as const) {
    for (const [name, s] of Object.entries(f[group]) as [string, FloorStats | null][]) {
      const key = `${group}.${name}`;
      if (!s) rows.push([key, LABELS[key] ?? '', 'skipped (see notes)', '-']);
      else rows.push([key, LABELS[key] ?? '', `${s.min.toFixed(1)} / ${s.median.toFixed(1)} / ${s.max.toFixed(1)}`, ((f.sizeMiB * MiB) / 1e6 / (s.median / 1000)).toFixed(0)]);
    }
  }
  return rows;
}

/** `pvisor bench floors`' options, checked. */
export interface FloorsBenchOptions {
  /** Where the files go: on the disk whose floors are wanted. */
  dir: string;
  sizeMiB: number;
  runs: number;
}

/** `pvisor bench floors`: measures, prints the table and its notes, returns the JSON. */
export async function benchFloors({ dir, sizeMiB, runs }: FloorsBenchOptions): Promise<MemoryFloors> {
  mkdirSync(dir, { recursive: true });
  progress(`physical floors, ${sizeMiB} MiB, ${runs} runs, files in ${resolve(dir)}`);
  const floors = await measureMemoryFloors({ dir, sizeMiB, runs });
  process.stdout.write(`Physical floors: ${sizeMiB} MiB, ${runs} runs, files in ${floors.dir} (${floors.filesystem})\n`);
  printTable(floorRows(floors));
  for (const n of floors.notes) process.stdout.write(`note: ${n}\n`);
  return floors;
}
