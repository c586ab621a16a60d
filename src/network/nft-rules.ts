/**
 * The nftables rules of one NAT'd VM: two tables of its own, both named after the owning process
 * and the VM's index in it (`pvisor_<pid>_<n>`), so that removing the VM's rules is deleting them,
 * and tables whose process is gone are found and removed by the next process that sets up a VM.
 *
 * - `netdev` table, on the TAP's ingress (before conntrack, routing or any protocol sees a frame):
 *   only IPv4 from the guest's address and ARP about it, both from the guest's MAC, pass; every
 *   other frame (IPv6, a forged source, VLAN tags, any other ethertype) is dropped. A guest can thus
 *   never pass for another host's or VM's end of a connection (spoofed replies, related ICMP errors
 *   on flows that are not its own start from a forged source, or are dealt with below).
 * - `inet` table (both IP families, so IPv6 is filtered even if it comes back on the TAP):
 *   - forward: IPv6 to or from the TAP is dropped; from the TAP, a source other than the guest's is
 *     dropped; then replies and ICMP errors of the guest's own connections pass (conntrack's
 *     original source is the guest), whatever else is not a new connection is dropped, and a new
 *     one goes to the `egress` chain: deny rules drop, then allow rules (or every destination) and
 *     the set of addresses the VM's resolver opened (`hosts`, elements with timeouts) accept; then
 *     drop. The egress chain is all that `vm.network.update` replaces. Towards the TAP, only
 *     packets of the guest's own connections pass: nothing outside opens a connection to it.
 *   - input: from the TAP to the host itself, only replies and errors on connections the host
 *     opened to the guest, and DNS to the VM's own resolver (port 53 of the TAP's host end) when it
 *     has one: the guest reaches no other service of the host, whatever the allow list says.
 *   - postrouting: the guest's address is masqueraded to whatever the packet leaves the host by.
 * Base chains run at priority filter - 5 / srcnat: another table's chain on the same hook (a
 * firewall's) still sees the packets after these accept them; a drop there wins.
 */
import { formatCidr, formatIpv4, formatMac } from './addresses';
import { cidrRules, type CidrRule, type EgressPolicy } from './egress-rules';
import { HOSTS_SET, hostsSetDeclaration } from './egress-set';

/** The prefix of every table pvisor creates. */
export const TABLE_PREFIX = 'pvisor_';

/** The families of a VM's tables; `ip` is what pvisor made before, and is still removed when stale. */
export const TABLE_FAMILIES = ['inet', 'netdev'] as const;

/** The table of VM `index` of process `pid`. */
export function tableName(pid: number, index: number): string {
  return `${TABLE_PREFIX}${pid}_${index}`;
}

/** The owner of a table pvisor made, or undefined for any other table. */
export function tableOwner(name: string): { pid: number; index: number } | undefined {
  const m = /^pvisor_([1-9][0-9]*)_([0-9]+)$/.exec(name);
  return m ? { pid: Number(m[1]), index: Number(m[2]) } : undefined;
}

/** A table as `nft list tables` names it. */
export interface TableId {
  family: string;
  name: string;
}

/** The tables in `nft list tables` output (`table FAMILY NAME` lines). */
export function parseTableList(output: string): TableId[] {
  return [...output.matchAll(/^table (\S+) (\S+)$/gm)].map((m) => ({ family: m[1], name: m[2] }));
}

/**
 * The `nft -f -` script that deletes `tables` if they exist (one transaction; `add` first, so that
 * a table already gone is no error).
 */
export function deleteTablesScript(tables: readonly TableId[]): string {
  return tables.map((t) => `add table ${t.family} ${t.name}\ndelete table ${t.family} ${t.name}\n`).join('');
}

/** What a VM's tables are made of. */
export interface NatRules {
  table: string;
  tap: string;
  guestAddress: number;
  guestMac: Buffer;
  /** The host's end of the TAP, where the VM's resolver listens (with `resolver`). */
  hostAddress: number;
  egress: EgressPolicy;
  /**
   * Whether the VM has pvisor's resolver on the host's end of the TAP: then the guest may send
   * it DNS (UDP and TCP port 53, nothing else of the host), and the set of addresses it opened is
   * made.
   */
  resolver: boolean;
}

