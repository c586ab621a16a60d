/**
 * The egress rules of a NAT'd VM (`network.allow` and `network.deny`): hostnames (`api.openai.com`,
 * or `*.pypi.org` for every name under pypi.org) and IPv4 networks (`CIDR` or `CIDR:PORT`), mixed.
 * Parsed and checked whole before anything is created; a bad entry is an
 * {@link InvalidOptionError} naming it. Deny wins over allow.
 *
 * Addresses are enforced by nftables (./nft-rules.ts); hostnames by the VM's resolver
 * (./egress-resolver.ts), which answers only allowed names and opens exactly the addresses it
 * answered (./egress-set.ts).
 */
import { InvalidOptionError } from '../errors';
import { formatCidr, parseCidr, type Cidr } from './addresses';

/** An IPv4 network, optionally one TCP and UDP port of it. */
export interface CidrRule {
  kind: 'cidr';
  network: Cidr;
  /** TCP and UDP port; undefined: every protocol and port. */
  port?: number;
}

/** A hostname: `name` exactly, or (wildcard) every name under it, at any depth, but not `name` itself. */
export interface HostRule {
  kind: 'host';
  /** Lower case, no trailing dot. */
  name: string;
  wildcard: boolean;
}

export type EgressRule = CidrRule | HostRule;

/** A VM's egress policy. */
export interface EgressPolicy {
  /** `'all'`: every destination (no allow list was given). */
  allow: readonly EgressRule[] | 'all';
  deny: readonly EgressRule[];
}

/** The longest name DNS can carry (RFC 1035: 255 bytes on the wire, 253 as text). */
const MAX_NAME_LENGTH = 253;
/** One label: letters, digits, `-` and `_` (service names such as `_dns._udp`), 1 to 63 of them. */
const LABEL = /^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$/;

/**
 * A hostname as DNS compares it: lower case, without its trailing dot; undefined if it is not a
 * name pvisor lets a rule or a query carry (a label other than letters, digits, `-`, `_`, or too long).
 */
export function normalizeName(text: string): string | undefined {
  const name = text.toLowerCase().replace(/\.$/, '');
  if (name.length === 0 || name.length > MAX_NAME_LENGTH) return undefined;
  return name.split('.').every((l) => LABEL.test(l)) ? name : undefined;
}

/** `CIDR[:PORT]` or a hostname (`name`, `*.name`); throws {@link InvalidOptionError} naming `text`. */
export function parseEgressRule(text: unknown, option: string): EgressRule {
  if (typeof text !== 'string') throw new InvalidOptionError(option, `expected hostname, "*.domain", "CIDR" or "CIDR:PORT" strings, got ${JSON.stringify(text)}`);
  // Only digits, dots, slashes and colons: an address rule. A hostname's last label is never all
  // digits, so the two cannot be confused.
  if (/^[0-9./:]+$/.test(text)) {
    const [cidr, port, extra] = text.split(':');
    const network = parseCidr(cidr);
    if (!network || extra !== undefined) throw new InvalidOptionError(option, `"${text}" is not CIDR or CIDR:PORT (e.g. 10.0.0.0/8 or 192.0.2.7/32:443; host bits of the CIDR clear)`);
    if (port === undefined) return { kind: 'cidr', network };
    const n = /^[0-9]{1,5}$/.test(port) ? Number(port) : NaN;
    if (!(n >= 1 && n <= 65535)) throw new InvalidOptionError(option, `"${text}": the port must be 1 to 65535`);
    return { kind: 'cidr', network, port: n };
  }
  const wildcard = text.startsWith('*.');
  const name = normalizeName(wildcard ? text.slice(2) : text);
  if (text.includes(':')) throw new InvalidOptionError(option, `"${text}": a port goes only with a CIDR rule; a hostname rule allows every port of the addresses it resolves to`);
  if (!name || /^[0-9]+$/.test(name.split('.').pop()!)) {
    throw new InvalidOptionError(option, `"${text}" is neither a hostname (api.example.com, or *.example.com for every name under example.com) nor CIDR[:PORT]`);
  }
  return { kind: 'host', name, wildcard };
}

export function formatEgressRule(r: EgressRule): string {
  if (r.kind === 'host') return r.wildcard ? `*.${r.name}` : r.name;
  return r.port === undefined ? formatCidr(r.network) : `${formatCidr(r.network)}:${r.port}`;
}

/**
 * `allow` and `deny` as the user wrote them (undefined: not given), checked whole; throws
 * {@link InvalidOptionError} naming the first bad entry (`network.allow[2]: ...`).
 */
export function parseEgressPolicy(allow: unknown, deny: unknown, option = 'network'): EgressPolicy {
  const list = (value: unknown, key: string): EgressRule[] => {
    if (!Array.isArray(value)) throw new InvalidOptionError(`${option}.${key}`, 'expected an array of hostname, "*.domain", "CIDR" or "CIDR:PORT" strings');
    if (value.length > MAX_RULES) throw new InvalidOptionError(`${option}.${key}`, `at most ${MAX_RULES} rules, got ${value.length}`);
    return value.map((r, i) => parseEgressRule(r, `${option}.${key}[${i}]`));
  };
  return { allow: allow === undefined ? 'all' : list(allow, 'allow'), deny: deny === undefined ? [] : list(deny, 'deny') };
}

/** Rules per list: each CIDR rule is an nftables rule, each hostname a comparison per query. */
export const MAX_RULES = 1024;

function nameMatches(rule: HostRule, name: string): boolean {
  return rule.wildcard ? name.endsWith(`.${rule.name}`) : name === rule.name;
}

const hosts = (rules: readonly EgressRule[]) => rules.filter((r): r is HostRule => r.kind === 'host');

/** Whether a deny rule names `name` (normalized). */
export function nameDenied(policy: EgressPolicy, name: string): boolean {
  return hosts(policy.deny).some((r) => nameMatches(r, name));
}

/** Whether the resolver may answer `name` (normalized): not denied, and allowed (by a rule or by `'all'`). */
export function nameAllowed(policy: EgressPolicy, name: string): boolean {
  if (nameDenied(policy, name)) return false;
  return policy.allow === 'all' || hosts(policy.allow).some((r) => nameMatches(r, name));
}

function inNetwork(address: number, c: Cidr): boolean {
  const mask = c.prefixLength === 0 ? 0 : (0xffffffff << (32 - c.prefixLength)) >>> 0;
  return ((address & mask) >>> 0) === c.address;
}

/** Whether a deny rule covers every port of `address` (such an address is never opened). */
export function addressDenied(policy: EgressPolicy, address: number): boolean {
  return policy.deny.some((r) => r.kind === 'cidr' && r.port === undefined && inNetwork(address, r.network));
}

/** The CIDR rules of a list. */
export function cidrRules(rules: readonly EgressRule[]): CidrRule[] {
  return rules.filter((r): r is CidrRule => r.kind === 'cidr');
}
