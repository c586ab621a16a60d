#!/usr/bin/env node
/**
 * The `pvisor-daemon` command: `serve --memory-pool` runs the page pool that PoolClient VMs share
 * (src/daemon/), `status` asks a running one for its figures.
 */
import { execFileSync } from 'node:child_process';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { InvalidOptionError } from '../errors';
import { parseSize } from '../units';
import { ensureRuntimeDir, runtimeDir } from './control-socket';

const HELP = `pvisor-daemon: the page pool that pvisor VMs share

Usage:
  pvisor-daemon serve --memory-pool [--socket PATH] [--max-pool 1GiB] [--group GROUP]
      Holds one copy of each page that VMs started with --vm-pool (SDK: new PoolClient()) have in
      common, in a memfd they map copy-on-write. The socket is 0600 (0660 and of GROUP with
      --group); every peer's credentials are checked. SIGTERM or SIGINT ends it; VMs keep the
      pages they map and carry on without the pool.
  pvisor-daemon status [--socket PATH] [--json]
      Prints the pool's size, pages, references and clients.

The socket defaults to ${join('$PVISOR_RUNTIME_DIR (or /run/pvisor)', 'pool.sock')}.
`;

/** Where the pool's socket is unless --socket says otherwise. */
export function defaultPoolSocket(): string {
  return join(runtimeDir(), 'pool.sock');
}

async function serve(argv: string[]): Promise<number> {
  const { values } = parseArgs({
    args: argv,
    options: { 'memory-pool': { type: 'boolean', default: false }, socket: { type: 'string' }, 'max-pool': { type: 'string', default: '1GiB' }, group: { type: 'string' } },
  });
  if (!values['memory-pool']) throw new InvalidOptionError('--memory-pool', 'serve needs --memory-pool (the pool is off unless asked for)');
  const poolBytes = parseSize('--max-pool', values['max-pool']!);
  if (poolBytes < 4096 || poolBytes > 2 ** 44) throw new InvalidOptionError('--max-pool', `must be from 4 KiB to 16 TiB, got ${poolBytes} bytes`);
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
  const { values } = parseArgs({ args: argv, options: { socket: { type: 'string' }, json: { type: 'boolean', default: false } } });
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
  switch (command) {
    case 'serve':
      return serve(rest);
    case 'status':
      return status(rest);
    case 'help':
    case '--help':
    case '-h':
      process.stdout.write(HELP);
      return 0;
    default:
      process.stderr.write(HELP);
      return 2;
  }
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (e: Error) => {
    process.stderr.write(`pvisor-daemon: ${e.message}\n`);
    process.exit(1);
  },
);
