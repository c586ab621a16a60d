/**
 * `pvisor run`'s arguments: where the VM comes from (a fresh boot, or a snapshot with `--from`),
 * its memory strategies and the command, all checked before anything is allocated. Pure: it reads
 * no file and starts nothing, so every refusal here happens before a VM exists.
 */
import { resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { InvalidOptionError, StoreError } from '../errors';
import { isStoreUrl, parseStoreUrl } from '../store/store-url';
import { ColdCompression } from '../memory/strategies/cold-compression';
import { CompressedOffload } from '../memory/strategies/compressed-offload';
import { IdleRelease } from '../memory/strategies/idle-release';
import { KsmAdvice } from '../memory/strategies/ksm-advice';
import { Offload } from '../memory/strategies/offload';
import { PoolClient } from '../memory/strategies/pool-client';
import { SharedSnapshot } from '../memory/strategies/shared-snapshot';
import { planComposition } from '../memory/composition';
import { DEFAULT_BACKING_DIR } from '../memory/backing-file';
import type { MemoryStrategy } from '../memory/strategy';
import { labelsFromText, type Labels } from '../labels';
import { parseDurationMs } from '../units';
import { checkVmShape, MAX_VCPUS } from '../vm-shape';
import { validateVmName } from '../vm-name';
import type { GuestKind, RootfsOptions } from '../vm-types';
import { networkFromCli, parseNetworkOption, type NetworkOption } from '../network/options';
import { resolveLimits, type JailLimitsInput } from '../jail/limits';

/** A VM booted fresh from a guest image. */
export interface BootSource {
  kind: 'boot';
  memoryBytes: number;
  /** `--memory` as given (default `512MiB`), for messages. */
  memoryText: string;
  vcpus: number;
  guest: GuestKind;
  kernel?: string;
  initrd?: string;
  rootfs?: RootfsOptions;
  /** `--net`, `--net-allow` and `--net-deny`. */
  network: NetworkOption;
}

/** A VM restored from a snapshot directory (`--from DIR`). */
export interface SnapshotSource {
  kind: 'snapshot';
  /** The snapshot directory, made absolute against the cwd of the run. */
  dir: string;
  /**
   * `--shared`: guest RAM is the snapshot's RAM file mapped copy-on-write ({@link SharedSnapshot},
   * first in the strategies), so clones share the pages they only read.
   */
  shared: boolean;
}

/** Everything `pvisor run` was asked for. */
export interface RunArgs {
  source: BootSource | SnapshotSource;
  /** `--name`: the VM's id. */
  name?: string;
  /** `--vm-socket`: the control socket's path. */
  socketPath?: string;
  /** `--console`: the guest's serial console goes to stderr. */
  console: boolean;
  /** `--quiet`: no progress lines; only CMD's output (and errors that end the run). */
  quiet: boolean;
  /** `--label KEY=VALUE`: the VM's labels ({@link VmOptions.labels}). */
  labels: Labels;
  /** The memory strategies, in composition order. */
  strategies: MemoryStrategy[];
  /** The words after `--`: an argv for the Linux guest, probe steps for the probe guest. */
  command: string[];
  /** `--publish HOSTPORT:GUESTPORT`: 127.0.0.1:HOSTPORT reaches the guest's TCP GUESTPORT (Linux guest). */
  publish: { hostPort: number; guestPort: number }[];
  /**
   * The flags that go on with the VM if it hibernates (see {@link CARRIED_FLAGS}), each
   * `--name` or `--name=value`, paths made absolute: the run that resumes it has another cwd.
   */
  carriedFlags: string[];
  /** `--vm-backing-dir` made absolute, else the default: where a hibernation goes too. */
  backingDir: string;
  /**
   * `--isolation`: `process` runs the VMM in a jail of its own (src/jail/: another uid, its own
   * namespaces and empty root, seccomp, a cgroup with `limits`); `none` in this process.
   */
  isolation: 'process' | 'none';
  /** Whether `--isolation` was given (else {@link DEFAULT_ISOLATION} was taken), for messages. */
  isolationGiven: boolean;
  /** `--limit-memory`, `--limit-cpus`, `--limit-pids` (with `--isolation process`); unset ones take the jail's defaults. */
  limits: JailLimitsInput;
}

/**
 * `--isolation`'s default: each VM jailed. A host that cannot jail refuses the run, naming
 * `--isolation none` (src/cli/run-jailed.ts): it never falls back to an unjailed VMM.
 */
export const DEFAULT_ISOLATION: 'process' | 'none' = 'process';

/**
 * `pvisor run` flags that a hibernated VM keeps when `pvisor resume` continues it in a new
 * process: its memory strategies, its console and its forwarded ports. What the snapshot decides
 * (memory, vCPUs, guest, disks) travels in the snapshot; `--from` and `--shared` do not go on (the
 * VM is restored from its hibernation, into memory of its own). True: the flag takes a value.
 */
export const CARRIED_FLAGS: Readonly<Record<string, boolean>> = {
  console: false,
  label: true,
  publish: true,
  'vm-ram-dedup': false,
  'vm-idle-release': false,
  'vm-offload': false,
  'vm-offload-reload': true,
  'vm-ram-compression': false,
  'vm-backing-dir': true,
  'vm-cold-ram-compression': false,
  'vm-cold-after': true,
  'vm-pool': true,
  'vm-pool-scope': true,
  // A jailed VM comes back jailed, with its limits.
  isolation: true,
  'limit-memory': true,
  'limit-cpus': true,
  'limit-pids': true,
};

/**
 * Checks flags a hibernation record carries (read from a file): each one of {@link CARRIED_FLAGS},
 * with `=value` exactly when it takes one, so that nothing else reaches the parser (not `--from`,
 * `--name` or `--vm-socket`). Their values are checked by {@link parseRunArgs}.
 */
export function checkCarriedFlags(flags: readonly string[]): string[] {
  for (const f of flags) {
    const m = /^--([a-z-]+)(=.*)?$/s.exec(f);
    const takesValue = m ? CARRIED_FLAGS[m[1]] : undefined;
    if (!m || takesValue === undefined || !Object.hasOwn(CARRIED_FLAGS, m[1])) throw new InvalidOptionError('flags', `${JSON.stringify(f)} is not a flag that goes on with a hibernated VM`);
    if (takesValue !== (m[2] !== undefined)) throw new InvalidOptionError('flags', `${JSON.stringify(f)}: --${m[1]} ${takesValue ? 'takes' : 'takes no'} value`);
  }
  return [...flags];
}

/**
 * Options a snapshot decides: the VM it restores has the memory, vCPUs, guest and disks it was
 * taken with, so giving one beside `--from` can only be a mistake.
 */
const SNAPSHOT_DECIDES = ['memory', 'vcpus', 'guest', 'kernel', 'initrd', 'rootfs', 'rootfs-readonly', 'net', 'net-allow', 'net-deny'] as const;

/**
 * Parses `pvisor run [OPTIONS] -- CMD...`. A wrong or conflicting option is an
 * {@link InvalidOptionError} naming it (strategies that cannot be composed, a
 * StrategyConflictError); an unknown one is Node's `ERR_PARSE_ARGS_UNKNOWN_OPTION`.
 * @param cwd what a relative `--from` is relative to.
 */
export function parseRunArgs(argv: string[], cwd: string = process.cwd()): RunArgs {
  const dash = argv.indexOf('--');
  const own = dash >= 0 ? argv.slice(0, dash) : argv;
  const command = dash >= 0 ? argv.slice(dash + 1) : [];
  // No defaults for what a snapshot decides: a flag given must be told apart from one left out.
  const { values } = parseArgs({
    args: own,
    options: {
      executor: { type: 'string' },
      from: { type: 'string' },
      shared: { type: 'boolean', default: false },
      memory: { type: 'string' },
      vcpus: { type: 'string' },
      guest: { type: 'string' },
      kernel: { type: 'string' },
      initrd: { type: 'string' },
      rootfs: { type: 'string' },
      'rootfs-readonly': { type: 'boolean' },
      net: { type: 'string' },
      publish: { type: 'string', multiple: true },
      'net-allow': { type: 'string', multiple: true },
      'net-deny': { type: 'string', multiple: true },
      console: { type: 'boolean', default: false },
      quiet: { type: 'boolean', short: 'q', default: false },
      label: { type: 'string', multiple: true },
      'vm-ram-dedup': { type: 'boolean', default: false },
      'vm-idle-release': { type: 'boolean', default: false },
      'vm-offload': { type: 'boolean', default: false },
      'vm-offload-reload': { type: 'string' },
      'vm-ram-compression': { type: 'boolean', default: false },
      'vm-backing-dir': { type: 'string' },
      'vm-cold-ram-compression': { type: 'boolean', default: false },
      'vm-cold-after': { type: 'string' },
      'vm-pool': { type: 'string' },
      'vm-pool-scope': { type: 'string' },
      name: { type: 'string' },
      'vm-socket': { type: 'string' },
      isolation: { type: 'string' },
      'limit-memory': { type: 'string' },
      'limit-cpus': { type: 'string' },
      'limit-pids': { type: 'string' },
    },
    strict: true,
  });
  // The reference CLI's `--executor vm`: a VM is the only executor pvisor has, so it is accepted
  // and anything else is refused, naming the one there is.
  if (values.executor !== undefined && values.executor !== 'vm') throw new InvalidOptionError('--executor', `expected vm (pvisor runs commands only in a VM), got ${JSON.stringify(values.executor)}`);
  const from = values.from;
  if (from !== undefined) {
    if (!from) throw new InvalidOptionError('--from', 'expected a snapshot directory (one that pvisor snapshot or vm.snapshot() wrote)');
    const given = SNAPSHOT_DECIDES.find((k) => values[k] !== undefined);
    if (given) throw new InvalidOptionError(`--${given}`, 'does not go with --from: a VM restored from a snapshot has the memory, vCPUs, guest and disks it was taken with');
  }
  if (values.shared && from === undefined) throw new InvalidOptionError('--shared', "only goes with --from DIR: clones share the snapshot's RAM file");
  const coldAfter = values['vm-cold-after'];
  if (coldAfter !== undefined && !values['vm-cold-ram-compression']) throw new InvalidOptionError('--vm-cold-after', 'only goes with --vm-cold-ram-compression');
  if (values['rootfs-readonly'] && values.rootfs === undefined) throw new InvalidOptionError('--rootfs-readonly', 'only goes with --rootfs IMAGE');
  if (values['vm-pool-scope'] !== undefined && values['vm-pool'] === undefined) throw new InvalidOptionError('--vm-pool-scope', 'only goes with --vm-pool');
  const reload = values['vm-offload-reload'];
  if (reload !== undefined && !values['vm-offload']) throw new InvalidOptionError('--vm-offload-reload', 'only goes with --vm-offload');
  if (reload !== undefined && reload !== 'eager' && reload !== 'lazy') throw new InvalidOptionError('--vm-offload-reload', `expected eager or lazy, got ${JSON.stringify(reload)}`);
  if (!command.length) throw new InvalidOptionError('command', 'nothing to run: give it after --, e.g. pvisor run -- uname -a');
  const source = from !== undefined ? ({ kind: 'snapshot', dir: snapshotLocation(from, cwd), shared: values.shared } as const) : bootSource(values);

  const strategies: MemoryStrategy[] = [];
  if (values.shared) strategies.push(new SharedSnapshot());
  if (values['vm-ram-dedup']) strategies.push(new KsmAdvice());
  if (values['vm-idle-release']) strategies.push(new IdleRelease());
  const dir = values['vm-backing-dir'];
  if (values['vm-cold-ram-compression']) strategies.push(new ColdCompression({ coldAfterMs: coldAfter === undefined ? undefined : parseDurationMs('--vm-cold-after', coldAfter), dir }));
  if (values['vm-pool'] !== undefined) strategies.push(new PoolClient({ socket: values['vm-pool'], scope: values['vm-pool-scope'] }));
  if (values['vm-offload']) strategies.push(new Offload({ reload, dir }));
  if (values['vm-ram-compression']) strategies.push(new CompressedOffload({ dir }));
  // `pvisor suspend ID --vm-offload` must work on any VM, as in the reference CLI: Offload costs
  // nothing until a suspend, so it is composed unless another suspend-image strategy was chosen.
  if (!strategies.some((s) => s.exclusive.includes('suspend-image'))) strategies.push(new Offload({ dir }));
  if (values.name !== undefined) validateVmName(values.name);
  // A composition that cannot work is refused now, as Vm.start would refuse it, before anything is printed.
  planComposition(strategies);
  const publish = (values.publish ?? []).map((p) => {
    const m = /^([0-9]{1,5}):([0-9]{1,5})$/.exec(p);
    const [hostPort, guestPort] = m ? [Number(m[1]), Number(m[2])] : [0, 0];
    if (!(hostPort >= 1 && hostPort <= 65535 && guestPort >= 1 && guestPort <= 65535)) throw new InvalidOptionError('--publish', `expected HOSTPORT:GUESTPORT (1-65535 each), got ${JSON.stringify(p)}`);
    return { hostPort, guestPort };
  });
  if (publish.length && source.kind === 'boot' && source.guest === 'probe') throw new InvalidOptionError('--publish', 'is for the Linux guest');
  const absolute = (p: string) => resolve(cwd, p);
  const carriedFlags: string[] = [];
  for (const [flag, takesValue] of Object.entries(CARRIED_FLAGS)) {
    const v = values[flag as keyof typeof values];
    if (v === undefined || v === false) continue;
    if (!takesValue) carriedFlags.push(`--${flag}`);
    else for (const one of Array.isArray(v) ? v : [v]) carriedFlags.push(`--${flag}=${flag === 'vm-backing-dir' || flag === 'vm-pool' ? absolute(String(one)) : String(one)}`);
  }
  const backingDir = absolute(dir ?? DEFAULT_BACKING_DIR);
  const labels = labelsFromText('--label', values.label ?? []);
  const { isolation, limits } = isolationOf(values, source);
  return { source, name: values.name, socketPath: values['vm-socket'], console: values.console, quiet: values.quiet, labels, strategies, command, publish, carriedFlags, backingDir, isolation, isolationGiven: values.isolation !== undefined, limits };
}

/**
 * `--isolation` and the `--limit-*` options, checked. A network, `--vm-socket`, `--publish`, a
 * writable rootfs and `--vm-pool` are the launcher's, which hands them to the jail
 * (src/jail/launcher.ts, ./run-jailed.ts).
 */
function isolationOf(
  values: { isolation?: string; 'limit-memory'?: string; 'limit-cpus'?: string; 'limit-pids'?: string },
  source: BootSource | SnapshotSource,
): { isolation: 'process' | 'none'; limits: JailLimitsInput } {
  const isolation = values.isolation ?? DEFAULT_ISOLATION;
  if (isolation !== 'process' && isolation !== 'none') throw new InvalidOptionError('--isolation', `expected process or none, got ${JSON.stringify(isolation)}`);
  const limits: JailLimitsInput = {};
  if (values['limit-memory'] !== undefined) limits.memory = values['limit-memory'];
  for (const [flag, key] of [['limit-cpus', 'cpus'], ['limit-pids', 'pids']] as const) {
    const text = values[flag];
    if (text === undefined) continue;
    if (!/^\d+(\.\d+)?$/.test(text)) throw new InvalidOptionError(`--${flag}`, `expected a number, got ${JSON.stringify(text)}`);
    limits[key] = Number(text);
  }
  if (isolation === 'none') {
    const given = Object.keys(limits)[0];
    if (given) throw new InvalidOptionError(`--limit-${given}`, 'only goes with --isolation process (a VM in this process has no limits of its own)');
    return { isolation, limits };
  }
  // The limits are checked against the VM they bound.
  if (source.kind === 'boot') resolveLimits(limits, source);
  return { isolation, limits };
}

function bootSource(values: { memory?: string; vcpus?: string; guest?: string; kernel?: string; initrd?: string; rootfs?: string; 'rootfs-readonly'?: boolean; net?: string; 'net-allow'?: string[]; 'net-deny'?: string[] }): BootSource {
  const memoryText = values.memory ?? '512MiB';
  // Checked here as Vm.start checks them, so that a bad value is a usage error before anything is printed.
  const vcpuText = values.vcpus ?? '2';
  if (!/^\d+$/.test(vcpuText)) throw new InvalidOptionError('vcpus', `must be a whole number from 1 to ${MAX_VCPUS}, got ${JSON.stringify(vcpuText)}`);
  const { memoryBytes, vcpus, guest } = checkVmShape({ memory: memoryText, vcpus: Number(vcpuText), guest: values.guest });
  if (guest === 'probe' && (values.kernel !== undefined || values.initrd !== undefined)) throw new InvalidOptionError('--kernel', '--kernel and --initrd are for the Linux guest');
  if (guest === 'probe' && values.rootfs !== undefined) throw new InvalidOptionError('--rootfs', 'is for the Linux guest');
  const rootfs = values.rootfs === undefined ? undefined : { path: values.rootfs, readOnly: values['rootfs-readonly'] === true };
  for (const flag of ['net-allow', 'net-deny'] as const) {
    if (values[flag] !== undefined && values.net === undefined) throw new InvalidOptionError(`--${flag}`, 'only goes with --net nat');
  }
  const network = networkFromCli(values.net ?? 'none', values['net-allow'] ?? [], values['net-deny'] ?? []);
  parseNetworkOption(network); // a bad rule is a usage error, before anything starts
  if (guest === 'probe' && network !== 'none') throw new InvalidOptionError('--net', 'is for the Linux guest');
  return { kind: 'boot', memoryBytes, memoryText, vcpus, guest, kernel: values.kernel, initrd: values.initrd, rootfs, network };
}

/** `--from`: a directory (made absolute) or an `s3://bucket/prefix` location (checked now). */
function snapshotLocation(from: string, cwd: string): string {
  if (!isStoreUrl(from)) return resolve(cwd, from);
  try {
    return parseStoreUrl(from).url;
  } catch (e) {
    if (e instanceof StoreError) throw new InvalidOptionError('--from', e.message);
    throw e;
  }
}
