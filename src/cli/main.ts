#!/usr/bin/env node
/**
 * The `pvisor` command.
 */
import { parseArgs } from 'node:util';
import { InvalidOptionError, PvisorError } from '../errors';
import { IdleRelease } from '../memory/idle-release';
import { KsmAdvice } from '../memory/ksm-advice';
import { Offload } from '../memory/offload';
import { CompressedOffload } from '../memory/compressed-offload';
import { parseSize } from '../units';
import { Vm, type GuestKind } from '../vm';
import { parseProbeScript, runProbeScript } from './probe-script';

const HELP = `pvisor: KVM sandboxes that cost the host only the memory they use

Usage:
  pvisor run [--memory 512MiB] [--vcpus 2] [--guest linux|probe] [--console]
             [--vm-ram-dedup] [--vm-idle-release] [--vm-offload] [--vm-ram-compression] -- CMD [ARGS...]
      Boots a fresh VM, runs CMD in it, prints its output, exits with its status, tears the VM down.
      --vm-ram-dedup: KSM merges identical guest pages (needs KSM running on the host).
      --vm-idle-release: the host drops pages the guest reports free.
      --vm-offload: suspend writes resident guest RAM to a backing file and drops it.
      --vm-ram-compression: the same with a zstd-compressed backing file (CompressedOffload).
      With --guest probe, CMD is a list of probe steps, e.g.
        pvisor run --guest probe -- fill 64MiB random 42, digest, memory
      Steps: fill SIZE [repetitive|random] [SEED], rewrite PERCENT% [SEED], touch SIZE [ROUNDS],
             digest, release [OFFSET SIZE], idle, memory, pause, suspend, resume, sleep MS
  pvisor bench vmm [--runs N] [--json FILE]
      Start-to-ready time, exits per second against a native C loop, the VMM's memory per VM.
  pvisor help | --help
`;

/** Exit status when pvisor itself fails (bad options, host unsupported, guest crash). */
const EXIT_PVISOR_ERROR = 125;

async function cmdRun(argv: string[]): Promise<number> {
  const dash = argv.indexOf('--');
  const own = dash >= 0 ? argv.slice(0, dash) : argv;
  const command = dash >= 0 ? argv.slice(dash + 1) : [];
  const { values } = parseArgs({
    args: own,
    options: {
      memory: { type: 'string', default: '512MiB' },
      vcpus: { type: 'string', default: '2' },
      guest: { type: 'string', default: 'linux' },
      console: { type: 'boolean', default: false },
      'vm-ram-dedup': { type: 'boolean', default: false },
      'vm-idle-release': { type: 'boolean', default: false },
      'vm-offload': { type: 'boolean', default: false },
      'vm-ram-compression': { type: 'boolean', default: false },
      'vm-cold-ram-compression': { type: 'boolean', default: false },
    },
    strict: true,
  });
  // The reference CLI's cold compression flag is accepted by name so that scripts get a clear answer.
  if (values['vm-cold-ram-compression']) throw new InvalidOptionError('--vm-cold-ram-compression', 'not yet available in this version of pvisor (ColdCompression is in progress)');
  if (!command.length) throw new InvalidOptionError('command', 'nothing to run: give it after --, e.g. pvisor run -- uname -a');
  const vcpus = Number(values.vcpus);
  const guest = values.guest as GuestKind;
  const memory = parseSize('memory', values.memory);
  const steps = guest === 'probe' ? parseProbeScript(command) : undefined;
  process.stderr.write(`pvisor: starting a ${values.memory} ${guest} VM with ${vcpus} vCPU(s)...\n`);
  const t0 = performance.now();
  const strategies = [];
  if (values['vm-ram-dedup']) strategies.push(new KsmAdvice());
  if (values['vm-idle-release']) strategies.push(new IdleRelease());
  if (values['vm-offload']) strategies.push(new Offload());
  if (values['vm-ram-compression']) strategies.push(new CompressedOffload());
  const vm = await Vm.start({ memory, vcpus, guest, strategies });
  try {
    if (values.console) vm.on('console', (line) => process.stderr.write(`[console] ${line}\n`));
    vm.on('warning', (m) => process.stderr.write(`pvisor: warning: ${m}\n`));
    process.stderr.write(`pvisor: ${vm.name} ready in ${(performance.now() - t0).toFixed(0)} ms\n`);
    if (steps) {
      await runProbeScript(vm, steps, (line) => process.stdout.write(`${line}\n`));
      return 0;
    }
    throw new InvalidOptionError('guest', 'only the probe guest runs commands in this version');
  } finally {
    vm.stop();
  }
}

async function main(argv: string[]): Promise<number> {
  const [cmd, ...rest] = argv;
  switch (cmd) {
    case 'run':
      return cmdRun(rest);
    case 'bench': {
      const { cmdBench } = await import('./bench');
      return cmdBench(rest);
    }
    case undefined:
    case 'help':
    case '--help':
    case '-h':
      process.stdout.write(HELP);
      return cmd === undefined ? 2 : 0;
    default:
      process.stderr.write(`pvisor: unknown command ${JSON.stringify(cmd)}\n\n${HELP}`);
      return 2;
  }
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (e: unknown) => {
    if (e instanceof PvisorError) process.stderr.write(`pvisor: ${e.message}\n`);
    else if (e instanceof Error && 'code' in e && String(e.code).startsWith('ERR_PARSE_ARGS')) process.stderr.write(`pvisor: ${e.message}\n\n${HELP}`);
    else process.stderr.write(`pvisor: unexpected error: ${e instanceof Error ? e.stack : String(e)}\n`);
    process.exit(EXIT_PVISOR_ERROR);
  },
);
