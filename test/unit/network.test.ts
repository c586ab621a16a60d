// The host side's pure parts: the network option, each VM's /30, the nftables ruleset and the
// names that tell a dead owner's leftovers apart. No root, no nft (network-hostile-guest.test.ts
// runs the rules).
import { InvalidOptionError } from '../../src/errors';
import { allocateSubnet, formatCidr, formatIpv4, formatMac, parseCidr, parseIpAddrShow, parseIpv4, parseMac } from '../../src/network/addresses';
import { tapName, tapOwner } from '../../src/network/host-network';
import { deleteTablesScript, natRuleset, parseTableList, tableName, tableOwner } from '../../src/network/nft-rules';
import { parseEgressRule } from '../../src/network/egress-rules';
import { natOptionOf, parseNetworkOption } from '../../src/network/options';

const ALL = { allow: 'all' as const, deny: [] };
const parseAllowRule = (text: string) => parseEgressRule(text, 'network.allow');

describe('network option', () => {
  it("is 'none' by default, and 'nat' allows every destination from the default range", () => {
    expect(parseNetworkOption(undefined)).toEqual({ kind: 'none' });
    expect(parseNetworkOption('nat')).toEqual({ kind: 'nat', egress: ALL, resolver: false, range: parseCidr('10.200.0.0/16'), dns: undefined });
  });

  it('takes an allow list of CIDR[:PORT] and refuses what is not one, naming it', () => {
    const plan = parseNetworkOption({ mode: 'nat', allow: ['192.0.2.0/24', '198.51.100.7:443'] });
    expect(plan).toMatchObject({ kind: 'nat', resolver: true, egress: { allow: [{ network: parseCidr('192.0.2.0/24') }, { network: parseCidr('198.51.100.7/32'), port: 443 }], deny: [] } });
    for (const bad of ['10.0.0.1/8', '10.0.0.0/33', '10.0.0.0/8:0', '10.0.0.0/8:65536', 'example.com:443', '10.0.0.0/8:80:1', '256.0.0.0/8']) {
      expect(() => parseAllowRule(bad)).toThrow(InvalidOptionError);
    }
    expect(() => parseNetworkOption({ mode: 'nat', allow: '10.0.0.0/8' })).toThrow(/^network.allow: expected an array/);
    expect(() => parseNetworkOption({ mode: 'nat', allowed: [] })).toThrow(/^network: unknown field allowed/);
    expect(() => parseNetworkOption({ mode: 'nat', subnetRange: '10.0.0.0/31' })).toThrow(/^network.subnetRange/);
    expect(() => parseNetworkOption({ mode: 'bridge' })).toThrow(/^network.mode/);
    expect(() => parseNetworkOption('on')).toThrow(InvalidOptionError);
  });

  it('takes a user TAP by name, with an optional guest address', () => {
    expect(parseNetworkOption({ tap: 'tap0' })).toEqual({ kind: 'tap', name: 'tap0' });
    expect(parseNetworkOption({ tap: 'tap0', address: '192.168.7.2/24', gateway: '192.168.7.1' })).toEqual({
      kind: 'tap', name: 'tap0', guest: { address: parseIpv4('192.168.7.2'), prefixLength: 24, gateway: parseIpv4('192.168.7.1'), dns: undefined },
    });
    expect(() => parseNetworkOption({ tap: 'a/b' })).toThrow(/^network.tap/);
    expect(() => parseNetworkOption({ tap: 'x'.repeat(16) })).toThrow(/^network.tap/);
    expect(() => parseNetworkOption({ tap: 'tap0', address: '192.168.7.2' })).toThrow(/^network.address/);
    expect(() => parseNetworkOption({ tap: 'tap0', gateway: '192.168.7.1' })).toThrow(/need address/);
  });
});

