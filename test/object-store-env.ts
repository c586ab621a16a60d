// The test object store (scripts/object-store.sh: Ceph radosgw on loopback) as a test file uses
// it: the script run against a state directory of the file's own (so a store a developer started
// is left alone), why this machine cannot have it, and the AWS environment it prints put into
// this process's and taken out again.
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { GetObjectCommand, PutObjectCommand, S3Client } from '@aws-sdk/client-s3';
import { DEFAULT_BACKING_DIR } from '../src/memory/backing-file';
import { parseExportLines } from '../src/bench/fleet-store';

const SCRIPT = join(__dirname, '..', '..', 'scripts', 'object-store.sh');
/** The script's exit code when this machine cannot install the store's packages. */
const CANNOT_INSTALL = 3;

export interface ScriptResult {
  status: number | null;
  stdout: string;
  stderr: string;
}

/**
 * Runs the script with `--dir stateDir`. 300 s by default: a first start on a fresh machine
 * installs Ceph's packages (about 45 s here) first. `env`: the script's own settings (backend, size).
 */
export function objectStoreScript(stateDir: string, options: { timeoutMs?: number; env?: Record<string, string> } = {}): (...args: string[]) => ScriptResult {
  return (...args) => {
    const r = spawnSync('bash', [SCRIPT, ...args, '--dir', stateDir], { encoding: 'utf8', timeout: options.timeoutMs ?? 300_000, env: { ...process.env, ...options.env } });
    return { status: r.status, stdout: r.stdout, stderr: r.stderr };
  };
}

/**
 * Why this machine cannot have the store (not root and the packages not installed, or no
 * apt-get), said once on the console as `what: SKIPPED, why`; undefined when it can. Any other
 * failure to start is the test's to fail on.
 */
export function objectStoreSkipReason(what: string): string | undefined {
  const check = spawnSync('bash', [SCRIPT, 'check'], { encoding: 'utf8' });
  const why = check.status === CANNOT_INSTALL ? check.stderr.trim().replace(/^object-store: /, '') : undefined;
  if (why) console.log(`${what}: SKIPPED, ${why}`);
  return why;
}

/**
 * Starts the store (throwing with its stderr if it does not start) and puts the AWS environment
 * it prints into process.env, so that clients read nothing else. Returns the exports, and
 * `restoreEnv()`, which puts back what process.env had.
 */
export function startObjectStore(script: (...args: string[]) => ScriptResult): { exports: Record<string, string>; restoreEnv(): void } {
  const r = script('start');
  if (r.status !== 0) throw new Error(`scripts/object-store.sh start exited ${r.status}:\n${r.stderr}`);
  const exports = parseExportLines(r.stdout);
  const saved: Record<string, string | undefined> = {};
  for (const [k, v] of Object.entries(exports)) {
    saved[k] = process.env[k];
    process.env[k] = v;
  }
  return {
    exports,
    restoreEnv: () => {
      for (const [k, v] of Object.entries(saved)) {
        if (v === undefined) delete process.env[k];
        else process.env[k] = v;
      }
    },
  };
}

/**
 * In a `describe` of a harness test: the store started before its tests (its AWS environment in
 * process.env) and a new work directory under the backing directory, `workPrefix`-named, given
 * to `onWork`; after them, `beforeStop` (clones to end), the environment put back, the store
 * stopped (which must succeed) and the work directory removed.
 */
export function objectStoreSuite(
  script: (...args: string[]) => ScriptResult,
  workPrefix: string,
  options: { onWork(dir: string): void; beforeStop?: () => Promise<void>; stopTimeoutMs?: number },
): void {
  let restoreEnv = () => {};
  let work: string | undefined;
  beforeAll(() => {
    work = mkdtempSync(join(DEFAULT_BACKING_DIR, workPrefix));
    options.onWork(work);
    ({ restoreEnv } = startObjectStore(script));
  }, 620_000);
  afterAll(async () => {
    await options.beforeStop?.();
    restoreEnv();
    const r = script('stop');
    if (work) rmSync(work, { recursive: true, force: true });
    expect(r.status).toBe(0);
  }, options.stopTimeoutMs ?? 120_000);
}

/** The object `key` of the test store's bucket `pvisor`, read past pvisor (to corrupt it, or to look). */
export async function getObject(key: string): Promise<Buffer> {
  const client = new S3Client({});
  try {
    const r = await client.send(new GetObjectCommand({ Bucket: 'pvisor', Key: key }));
    return Buffer.from(await r.Body!.transformToByteArray());
  } finally {
    client.destroy();
  }
}

/** Writes `body` as the object `key` of the test store's bucket `pvisor`, past pvisor. */
export async function putObject(key: string, body: Buffer): Promise<void> {
  const client = new S3Client({});
  try {
    await client.send(new PutObjectCommand({ Bucket: 'pvisor', Key: key, Body: body, ContentLength: body.length }));
  } finally {
    client.destroy();
  }
}
