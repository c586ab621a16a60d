/**
 * The nftables rules of one NAT'd VM: one table of its own, named after the owning process and
 * the VM's index in it (`pvisor_<pid>_<n>`), so that removing the VM's rules is deleting one table,
 * and a table whose process is gone is found and removed by the next process that sets up a VM.
 *
 * Inside the table (family ip, so IPv4 only; the guest has no IPv6):
 * - forward: from the TAP, replies of connections already accepted pass; then the `allow` rules
 *   (or everything); then drop. Towards the TAP, only replies pass: nothing outside can open a
 *   connection to the guest.
 * - input: from the TAP to the host itself, only replies: the guest reaches no service of the host
 *   (a resolver on the host included), whatever the allow list says.
 * - postrouting: the guest's address is masqueraded to whatever the packet leaves the host by.
 * Base chains run at priority filter - 5 / srcnat: another table's chain on the same hook (a
 * firewall's) still sees the packets after these accept them; a drop there wins.
 */
import { formatCidr, formatIpv4 } from './addresses';
import type { AllowRule } from './options';

/** The prefix of every table pvisor creates. */
export const TABLE_PREFIX = 'pvisor_';

/** The table of VM `index` of process `pid`. */
export function tableName(pid: number, index: number): string {
  return `${TABLE_PREFIX}${pid}_${index}`;
}

/** The owner of a table pvisor made, or undefined for any other table. */
export function tableOwner(name: string): { pid: number; index: number } | undefined {
  const m = /^pvisor_([1-9][0-9]*)_([0-9]+)$/.exec(name);
  return m ? { pid: Number(m[1]), index: Number(m[2]) } : undefined;
}

/** Table names in `nft list tables` output (`table ip NAME` lines), of family ip. */
export function parseTableList(output: string): string[] {
  return [...output.matchAll(/^table ip (\S+)$/gm)].map((m) => m[1]);
}

/** What a VM's table is made of. */
export interface NatRules {
  table: string;
  tap: string;
  guestAddress: number;
  allow: readonly AllowRule[] | 'all';
}

/** The `nft -f -` script that creates the table (atomically: all of it or nothing). */
export function natRuleset(r: NatRules): string {
  const tap = JSON.stringify(r.tap);
  const guest = formatIpv4(r.guestAddress);
  const allowed =
    r.allow === 'all'
      ? [`iifname ${tap} ip saddr ${guest} accept`]
      : r.allow.flatMap((a) => {
          const to = `iifname ${tap} ip saddr ${guest} ip daddr ${formatCidr(a.network)}`;
          return a.port === undefined ? [`${to} accept`] : [`${to} tcp dport ${a.port} accept`, `${to} udp dport ${a.port} accept`];
        });
  return [
    `table ip ${r.table} {`,
    '  chain forward {',
    '    type filter hook forward priority filter - 5; policy accept;',
    `    iifname ${tap} ct state established,related accept`,
    ...allowed.map((l) => `    ${l}`),
    `    iifname ${tap} drop`,
    `    oifname ${tap} ct state established,related accept`,
    `    oifname ${tap} drop`,
    '  }',
    '  chain input {',
    '    type filter hook input priority filter - 5; policy accept;',
    `    iifname ${tap} ct state established,related accept`,
    `    iifname ${tap} drop`,
    '  }',
    '  chain postrouting {',
    '    type nat hook postrouting priority srcnat; policy accept;',
    `    ip saddr ${guest} oifname != ${tap} masquerade`,
    '  }',
    '}',
    '',
  ].join('\n');
}