describe("what a snapshot records of a 'nat' network", () => {
  it('the option it writes makes the same plan again, for each clone', () => {
    for (const option of ['nat', { mode: 'nat', allow: ['192.0.2.0/24', '198.51.100.7/32:443'], subnetRange: '10.77.0.0/24', dns: '192.0.2.53' }, { mode: 'nat', allow: [], dns: null }] as const) {
      const plan = parseNetworkOption(option) as Extract<ReturnType<typeof parseNetworkOption>, { kind: 'nat' }>;
      const saved = JSON.parse(JSON.stringify(natOptionOf(plan)));
      expect(parseNetworkOption(saved)).toEqual(plan);
    }
    expect(natOptionOf(parseNetworkOption('nat') as never)).toEqual({ mode: 'nat', subnetRange: '10.200.0.0/16' });
  });

  it("reads back the MAC it wrote, and refuses one that is not a unicast address in that form", () => {
    const mac = Buffer.from([0x02, 0x70, 0xab, 0, 1, 0xff]);
    expect(parseMac(formatMac(mac))).toEqual(mac);
    for (const bad of ['03:70:ab:00:01:ff', '02:70:AB:00:01:ff', '02:70:ab:00:01', '02-70-ab-00-01-ff', '02:70:ab:00:01:ff:00', '']) expect(parseMac(bad)).toBeUndefined();
  });
});

describe('address allocation', () => {
  const range = parseCidr('10.200.0.0/16')!;
  it('gives the first /30 that overlaps nothing on the host: the host end .1, the guest .2', () => {
    const s = allocateSubnet(range, [])!;
    expect([formatCidr(s.network), formatIpv4(s.hostAddress), formatIpv4(s.guestAddress)]).toEqual(['10.200.0.0/30', '10.200.0.1', '10.200.0.2']);
    const used = parseIpAddrShow('1: lo    inet 127.0.0.1/8 scope host lo\n5: pv12n0    inet 10.200.0.1/30 scope global pv12n0\n6: eth0    inet 10.200.0.9/29 brd 10.200.0.15 scope global eth0\n');
    expect(used.map(formatCidr)).toEqual(['127.0.0.0/8', '10.200.0.0/30', '10.200.0.8/29']);
    expect(formatCidr(allocateSubnet(range, used)!.network)).toBe('10.200.0.4/30');
    expect(formatCidr(allocateSubnet(range, [...used, parseCidr('10.200.0.4/30')!])!.network)).toBe('10.200.0.16/30');
  });

  it('says when the range is full, and a host route over the whole range fills it', () => {
    expect(allocateSubnet(parseCidr('10.9.0.0/30')!, [parseCidr('10.9.0.0/30')!])).toBeUndefined();
    expect(allocateSubnet(range, [parseCidr('10.0.0.0/8')!])).toBeUndefined();
  });
});

