/**
 * The per-interface kernel settings of a TAP pvisor creates for a 'nat' VM. They are written after
 * the TAP exists and before it comes up (so IPv6 never configures it), and go with the TAP.
 *
 * - IPv6 off: the TAP never gets an fe80:: address and the host's IPv6 stack takes nothing the
 *   guest sends (the guest's network is IPv4 NAT only). `sysctl net.ipv6.conf.all.disable_ipv6=0`
 *   turns it back on for every interface: the VM's nftables rules drop IPv6 too (./nft-rules.ts).
 * - rp_filter 1 (strict): a packet from the TAP whose source the host would not route back through
 *   the TAP is dropped. The kernel applies the larger of `all` and the interface's value, so a
 *   host-wide loose setting (2, systemd's default) wins; the netdev table's source check holds
 *   either way.
 * - arp_ignore 1: ARP on the TAP is answered only for the TAP's own address, so the guest does not
 *   find the host's addresses on other interfaces.
 */
import { existsSync, writeFileSync } from 'node:fs';
import { NetworkSetupError } from '../errors';

const IPV6_CONF = '/proc/sys/net/ipv6/conf';

/** Writes the settings for TAP `name`; throws {@link NetworkSetupError} if one cannot be written. */
export function restrictTap(name: string): void {
  const settings: [string, string][] = [
    [`/proc/sys/net/ipv4/conf/${name}/rp_filter`, '1'],
    [`/proc/sys/net/ipv4/conf/${name}/arp_ignore`, '1'],
  ];
  // Without IPv6 in the host's kernel (or with ipv6.disable=1) there is nothing to turn off.
  if (existsSync(IPV6_CONF)) settings.unshift([`${IPV6_CONF}/${name}/disable_ipv6`, '1']);
  for (const [path, value] of settings) {
    try {
      writeFileSync(path, `${value}\n`);
    } catch (e) {
      throw new NetworkSetupError('failed', `cannot write ${value} to ${path}: ${(e as Error).message}`, { cause: e });
    }
  }
}
