/**
 * A hostile guest without a VM, run as root inside a network namespace that
 * test/unit/network-hostile-guest.test.ts made (`ip netns exec NS node hostile-tap-guest.js
 * MODE OPTIONS`). It sets up pvisor's host side of 'nat' VMs with the real module
 * (HostNetwork.create: what Vm.start does once /dev/vhost-net is known to be there), then reads
 * and writes raw Ethernet frames on their TAPs' fds: exactly what a guest can send through its
 * virtio-net device, whatever its kernel. It prints one JSON line of what it saw; the test judges.
 *
 * Modes: `probe` (everything below), `crash` (set up one network, then SIGKILL itself) and
 * `stale` (what removeStaleNetworks removes, and what is left).
 */
import { execFileSync } from 'node:child_process';
import { createSocket } from 'node:dgram';
import { readFileSync, readSync, writeFileSync, writeSync } from 'node:fs';
import { createServer } from 'node:net';
import { HostNetwork, removeStaleNetworks } from '../src/network/host-network';
import { parseNetworkOption } from '../src/network/options';
import { openLibc } from '../src/sys/libc';
import * as F from './raw-frames';

export interface HostileGuestOptions {
  /** The namespace behind the host's veth: "outside", with a TCP server and a UDP echo. */
  outsideNs: string;
  outside4: string;
  hostOutside4: string;
  outside6: string;
  hostOutside6: string;
  /** TCP: answers `outside saw ADDRESS`. */
  outsideTcpPort: number;
  /** UDP: echoes each datagram. */
  outsideUdpPort: number;
}

/** How long a frame that should not come is waited for: the host answers within a millisecond. */
const SILENCE_MS = 600;
const ANSWER_MS = 3000;
/** A global IPv6 source the guest makes up: link-local sources are never forwarded. */
const GUEST_GLOBAL6 = F.ipv6('fd00:2::2');
/** The vnet header pvisor's TAP carries before each frame (virtio_net_hdr_mrg_rxbuf), all zero: no offload. */
const VNET_HDR = Buffer.alloc(12);
const HOST_SERVICE_PORT = 2222;
const HOST_FLOW_PORT = 7001;
const VM_B_FLOW_PORT = 5000;

const sh = (cmd: string) => execFileSync('sh', ['-c', cmd], { encoding: 'utf8' });
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const sysctl = (path: string) => readFileSync(`/proc/sys/net/${path}`, 'utf8').trim();

let fcntl: ((args: [number, number, number]) => unknown) | undefined;
function setNonBlocking(fd: number): void {
  const { define, DataType } = openLibc();
  fcntl ??= define({ fcntl: { library: 'libc', retType: DataType.I32, paramsType: [DataType.I32, DataType.I32, DataType.I32] } }).fcntl;
  const F_GETFL = 3;
  const F_SETFL = 4;
  const O_NONBLOCK = 0o4000;
  fcntl([fd, F_SETFL, (fcntl([fd, F_GETFL, 0]) as number) | O_NONBLOCK]);
}

/** One guest: the far end of a TAP pvisor set up. */
export class TapGuest {
  static readonly all: TapGuest[] = [];
  readonly mac: Buffer;
  readonly address: Buffer;
  readonly hostAddress: Buffer;
  readonly hostMac: Buffer;
  readonly linkLocal: Buffer;
  private readonly received: F.Frame[] = [];

  constructor(readonly net: HostNetwork) {
    this.mac = net.mac;
    this.address = F.ipv4(net.info.guestAddress!.split('/')[0]);
    this.hostAddress = F.ipv4(net.info.hostAddress!);
    this.hostMac = F.mac(readFileSync(`/sys/class/net/${net.info.tap}/address`, 'utf8'));
    this.linkLocal = F.linkLocalOf(this.mac);
    setNonBlocking(net.tap.fd);
    TapGuest.all.push(this);
  }

  send(frame: Buffer): void {
    writeSync(this.net.tap.fd, Buffer.concat([VNET_HDR, frame]));
  }

  /** An IP packet to the host's MAC (the gateway's), from any source the guest likes. */
  sendIp(src: Buffer, dst: Buffer, protocol: number, l4: Buffer): void {
    this.send(F.ethernet(this.hostMac, this.mac, src.length === 4 ? F.ETH_IPV4 : F.ETH_IPV6, F.ip(src, dst, protocol, l4)));
  }

