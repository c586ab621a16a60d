/**
 * IPv4 addresses and prefixes as pvisor's host networking needs them: parsing `a.b.c.d[/n]`, and
 * choosing each VM's /30 (network, the host's end, the guest's end, broadcast) from a range so
 * that it overlaps no address already on the host.
 */

/** An IPv4 network: `address` is its first address (host bits cleared), as a 32-bit number. */
export interface Cidr {
  address: number;
  prefixLength: number;
}

/** One VM's /30: the TAP's address on the host (the guest's gateway) and the guest's. */
export interface VmSubnet {
  network: Cidr;
  hostAddress: number;
  guestAddress: number;
}

/** a.b.c.d as a 32-bit unsigned number, or undefined if it is not one. */
export function parseIpv4(text: string): number | undefined {
  const parts = text.split('.');
  if (parts.length !== 4 || !parts.every((p) => /^(0|[1-9][0-9]{0,2})$/.test(p) && Number(p) <= 255)) return undefined;
  return parts.reduce((n, p) => n * 256 + Number(p), 0);
}

export function formatIpv4(address: number): string {
  return [24, 16, 8, 0].map((s) => Math.floor(address / 2 ** s) % 256).join('.');
}

/** The mask of a prefix length, as a number. */
function maskOf(prefixLength: number): number {
  return prefixLength === 0 ? 0 : (0xffffffff << (32 - prefixLength)) >>> 0;
}

/**
 * `a.b.c.d/n` (or `a.b.c.d`, a /32) as a network. With `strict`, host bits must be clear
 * (`10.0.0.1/8` is refused: the user probably meant something else); otherwise they are cleared.
 */
export function parseCidr(text: string, strict = true): Cidr | undefined {
  const [addr, len, extra] = text.split('/');
  if (extra !== undefined) return undefined;
  const address = parseIpv4(addr);
  const prefixLength = len === undefined ? 32 : /^[0-9]{1,2}$/.test(len) ? Number(len) : NaN;
  if (address === undefined || !(prefixLength >= 0 && prefixLength <= 32)) return undefined;
  const network = (address & maskOf(prefixLength)) >>> 0;
  if (strict && network !== address) return undefined;
  return { address: network, prefixLength };
}

export function formatCidr(c: Cidr): string {
  return `${formatIpv4(c.address)}/${c.prefixLength}`;
}

/** Whether two networks share any address. */
export function overlaps(a: Cidr, b: Cidr): boolean {
  const p = Math.min(a.prefixLength, b.prefixLength);
  return ((a.address & maskOf(p)) >>> 0) === ((b.address & maskOf(p)) >>> 0);
}

/** The default range VMs' /30s come from: 16384 VMs, rarely used by anything else. */
export const DEFAULT_SUBNET_RANGE = '10.200.0.0/16';

/**
 * The first /30 of `range` that overlaps none of `inUse` (the host's addresses and routes, with
 * their prefixes), or undefined when the range is full.
 */
export function allocateSubnet(range: Cidr, inUse: readonly Cidr[]): VmSubnet | undefined {
  if (range.prefixLength > 30) return undefined;
  const count = 2 ** (30 - range.prefixLength);
  for (let i = 0; i < count; i++) {
    const network = { address: range.address + 4 * i, prefixLength: 30 };
    if (inUse.some((u) => overlaps(u, network))) continue;
    return { network, hostAddress: network.address + 1, guestAddress: network.address + 2 };
  }
  return undefined;
}

/**
 * The IPv4 networks of `ip -4 -o addr show` output (`2: eth0    inet 10.0.0.5/24 brd ...`): each
 * address with its prefix, whose whole network counts as used.
 */
export function parseIpAddrShow(output: string): Cidr[] {
  const found: Cidr[] = [];
  for (const m of output.matchAll(/\sinet\s+([0-9.]+\/[0-9]+)/g)) {
    const c = parseCidr(m[1], false);
    if (c) found.push(c);
  }
  return found;
}

/** A locally administered unicast MAC address (02:xx:...) from 4 bytes of `seed`. */
export function macFor(seed: Buffer): Buffer {
  return Buffer.from([0x02, 0x70, seed[0], seed[1], seed[2], seed[3]]);
}

export function formatMac(mac: Buffer): string {
  return [...mac].map((b) => b.toString(16).padStart(2, '0')).join(':');
}

/** `aa:bb:cc:dd:ee:ff` (lower case, as {@link formatMac} writes it) of a unicast address, or undefined. */
export function parseMac(text: string): Buffer | undefined {
  if (!/^([0-9a-f]{2}:){5}[0-9a-f]{2}$/.test(text)) return undefined;
  const mac = Buffer.from(text.split(':').map((h) => parseInt(h, 16)));
  return mac[0] & 1 ? undefined : mac; // a multicast address is no interface's
}
