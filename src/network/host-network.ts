/**
 * The host side of one VM's network: for `'nat'`, a /30 chosen from the range, a TAP pvisor
 * creates with the host's end of it and its own kernel settings (./tap-sysctls.ts), IPv4
 * forwarding, and the VM's nftables tables (./nft-rules.ts); for `{ tap }`, the user's TAP opened
 * as it is. {@link HostNetwork.close} removes what setup made.
 *
 * All or nothing: a step that fails undoes the ones before it and throws
 * {@link NetworkSetupError}. A process that dies (SIGKILL included) leaves only its tables behind:
 * its TAPs are not persistent and go with their fds, their addresses with them; the next
 * process that sets up a network removes the tables whose owner is gone ({@link removeStaleNetworks}).
 *
 * Host changes outside a VM's own objects: net.ipv4.ip_forward is turned on if it was off, and
 * left on (other things on the host may have come to rely on it by the time the VM ends).
 */
import { spawnSync } from 'node:child_process';
import { closeSync, existsSync, openSync, readFileSync, writeFileSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { NetworkSetupError, SystemCallError } from '../errors';
import { tryLockFile } from '../sys/libc';
import { allocateSubnet, formatCidr, formatIpv4, formatMac, macFor, parseIpAddrShow, parseIpv4 } from './addresses';
import { deleteTablesScript, natRuleset, parseTableList, TABLE_FAMILIES, tableName, tableOwner } from './nft-rules';
import { formatAllowRule, type NetworkPlan } from './options';
import { Tap, TUN_PATH } from './tap';
import { restrictTap } from './tap-sysctls';
import { processGone } from '../sys/processes';

/**
 * What {@link Vm.network} says of a VM's network.
 * @category Network
 */
export interface VmNetworkInfo {
  /** `none`: no network device. */
  mode: 'none' | 'nat' | 'tap';
  /** The TAP on the host. */
  tap?: string;
  /** The guest's MAC address. */
  mac?: string;
  /** The guest's eth0 address with its prefix, e.g. `10.200.0.2/30`. */
  guestAddress?: string;
  /** The host's end (the guest's gateway), e.g. `10.200.0.1`. */
  hostAddress?: string;
  /** The resolver the guest was given. */
  dns?: string;
  /** `nat`: the destinations the guest may reach (`all`, or the CIDR[:PORT] list). */
  allow?: 'all' | string[];
  /** `nat`: the name of the VM's nftables tables (families inet and netdev). */
  nftTable?: string;
}

/** CAP_NET_ADMIN's bit in /proc/self/status' CapEff (<linux/capability.h>). */
const CAP_NET_ADMIN = 12n;
const VHOST_NET_PATH = '/dev/vhost-net';
const LOCK_PATH = '/run/pvisor-network.lock';
const LOCK_WAIT_MS = 10_000;

let vmIndex = 0;

/** The TAP name of VM `index` of process `pid` (at most 15 bytes: "pv" + 7-digit pid + "n" + index). */
export function tapName(pid: number, index: number): string {
  return `pv${pid}n${index}`;
}

/** The owner of a TAP pvisor named, or undefined. */
export function tapOwner(name: string): { pid: number; index: number } | undefined {
  const m = /^pv([1-9][0-9]*)n([0-9]+)$/.exec(name);
  return m ? { pid: Number(m[1]), index: Number(m[2]) } : undefined;
}

/** Whether this process has CAP_NET_ADMIN in its effective set. */
export function hasNetAdmin(): boolean {
  const m = /^CapEff:\s*([0-9a-f]+)$/m.exec(readFileSync('/proc/self/status', 'utf8'));
  return m !== null && (BigInt(`0x${m[1]}`) & (1n << CAP_NET_ADMIN)) !== 0n;
}

/** Runs a host tool; throws with its stderr. A missing tool is `unsupported`, naming its package. */
function run(tool: 'nft' | 'ip', args: string[], input?: string): string {
  const r = spawnSync(tool, args, { input, encoding: 'utf8', timeout: 15_000, env: { ...process.env, LC_ALL: 'C' } });
  if (r.error) {
    if ((r.error as NodeJS.ErrnoException).code === 'ENOENT') {
      throw new NetworkSetupError('unsupported', `${tool} is not installed (Debian package ${tool === 'nft' ? 'nftables' : 'iproute2'})`);
    }
    throw new NetworkSetupError('failed', `${tool} ${args.join(' ')}: ${r.error.message}`, { cause: r.error });
  }
  if (r.status !== 0) throw new Error(`${tool} ${args.join(' ')}: ${(r.stderr || r.stdout).trim() || `exit ${r.status}`}`);
  return r.stdout;
}

/**
 * Removes what processes that are gone left behind: their nftables tables (`FAMILY NAME` in the
 * result) and any TAP still named after them. Returns what it removed. Needs CAP_NET_ADMIN.
 */
export function removeStaleNetworks(): string[] {
  const removed: string[] = [];
  for (const table of parseTableList(run('nft', ['list', 'tables']))) {
    const owner = tableOwner(table.name);
    if (!owner || owner.pid === process.pid || !processGone(owner.pid)) continue;
    try {
      run('nft', ['delete', 'table', table.family, table.name]);
      removed.push(`${table.family} ${table.name}`);
    } catch {
      // Another process removed it first.
    }
  }
  for (const m of run('ip', ['-o', 'link', 'show']).matchAll(/^[0-9]+: ([^:@\s]+)/gm)) {
    const owner = tapOwner(m[1]);
    if (!owner || owner.pid === process.pid || !processGone(owner.pid)) continue;
    try {
      run('ip', ['link', 'delete', m[1]]);
      removed.push(m[1]);
    } catch {
      // Gone meanwhile.
    }
  }
  return removed;
}

/** Holds the host-wide lock that makes choosing a /30 and claiming it one step among processes. */
function withHostLock<T>(work: () => T): T {
  const fd = openSync(LOCK_PATH, 'a', 0o600);
  try {
    const sleeper = new Int32Array(new SharedArrayBuffer(4));
    for (const deadline = Date.now() + LOCK_WAIT_MS; !tryLockFile(fd, true);) {
      if (Date.now() > deadline) throw new NetworkSetupError('failed', `another process holds ${LOCK_PATH} for more than ${LOCK_WAIT_MS} ms`);
      Atomics.wait(sleeper, 0, 0, 20);
    }
    return work();
  } finally {
    closeSync(fd); // releases the lock
  }
}

/** The first nameserver of /etc/resolv.conf that a guest can reach (not loopback), if any. */
function hostResolver(): string | undefined {
  let text = '';
  try {
    text = readFileSync('/etc/resolv.conf', 'utf8');
  } catch {
    return undefined;
  }
  for (const m of text.matchAll(/^\s*nameserver\s+([0-9.]+)\s*$/gm)) {
    const a = parseIpv4(m[1]);
    if (a !== undefined && a >>> 24 !== 127) return m[1];
  }
  return undefined;
}

function checkDevice(path: string, what: string): void {
  if (!existsSync(path)) throw new NetworkSetupError('unsupported', `${path} does not exist: the host kernel needs ${what}`);
  try {
    closeSync(openSync(path, 'r+'));
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    throw new NetworkSetupError(code === 'EACCES' || code === 'EPERM' ? 'permission' : 'failed', `cannot open ${path}: ${(e as Error).message}`, { cause: e });
  }
}

function asSetupError(e: unknown, what: string): NetworkSetupError {
  if (e instanceof NetworkSetupError) return e;
  if (e instanceof SystemCallError && (e.errno === 1 || e.errno === 13)) return new NetworkSetupError('permission', `${what}: ${e.message}`, { cause: e });
  return new NetworkSetupError('failed', `${what}: ${(e as Error).message}`, { cause: e });
}

/** Options of {@link HostNetwork.setup}. */
export interface HostNetworkOptions {
  /**
   * The guest's MAC; default a new random one. A clone of a snapshot keeps its snapshot's: each
   * TAP is a link of its own, so clones with one MAC never meet.
   */
  mac?: Buffer;
}

/** One VM's host networking, set up; {@link close} removes it. */
export class HostNetwork {
  private closed = false;

  private constructor(
    readonly info: VmNetworkInfo,
    readonly tap: Tap,
    readonly mac: Buffer,
    /** `pvisor.net=...` for the guest's kernel command line, when the guest is to configure eth0. */
    readonly kernelArg: string | undefined,
    private readonly table: string | undefined,
    /** What was set up. */
    readonly plan: Exclude<NetworkPlan, { kind: 'none' }>,
  ) {}

  /** The guest's configuration, `ADDRESS/PREFIX,GATEWAY[,DNS]` (the value of {@link kernelArg}). */
  get guestConfig(): string | undefined {
    return this.kernelArg?.slice('pvisor.net='.length);
  }

  /**
   * Sets up what `plan` asks (not `none`) for a VM, whose vhost-net will serve the TAP. Throws
   * {@link NetworkSetupError}; nothing is left then.
   */
  static setup(plan: Exclude<NetworkPlan, { kind: 'none' }>, options: HostNetworkOptions = {}): HostNetwork {
    if (plan.kind === 'nat' && !hasNetAdmin()) {
      throw new NetworkSetupError('permission', "network 'nat' needs CAP_NET_ADMIN (run as root, or give node the capability) to create a TAP device and nftables rules; use network 'none', or { tap: NAME } with a TAP made for you");
    }
    checkDevice(VHOST_NET_PATH, 'vhost-net (CONFIG_VHOST_NET, module vhost_net)');
    return HostNetwork.create(plan, options);
  }

  /**
   * What {@link setup} does once /dev/vhost-net is known to be there: the same host side, for a
   * reader of the TAP's fd other than vhost (test/hostile-tap-guest.ts plays a hostile guest on
   * it, on hosts with no vhost-net too).
   */
  static create(plan: Exclude<NetworkPlan, { kind: 'none' }>, options: HostNetworkOptions = {}): HostNetwork {
    const mac = options.mac ?? macFor(randomBytes(4));
    if (plan.kind === 'tap') {
      if (!existsSync(`/sys/class/net/${plan.name}`)) throw new NetworkSetupError('failed', `there is no network interface named ${plan.name} (create it with: ip tuntap add ${plan.name} mode tap user $USER)`);
      let tap: Tap;
      try {
        tap = Tap.open(plan.name);
      } catch (e) {
        throw asSetupError(e, `opening TAP ${plan.name}`);
      }
      const g = plan.guest;
      const kernelArg = g && `pvisor.net=${formatIpv4(g.address)}/${g.prefixLength},${g.gateway === undefined ? '0.0.0.0' : formatIpv4(g.gateway)}${g.dns === undefined ? '' : `,${formatIpv4(g.dns)}`}`;
      return new HostNetwork(
        { mode: 'tap', tap: plan.name, mac: formatMac(mac), ...(g && { guestAddress: `${formatIpv4(g.address)}/${g.prefixLength}` }), ...(g?.gateway !== undefined && { hostAddress: formatIpv4(g.gateway) }), ...(g?.dns !== undefined && { dns: formatIpv4(g.dns) }) },
        tap, mac, kernelArg, undefined, plan,
      );
    }
    checkDevice(TUN_PATH, 'TUN/TAP (CONFIG_TUN, module tun)');
    const index = vmIndex++;
    const name = tapName(process.pid, index);
    const table = tableName(process.pid, index);
    const dns = plan.dns === null ? undefined : plan.dns ?? hostResolver();
    try {
      removeStaleNetworks();
    } catch (e) {
      throw asSetupError(e, 'removing what ended processes left');
    }
    let tap: Tap | undefined;
    let tableMade = false;
    try {
      return withHostLock(() => {
        const subnet = allocateSubnet(plan.range, parseIpAddrShow(run('ip', ['-4', '-o', 'addr', 'show'])));
        if (!subnet) throw new NetworkSetupError('failed', `no free /30 left in ${formatCidr(plan.range)}`);
        tap = Tap.open(name);
        // All of the TAP's restrictions are in place before it comes up: until then it takes nothing.
        restrictTap(name);
        run('nft', ['-f', '-'], natRuleset({ table, tap: name, guestAddress: subnet.guestAddress, guestMac: mac, allow: plan.allow }));
        tableMade = true;
        run('ip', ['addr', 'add', `${formatIpv4(subnet.hostAddress)}/30`, 'dev', name]);
        enableForwarding();
        run('ip', ['link', 'set', 'dev', name, 'up']);
        const guest = formatIpv4(subnet.guestAddress);
        const host = formatIpv4(subnet.hostAddress);
        return new HostNetwork(
          { mode: 'nat', tap: name, mac: formatMac(mac), guestAddress: `${guest}/30`, hostAddress: host, ...(dns && { dns }), allow: plan.allow === 'all' ? 'all' : plan.allow.map(formatAllowRule), nftTable: table },
          tap, mac, `pvisor.net=${guest}/30,${host}${dns ? `,${dns}` : ''}`, table, plan,
        );
      });
    } catch (e) {
      if (tableMade) deleteTables(table);
      tap?.close(); // the TAP and its address go with the fd
      throw asSetupError(e, `setting up network 'nat' (TAP ${name})`);
    }
  }

  /** Removes the VM's table and closes its TAP (pvisor's own TAP disappears). Idempotent; never throws. */
  close(): string | undefined {
    if (this.closed) return undefined;
    this.closed = true;
    let problem: string | undefined;
    if (this.table) problem = deleteTables(this.table);
    try {
      this.tap.close();
    } catch (e) {
      problem ??= (e as Error).message;
    }
    return problem;
  }
}

/** Deletes the VM's tables, both in one transaction; a table already gone is no error. */
function deleteTables(table: string): string | undefined {
  try {
    run('nft', ['-f', '-'], deleteTablesScript(TABLE_FAMILIES.map((family) => ({ family, name: table }))));
    return undefined;
  } catch (e) {
    return `removing nftables tables ${table}: ${(e as Error).message}`;
  }
}

function enableForwarding(): void {
  const path = '/proc/sys/net/ipv4/ip_forward';
  if (readFileSync(path, 'utf8').trim() === '1') return;
  try {
    writeFileSync(path, '1\n');
  } catch (e) {
    throw new NetworkSetupError('permission', `cannot turn on IPv4 forwarding (${path}): ${(e as Error).message}`, { cause: e });
  }
}