  private readAll(): void {
    const buf = Buffer.alloc(65536);
    for (;;) {
      let n: number;
      try {
        n = readSync(this.net.tap.fd, buf, 0, buf.length, null);
      } catch (e) {
        if ((e as NodeJS.ErrnoException).code === 'EAGAIN') return;
        throw e;
      }
      const f = F.parseFrame(Buffer.from(buf.subarray(VNET_HDR.length, n)));
      this.answerNeighbours(f);
      this.received.push(f);
    }
  }

  /** What any guest does for its own addresses: answers ARP and IPv6 neighbour solicitations. */
  private answerNeighbours(f: F.Frame): void {
    if (f.arp?.op === F.ARP_REQUEST && f.arp.targetIp.equals(this.address)) {
      this.send(F.ethernet(f.arp.senderMac, this.mac, F.ETH_ARP, F.arp(F.ARP_REPLY, this.mac, this.address, f.arp.senderMac, f.arp.senderIp)));
    }
    if (f.ip?.version === 6 && f.icmp?.type === F.ICMPV6_NEIGHBOR_SOLICIT && f.icmp.body.length >= 20) {
      const target = f.icmp.body.subarray(4, 20);
      if (!target.equals(this.linkLocal) && !target.equals(GUEST_GLOBAL6)) return;
      this.send(F.ethernet(f.srcMac, this.mac, F.ETH_IPV6, F.ip(target, f.ip.src, F.PROTO_ICMPV6, F.neighbourAdvert(target, f.ip.src, target, this.mac))));
    }
  }

  /** The first frame to this guest that `match` takes, within `ms`; every guest's TAP is served meanwhile. */
  async waitFor(ms: number, match: (f: F.Frame) => boolean): Promise<F.Frame | undefined> {
    for (const end = Date.now() + ms; ;) {
      for (const g of TapGuest.all) g.readAll();
      const i = this.received.findIndex(match);
      if (i >= 0) return this.received.splice(i, 1)[0];
      if (Date.now() > end) return undefined;
      await sleep(5);
    }
  }
}

let nextPort = 40000;

/**
 * A TCP connection from the guest by hand: SYN; on a SYN-ACK, the ACK, then the first data the
 * server sends (its banner). `answer` says how far it got.
 */
export async function tcpConnect(g: TapGuest, src: Buffer, dst: Buffer, dport: number): Promise<{ answer: 'none' | 'rst' | 'syn-ack'; banner?: string }> {
  const sport = nextPort++;
  const ours = (f: F.Frame) => f.tcp?.dport === sport && f.tcp.sport === dport && f.ip!.src.equals(dst);
  g.sendIp(src, dst, F.PROTO_TCP, F.tcp(src, dst, { sport, dport, seq: 1000, ack: 0, flags: F.TCP_SYN }));
  const reply = await g.waitFor(SILENCE_MS, ours);
  if (!reply) return { answer: 'none' };
  if (reply.tcp!.flags & F.TCP_RST) return { answer: 'rst' };
  g.sendIp(src, dst, F.PROTO_TCP, F.tcp(src, dst, { sport, dport, seq: 1001, ack: reply.tcp!.seq + 1, flags: F.TCP_ACK }));
  const data = await g.waitFor(ANSWER_MS, (f) => ours(f) && f.tcp!.data.length > 0);
  return { answer: 'syn-ack', banner: data?.tcp!.data.toString() };
}

/** A counter of /proc/net/snmp (`Tcp` `InSegs`...), in namespace `ns` or this one. */
function snmp(group: string, field: string, ns?: string): number {
  const text = ns ? sh(`ip netns exec ${ns} cat /proc/net/snmp`) : readFileSync('/proc/net/snmp', 'utf8');
  const [names, values] = text.split('\n').filter((l) => l.startsWith(`${group}:`)).map((l) => l.split(/\s+/));
  return Number(values[names.indexOf(field)]);
}

/** The first 28 bytes of the packet an ICMP error is about, as RFC 792 quotes it. */
function quoted(src: Buffer, dst: Buffer, sport: number, dport: number): Buffer {
  return F.ip(src, dst, F.PROTO_UDP, F.udp(src, dst, sport, dport, Buffer.from('12345678'))).subarray(0, 28);
}

async function ipv6Probes(a: TapGuest, o: HostileGuestOptions) {
  const hostLinkLocal = F.linkLocalOf(a.hostMac);
  const inSegs = snmp('Tcp', 'InSegs', o.outsideNs);
  const hostLinkLocalService = await tcpConnect(a, a.linkLocal, hostLinkLocal, HOST_SERVICE_PORT);
  const hostGlobalService = await tcpConnect(a, a.linkLocal, F.ipv6(o.hostOutside6), HOST_SERVICE_PORT);
  const beyond = await tcpConnect(a, GUEST_GLOBAL6, F.ipv6(o.outside6), o.outsideTcpPort);
  return { hostLinkLocalService, hostGlobalService, beyond, outsideTcpSegmentsSeen: snmp('Tcp', 'InSegs', o.outsideNs) - inSegs };
}