/** The VM's regular chain that decides a new connection of the guest's (forward jumps to it). */
export const EGRESS_CHAIN = 'egress';

/**
 * The rules of the egress chain: deny rules drop first (deny wins), then allow rules and the
 * resolver's set accept; what none takes returns to forward, which drops it.
 */
export function egressChainRules(policy: EgressPolicy, resolver: boolean): string[] {
  const to = (r: CidrRule, verdict: 'accept' | 'drop') => {
    const d = `ip daddr ${formatCidr(r.network)}`;
    return r.port === undefined ? [`${d} ${verdict}`] : [`${d} tcp dport ${r.port} ${verdict}`, `${d} udp dport ${r.port} ${verdict}`];
  };
  return [
    ...cidrRules(policy.deny).flatMap((r) => to(r, 'drop')),
    ...(policy.allow === 'all' ? ['accept'] : cidrRules(policy.allow).flatMap((r) => to(r, 'accept'))),
    ...(resolver && policy.allow !== 'all' ? [`ip daddr @${HOSTS_SET} accept`] : []),
  ];
}

/** The `nft -f -` script that replaces the egress chain's rules (one transaction). */
export function egressUpdateScript(table: string, policy: EgressPolicy, resolver: boolean): string {
  return [`flush chain inet ${table} ${EGRESS_CHAIN}`, ...egressChainRules(policy, resolver).map((r) => `add rule inet ${table} ${EGRESS_CHAIN} ${r}`), ''].join('\n');
}

/**
 * The `nft -f -` script that creates the VM's tables (atomically: all of it or nothing). Tables of
 * the same name are replaced: only a process that died with the same pid left them.
 */
export function natRuleset(r: NatRules): string {
  const tap = JSON.stringify(r.tap);
  const guest = formatIpv4(r.guestAddress);
  const mac = formatMac(r.guestMac);
  const fromGuest = `iifname ${tap}`;
  const host = formatIpv4(r.hostAddress);
  return [
    deleteTablesScript(TABLE_FAMILIES.map((family) => ({ family, name: r.table }))).trimEnd(),
    `table netdev ${r.table} {`,
    '  chain ingress {',
    `    type filter hook ingress device ${tap} priority filter - 5; policy drop;`,
    `    ether saddr ${mac} ether type ip ip saddr ${guest} accept`,
    `    ether saddr ${mac} ether type arp arp htype 1 arp ptype ip arp hlen 6 arp plen 4 arp operation { request, reply } arp saddr ether ${mac} arp saddr ip ${guest} accept`,
    '  }',
    '}',
    `table inet ${r.table} {`,
    ...(r.resolver ? [hostsSetDeclaration()] : []),
    `  chain ${EGRESS_CHAIN} {`,
    ...egressChainRules(r.egress, r.resolver).map((l) => `    ${l}`),
    '  }',
    '  chain forward {',
    '    type filter hook forward priority filter - 5; policy accept;',
    `    ${fromGuest} meta nfproto ipv6 drop`,
    `    oifname ${tap} meta nfproto ipv6 drop`,
    `    ${fromGuest} ip saddr != ${guest} drop`,
    `    ${fromGuest} ct state established,related ct original ip saddr ${guest} accept`,
    `    ${fromGuest} ct state != new drop`,
    `    ${fromGuest} jump ${EGRESS_CHAIN}`,
    `    ${fromGuest} drop`,
    `    oifname ${tap} ct state established,related ct original ip saddr ${guest} accept`,
    `    oifname ${tap} drop`,
    '  }',
    '  chain input {',
    '    type filter hook input priority filter - 5; policy accept;',
    `    ${fromGuest} meta nfproto ipv6 drop`,
    `    ${fromGuest} ip saddr != ${guest} drop`,
    `    ${fromGuest} ct state established,related ct original ip daddr ${guest} accept`,
    ...(r.resolver ? [`    ${fromGuest} ip daddr ${host} udp dport 53 accept`, `    ${fromGuest} ip daddr ${host} tcp dport 53 accept`] : []),
    `    ${fromGuest} drop`,
    '  }',
    '  chain postrouting {',
    '    type nat hook postrouting priority srcnat; policy accept;',
    `    ip saddr ${guest} oifname != ${tap} masquerade`,
    '  }',
    '}',
    '',
  ].join('\n');
}