describe('nftables rules of one VM', () => {
  const guest = parseIpv4('10.200.0.6')!;
  const guestMac = Buffer.from([0x02, 0x70, 1, 2, 3, 4]);
  const chain = (text: string, name: string) => {
    const body = text.slice(text.indexOf(`chain ${name} {`));
    return body.slice(0, body.indexOf('\n  }')).split('\n').map((l) => l.trim()).filter((l) => l && !l.startsWith('chain') && !l.startsWith('type'));
  };

  it("the TAP's ingress (netdev) takes only IPv4 from the guest's address and ARP about it, both from its MAC", () => {
    const text = natRuleset({ table: 'pvisor_42_0', tap: 'pv42n0', guestAddress: guest, guestMac, hostAddress: guest - 1, egress: ALL, resolver: false });
    expect(text).toMatch(/table netdev pvisor_42_0 \{\s+chain ingress \{\s+type filter hook ingress device "pv42n0" priority filter - 5; policy drop;/);
    expect(chain(text, 'ingress')).toEqual([
      'ether saddr 02:70:01:02:03:04 ether type ip ip saddr 10.200.0.6 accept',
      'ether saddr 02:70:01:02:03:04 ether type arp arp htype 1 arp ptype ip arp hlen 6 arp plen 4 arp operation { request, reply } arp saddr ether 02:70:01:02:03:04 arp saddr ip 10.200.0.6 accept',
    ]);
  });

  it("allow all: forwards the guest's new connections anywhere but to the host, IPv6 never; replies only on the guest's own connections", () => {
    const text = natRuleset({ table: 'pvisor_42_0', tap: 'pv42n0', guestAddress: guest, guestMac, hostAddress: guest - 1, egress: ALL, resolver: false });
    expect(text).toContain('table inet pvisor_42_0 {');
    expect(text).not.toMatch(/^table ip /m);
    expect(chain(text, 'forward')).toEqual([
      'iifname "pv42n0" meta nfproto ipv6 drop',
      'oifname "pv42n0" meta nfproto ipv6 drop',
      'iifname "pv42n0" ip saddr != 10.200.0.6 drop',
      'iifname "pv42n0" ct state established,related ct original ip saddr 10.200.0.6 accept',
      'iifname "pv42n0" ct state != new drop',
      'iifname "pv42n0" jump egress',
      'iifname "pv42n0" drop',
      'oifname "pv42n0" ct state established,related ct original ip saddr 10.200.0.6 accept',
      'oifname "pv42n0" drop',
    ]);
    expect(chain(text, 'input')).toEqual([
      'iifname "pv42n0" meta nfproto ipv6 drop',
      'iifname "pv42n0" ip saddr != 10.200.0.6 drop',
      'iifname "pv42n0" ct state established,related ct original ip daddr 10.200.0.6 accept',
      'iifname "pv42n0" drop',
    ]);
    expect(text).toMatch(/type nat hook postrouting priority srcnat;[^}]*ip saddr 10.200.0.6 oifname != "pv42n0" masquerade/);
    // Tables a dead process of the same pid left are replaced, in the same transaction.
    expect(text.startsWith('add table inet pvisor_42_0\ndelete table inet pvisor_42_0\nadd table netdev pvisor_42_0\ndelete table netdev pvisor_42_0\n')).toBe(true);
  });

  it('an allow list: each CIDR, with a port for TCP and UDP, for new connections only; an empty list drops all', () => {
    const allow = [parseAllowRule('192.0.2.0/24'), parseAllowRule('198.51.100.7/32:443')];
    const lines = chain(natRuleset({ table: 't', tap: 'pv1n0', guestAddress: guest, guestMac, hostAddress: guest - 1, egress: { allow, deny: [] }, resolver: false }), 'forward');
    const at = lines.indexOf('iifname "pv1n0" ct state != new drop');
    expect(lines.slice(at + 1, at + 3)).toEqual(['iifname "pv1n0" jump egress', 'iifname "pv1n0" drop']);
    expect(chain(natRuleset({ table: 't', tap: 'pv1n0', guestAddress: guest, guestMac, hostAddress: guest - 1, egress: { allow, deny: [] }, resolver: false }), 'egress')).toEqual([
      'ip daddr 192.0.2.0/24 accept',
      'ip daddr 198.51.100.7/32 tcp dport 443 accept',
      'ip daddr 198.51.100.7/32 udp dport 443 accept',
    ]);
    const none = natRuleset({ table: 't', tap: 'pv1n0', guestAddress: guest, guestMac, hostAddress: guest - 1, egress: { allow: [], deny: [] }, resolver: false });
    expect(chain(none, 'egress')).toEqual([]);
    expect([...chain(none, 'forward'), ...chain(none, 'input')].filter((l) => l.startsWith('iifname "pv1n0"') && l.endsWith('accept'))).toEqual([
      'iifname "pv1n0" ct state established,related ct original ip saddr 10.200.0.6 accept', // forward: the guest's own connections
      'iifname "pv1n0" ct state established,related ct original ip daddr 10.200.0.6 accept', // input: the host's connections to the guest
    ]);
  });

  it('names tables and TAPs after their process, and finds the owner again; other names are not ours', () => {
    expect(tableOwner(tableName(4194304, 12))).toEqual({ pid: 4194304, index: 12 });
    expect(tapName(4194304, 12).length).toBeLessThanOrEqual(15);
    expect(tapOwner(tapName(4194304, 12))).toEqual({ pid: 4194304, index: 12 });
    for (const other of ['filter', 'pvisor_', 'pvisor_0_1', 'pvisor_12', 'pvisor_12_x', 'pvisor_12_1_2']) expect(tableOwner(other)).toBeUndefined();
    for (const other of ['eth0', 'pv', 'pvn1', 'pv0n1', 'pv12n', 'tap0']) expect(tapOwner(other)).toBeUndefined();
    expect(parseTableList('table inet filter\ntable ip pvisor_9_0\ntable netdev pvisor_9_1\n')).toEqual([
      { family: 'inet', name: 'filter' }, { family: 'ip', name: 'pvisor_9_0' }, { family: 'netdev', name: 'pvisor_9_1' },
    ]);
    expect(deleteTablesScript([{ family: 'inet', name: 'pvisor_9_0' }])).toBe('add table inet pvisor_9_0\ndelete table inet pvisor_9_0\n');
  });
});
