#!/usr/bin/env -S node --max-semi-space-size=1 --optimize-for-size
/**
 * The `pvisor-daemon` command: `serve --memory-pool` runs the page pool that PoolClient VMs share
 * (src/daemon/), `status` asks a running one for its figures.
 */
import { execFileSync } from 'node:child_process';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { InvalidOptionError } from '../errors';
import { parseSize } from '../units';
import { ensureRuntimeDir, runtimeDir } from '../control-socket';
import { DAEMON_HELP, DAEMON_USAGE, packageVersion, parseUsage, printUsage, runProgram, UsageError, wantsHelp } from './usage';

/** Where the pool's socket is unless --socket says otherwise. */
export function defaultPoolSocket(): string {
  return join(runtimeDir(), 'pool.sock');
}

async function serve(argv: string[]): Promise<number> {
  const { values, poolBytes } = parseUsage(
    'serve',
    () => {
      const { values } = parseArgs({
        args: argv,
        options: { 'memory-pool': { type: 'boolean', default: false }, socket: { type: 'string' }, 'max-pool': { type: 'string', default: '1GiB' }, group: { type: 'string' } },
        strict: true,
      });
      if (!values['memory-pool']) throw new InvalidOptionError('--memory-pool', 'serve needs --memory-pool (the pool is off unless asked for)');
      const poolBytes = parseSize('--max-pool', values['max-pool']);
      if (poolBytes < 4096 || poolBytes > 2 ** 44) throw new InvalidOptionError('--max-pool', `must be from 4 KiB to 16 TiB, got ${poolBytes} bytes`);
      return { values, poolBytes };
    },
    'pvisor-daemon',
  );
  const socketPath = values.socket ?? (ensureRuntimeDir(runtimeDir()), defaultPoolSocket());
  const gid = values.group === undefined ? undefined : groupId(values.group);
  const { PoolServer } = await import('../daemon/pool-server');
  const server = await PoolServer.listen({ socketPath, poolBytes, gid });
  process.stderr.write(`pvisor-daemon: page pool of up to ${poolBytes} bytes on ${socketPath} (pid ${process.pid})\n`);
  await new Promise<void>((resolve) => {
    const end = () => resolve();
    process.once('SIGTERM', end);
    process.once('SIGINT', end);
  });
  await server.close();
  return 0;
}

function groupId(group: string): number {
  if (/^\d+$/.test(group)) return Number(group);
  try {
    return Number(execFileSync('getent', ['group', group], { encoding: 'utf8' }).split(':')[2]);
  } catch {
    throw new InvalidOptionError('--group', `no group ${group}`);
  }
}

async function status(argv: string[]): Promise<number> {
  const { values } = parseUsage('status', () => parseArgs({ args: argv, options: { socket: { type: 'string' }, json: { type: 'boolean', default: false } }, strict: true }), 'pvisor-daemon');
  const { poolStatus } = await import('../memory/pool-link');
  const s = await poolStatus(values.socket ?? defaultPoolSocket(), 5000);
  if (values.json) {
    process.stdout.write(`${JSON.stringify(s)}\n`);
    return 0;
  }
  const mib = (b: number) => `${(b / 2 ** 20).toFixed(1)} MiB`;
  process.stdout.write(`pool (pid ${s.pid}): ${s.pagesUsed} pages in use (${mib(s.pagesUsed * 4096)} of ${mib(s.poolBytes)}), ${s.references} references, ${s.clients.length} clients, ${s.scopes} scopes, daemon PSS ${mib(s.pssBytes)}\n`);
  for (const c of s.clients) process.stdout.write(`  client ${c.id}: ${c.name} (pid ${c.pid}, scope ${c.scope}), ${c.references} references\n`);
  return 0;
}

async function main(argv: string[]): Promise<number> {
  const [command, ...rest] = argv;
  if (command !== undefined && command in DAEMON_USAGE && wantsHelp(rest)) return printUsage(DAEMON_USAGE[command]);
  switch (command) {
    case 'serve':
      return serve(rest);
    case 'status':
      return status(rest);
    case 'help':
    case '--help':
    case '-h':
      process.stdout.write(DAEMON_HELP);
      return 0;
    case '--version':
    case '-V':
      process.stdout.write(`pvisor-daemon ${packageVersion()}\n`);
      return 0;
    case undefined:
      throw new UsageError('pvisor-daemon', '', 'which command? serve or status');
    default:
      throw new UsageError('pvisor-daemon', '', `unknown command ${JSON.stringify(command)}`);
  }
}

runProgram('pvisor-daemon', main);
