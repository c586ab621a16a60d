#!/usr/bin/env -S MALLOC_ARENA_MAX=1 node --max-semi-space-size=1 --expose-gc
/**
 * The `pvisor` command.
 */
import { cmdRun } from './run-command';
import { PVISOR_HELP, PVISOR_USAGE, packageVersion, printUsage, runProgram, UsageError, wantsHelp } from './usage';

async function main(argv: string[]): Promise<number> {
  const [cmd, ...rest] = argv;
  if (cmd !== undefined && cmd in PVISOR_USAGE && cmd !== 'bench' && wantsHelp(rest)) return printUsage(PVISOR_USAGE[cmd]);
  switch (cmd) {
    case 'run':
      return cmdRun(rest);
    case 'suspend':
    case 'resume':
    case 'stop': {
      const { cmdControl } = await import('./control-commands');
      return cmdControl(cmd, rest);
    }
    case 'snapshot': {
      const { cmdSnapshot } = await import('./snapshot-command');
      return cmdSnapshot(rest);
    }
    case 'ps': {
      const { cmdPs } = await import('./control-commands');
      return cmdPs(rest);
    }
    case 'bench': {
      const { cmdBench } = await import('./bench');
      return cmdBench(rest);
    }
    case 'help':
    case '--help':
    case '-h':
      process.stdout.write(PVISOR_HELP);
      return 0;
    case '--version':
    case '-v':
    case '-V':
      process.stdout.write(`pvisor ${packageVersion()}\n`);
      return 0;
    case undefined:
      throw new UsageError('pvisor', '', 'which command? run, suspend, resume, snapshot, stop, ps or bench');
    default:
      throw new UsageError('pvisor', '', `unknown command ${JSON.stringify(cmd)}`);
  }
}

runProgram('pvisor', main);
