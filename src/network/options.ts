/**
 * The `network` option of `Vm.start` and `pvisor run --net`: what the user may write, checked
 * whole before anything is created, and the plan the host side carries out.
 */
import { InvalidOptionError } from '../errors';
import { DEFAULT_SUBNET_RANGE, formatCidr, parseCidr, parseIpv4, type Cidr } from './addresses';

/**
 * `'none'` (the default): no network device. `'nat'`: a TAP pvisor creates, NAT to the host's
 * uplinks, every destination allowed. {@link NatNetworkOptions}: NAT with a policy.
 * {@link TapNetworkOptions}: the user's own TAP, nothing configured on the host.
 * @category Network
 */
export type NetworkOption = 'none' | 'nat' | NatNetworkOptions | TapNetworkOptions;

/**
 * NAT through a TAP that pvisor creates and removes. Needs CAP_NET_ADMIN.
 * @category Network
 */
export interface NatNetworkOptions {
  mode: 'nat';
  /**
   * Where the guest may connect, enforced on the host (nftables): `CIDR` or `CIDR:PORT` (TCP and
   * UDP to that port), e.g. `['10.1.0.0/16', '192.0.2.7/32:443']`. Everything else the guest
   * sends out is dropped, the host's own addresses included. Default: every destination but the
   * host itself. `[]` denies everything.
   */
  allow?: readonly string[];
  /** The range each VM's /30 comes from. Default `10.200.0.0/16`. */
  subnetRange?: string;
  /**
   * The resolver written in the guest's /etc/resolv.conf. Default: the first nameserver of the
   * host's /etc/resolv.conf that is not a loopback address; none if there is no such one. With an
   * `allow` list, the resolver is reachable only if the list allows it (`'RESOLVER/32:53'`).
   */
  dns?: string | null;
}

/**
 * The user's own TAP device (it must exist); pvisor configures nothing on the host.
 * @category Network
 */
export interface TapNetworkOptions {
  tap: string;
  /** The guest's `ADDRESS/PREFIX` on eth0; without it the guest's eth0 stays unconfigured. */
  address?: string;
  /** The guest's default gateway (with `address`). */
  gateway?: string;
  /** The guest's resolver (with `address`). */
  dns?: string;
}

/** One allowed destination. */
export interface AllowRule {
  network: Cidr;
  /** TCP and UDP port; undefined: every protocol and port. */
  port?: number;
}

/** What the host side does, from a checked option. */
export type NetworkPlan =
  | { kind: 'none' }
  | { kind: 'nat'; allow: AllowRule[] | 'all'; range: Cidr; dns: string | null | undefined }
  | { kind: 'tap'; name: string; guest?: { address: number; prefixLength: number; gateway?: number; dns?: number } };

/** `CIDR[:PORT]`, or throws {@link InvalidOptionError} naming it. */
export function parseAllowRule(text: string, option = 'network.allow'): AllowRule {
  if (typeof text !== 'string') throw new InvalidOptionError(option, `expected "CIDR" or "CIDR:PORT" strings, got ${JSON.stringify(text)}`);
  const [cidr, port, extra] = text.split(':');
  const network = parseCidr(cidr);
  if (!network || extra !== undefined) throw new InvalidOptionError(option, `"${text}" is not CIDR or CIDR:PORT (e.g. 10.0.0.0/8 or 192.0.2.7/32:443; host bits of the CIDR clear)`);
  if (port === undefined) return { network };
  const n = /^[0-9]{1,5}$/.test(port) ? Number(port) : NaN;
  if (!(n >= 1 && n <= 65535)) throw new InvalidOptionError(option, `"${text}": the port must be 1 to 65535`);
  return { network, port: n };
}

export function formatAllowRule(r: AllowRule): string {
  return r.port === undefined ? formatCidr(r.network) : `${formatCidr(r.network)}:${r.port}`;
}

/** Linux interface names: 1-15 bytes, no `/`, whitespace or `:`, not `.` or `..`. */
const IFNAME = /^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,15}$/;

