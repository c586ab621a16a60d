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
 *     one passes by the `allow` rules (or for every destination); then drop. Towards the TAP, only
 *     packets of the guest's own connections pass: nothing outside opens a connection to it.
 *   - input: from the TAP to the host itself, only replies and errors on connections the host
 *     opened to the guest: the guest reaches no service of the host (a resolver on the host
 *     included), whatever the allow list says.
 *   - postrouting: the guest's address is masqueraded to whatever the packet leaves the host by.
 * Base chains run at priority filter - 5 / srcnat: another table's chain on the same hook (a
 * firewall's) still sees the packets after these accept them; a drop there wins.
 */
import { formatCidr, formatIpv4, formatMac } from './addresses';
import type { AllowRule } from './options';

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
  allow: readonly AllowRule[] | 'all';
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
  const allowed =
    r.allow === 'all'
      ? [`${fromGuest} ip saddr ${guest} accept`]
      : r.allow.flatMap((a) => {
          const to = `${fromGuest} ip saddr ${guest} ip daddr ${formatCidr(a.network)}`;
          return a.port === undefined ? [`${to} accept`] : [`${to} tcp dport ${a.port} accept`, `${to} udp dport ${a.port} accept`];
        });
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
    '  chain forward {',
    '    type filter hook forward priority filter - 5; policy accept;',
    `    ${fromGuest} meta nfproto ipv6 drop`,
    `    oifname ${tap} meta nfproto ipv6 drop`,
    `    ${fromGuest} ip saddr != ${guest} drop`,
    `    ${fromGuest} ct state established,related ct original ip saddr ${guest} accept`,
    `    ${fromGuest} ct state != new drop`,
    ...allowed.map((l) => `    ${l}`),
    `    ${fromGuest} drop`,
    `    oifname ${tap} ct state established,related ct original ip saddr ${guest} accept`,
    `    oifname ${tap} drop`,
    '  }',
    '  chain input {',
    '    type filter hook input priority filter - 5; policy accept;',
    `    ${fromGuest} meta nfproto ipv6 drop`,
    `    ${fromGuest} ip saddr != ${guest} drop`,
    `    ${fromGuest} ct state established,related ct original ip daddr ${guest} accept`,
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
