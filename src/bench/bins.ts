/**
 * The pvisor bins a bench starts as child processes (a cell, a VM of Table 3, a soak, a page pool
 * daemon), run with the flags and environment the bins' `#!` lines give them, so that a bench
 * measures what a user runs. The benches' internal commands (`pvisor bench memory-cell`, ...) are
 * dispatched by the CLI like the others.
 */
import { join } from 'node:path';
import { PVISOR_NODE_FLAGS } from '../node-flags';

/** The `pvisor` bin, built beside this module. */
export const PVISOR_BIN = join(__dirname, '..', 'cli', 'main.js');
/** The `pvisor-daemon` bin. */
export const PVISOR_DAEMON_BIN = join(__dirname, '..', 'cli', 'daemon-main.js');

/** Node's arguments for `pvisor bench ...args`, with pvisor's flags (and `extraFlags` after them). */
export function pvisorBenchArgv(args: readonly string[], extraFlags: readonly string[] = []): string[] {
  return [...PVISOR_NODE_FLAGS, ...extraFlags, PVISOR_BIN, 'bench', ...args];
}
