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
import { spawn, spawnSync } from 'node:child_process';
import { closeSync, existsSync, openSync, readFileSync, writeFileSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { InvalidOptionError, NetworkSetupError, SystemCallError, VmStateError } from '../errors';
import { VmNetwork, type EgressRulesUpdate, type VmNetworkInfo } from './vm-network';
import { tryLockFile } from '../sys/libc';
import { allocateSubnet, formatCidr, formatIpv4, formatMac, macFor, parseIpAddrShow, parseIpv4, parseMac } from './addresses';
import { EgressResolver } from './egress-resolver';
import { addressDenied, formatEgressRule, nameAllowed, nameDenied, parseEgressPolicy, type EgressPolicy } from './egress-rules';
import { EgressSet } from './egress-set';
import { deleteTablesScript, egressUpdateScript, natRuleset, parseTableList, TABLE_FAMILIES, tableName, tableOwner } from './nft-rules';
import type { NetworkPlan } from './options';
import { Tap, TUN_PATH } from './tap';
import { handedNetwork, type HandedNetwork } from './handed-network';
import { restrictTap } from './tap-sysctls';
import { processGone } from '../sys/processes';


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

/** `nft -f -` with `script`, without blocking the event loop (the resolver's path). */
function nftAsync(script: string): Promise<void> {
  return new Promise((resolve, reject) => {
    const child = spawn('nft', ['-f', '-'], { stdio: ['pipe', 'ignore', 'pipe'], env: { ...process.env, LC_ALL: 'C' }, timeout: 15_000 });
    let stderr = '';
    child.stderr!.on('data', (d: Buffer) => {
      if (stderr.length < 4096) stderr += d.toString();
    });
    child.on('error', reject);
    child.on('close', (code) => (code === 0 ? resolve() : reject(new Error(`nft -f -: ${stderr.trim() || `exit ${code}`}`))));
    child.stdin!.end(script);
  });
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

/**
 * The first nameserver of /etc/resolv.conf that a guest can reach (not loopback), if any; with
 * `loopback`, the first of them all (what the host itself can ask).
 */
function hostResolver(loopback = false): string | undefined {
  let text = '';
  try {
    text = readFileSync('/etc/resolv.conf', 'utf8');
  } catch {
    return undefined;
  }
  for (const m of text.matchAll(/^\s*nameserver\s+([0-9.]+)\s*$/gm)) {
    const a = parseIpv4(m[1]);
    if (a !== undefined && (loopback || a >>> 24 !== 127)) return m[1];
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
  /** With egress rules: pvisor's resolver for the guest, and the set of addresses it opened. */
  private egress: { resolver: EgressResolver; set: EgressSet } | undefined;
  /** A jailed VMM's: its launcher made it and keeps its rules. */
  private handed = false;

  /** What a jailed VMM is handed of this network: the description, with the fd it will have. */
  handOver(tapFd: number): HandedNetwork {
    return { tapFd, ...(this.kernelArg && { kernelArg: this.kernelArg }), info: { ...this.info, tap: this.tap.name, mac: formatMac(this.mac) } };
  }

  private constructor(
    readonly info: VmNetworkInfo,
    readonly tap: Tap,
    readonly mac: Buffer,
    /** `pvisor.net=...` for the guest's kernel command line, when the guest is to configure eth0. */
    readonly kernelArg: string | undefined,
    private readonly table: string | undefined,
    /** What was set up, with the egress rules in force (`update` replaces them). */
    public plan: Exclude<NetworkPlan, { kind: 'none' }>,
  ) {}

  /** The guest's configuration, `ADDRESS/PREFIX,GATEWAY[,DNS]` (the value of {@link kernelArg}). */
  get guestConfig(): string | undefined {
    return this.kernelArg?.slice('pvisor.net='.length);
  }

  /**
   * The resolver's counters (egress-resolver.ts `ResolverStats`), when the VM has pvisor's
   * resolver: tests and diagnostics. Typed loosely so that this module's declarations do not
   * reach the DNS codec's types.
   */
  get resolverStats(): Readonly<Record<string, number>> | undefined {
    return this.egress?.resolver.stats;
  }

  /** Whether the resolver opened `address` (a.b.c.d) and it has not expired. */
  isOpen(address: string): boolean {
    const a = parseIpv4(address);
    return a !== undefined && this.egress !== undefined && this.egress.set.has(a);
  }

  /** What {@link Vm.network} hands out: {@link info}, with `update`. */
  view(): VmNetwork {
    return new VmNetwork({ ...this.info }, (rules) => this.update(rules));
  }

  /**
   * Sets up what `plan` asks (not `none`) for a VM, whose vhost-net will serve the TAP. Throws
   * {@link NetworkSetupError}; nothing is left then.
   */
  static async setup(plan: Exclude<NetworkPlan, { kind: 'none' }>, options: HostNetworkOptions = {}): Promise<HostNetwork> {
    // A jailed VMM: its launcher made the host side and handed over the TAP.
    const handed = handedNetwork();
    if (handed === null) {
      throw new NetworkSetupError('unsupported', "this VMM runs in a jail whose launcher made no network for it (a jailed VMM cannot make a TAP or host rules): its launcher makes it from Vm.start's or pvisor run's network option, or from the snapshot pvisor run --from restores");
    }
    if (handed) return HostNetwork.adopt(plan, handed, options);
    if (plan.kind === 'nat' && !hasNetAdmin()) {
      throw new NetworkSetupError('permission', "network 'nat' needs CAP_NET_ADMIN (run as root, or give node the capability) to create a TAP device and nftables rules; use network 'none', or { tap: NAME } with a TAP made for you");
    }
    checkDevice(VHOST_NET_PATH, 'vhost-net (CONFIG_VHOST_NET, module vhost_net)');
    return HostNetwork.create(plan, options);
  }

  /**
   * The network a jailed VMM was handed ({@link HandedNetwork}): the TAP's fd and what its
   * launcher said of it. Nothing on the host is changed from here: {@link update} is refused (the
   * rules are the launcher's) and {@link close} only closes this process's fd.
   */
  private static adopt(plan: Exclude<NetworkPlan, { kind: 'none' }>, handed: HandedNetwork, options: HostNetworkOptions): HostNetwork {
    const mac = parseMac(handed.info.mac)!;
    if (options.mac && !options.mac.equals(mac)) throw new NetworkSetupError('unsupported', `the jail's launcher made the network for MAC ${handed.info.mac}, not ${formatMac(options.mac)}`);
    const net = new HostNetwork({ ...handed.info }, Tap.adopt(handed.tapFd, handed.info.tap), mac, handed.kernelArg, undefined, plan);
    net.handed = true;
    return net;
  }

  /**
   * What {@link setup} does once /dev/vhost-net is known to be there: the same host side, for a
   * reader of the TAP's fd other than vhost (test/hostile-tap-guest.ts plays a hostile guest on
   * it, on hosts with no vhost-net too).
   */
  static async create(plan: Exclude<NetworkPlan, { kind: 'none' }>, options: HostNetworkOptions = {}): Promise<HostNetwork> {
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
    // With egress rules the guest asks pvisor's resolver, which asks the host's (loopback included).
    const upstream = plan.dns === null ? undefined : plan.dns ?? hostResolver(plan.resolver);
    try {
      removeStaleNetworks();
    } catch (e) {
      throw asSetupError(e, 'removing what ended processes left');
    }
    let tap: Tap | undefined;
    let tableMade = false;
    let net: HostNetwork | undefined;
    try {
      net = withHostLock(() => {
        const subnet = allocateSubnet(plan.range, parseIpAddrShow(run('ip', ['-4', '-o', 'addr', 'show'])));
        if (!subnet) throw new NetworkSetupError('failed', `no free /30 left in ${formatCidr(plan.range)}`);
        tap = Tap.open(name);
        // All of the TAP's restrictions are in place before it comes up: until then it takes nothing.
        restrictTap(name);
        run('nft', ['-f', '-'], natRuleset({ table, tap: name, guestAddress: subnet.guestAddress, guestMac: mac, hostAddress: subnet.hostAddress, egress: plan.egress, resolver: plan.resolver }));
        tableMade = true;
        run('ip', ['addr', 'add', `${formatIpv4(subnet.hostAddress)}/30`, 'dev', name]);
        enableForwarding();
        run('ip', ['link', 'set', 'dev', name, 'up']);
        const guest = formatIpv4(subnet.guestAddress);
        const host = formatIpv4(subnet.hostAddress);
        const dns = plan.resolver ? host : upstream;
        return new HostNetwork(
          {
            mode: 'nat', tap: name, mac: formatMac(mac), guestAddress: `${guest}/30`, hostAddress: host, ...(dns && { dns }),
            ...(plan.resolver && upstream && { upstreamDns: upstream }), ...rulesInfo(plan.egress), nftTable: table,
          },
          tap, mac, `pvisor.net=${guest}/30,${host}${dns ? `,${dns}` : ''}`, table, plan,
        );
      });
      if (plan.resolver) {
        const set = new EgressSet(table, nftAsync);
        const resolver = await EgressResolver.start({
          listenAddress: net.info.hostAddress!,
          clientAddress: net.info.guestAddress!.split('/')[0],
          upstream,
          policy: () => (net!.plan as Extract<NetworkPlan, { kind: 'nat' }>).egress,
          open: (addresses, timeoutS, chain) => set.open(addresses, timeoutS, chain),
        }).catch((e: NodeJS.ErrnoException) => {
          if (e.code !== 'EADDRINUSE') throw e;
          throw new NetworkSetupError('failed', `the VM's resolver cannot listen on ${net!.info.hostAddress}:53, which another DNS server holds (one listening on every address, e.g. dnsmasq without bind-interfaces); make it listen on its own addresses only`, { cause: e });
        });
        net.egress = { resolver, set };
      }
      return net;
    } catch (e) {
      if (tableMade) deleteTables(table);
      tap?.close(); // the TAP and its address go with the fd
      throw asSetupError(e, `setting up network 'nat' (TAP ${name})`);
    }
  }

  /** See {@link VmNetwork.update}. */
  async update(rules: EgressRulesUpdate): Promise<void> {
    const plan = this.plan;
    if (this.handed) throw new VmStateError("this VM runs in a jail: its network's rules are its launcher's (update them through the launcher's handle, JailedVmHandle.network)");
    if (this.closed || plan.kind !== 'nat') throw new VmStateError(this.closed ? 'the VM has stopped: its network is gone' : `the VM's network is the user's TAP ${this.info.tap}: pvisor applies no rules to it (start it with network: { mode: 'nat', allow })`);
    if (rules === null || typeof rules !== 'object') throw new InvalidOptionError('network.update', 'expected { allow?, deny? }');
    const extra = Object.keys(rules).filter((k) => k !== 'allow' && k !== 'deny');
    if (extra.length) throw new InvalidOptionError('network.update', `unknown field${extra.length > 1 ? 's' : ''} ${extra.join(', ')} (expected allow, deny)`);
    const given = parseEgressPolicy(rules.allow, rules.deny, 'network.update');
    const egress: EgressPolicy = { allow: rules.allow === undefined ? plan.egress.allow : given.allow, deny: rules.deny === undefined ? plan.egress.deny : given.deny };
    if (!plan.resolver) {
      const host = [...(egress.allow === 'all' ? [] : egress.allow), ...egress.deny].find((r) => r.kind === 'host');
      if (host) throw new InvalidOptionError('network.update', `"${formatEgressRule(host)}": hostname rules need the VM started with one (its resolver is then pvisor's); this one was started with network rules only`);
    }
    try {
      await nftAsync(egressUpdateScript(this.table!, egress, plan.resolver));
    } catch (e) {
      throw new NetworkSetupError('failed', `replacing the egress rules of ${this.table}: ${(e as Error).message}`, { cause: e });
    }
    this.plan = { ...plan, egress };
    Object.assign(this.info, rulesInfo(egress));
    if (!hasRules(egress)) delete this.info.deny;
    // Addresses stay open only if an answer that opened them is still allowed now.
    await this.egress?.set.retain((address, chain) => !addressDenied(egress, address) && nameAllowed(egress, chain[0]) && !chain.slice(1).some((n) => nameDenied(egress, n)));
  }

  /** Removes the VM's table and closes its TAP (pvisor's own TAP disappears). Idempotent; never throws. */
  close(): string | undefined {
    if (this.closed) return undefined;
    this.closed = true;
    this.egress?.resolver.close();
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

/** What {@link VmNetworkInfo} says of the rules. */
function rulesInfo(egress: EgressPolicy): Pick<VmNetworkInfo, 'allow' | 'deny'> {
  return { allow: egress.allow === 'all' ? 'all' : egress.allow.map(formatEgressRule), ...(hasRules(egress) && { deny: egress.deny.map(formatEgressRule) }) };
}

/** Whether the VM has egress rules at all (plain 'nat' has none: its info says no deny list). */
function hasRules(egress: EgressPolicy): boolean {
  return egress.allow !== 'all' || egress.deny.length > 0;
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
