/**
 * Starts one VMM (`pvisor run`) in a jail and watches it end: the launcher side of
 * `isolation: 'process'`. It runs as root, because it makes what the jail is given and the jail
 * cannot make for itself:
 * - a cgroup (v2, or v1 on a host whose controllers are bound there) with the VM's limits
 *   (./cgroup.ts), which the process enters before it execs;
 * - a directory only root reaches (/run/pvisor-jail/ID, mode 0700) holding the VM's /dev/kvm node
 *   (mknod'ed for the jail's uid, as Firecracker's jailer does), its control socket (listening,
 *   handed over as an fd) and the seccomp program (./seccomp.ts, handed over as an fd);
 * - the VM's own backing directory, owned by the jail's uid;
 * - with a network, its host side (../network/host-network.ts: the TAP, its settings, its
 *   nftables tables, the resolver of its egress rules), made here as an in-process VM's start
 *   makes it; the jail gets the TAP's fd (inherited as fd 6), a /dev/vhost-net node of its uid,
 *   and what the guest is to be told (../network/handed-network.ts), and needs no CAP_NET_ADMIN;
 *   the launcher removes it all when the VMM ends, however it ends;
 * and then runs sh (to enter the cgroup) -> prlimit (./rlimits.ts: no core dumps, a bound on open
 * files) -> bwrap (./sandbox.ts: namespaces, empty root) ->
 * pvisor-jail-exec (the jail's uid and gid, no_new_privs, seccomp) -> node. The process it waits for is bwrap; what killed the VMM is read
 * from its report (none: it was killed) and its cgroup's memory.events.
 * @module
 */
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { chownSync, closeSync, existsSync, lchownSync, lstatSync, mkdirSync, openSync, readdirSync, realpathSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { constants as osConstants } from 'node:os';
import { JailUnavailableError, JailViolationError, VmLimitError, type PvisorError } from '../errors';
import { nativePrebuild, PACKAGE_ROOT } from '../native';
import { closeFd } from '../sys/libc';
import { JailCgroup } from './cgroup';
import { JailIdLock } from './jail-lock';
import { checkCgroupHost, type CgroupHost } from './cgroup-host';
import { JAIL_ENV, parseJailedReport } from './jailed-entry';
import type { JailLimits } from './limits';
import { listenUnixSocket } from './listen-socket';
import { withJailRlimits } from './rlimits';
import { bwrapArgs, nodeRuntimeFiles, usrMergeLinks } from './sandbox';
import { buildFilter } from './seccomp';
import type { HostNetwork } from '../network/host-network';
import { formatHandedNetwork, HANDED_NETWORK_ENV } from '../network/handed-network';
import type { NetworkPlan } from '../network/options';

/**
 * The jail's uid and gid by default: `nobody`/`nogroup` (65534), which owns no file on a Debian
 * host, so the VMM can read only what is world-readable and write only what the launcher gave it.
 * Several VMs share it; their processes still cannot reach each other: each has its own pid
 * namespace (no kill, no ptrace, no /proc of the other) and its own files (a kvm node and a backing
 * directory each). `PVISOR_JAIL_UID` / `PVISOR_JAIL_GID` choose others (say, one per tenant).
 */
export const DEFAULT_JAIL_ID = 65534;
/** Where the launcher keeps each jailed VM's private files. */
export const JAIL_RUN_DIR = '/run/pvisor-jail';
/** The largest answer the launcher relays from a jailed VMM (exec output is capped at 1 MiB by default, far below). */
export const MAX_RELAYED_ANSWER_BYTES = 64 * 1024 * 1024;

/** What to jail. */
export interface JailPlan {
  /** The VM's id. */
  id: string;
  limits: JailLimits;
  /** The `pvisor run` arguments the jailed VMM gets (after `run`). */
  runArgv: readonly string[];
  /** The control socket's path its clients use (the launcher's, relayed): the name the jailed VMM says. */
  socketPath?: string;
  /** Host paths the VM reads (its kernel, initrd, a read-only rootfs, a snapshot directory). */
  readOnly: readonly string[];
  /** Host paths the VM writes (a writable rootfs). */
  readWrite: readonly string[];
  /** The directory under which the VM's own backing directory is made (its `--vm-backing-dir`). */
  backingParent: string;
  /** The jail's uid and gid (default {@link DEFAULT_JAIL_ID}). */
  uid?: number;
  gid?: number;
  /** The VM's network, set up here and handed to the jail (none when absent). */
  network?: Exclude<NetworkPlan, { kind: 'none' }>;
  /** The guest's MAC on that network: a restored guest's is its snapshot's (default a new one). */
  networkMac?: Buffer;
  /**
   * Open files the jailed VMM gets instead of paths it could not open as the jail's uid (a
   * writable rootfs, a connection to the pool daemon): each inherited as fd 7, 8, ... in order,
   * its number in the jail set in the environment variable `env` (./handed-files.ts reads them).
   * The caller keeps and closes its own copies.
   */
  handedFds?: readonly { fd: number; env: string; value: (fdInJail: number) => string }[];
  /** More environment for the jailed VMM (trusted: the launcher's own words, such as {@link JAIL_ENV}.resumed). */
  env?: Readonly<Record<string, string>>;
  /**
   * Directories moved (renamed, on the same filesystem) into the VM's backing directory under
   * `name`, and given to the jail's uid: a hibernated VM that the jailed VMM restores and
   * consumes. What is still there when the jail is taken down (it could not be started, or the
   * restore failed) is moved back and given back to this process's uid.
   */
  moveIn?: readonly { from: string; name: string }[];
  /**
   * Private directories of the caller's (a snapshot fetched from a store, 0700 with 0600 files)
   * given to the jail's uid before it starts, so that the jail can read them where
   * {@link readOnly} binds them; the caller removes them after the jail.
   */
  giveToJail?: readonly string[];
}

/** The VM's own backing directory in `backingParent` (made by {@link JailedVmm.start}, bound into its jail). */
export function jailBackingDir(backingParent: string, id: string): string {
  return join(backingParent, `pvisor-jail-${id}`);
}

/** The fd the jailed VMM has the TAP on (after stdio, the control socket, the status pipe and the seccomp program). */
const TAP_FD_IN_JAIL = 6;
/** The first fd of {@link JailPlan.handedFds} in the jail. */
const FIRST_HANDED_FD_IN_JAIL = 7;

/**
 * How a jailed VMM ended.
 * @category VM
 */
export type JailOutcome = { exitCode: number } | { error: PvisorError } | { signal: NodeJS.Signals };

/**
 * Checks that this host can jail a VM, making nothing: root, bubblewrap, a cgroup (v2 or v1)
 * with the jail's controllers, /dev/kvm; returns bwrap's path and where the cgroups go, read once
 * for the whole start. Throws a {@link JailUnavailableError} naming what is missing.
 */
export function checkJailHost(): { bwrap: string; cgroups: CgroupHost } {
  if (process.getuid?.() !== 0) throw new JailUnavailableError(`isolation 'process' needs root (uid ${process.getuid?.()}): the launcher makes a cgroup and a /dev/kvm node for the jail and changes to its uid; use isolation 'none' here`);
  const find = (name: string, pkg: string) => {
    for (const dir of ['/usr/bin', '/bin', '/usr/sbin', '/sbin']) if (existsSync(join(dir, name))) return join(dir, name);
    throw new JailUnavailableError(`isolation 'process' needs ${name} (Debian package ${pkg}): apt-get install ${pkg}`);
  };
  const bwrap = find('bwrap', 'bubblewrap');
  const cgroups = checkCgroupHost();
  // The jail gets a node of its own for it (makeDeviceNode): without the host's, there is nothing to give.
  if (!existsSync('/dev/kvm')) throw new JailUnavailableError('/dev/kvm does not exist: the kvm module is not loaded, or this host has no usable KVM');
  return { bwrap, cgroups };
}

/**
 * Takes down what a killed launcher left of jail `id` (its lock is this process's now, so no live
 * launcher uses any of it): the tasks still in its cgroup and the cgroup, its private directory;
 * its backing directory is moved aside, not removed (a hibernation may have been under way in
 * it). Returns what it found and did, for the launcher to say; undefined if nothing was left.
 */
async function reclaimStaleJail(id: string, dir: string, backingDir: string, cgroups: CgroupHost): Promise<string | undefined> {
  const found: string[] = [];
  const cgroup = JailCgroup.find(id, cgroups);
  if (cgroup) {
    for (const pid of cgroup.pids()) {
      try {
        process.kill(pid, 'SIGKILL');
      } catch {
        // Gone meanwhile.
      }
    }
    if (!(await cgroup.removeWhenEmpty())) throw new JailUnavailableError(`${id}: a killed launcher's cgroup (${cgroup.dirs.join(', ')}) still has tasks after SIGKILL; remove it once it is empty`);
    found.push('its cgroup, removed');
  }
  if (existsSync(dir)) {
    rmSync(dir, { recursive: true, force: true });
    found.push(`${dir}, removed`);
  }
  if (existsSync(backingDir)) {
    const aside = `${backingDir}.left-${new Date().toISOString().replace(/[:.]/g, '-')}`;
    renameSync(backingDir, aside);
    found.push(`its backing directory, moved to ${aside}`);
  }
  return found.length ? `a launcher of ${id} was killed before it could take its jail down: ${found.join('; ')}` : undefined;
}

/** A jailed VMM, started. */
export class JailedVmm {
  private report = '';
  private readonly ended: Promise<JailOutcome>;
  private readonly teardownHooks: ((o: JailOutcome) => Promise<void>)[] = [];

  private constructor(
    readonly id: string,
    /** The socket the jailed VMM accepts on (the launcher relays to it). */
    readonly innerSocketPath: string,
    private readonly child: ChildProcess,
    private readonly cgroup: JailCgroup,
    private readonly limits: JailLimits,
    private readonly cleanup: () => void,
    /** The VM's network, when it has one: its host side is this process's. */
    readonly network: HostNetwork | undefined,
    /** The VM's own backing directory, bound into the jail and the jail uid's (a snapshot is staged there). */
    readonly backingDir: string,
    /** The jail's uid. */
    readonly uid: number,
    /** What was left of this id's jail by a launcher killed before it could take it down, and what became of it. */
    readonly reclaimed: string | undefined,
  ) {
    child.stdio[4]?.on('data', (d: Buffer) => {
      if (this.report.length < 4096) this.report += d.toString('utf8');
    });
    this.ended = new Promise((resolve) => {
      child.once('exit', (code, signal) => resolve(this.outcome(code, signal)));
      // The shell that enters the cgroup could not be started at all: no exit will come.
      child.once('error', (e) => resolve({ error: new JailUnavailableError(`${id}: cannot start the jail: ${e.message}`, { cause: e }) }));
    }).then(async (o) => {
      await this.cgroup.removeWhenEmpty();
      for (const hook of this.teardownHooks) {
        try {
          await hook(o as JailOutcome);
        } catch {
          // A hook reports its own failure to whoever registered it; the jail comes down all the same.
        }
      }
      this.cleanup();
      return o as JailOutcome;
    });
  }

  /** The pid of the jail's outermost process (bwrap), which ends with the VMM. */
  get pid(): number {
    return this.child.pid ?? -1;
  }

  /** Resolves when the VMM has ended and the jail is taken down (cgroup, kvm node, backing directory, network). */
  exited(): Promise<JailOutcome> {
    return this.ended;
  }

  /**
   * Runs `hook` once the VMM has ended, before its backing directory is removed: what the VMM
   * left there for this process (a hibernated VM) is taken out then. Hooks run in order.
   */
  beforeTeardown(hook: (outcome: JailOutcome) => Promise<void>): void {
    this.teardownHooks.push(hook);
  }

  /** Ends the VMM at once (SIGKILL to bwrap; --die-with-parent and the pid namespace take the rest). */
  kill(): void {
    this.child.kill('SIGKILL');
  }

  /**
   * Starts `plan`'s VMM in a new jail. Throws a {@link JailUnavailableError} when the host cannot
   * jail it, a {@link NetworkSetupError} when it cannot make its network; nothing is left behind.
   */
  static async start(plan: JailPlan, stdio: { stdout: 'inherit' | 'ignore'; stderr: 'inherit' | 'ignore' } = { stdout: 'inherit', stderr: 'inherit' }): Promise<JailedVmm> {
    const { bwrap, cgroups } = checkJailHost();
    const uid = plan.uid ?? envId('PVISOR_JAIL_UID') ?? DEFAULT_JAIL_ID;
    const gid = plan.gid ?? envId('PVISOR_JAIL_GID') ?? DEFAULT_JAIL_ID;
    if (uid === 0 || gid === 0) throw new JailUnavailableError('the jail\'s uid and gid must not be 0 (root): the jail is for an unprivileged VMM');
    const program = buildFilter();
    const undo: (() => void)[] = [];
    let controlFd: number | undefined;
    let filterFd: number | undefined;
    const cleanup = () => {
      for (const u of undo.reverse()) {
        try {
          u();
        } catch {
          // Best effort: each part is removed on its own.
        }
      }
      undo.length = 0;
    };
    let reclaimed: string | undefined;
    try {
      // Held for the launcher's life (the last undo): while it is, nothing else of this id runs.
      const lock = JailIdLock.take(JAIL_RUN_DIR, plan.id);
      undo.push(() => lock.release());
      const dir = join(JAIL_RUN_DIR, plan.id);
      const backingDir = jailBackingDir(plan.backingParent, plan.id);
      reclaimed = await reclaimStaleJail(plan.id, dir, backingDir, cgroups);
      try {
        mkdirSync(dir, { mode: 0o711 });
      } catch (e) {
        throw new JailUnavailableError(`cannot make ${dir}: ${(e as Error).message} (another jailed run of ${plan.id}?)`, { cause: e });
      }
      undo.push(() => rmSync(dir, { recursive: true, force: true }));
      // /dev/kvm for this jail only: the host's node is root's (0600 or 0660 root:kvm); this one
      // is the jail uid's. /dev/userfaultfd too where the kernel has it (6.1+): memory strategies
      // that load guest RAM lazily need a userfaultfd that handles KVM's own faults, which an
      // unprivileged process gets only through it (or a host-wide sysctl).
      const devices: { node: string; path: string }[] = [];
      for (const [host, name] of [['/dev/kvm', 'kvm'], ['/dev/userfaultfd', 'userfaultfd']] as const) {
        if (name !== 'kvm' && !existsSync(host)) continue;
        devices.push({ node: makeDeviceNode(host, join(dir, name), uid, gid), path: host });
      }
      // The network's host side, made here (root, the host's namespace) as Vm.start makes it.
      // vhost-net is opened in the jail: VHOST_SET_OWNER binds its worker to the caller's memory,
      // which must be the VMM's.
      let network: HostNetwork | undefined;
      if (plan.network) {
        const { HostNetwork } = await import('../network/host-network');
        const net = await HostNetwork.setup(plan.network, plan.networkMac ? { mac: plan.networkMac } : {});
        network = net;
        undo.push(() => net.close());
        devices.push({ node: makeDeviceNode('/dev/vhost-net', join(dir, 'vhost-net'), uid, gid), path: '/dev/vhost-net' });
      }
      // The VM's own backing directory (Offload writes guest RAM there on suspend).
      mkdirSync(backingDir, { mode: 0o700 });
      undo.push(() => rmSync(backingDir, { recursive: true, force: true }));
      chownSync(backingDir, uid, gid);
      for (const d of plan.giveToJail ?? []) chownTree(d, uid, gid);
      for (const m of plan.moveIn ?? []) {
        const inside = join(backingDir, m.name);
        renameSync(m.from, inside);
        // Undone before the backing directory is removed (undo runs in reverse), also once the VMM
        // has ended: what it did not consume (a restore that failed) goes back where it was.
        undo.push(() => {
          if (!existsSync(inside)) return;
          chownTree(inside, process.getuid?.() ?? 0, process.getgid?.() ?? 0);
          renameSync(inside, m.from);
        });
        chownTree(inside, uid, gid);
      }
      // The seccomp program: a root-only file, opened here and read by pvisor-jail-exec through the fd.
      const filterPath = join(dir, 'seccomp.bpf');
      writeFileSync(filterPath, program, { mode: 0o600 });
      filterFd = openSync(filterPath, 'r');
      // The control socket the VMM accepts on, in the root-only part of its directory.
      const sockDir = join(dir, 'control');
      mkdirSync(sockDir, { mode: 0o700 });
      const innerSocketPath = join(sockDir, 'control.sock');
      controlFd = listenUnixSocket(innerSocketPath);
      const cgroup = JailCgroup.create(plan.id, plan.limits, cgroups);
      undo.push(() => cgroup.remove());

      const nodeModules = join(PACKAGE_ROOT, 'node_modules');
      const nodeModulesReal = realpathSync(nodeModules);
      const readOnly = [
        ...nodeRuntimeFiles(nodeModulesReal),
        join(PACKAGE_ROOT, 'dist'),
        join(PACKAGE_ROOT, 'package.json'),
        join(PACKAGE_ROOT, 'native-prebuilds'),
        nodeModulesReal,
        ...plan.readOnly,
      ].filter((p, i, all) => all.indexOf(p) === i);
      const links = usrMergeLinks();
      if (nodeModulesReal !== nodeModules) links.push({ path: nodeModules, target: nodeModulesReal });
      const env: Record<string, string> = {
        PATH: '/usr/bin:/bin',
        HOME: '/tmp',
        // The control socket is handed over: nothing of the host's runtime directory is in the jail.
        PVISOR_RUNTIME_DIR: '/tmp',
        MALLOC_ARENA_MAX: '1',
        [JAIL_ENV.controlFd]: '3',
        [JAIL_ENV.statusFd]: '4',
        [HANDED_NETWORK_ENV]: formatHandedNetwork(network?.handOver(TAP_FD_IN_JAIL)),
      };
      for (const k of ['PVISOR_NESTED', 'PVISOR_KEEP_PROCESS_PAGES', JAIL_ENV.testForbiddenSyscall]) {
        const v = process.env[k];
        if (v !== undefined) env[k] = v;
      }
      Object.assign(env, plan.env);
      const handed = plan.handedFds ?? [];
      handed.forEach((h, i) => (env[h.env] = h.value(FIRST_HANDED_FD_IN_JAIL + i)));
      const args = bwrapArgs({
        readOnly,
        readWrite: [backingDir, ...plan.readWrite],
        devices,
        links,
        uid,
        gid,
        jailExec: nativePrebuild('pvisor-jail-exec'),
        seccompFd: 5,
        env,
        command: [realpathSync(process.execPath), '--expose-gc', '--max-semi-space-size=1', join(PACKAGE_ROOT, 'dist', 'src', 'cli', 'main.js'), 'run', ...withJailedRunArgs(plan.runArgv, plan.id, backingDir, plan.socketPath)],
      });
      const argv = cgroup.enterArgv(withJailRlimits([bwrap, ...args]));
      const child = spawn(argv[0], argv.slice(1), { stdio: ['ignore', stdio.stdout, stdio.stderr, controlFd, 'pipe', filterFd, network ? network.tap.fd : 'ignore', ...handed.map((h) => h.fd)], env: {} });
      return new JailedVmm(plan.id, innerSocketPath, child, cgroup, plan.limits, cleanup, network, backingDir, uid, reclaimed);
    } catch (e) {
      cleanup();
      throw e;
    } finally {
      // The child has its copies: the launcher keeps none of the jail's fds.
      if (controlFd !== undefined) closeFd(controlFd);
      if (filterFd !== undefined) closeSync(filterFd);
    }
  }

  private outcome(code: number | null, signal: NodeJS.Signals | null): JailOutcome {
    const reported = parseJailedReport(this.report);
    if (reported !== undefined) return { exitCode: reported };
    // No report: the VMM did not exit by itself.
    if (this.cgroup.oomKills() > 0) return { error: new VmLimitError(this.id, 'memory', this.limits.memoryBytes) };
    // bwrap reports its child's death by a signal as 128 + the signal, as a shell does.
    const sig = signal ?? (code !== null && code > 128 ? signalName(code - 128) : undefined);
    if (sig === 'SIGSYS') return { error: new JailViolationError(this.id, 'SIGSYS') };
    if (sig) return { signal: sig };
    return { error: new JailUnavailableError(`${this.id}: the jail ended (exit ${code}) before its VMM said anything; bwrap's or node's message, if any, is above`) };
  }
}

/** Gives `path` and, if it is a directory, the entries directly in it, to uid:gid (never through a link). */
function chownTree(path: string, uid: number, gid: number): void {
  lchownSync(path, uid, gid);
  if (!lstatSync(path).isDirectory()) return;
  for (const name of readdirSync(path)) lchownSync(join(path, name), uid, gid);
}

/** A character device node at `path` for the same device as `host`, owned by uid:gid, mode 0600. */
function makeDeviceNode(host: string, path: string, uid: number, gid: number): string {
  const rdev = statSync(host).rdev;
  // glibc's gnu_dev_major/minor: the 12-bit major and 20-bit minor are split over the 32 low bits.
  const major = Math.floor(rdev / 256) & 0xfff;
  const minor = (rdev & 0xff) | (Math.floor(rdev / 4096) & 0xfff00);
  const mk = spawnSync('mknod', ['-m', '0600', path, 'c', String(major), String(minor)], { encoding: 'utf8' });
  if (mk.status !== 0) throw new JailUnavailableError(`mknod ${path} (for ${host}) failed: ${mk.stderr || mk.error?.message}`);
  chownSync(path, uid, gid);
  return path;
}

function envId(name: string): number | undefined {
  const v = process.env[name];
  if (v === undefined) return undefined;
  if (!/^[0-9]{1,10}$/.test(v) || Number(v) > 0xfffffffe) throw new JailUnavailableError(`${name}: expected a uid or gid number, got ${JSON.stringify(v)}`);
  return Number(v);
}

function signalName(n: number): NodeJS.Signals | undefined {
  return (Object.entries(osConstants.signals).find(([, v]) => v === n)?.[0] as NodeJS.Signals | undefined);
}

/**
 * The run arguments the jailed VMM gets: the user's, with the VM's id, its own backing
 * directory and the launcher's socket path put in before `--` (a later value of an option wins). Pure.
 */
export function withJailedRunArgs(argv: readonly string[], id: string, backingDir: string, socketPath?: string): string[] {
  const dash = argv.indexOf('--');
  const own = dash >= 0 ? argv.slice(0, dash) : [...argv];
  const rest = dash >= 0 ? argv.slice(dash) : [];
  // Its socket is the fd it is handed: the path is only the name it says (the launcher's).
  return [...own, `--name=${id}`, `--vm-backing-dir=${backingDir}`, ...(socketPath !== undefined ? [`--vm-socket=${socketPath}`] : []), ...rest];
}
