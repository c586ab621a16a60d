/**
 * The `network` option of `Vm.start` and `pvisor run --net`: what the user may write, checked
 * whole before anything is created, and the plan the host side carries out.
 */
import { InvalidOptionError } from '../errors';
import { DEFAULT_SUBNET_RANGE, formatCidr, parseCidr, parseIpv4, type Cidr } from './addresses';
import { formatEgressRule, parseEgressPolicy, type EgressPolicy } from './egress-rules';

const ALLOW_ALL: EgressPolicy = { allow: 'all', deny: [] };

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
   * Where the guest may connect, enforced on the host: hostnames (`'api.openai.com'`, or
   * `'*.pypi.org'` for every name under pypi.org, not pypi.org itself) and IPv4 networks (`CIDR`,
   * or `CIDR:PORT` for TCP and UDP to that port), mixed, e.g.
   * `['api.openai.com', '*.pypi.org', '10.1.0.0/16:443']`. Everything else the guest sends out is
   * dropped, the host's own addresses included. Default: every destination but the host itself.
   * `[]` denies everything.
   *
   * With `allow` or `deny` given, the guest's resolver is pvisor's, on the host's end of the TAP:
   * it answers only allowed names (others get REFUSED), asks {@link dns} for them, and opens
   * exactly the IPv4 addresses of each answer for the answer's TTL (at least 30 s, at most 1 h;
   * connections made meanwhile go on after it). A hostname rule allows every port of those
   * addresses. The rules can be replaced while the VM runs: `vm.network.update`.
   */
  allow?: readonly string[];
  /**
   * Hostnames and `CIDR[:PORT]` the guest may not reach, whatever `allow` says (deny wins): a
   * denied name is not resolved (nor is a name whose CNAME chain goes through one), a denied
   * network is dropped. With no `allow`, every other destination stays reachable: a denied name
   * then only keeps the name from resolving, not its addresses from being reached.
   */
  deny?: readonly string[];
  /** The range each VM's /30 comes from. Default `10.200.0.0/16`. */
  subnetRange?: string;
  /**
   * The resolver: without `allow` and `deny`, the one written in the guest's /etc/resolv.conf
   * (default: the first nameserver of the host's /etc/resolv.conf that is not a loopback address;
   * none if there is no such one). With them, the upstream that pvisor's resolver asks (default:
   * the host's first nameserver, loopback included, since it is asked from the host). `null`:
   * none.
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

/** What the host side does, from a checked option. */
export type NetworkPlan =
  | { kind: 'none' }
  | {
      kind: 'nat';
      /** The rules; `{ allow: 'all', deny: [] }` for plain NAT. */
      egress: EgressPolicy;
      /** Whether `allow` or `deny` was given: then the VM gets pvisor's resolver. */
      resolver: boolean;
      range: Cidr;
      dns: string | null | undefined;
    }
  | { kind: 'tap'; name: string; guest?: { address: number; prefixLength: number; gateway?: number; dns?: number } };

/** Linux interface names: 1-15 bytes, no `/`, whitespace or `:`, not `.` or `..`. */
const IFNAME = /^(?!\.{1,2}$)[A-Za-z0-9_.-]{1,15}$/;

/** Checks a {@link NetworkOption}; throws {@link InvalidOptionError} (option `network`). */
export function parseNetworkOption(value: unknown): NetworkPlan {
  if (value === undefined || value === 'none') return { kind: 'none' };
  if (value === 'nat') return { kind: 'nat', egress: ALLOW_ALL, resolver: false, range: parseCidr(DEFAULT_SUBNET_RANGE)!, dns: undefined };
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
    known(['mode', 'allow', 'deny', 'subnetRange', 'dns']);
    const egress = parseEgressPolicy(o.allow, o.deny);
    const range = o.subnetRange === undefined ? parseCidr(DEFAULT_SUBNET_RANGE)! : typeof o.subnetRange === 'string' ? parseCidr(o.subnetRange) : undefined;
    if (!range || range.prefixLength > 30) throw new InvalidOptionError('network.subnetRange', `expected a network of /30 or larger such as 10.200.0.0/16, got ${JSON.stringify(o.subnetRange)}`);
    if (o.dns !== undefined && o.dns !== null) ipv4('dns');
    return { kind: 'nat', egress, resolver: o.allow !== undefined || o.deny !== undefined, range, dns: o.dns as string | null | undefined };
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
    ...(plan.resolver && plan.egress.allow !== 'all' && { allow: plan.egress.allow.map(formatEgressRule) }),
    ...(plan.resolver && { deny: plan.egress.deny.map(formatEgressRule) }),
    subnetRange: formatCidr(plan.range),
    ...(plan.dns !== undefined && { dns: plan.dns }),
  };
}

/**
 * `--net none|nat|tap:NAME`, `--net-allow` and `--net-deny` values of `pvisor run`, as a
 * {@link NetworkOption}.
 */
export function networkFromCli(net: string, allow: readonly string[], deny: readonly string[] = []): NetworkOption {
  const flag = allow.length ? '--net-allow' : '--net-deny';
  if (net === 'none' || net === 'nat') {
    if ((allow.length || deny.length) && net === 'none') throw new InvalidOptionError(flag, 'needs --net nat');
    if (net === 'none' || (!allow.length && !deny.length)) return net;
    return { mode: 'nat', ...(allow.length && { allow }), ...(deny.length && { deny }) };
  }
  if (net.startsWith('tap:')) {
    if (allow.length || deny.length) throw new InvalidOptionError(flag, 'needs --net nat (a user TAP gets no host rules)');
    return { tap: net.slice(4) };
  }
  throw new InvalidOptionError('--net', `expected none, nat or tap:NAME, got ${JSON.stringify(net)}`);
}
