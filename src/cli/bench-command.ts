/**
 * `pvisor bench ...`: figures measured on real VMs (src/bench/), printed as tables (with the
 * reference's figures beside pvisor's where the study has one) and written as JSON. This parses
 * the command line (./bench-args.ts), runs the bench and writes its JSON: to `--json FILE`, or
 * as one line on stdout after the tables. It also dispatches the benches' internal commands, the
 * processes a bench starts for its cells.
 */
import { writeFileSync } from 'node:fs';
import type { MemoryBenchArgs } from './bench-args';
import { BENCH_USAGE, parseUsage, printUsage, PVISOR_USAGE, UsageError, wantsHelp, type BenchName } from './usage';

/**
 * The benches' internal commands: each the process of one cell, started by the bench itself. They
 * load only what their process needs (not ./bench-args.ts and what it names), as a cell's
 * memory is what it measures.
 */
const CELL_COMMANDS: Record<string, (argv: string[]) => Promise<number>> = {
  'memory-cell': async (argv) => {
    const { memoryCell } = await import('../bench/memory-cell');
    await memoryCell(JSON.parse(argv[0]));
    return 0;
  },
  'memory-vm': async () => {
    const { vmProcess } = await import('../bench/table3-vm');
    await vmProcess();
    return 0;
  },
  'soak-run': async (argv) => {
    const { soakChild } = await import('../bench/soak');
    process.stdout.write(JSON.stringify(await soakChild(JSON.parse(argv[0]))));
    return 0;
  },
  'vmm-memory-case': async (argv) => {
    const { memoryCaseChild } = await import('../bench/vmm');
    process.stdout.write(JSON.stringify(await memoryCaseChild(Number(argv[0]))));
    return 0;
  },
};

/** Writes a bench's JSON where `--json` says, else as one line on stdout. */
function writeJson(json: unknown, file: string | undefined): void {
  if (file) writeFileSync(file, JSON.stringify(json, null, 2));
  else process.stdout.write(`${JSON.stringify(json)}\n`);
}

/** Entry of `pvisor bench`. */
export async function cmdBench(argv: string[]): Promise<number> {
  const [what, ...rest] = argv;
  if (what === undefined || what === '--help' || what === '-h') {
    if (what === undefined) throw new UsageError('pvisor', 'bench', `which bench? ${Object.keys(BENCH_USAGE).join(', ')}`);
    return printUsage(PVISOR_USAGE.bench);
  }
  if (what in BENCH_USAGE && wantsHelp(rest)) return printUsage(BENCH_USAGE[what as BenchName]);
  if (Object.hasOwn(CELL_COMMANDS, what)) return CELL_COMMANDS[what](rest);
  const args = await import('./bench-args');
  switch (what) {
    case 'vmm': {
      const opts = parseUsage('bench vmm', () => args.parseVmmArgs(rest));
      const { benchVmm } = await import('../bench/vmm');
      writeJson(await benchVmm(opts), opts.json);
      return 0;
    }
    case 'linux': {
      const opts = parseUsage('bench linux', () => args.parseLinuxArgs(rest));
      const { benchLinux } = await import('../bench/linux');
      writeJson(await benchLinux(opts), opts.json);
      return 0;
    }
    case 'memory':
      return benchMemory(parseUsage('bench memory', () => args.parseMemoryArgs(rest)));
    case 'snapshot': {
      const opts = parseUsage('bench snapshot', () => args.parseSnapshotArgs(rest));
      const { benchSnapshot } = await import('../bench/snapshot');
      writeJson(await benchSnapshot(opts), opts.json);
      return 0;
    }
    case 'floors': {
      const opts = parseUsage('bench floors', () => args.parseFloorsArgs(rest));
      const { benchFloors } = await import('../bench/floors');
      writeJson(await benchFloors(opts), opts.json);
      return 0;
    }
    case 'fleet': {
      const opts = parseUsage('bench fleet', () => args.parseFleetArgs(rest));
      if (opts.guest === 'linux') {
        const { benchFleetLinux } = await import('../bench/fleet-linux');
        writeJson(await benchFleetLinux(opts), opts.json);
      } else {
        const { benchFleet } = await import('../bench/fleet');
        writeJson(await benchFleet(opts), opts.json);
      }
      return 0;
    }
    case 'soak': {
      const opts = parseUsage('bench soak', () => args.parseSoakArgs(rest));
      const { benchSoak } = await import('../bench/soak');
      const report = await benchSoak(opts);
      writeJson(report, opts.json);
      // A cycle that failed fails the bench.
      return report.runs.some((r) => r.failures > 0) ? 1 : 0;
    }
    default:
      throw new UsageError('pvisor', 'bench', `unknown bench ${JSON.stringify(what)}; benches: ${Object.keys(BENCH_USAGE).join(', ')}`);
  }
}

/**
 * `pvisor bench memory`: Tables 1-2 and Table 3 as `--table` says (Table 3's options checked with
 * the others, before Tables 1-2 spend their minutes), their JSON together.
 */
async function benchMemory({ tables12, table3, json }: MemoryBenchArgs): Promise<number> {
  const { benchTables12 } = await import('../bench/tables12');
  const { benchTable3 } = await import('../bench/table3');
  const json12 = tables12 ? await benchTables12(tables12) : undefined;
  const json3 = table3 ? await benchTable3(table3) : undefined;
  writeJson(json12 && json3 ? { ...json12, table3: json3 } : (json12 ?? json3), json);
  return 0;
}
