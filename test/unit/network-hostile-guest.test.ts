// What a guest on a 'nat' TAP can reach, tested without a VM: as root, in network namespaces this
// test makes and deletes (the host's own network is not touched), pvisor's real host side is set up
// for two VMs, and test/hostile-tap-guest.ts plays both guests by writing and reading raw Ethernet
// frames on the TAPs' fds, which is all a guest can do, whatever its kernel. "Outside" is a second
// namespace behind a veth pair (198.18.0.0/30 and fd00:1::/64, never routed anywhere).
// Skipped, saying why in its name, without root, /dev/net/tun, IPv6 in the kernel, nft or ip.
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import type { HostileGuestOptions } from '../hostile-tap-guest';

const HELPER = join(__dirname, '..', 'hostile-tap-guest.js');
const HOST_NS = `pvt-hostile-${process.pid}`;
const OUTSIDE_NS = `pvt-outside-${process.pid}`;
const options: HostileGuestOptions = {
  outsideNs: OUTSIDE_NS,
  outside4: '198.18.0.2',
  hostOutside4: '198.18.0.1',
  outside6: 'fd00:1::2',
  hostOutside6: 'fd00:1::1',
  outsideTcpPort: 8080,
  outsideUdpPort: 9000,
};
const OUTSIDE_SERVER = `
const net = require('net'), dgram = require('dgram');
net.createServer((s) => s.end('outside saw ' + s.remoteAddress.replace(/^::ffff:/, ''))).listen(${options.outsideTcpPort}, '::', () => {
  const u = dgram.createSocket('udp4');
  u.on('message', (m, r) => u.send(m, r.port, r.address));
  u.bind(${options.outsideUdpPort}, '${options.outside4}', () => console.log('ready'));
});`;

function missing(): string | undefined {
  if (process.getuid?.() !== 0) return 'not root';
  if (!existsSync('/dev/net/tun')) return 'no /dev/net/tun';
  if (!existsSync('/proc/sys/net/ipv6')) return 'no IPv6 in this kernel';
  if (spawnSync('nft', ['--version']).status !== 0) return 'no nft (Debian package nftables)';
  if (spawnSync('ip', ['-V']).status !== 0) return 'no ip (Debian package iproute2)';
  return undefined;
}

function sh(cmd: string): string {
  const r = spawnSync('sh', ['-c', cmd], { encoding: 'utf8' });
  if (r.status !== 0) throw new Error(`${cmd}: ${r.stderr || r.stdout}`);
  return r.stdout;
}

/** Runs the helper in the host namespace; its last stdout line is its JSON report. */
function helper(mode: 'probe' | 'crash' | 'stale'): { status: number | null; signal: NodeJS.Signals | null; report: any } {
  const r = spawnSync('ip', ['netns', 'exec', HOST_NS, process.execPath, HELPER, mode, JSON.stringify(options)], { encoding: 'utf8', timeout: 120_000 });
  const last = r.stdout.trim().split('\n').pop();
  if (!last?.startsWith('{')) throw new Error(`hostile-tap-guest ${mode} printed no report (status ${r.status}, signal ${r.signal}): ${r.stderr}`);
  return { status: r.status, signal: r.signal, report: JSON.parse(last) };
}

const why = missing();

