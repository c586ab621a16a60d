/**
 * The object store `pvisor bench fleet` measures against: the one the standard AWS environment
 * names (`AWS_ENDPOINT_URL`), or else one the bench starts itself with the repository's
 * scripts/object-store.sh (Ceph radosgw on loopback, memstore) and stops at the end.
 *
 * Starting one is the default because it is one script call, and because the bench must run in
 * the nested harness, whose L1 has no network to the host's store and whose command does not
 * inherit the shell's environment: there, only a store started inside the L1 can be reached.
 * A machine that cannot have the store's packages (not root, not installed) is told so plainly.
 */
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { StoreError } from '../errors';
import { PACKAGE_ROOT } from '../native';
import { progress } from './report';

const SCRIPT = join(PACKAGE_ROOT, 'scripts', 'object-store.sh');
/** scripts/object-store.sh's exit status when this machine cannot install the store's packages. */
const CANNOT_INSTALL = 3;

/** A store the bench uses, and how to let go of it. */
export interface BenchStore {
  /** `environment` (AWS_ENDPOINT_URL was set) or `started` (the bench started radosgw). */
  origin: 'environment' | 'started';
  endpoint: string;
  /** Milliseconds the start took (0 for a store of the environment). */
  startMs: number;
  /** Stops a store the bench started and puts process.env back; nothing for the environment's. */
  close(): void;
}

/** `export NAME=value` lines, as scripts/object-store.sh prints them, into a map. */
export function parseExportLines(text: string): Record<string, string> {
  const env: Record<string, string> = {};
  for (const line of text.split('\n')) {
    const m = /^export ([A-Z0-9_]+)=(\S*)$/.exec(line);
    if (m) env[m[1]] = m[2];
  }
  return env;
}

/**
 * The environment's store when `AWS_ENDPOINT_URL` is set, else a store started in
 * `<package>/.cache/bench-fleet-store-PID` (under the harness only the repository is the host's
 * disk). Fails with a {@link StoreError} `unreachable` that says what to do when none can be had.
 */
export function openBenchStore(env: NodeJS.ProcessEnv = process.env): BenchStore {
  if (env.AWS_ENDPOINT_URL) return { origin: 'environment', endpoint: env.AWS_ENDPOINT_URL, startMs: 0, close: () => {} };
  if (!existsSync(SCRIPT)) throw new StoreError('unreachable', `no object store: AWS_ENDPOINT_URL is not set, and ${SCRIPT} (which starts one) is not in this installation; set the AWS environment of an S3 store with a bucket "pvisor"`);
  const stateDir = join(PACKAGE_ROOT, '.cache', `bench-fleet-store-${process.pid}`);
  // memstore: starts sooner and needs no block file (the harness's share of the repository is 9p);
  // the bench stores well under its 1 GiB.
  const scriptEnv = { ...env, OBJECT_STORE_BACKEND: 'memstore', OBJECT_STORE_SIZE_MIB: '1024', OBJECT_STORE_TIMEOUT_S: '400' };
  const run = (command: string) => spawnSync('bash', [SCRIPT, command, '--dir', stateDir], { encoding: 'utf8', timeout: 600_000, env: scriptEnv });
  progress(`AWS_ENDPOINT_URL is not set: starting an object store (scripts/object-store.sh start, memstore) in ${stateDir}`);
  const t0 = performance.now();
  const r = run('start');
  const startMs = performance.now() - t0;
  if (r.status !== 0) {
    run('stop');
    const why = r.status === CANNOT_INSTALL ? r.stderr.trim().replace(/^object-store: /, '') : `scripts/object-store.sh start exited ${r.status}:\n${r.stderr.trim().split('\n').slice(-15).join('\n')}`;
    throw new StoreError('unreachable', `no object store: AWS_ENDPOINT_URL is not set and the bench could not start one (${why}); set the AWS environment of an S3 store with a bucket "pvisor", or run as root with Debian's Ceph packages installable`);
  }
  const exports = parseExportLines(r.stdout);
  const saved = Object.fromEntries(Object.keys(exports).map((k) => [k, process.env[k]]));
  Object.assign(process.env, exports);
  progress(`object store ready in ${(startMs / 1000).toFixed(1)} s at ${exports.AWS_ENDPOINT_URL}`);
  return {
    origin: 'started',
    endpoint: exports.AWS_ENDPOINT_URL ?? '?',
    startMs,
    close: () => {
      for (const [k, v] of Object.entries(saved)) {
        if (v === undefined) delete process.env[k];
        else process.env[k] = v;
      }
      const s = run('stop');
      if (s.status !== 0) progress(`scripts/object-store.sh stop exited ${s.status}: ${s.stderr.trim()}`);
    },
  };
}
