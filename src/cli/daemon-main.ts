#!/usr/bin/env -S node
/**
 * The `pvisor-daemon` command: `serve --memory-pool` runs the page pool that PoolClient VMs share
 * (it checks its options, then becomes the native daemon, native-prebuilds/helpers/pool_daemon.c),
 * `status` asks a running one for its figures.
 */
import { execFileSync } from 'node:child_process';
import { accessSync, constants, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { HostUnsupportedError, InvalidOptionError } from '../errors';
import { nativePrebuild, prebuildMismatch } from '../native';
import { execProgram } from '../sys/exec';
import { parseSize } from '../units';
import { ensureRuntimeDir, runtimeDir } from '../control-socket';
import { DAEMON_HELP, DAEMON_USAGE, packageVersion, parseUsage, printUsage, runProgram, UsageError, wantsHelp } from './usage';

/** Where the pool's socket is unless --socket says otherwise. */
export function defaultPoolSocket(): string {
  return join(runtimeDir(), 'pool.sock');
}

/** Connections the daemon serves at once, in all and per uid, unless told otherwise. */
export const DEFAULT_MAX_CLIENTS = 1024;
export const DEFAULT_MAX_CLIENTS_PER_UID = 256;
/** The most connections a daemon may be told to serve (two descriptors each). */
const MAX_CLIENTS_LIMIT = 65536;

function serve(argv: string[]): never {
  const { values, poolBytes, gid, maxClients, maxPerUid } = parseUsage(
    'serve',
    () => {
      const { values } = parseArgs({
        args: argv,
        options: {
          'memory-pool': { type: 'boolean', default: false },
          socket: { type: 'string' },
          'max-pool': { type: 'string', default: '1GiB' },
          group: { type: 'string' },
          'max-clients': { type: 'string', default: String(DEFAULT_MAX_CLIENTS) },
          'max-clients-per-uid': { type: 'string' },
        },
        strict: true,
      });
      if (!values['memory-pool']) throw new InvalidOptionError('--memory-pool', 'serve needs --memory-pool (the pool is off unless asked for)');
      const poolBytes = parseSize('--max-pool', values['max-pool']);
      if (poolBytes < 4096 || poolBytes > 2 ** 44) throw new InvalidOptionError('--max-pool', `must be from 4 KiB to 16 TiB, got ${poolBytes} bytes`);
      if (values.socket !== undefined) checkSocketPath(values.socket);
      const maxClients = count('--max-clients', values['max-clients'], MAX_CLIENTS_LIMIT);
      const perUid = values['max-clients-per-uid'];
      const maxPerUid = perUid === undefined ? Math.min(DEFAULT_MAX_CLIENTS_PER_UID, maxClients) : count('--max-clients-per-uid', perUid, maxClients);
      return { values, poolBytes, gid: values.group === undefined ? undefined : groupId(values.group), maxClients, maxPerUid };
    },
    'pvisor-daemon',
  );
  const socketPath = values.socket ?? (ensureRuntimeDir(runtimeDir()), checkSocketPath(defaultPoolSocket()));
  // The pool itself is native (native-prebuilds/helpers/pool_daemon.c): this process becomes it,
  // keeping its pid, so that no Node process (15 MiB and more of PSS) stays behind the pool. It
  // prints the startup line once it listens, and exits 0 on SIGTERM or SIGINT.
  const program = poolDaemonProgram();
  execProgram(program, ['pvisor-pool-daemon', socketPath, String(poolBytes), String(maxClients), String(maxPerUid), ...(gid === undefined ? [] : [String(gid)])]);
}

/** A whole number from 1 to `max`, given as an option's text. */
function count(option: string, text: string, max: number): number {
  if (!/^[1-9][0-9]*$/.test(text) || Number(text) > max) throw new InvalidOptionError(option, `must be a whole number from 1 to ${max}, got ${JSON.stringify(text)}`);
  return Number(text);
}

/** The shipped native daemon, checked against its checksum file before this process becomes it. */
function poolDaemonProgram(): string {
  const path = nativePrebuild('pvisor-pool-daemon');
  let mismatch: string | undefined;
  try {
    accessSync(path, constants.X_OK);
    mismatch = prebuildMismatch(path, readFileSync(path));
  } catch (e) {
    throw new HostUnsupportedError(`the page pool's daemon ${path} is missing or not executable (${(e as Error).message}); reinstall pvisor, or rebuild it with native-prebuilds/helpers/build.sh`, { cause: e });
  }
  if (mismatch) throw new HostUnsupportedError(`${mismatch}; reinstall pvisor, or rebuild it with native-prebuilds/helpers/build.sh`);
  return path;
}

/** A path a Unix socket can be bound to (sun_path holds 107 bytes and a NUL). */
function checkSocketPath(path: string): string {
  if (path.length === 0 || path.includes('\0') || Buffer.byteLength(path) > 107) throw new InvalidOptionError('--socket', `a socket path is 1 to 107 bytes without NUL, got ${JSON.stringify(path)}`);
  return path;
}

function groupId(group: string): number {
  let gid: number;
  if (/^\d+$/.test(group)) gid = Number(group);
  else {
    try {
      gid = Number(execFileSync('getent', ['group', group], { encoding: 'utf8' }).split(':')[2]);
    } catch {
      throw new InvalidOptionError('--group', `no group ${group}`);
    }
  }
  // (gid_t)-1 means "no change" to chown: not a group.
  if (!Number.isSafeInteger(gid) || gid < 0 || gid >= 0xffffffff) throw new InvalidOptionError('--group', `no group ${group}`);
  return gid;
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
  for (const c of s.clients) process.stdout.write(`  client ${c.id}: ${c.name} (pid ${c.pid}, uid ${c.uid}, scope ${c.scope}), ${c.references} references\n`);
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