/** Until the TAP's IPv6 addresses (if any) are past duplicate address detection, as a booted guest would find them. */
async function settledIpv6(tap: string): Promise<string> {
  for (const end = Date.now() + 5000; ;) {
    const addrs = sh(`ip -6 -o addr show dev ${tap}`);
    if (!addrs.includes('tentative') || Date.now() > end) return addrs.trim();
    await sleep(100);
  }
}

function natPlan() {
  const plan = parseNetworkOption('nat');
  if (plan.kind !== 'nat') throw new Error(`'nat' parsed as ${plan.kind}`);
  return plan;
}

async function probe(o: HostileGuestOptions) {
  const plan = natPlan();
  const netA = await HostNetwork.create(plan);
  const netB = await HostNetwork.create(plan);
  const tap = netA.info.tap!;
  const table = netA.info.nftTable!;
  // The TAP as a VM's boot finds it, a second or more after it came up.
  const tapIpv6 = await settledIpv6(tap);
  const setup = {
    tap,
    table,
    disableIpv6: sysctl(`ipv6/conf/${tap}/disable_ipv6`),
    rpFilter: sysctl(`ipv4/conf/${tap}/rp_filter`),
    arpIgnore: sysctl(`ipv4/conf/${tap}/arp_ignore`),
    tapIpv6,
    tables: sh('nft list tables').trim().split('\n'),
  };

  // The host's services: a TCP one on every address, both families, and a UDP flow of its own to the outside.
  const serviceConnections: string[] = [];
  const service = createServer((s) => (serviceConnections.push(s.remoteAddress ?? '?'), s.end('host service banner\n')));
  await new Promise<void>((r) => service.listen(HOST_SERVICE_PORT, '::', r));
  const hostFlow = createSocket('udp4');
  const hostFlowMessages: string[] = [];
  const hostFlowErrors: string[] = [];
  hostFlow.on('message', (m) => hostFlowMessages.push(m.toString()));
  hostFlow.on('error', (e) => hostFlowErrors.push((e as NodeJS.ErrnoException).code ?? e.message));
  await new Promise<void>((r) => hostFlow.bind(HOST_FLOW_PORT, o.hostOutside4, r));
  await new Promise<void>((r) => hostFlow.connect(o.outsideUdpPort, o.outside4, () => r()));
  hostFlow.send('host flow');

  const a = new TapGuest(netA);
  const b = new TapGuest(netB);
  const outside4 = F.ipv4(o.outside4);
  const hostOutside4 = F.ipv4(o.hostOutside4);

  // ARP: for the gateway from the guest's own address; from a forged sender; for another host address.
  const arpFor = async (sender: Buffer, target: Buffer) => {
    a.send(F.ethernet(Buffer.alloc(6, 0xff), a.mac, F.ETH_ARP, F.arp(F.ARP_REQUEST, a.mac, sender, Buffer.alloc(6), target)));
    return (await a.waitFor(SILENCE_MS, (f) => f.arp?.op === F.ARP_REPLY && f.arp.senderIp.equals(target))) !== undefined;
  };
  const arp = {
    gatewayAnswered: await arpFor(a.address, a.hostAddress),
    forgedSenderAnswered: await arpFor(outside4, a.hostAddress),
    otherHostAddressAnswered: await arpFor(a.address, hostOutside4),
  };

  // The legitimate path, and the host's own service over IPv4 (refused since before).
  const ipv4 = {
    outside: await tcpConnect(a, a.address, outside4, o.outsideTcpPort),
    hostService: await tcpConnect(a, a.address, a.hostAddress, HOST_SERVICE_PORT),
  };

  // Forged replies on flows that are not the guest's: the host's (UDP 7001 <-> outside), VM B's.
  const hostFlowEchoed = (await waitUntil(() => hostFlowMessages.includes('host flow'), ANSWER_MS)) === true;
  b.sendIp(b.address, outside4, F.PROTO_UDP, F.udp(b.address, outside4, VM_B_FLOW_PORT, o.outsideUdpPort, Buffer.from('vm b flow')));
  const vmBEcho = await b.waitFor(ANSWER_MS, (f) => f.udp?.dport === VM_B_FLOW_PORT && f.udp.data.toString() === 'vm b flow');
  const unreachables = snmp('Icmp', 'InDestUnreachs');
  a.sendIp(outside4, hostOutside4, F.PROTO_UDP, F.udp(outside4, hostOutside4, o.outsideUdpPort, HOST_FLOW_PORT, Buffer.from('forged reply')));
  a.sendIp(a.address, hostOutside4, F.PROTO_ICMP, F.icmp(3, 3, Buffer.concat([Buffer.alloc(4), quoted(hostOutside4, outside4, HOST_FLOW_PORT, o.outsideUdpPort)])));
  // VM B's flow leaves masqueraded as hostOutside4, its source port kept (nothing else holds it).
  a.sendIp(outside4, hostOutside4, F.PROTO_UDP, F.udp(outside4, hostOutside4, o.outsideUdpPort, VM_B_FLOW_PORT, Buffer.from('forged reply to b')));
  const forgedToB = await b.waitFor(SILENCE_MS, (f) => f.udp?.data.toString() === 'forged reply to b');
  a.sendIp(a.address, hostOutside4, F.PROTO_ICMP, F.icmp(3, 3, Buffer.concat([Buffer.alloc(4), quoted(hostOutside4, outside4, VM_B_FLOW_PORT, o.outsideUdpPort)])));
  const icmpToB = await b.waitFor(SILENCE_MS, (f) => f.icmp !== undefined && f.ip?.version === 4);
  await sleep(SILENCE_MS);
  const forged = {
    hostFlowEchoed,
    vmBFlowEchoed: vmBEcho !== undefined,
    hostFlowGotForgedReply: hostFlowMessages.includes('forged reply'),
    hostFlowErrors: [...hostFlowErrors],
    hostIcmpUnreachablesTaken: snmp('Icmp', 'InDestUnreachs') - unreachables,
    vmBGotForgedReply: forgedToB !== undefined,
    vmBGotIcmpError: icmpToB !== undefined,
  };

  // IPv6, as set up; with IPv6 turned back on on the TAP (as `sysctl net.ipv6.conf.all.disable_ipv6=0`
  // would do to every interface); and then with only the inet table left.
  const ipv6 = await ipv6Probes(a, o);
  writeFileSync(`/proc/sys/net/ipv6/conf/${tap}/accept_dad`, '0');
  writeFileSync(`/proc/sys/net/ipv6/conf/${tap}/disable_ipv6`, '0');
  await sleep(200);
  const reenabledTapIpv6 = sh(`ip -6 -o addr show dev ${tap}`).trim();
  const ipv6Reenabled = await ipv6Probes(a, o);
  let netdevTableDeleted = true;
  try {
    sh(`nft delete table netdev ${table} 2>&1`);
  } catch {
    netdevTableDeleted = false;
  }
  const ipv6InetTableAlone = netdevTableDeleted ? await ipv6Probes(a, o) : undefined;

  await new Promise((r) => setTimeout(r, 100));
  service.close();
  hostFlow.close();
  const problems = [netA.close(), netB.close()].filter(Boolean);
  const teardown = {
    problems,
    tables: sh('nft list tables').trim(),
    links: sh('ip -o link show').split('\n').filter((l) => /: pv[0-9]+n[0-9]+[:@]/.test(l)),
  };
  return { setup, arp, ipv4, forged, ipv6, reenabledTapIpv6, ipv6Reenabled, ipv6InetTableAlone, serviceConnections, teardown };
}

async function waitUntil(check: () => boolean, ms: number): Promise<boolean> {
  for (const end = Date.now() + ms; !check();) {
    if (Date.now() > end) return false;
    await sleep(10);
  }
  return true;
}

async function main(): Promise<void> {
  const [mode, options] = process.argv.slice(2);
  if (mode === 'probe') {
    console.log(JSON.stringify(await probe(JSON.parse(options) as HostileGuestOptions)));
    process.exit(0);
  }
  if (mode === 'crash') {
    const net = await HostNetwork.create(natPlan());
    // Written at once: console.log to a pipe may still be queued when the SIGKILL comes.
    writeSync(1, `${JSON.stringify({ tap: net.info.tap, table: net.info.nftTable, tables: sh('nft list tables').trim() })}\n`);
    process.kill(process.pid, 'SIGKILL');
  }
  if (mode === 'stale') {
    const removed = removeStaleNetworks();
    console.log(JSON.stringify({ removed, tables: sh('nft list tables').trim() }));
    return;
  }
  throw new Error(`unknown mode ${mode}`);
}

if (require.main === module) {
  main().catch((e) => {
    console.error(e);
    process.exit(1);
  });
}