(why ? describe.skip : describe)(`a hostile guest on a 'nat' TAP, from raw frames${why ? ` (skipped: ${why})` : ''}`, () => {
  let outside: ChildProcess | undefined;
  let report: any;

  beforeAll(async () => {
    for (const ns of [HOST_NS, OUTSIDE_NS]) spawnSync('ip', ['netns', 'delete', ns]);
    sh(`ip netns add ${HOST_NS} && ip netns add ${OUTSIDE_NS} &&
        ip -n ${HOST_NS} link add pvh0 type veth peer name pvo0 netns ${OUTSIDE_NS} &&
        ip -n ${HOST_NS} addr add ${options.hostOutside4}/30 dev pvh0 && ip -n ${HOST_NS} addr add ${options.hostOutside6}/64 dev pvh0 nodad &&
        ip -n ${HOST_NS} link set pvh0 up && ip -n ${HOST_NS} link set lo up &&
        ip -n ${OUTSIDE_NS} addr add ${options.outside4}/30 dev pvo0 && ip -n ${OUTSIDE_NS} addr add ${options.outside6}/64 dev pvo0 nodad &&
        ip -n ${OUTSIDE_NS} link set pvo0 up && ip -n ${OUTSIDE_NS} link set lo up &&
        ip -n ${OUTSIDE_NS} -6 route add default via ${options.hostOutside6}`);
    // A host that routes IPv6 (so IPv6 "beyond the host" means something), with systemd's loose
    // rp_filter default (Debian's 50-default.conf), under which a TAP's own strict setting does not
    // count: the kernel takes the larger of `all` and the interface's.
    sh(`ip netns exec ${HOST_NS} sysctl -qw net.ipv6.conf.all.forwarding=1 net.ipv4.conf.all.rp_filter=2 net.ipv4.conf.default.rp_filter=2`);
    outside = spawn('ip', ['netns', 'exec', OUTSIDE_NS, process.execPath, '-e', OUTSIDE_SERVER], { stdio: ['ignore', 'pipe', 'inherit'] });
    await new Promise<void>((resolve, reject) => {
      let out = '';
      outside!.stdout!.on('data', (d) => (out += d).includes('ready') && resolve());
      outside!.once('exit', (code) => reject(new Error(`the outside's server exited (${code})`)));
    });
    report = helper('probe').report;
  }, 150_000);

  afterAll(() => {
    outside?.kill();
    // Deleting the namespaces takes whatever a failed run left in them (TAPs, tables, the veth).
    for (const ns of [HOST_NS, OUTSIDE_NS]) spawnSync('ip', ['netns', 'delete', ns]);
  });

  it('the TAP comes up with IPv6 off (no fe80:: address ever), strict rp_filter and arp_ignore 1; the VM has an inet and a netdev table', () => {
    const { setup } = report;
    expect(setup).toMatchObject({ disableIpv6: '1', rpFilter: '1', arpIgnore: '1', tapIpv6: '' });
    expect(setup.tables).toEqual(expect.arrayContaining([`table inet ${setup.table}`, `table netdev ${setup.table}`]));
    expect(setup.tables.filter((t: string) => t.startsWith('table ip '))).toEqual([]);
  });

  it('the legitimate IPv4 path works: ARP for the gateway, TCP to the outside through NAT; the host itself is not reachable', () => {
    expect(report.arp.gatewayAnswered).toBe(true);
    expect(report.ipv4.outside).toEqual({ answer: 'syn-ack', banner: `outside saw ${options.hostOutside4}` });
    expect(report.ipv4.hostService).toEqual({ answer: 'none' });
  });

  it('IPv6 from the guest reaches neither a host service (fe80:: or global) nor beyond the host, even when IPv6 is turned back on on the TAP, and with only the inet table', () => {
    const none = { hostLinkLocalService: { answer: 'none' }, hostGlobalService: { answer: 'none' }, beyond: { answer: 'none' }, outsideTcpSegmentsSeen: 0 };
    expect(report.ipv6).toEqual(none);
    // Turned back on, the TAP does get an fe80:: address: the rules alone keep the guest out.
    expect(report.reenabledTapIpv6).toMatch(/inet6 fe80::/);
    expect(report.ipv6Reenabled).toEqual(none);
    expect(report.ipv6InetTableAlone).toEqual(none);
    expect(report.serviceConnections).toEqual([]);
  });

  it("forged replies and ICMP errors on flows that are not the guest's reach neither the host's flow nor another VM's", () => {
    const { forged } = report;
    // Both flows work: each got its echo from the outside.
    expect(forged).toMatchObject({ hostFlowEchoed: true, vmBFlowEchoed: true });
    expect(forged).toMatchObject({ hostFlowGotForgedReply: false, hostFlowErrors: [], hostIcmpUnreachablesTaken: 0, vmBGotForgedReply: false, vmBGotIcmpError: false });
  });

  it("ARP: a forged sender address gets no answer, nor does a request for the host's addresses on other interfaces", () => {
    expect(report.arp).toEqual({ gatewayAnswered: true, forgedSenderAnswered: false, otherHostAddressAnswered: false });
  });

  it("closing removes both of the VM's tables and its TAP", () => {
    expect(report.teardown).toEqual({ problems: [], tables: '', links: [] });
  });

  it("a SIGKILLed owner's tables (inet and netdev) are removed by the next process that sets up a network", () => {
    const crashed = helper('crash');
    expect(crashed.signal ?? '').toBe('SIGKILL');
    const { table } = crashed.report;
    expect(crashed.report.tables.split('\n').sort()).toEqual([`table inet ${table}`, `table netdev ${table}`]);
    const stale = helper('stale').report;
    // The TAP went with the killed process's fd.
    expect(stale.removed.sort()).toEqual([`inet ${table}`, `netdev ${table}`]);
    expect(stale.tables).toBe('');
  });
});