/** Checks a {@link NetworkOption}; throws {@link InvalidOptionError} (option `network`). */
export function parseNetworkOption(value: unknown): NetworkPlan {
  if (value === undefined || value === 'none') return { kind: 'none' };
  if (value === 'nat') return { kind: 'nat', allow: 'all', range: parseCidr(DEFAULT_SUBNET_RANGE)!, dns: undefined };
  if (typeof value !== 'object' || value === null) throw new InvalidOptionError('network', `expected "none", "nat", { mode: "nat", allow } or { tap }, got ${JSON.stringify(value)}`);
  const o = value as Record<string, unknown>;
  const known = (keys: string[]) => {
    const extra = Object.keys(o).filter((k) => !keys.includes(k));
    if (extra.length) throw new InvalidOptionError('network', `unknown field${extra.length > 1 ? 's' : ''} ${extra.join(', ')}`);
  };
  const ipv4 = (key: string): number | undefined => {
    if (o[key] === undefined) return undefined;
    const a = typeof o[key] === 'string' ? parseIpv4(o[key] as string) : undefined;
    if (a === undefined) throw new InvalidOptionError(`network.${key}`, `expected an IPv4 address, got ${JSON.stringify(o[key])}`);
    return a;
  };
  if (o.mode === 'nat') {
    known(['mode', 'allow', 'subnetRange', 'dns']);
    if (o.allow !== undefined && !Array.isArray(o.allow)) throw new InvalidOptionError('network.allow', 'expected an array of "CIDR" or "CIDR:PORT" strings');
    const allow = o.allow === undefined ? 'all' : (o.allow as unknown[]).map((r) => parseAllowRule(r as string));
    const range = o.subnetRange === undefined ? parseCidr(DEFAULT_SUBNET_RANGE)! : typeof o.subnetRange === 'string' ? parseCidr(o.subnetRange) : undefined;
    if (!range || range.prefixLength > 30) throw new InvalidOptionError('network.subnetRange', `expected a network of /30 or larger such as 10.200.0.0/16, got ${JSON.stringify(o.subnetRange)}`);
    if (o.dns !== undefined && o.dns !== null) ipv4('dns');
    return { kind: 'nat', allow, range, dns: o.dns as string | null | undefined };
  }
  if (o.mode !== undefined) throw new InvalidOptionError('network.mode', `expected "nat", got ${JSON.stringify(o.mode)}`);
  if (o.tap !== undefined) {
    known(['tap', 'address', 'gateway', 'dns']);
    if (typeof o.tap !== 'string' || !IFNAME.test(o.tap)) throw new InvalidOptionError('network.tap', `expected an interface name (1-15 letters, digits, _ . -), got ${JSON.stringify(o.tap)}`);
    if (o.address === undefined) {
      if (o.gateway !== undefined || o.dns !== undefined) throw new InvalidOptionError('network', 'gateway and dns need address');
      return { kind: 'tap', name: o.tap };
    }
    const c = typeof o.address === 'string' && o.address.includes('/') ? parseCidr(o.address, false) : undefined;
    if (!c) throw new InvalidOptionError('network.address', `expected ADDRESS/PREFIX such as 192.168.100.2/24, got ${JSON.stringify(o.address)}`);
    return { kind: 'tap', name: o.tap, guest: { address: parseIpv4((o.address as string).split('/')[0])!, prefixLength: c.prefixLength, gateway: ipv4('gateway'), dns: ipv4('dns') } };
  }
  throw new InvalidOptionError('network', 'expected "none", "nat", { mode: "nat", allow } or { tap }');
}

/**
 * The option that makes `plan` again: what a snapshot records of a NAT network, so that each clone
 * gets the same policy (its own /30 and TAP).
 */
export function natOptionOf(plan: Extract<NetworkPlan, { kind: 'nat' }>): NatNetworkOptions {
  return {
    mode: 'nat',
    ...(plan.allow !== 'all' && { allow: plan.allow.map(formatAllowRule) }),
    subnetRange: formatCidr(plan.range),
    ...(plan.dns !== undefined && { dns: plan.dns }),
  };
}

/** `--net none|nat|tap:NAME` and `--net-allow` values of `pvisor run`, as a {@link NetworkOption}. */
export function networkFromCli(net: string, allow: readonly string[]): NetworkOption {
  if (net === 'none' || net === 'nat') {
    if (allow.length && net === 'none') throw new InvalidOptionError('--net-allow', 'needs --net nat');
    return net === 'nat' && allow.length ? { mode: 'nat', allow } : net;
  }
  if (net.startsWith('tap:')) {
    if (allow.length) throw new InvalidOptionError('--net-allow', 'needs --net nat (a user TAP gets no host rules)');
    return { tap: net.slice(4) };
  }
  throw new InvalidOptionError('--net', `expected none, nat or tap:NAME, got ${JSON.stringify(net)}`);
}
