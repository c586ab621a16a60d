/**
 * A guest with hostname egress rules, without a VM: run as root inside a network namespace that
 * test/unit/egress-resolver.test.ts made (`ip netns exec NS node egress-tap-guest.js OPTIONS`). It
 * sets up pvisor's real host side of a 'nat' VM with `allow` and `deny` (HostNetwork.create, with
 * its resolver and nft set), then plays the guest with raw frames on the TAP (./hostile-tap-guest.ts):
 * DNS queries to the host's end of the TAP, well-formed and hostile, and TCP connections to what
 * they resolved. It prints one JSON line of what it saw; the test judges.
 */
import { execFileSync } from 'node:child_process';
import { createSocket } from 'node:dgram';
import * as dnsPacket from 'dns-packet';
import { HostNetwork } from '../src/network/host-network';
import { parseNetworkOption } from '../src/network/options';
import { TapGuest, tcpConnect } from './hostile-tap-guest';
import * as F from './raw-frames';

export interface EgressGuestOptions {
  /** The upstream DNS server (in the outside namespace). */
  upstream: string;
  allow: string[];
  deny: string[];
  /** Where the outside's TCP server listens on every address. */
  tcpPort: number;
}

const sh = (cmd: string) => execFileSync('sh', ['-c', cmd], { encoding: 'utf8' });
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const ANSWER_MS = 4000;
const SILENCE_MS = 600;

let nextPort = 20000;
let nextId = 1;

/** One UDP datagram from the guest to its resolver; the reply's payload, or undefined. */
async function exchange(g: TapGuest, payload: Buffer, waitMs = ANSWER_MS): Promise<Buffer | undefined> {
  const sport = nextPort++;
  g.sendIp(g.address, g.hostAddress, F.PROTO_UDP, F.udp(g.address, g.hostAddress, sport, 53, payload));
  const f = await g.waitFor(waitMs, (fr) => fr.udp?.sport === 53 && fr.udp.dport === sport);
  return f?.udp!.data;
}

function queryOf(name: string, edns = false, id = nextId++): Buffer {
  return dnsPacket.encode({
    type: 'query', id, flags: dnsPacket.RECURSION_DESIRED, questions: [{ name, type: 'A', class: 'IN' }],
    ...(edns && { additionals: [{ type: 'OPT', name: '.', udpPayloadSize: 1232, extendedRcode: 0, ednsVersion: 0, flags: 0, flag_do: false, options: [] }] }),
  });
}

/**
 * One query over TCP from the guest, by hand: SYN, ACK, the framed query (2-byte length), then the
 * server's data until a whole framed answer is there. The answer, or undefined.
 */
async function tcpExchange(g: TapGuest, query: Buffer): Promise<Buffer | undefined> {
  const sport = nextPort++;
  const ours = (f: F.Frame) => f.tcp?.dport === sport && f.tcp.sport === 53;
  g.sendIp(g.address, g.hostAddress, F.PROTO_TCP, F.tcp(g.address, g.hostAddress, { sport, dport: 53, seq: 1000, ack: 0, flags: F.TCP_SYN }));
  const synAck = await g.waitFor(ANSWER_MS, ours);
  if (!synAck || !(synAck.tcp!.flags & F.TCP_SYN)) return undefined;
  const framed = Buffer.concat([Buffer.from([query.length >> 8, query.length & 255]), query]);
  const serverSeq = synAck.tcp!.seq + 1;
  g.sendIp(g.address, g.hostAddress, F.PROTO_TCP, F.tcp(g.address, g.hostAddress, { sport, dport: 53, seq: 1001, ack: serverSeq, flags: F.TCP_ACK }));
  g.sendIp(g.address, g.hostAddress, F.PROTO_TCP, F.tcp(g.address, g.hostAddress, { sport, dport: 53, seq: 1001, ack: serverSeq, flags: F.TCP_ACK | F.TCP_PSH, data: framed }));
  let got = Buffer.alloc(0);
  for (;;) {
    const f = await g.waitFor(ANSWER_MS, (fr) => ours(fr) && fr.tcp!.data.length > 0);
    if (!f) return undefined;
    got = Buffer.concat([got, f.tcp!.data]);
    g.sendIp(g.address, g.hostAddress, F.PROTO_TCP, F.tcp(g.address, g.hostAddress, { sport, dport: 53, seq: 1001 + framed.length, ack: f.tcp!.seq + f.tcp!.data.length, flags: F.TCP_ACK }));
    if (got.length >= 2 && got.length >= 2 + got.readUInt16BE(0)) break;
  }
  g.sendIp(g.address, g.hostAddress, F.PROTO_TCP, F.tcp(g.address, g.hostAddress, { sport, dport: 53, seq: 1001 + framed.length, ack: 0, flags: F.TCP_RST }));
  return got.subarray(2, 2 + got.readUInt16BE(0));
}

interface Resolved {
  rcode: string;
  truncated: boolean;
  idMatches: boolean;
  addresses: string[];
  cnames: string[];
  ttls: number[];
  elapsedMs: number;
}

async function resolve(g: TapGuest, name: string, edns = false, transport: 'udp' | 'tcp' = 'udp'): Promise<Resolved | undefined> {
  const q = queryOf(name, edns);
  const start = Date.now();
  const r = transport === 'udp' ? await exchange(g, q) : await tcpExchange(g, q);
  if (!r) return undefined;
  const p = dnsPacket.decode(r) as dnsPacket.DecodedPacket & { rcode: string };
  const records = (p.answers ?? []) as { type: string; data: unknown; ttl?: number }[];
  return {
    rcode: p.rcode,
    truncated: p.flag_tc,
    idMatches: p.id === q.readUInt16BE(0),
    addresses: records.filter((a) => a.type === 'A').map((a) => a.data as string),
    cnames: records.filter((a) => a.type === 'CNAME').map((a) => a.data as string),
    ttls: records.map((a) => a.ttl ?? -1),
    elapsedMs: Date.now() - start,
  };
}

/** The set's elements as nft lists them: address -> its timeout in seconds. */
function setElements(table: string): Record<string, number> {
  const text = sh(`nft list set inet ${table} hosts`);
  const out: Record<string, number> = {};
  for (const m of text.matchAll(/([0-9]+\.[0-9]+\.[0-9]+\.[0-9]+) timeout ([0-9hms]+)/g)) {
    const t = /(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?/.exec(m[2])!;
    out[m[1]] = Number(t[1] ?? 0) * 3600 + Number(t[2] ?? 0) * 60 + Number(t[3] ?? 0);
  }
  return out;
}

async function main(): Promise<void> {
  const o = JSON.parse(process.argv[2]) as EgressGuestOptions;
  const plan = parseNetworkOption({ mode: 'nat', allow: o.allow, deny: o.deny, dns: o.upstream });
  if (plan.kind !== 'nat') throw new Error('not nat');
  const net = await HostNetwork.create(plan);
  const table = net.info.nftTable!;
  const g = new TapGuest(net);
  const reach = async (address: string) => (await tcpConnect(g, g.address, F.ipv4(address), o.tcpPort)).answer;
  try {
    const setup = { info: JSON.parse(JSON.stringify(net.info)), setDeclaration: sh(`nft list set inet ${table} hosts`) };

    // Before any answer, nothing is open.
    const before = { reachAllowedAddress: await reach('198.18.0.2'), set: setElements(table) };

    const names: Record<string, Resolved | undefined> = {};
    for (const n of ['allowed.test', 'denied.test', 'unlisted.test', 'www.wild.test', 'bad.wild.test', 'via-denied.wild.test', 'missing.wild.test', 'ALLOWED.test.']) names[n] = await resolve(g, n);
    const set = setElements(table);
    const reachAfter = { allowed: await reach('198.18.0.2'), denied: await reach('198.18.0.3'), cnameTarget: await reach('198.18.0.4'), badWild: await reach('198.18.0.5') };

    // Upstream misbehaving, and an answer larger than UDP takes.
    const upstream = {
      wrongId: await resolve(g, 'wrongid.wild.test'),
      wrongQuestion: await resolve(g, 'wrongq.wild.test'),
      bigWithEdns: await resolve(g, 'big.wild.test', true),
      bigWithoutEdns: await resolve(g, 'big.wild.test', false),
      // What a guest does on a truncated answer: ask again over TCP.
      bigOverTcp: await resolve(g, 'big.wild.test', false, 'tcp'),
      deniedOverTcp: await resolve(g, 'denied.test', false, 'tcp'),
    };

    // Hostile queries: none gets an answer, and the resolver goes on.
    const oversized = Buffer.concat([queryOf('allowed.test'), Buffer.alloc(600)]);
    const isResponse = queryOf('allowed.test');
    isResponse[2] |= 0x80;
    const twoQuestions = dnsPacket.encode({ type: 'query', id: 7, questions: [{ name: 'allowed.test', type: 'A' }, { name: 'denied.test', type: 'A' }] });
    const badPointer = Buffer.concat([queryOf('allowed.test').subarray(0, 12), Buffer.from([0xc0, 0x20, 0, 1, 0, 1])]);
    const hostile: Record<string, boolean> = {};
    for (const [k, b] of Object.entries({ oversized, isResponse, twoQuestions, badPointer, garbage: Buffer.from('\x00\x01garbage that is no dns message at all'), empty: Buffer.alloc(0) })) {
      hostile[k] = (await exchange(g, b, SILENCE_MS)) !== undefined;
    }
    const afterHostile = await resolve(g, 'allowed.test');

    // A flood: 400 queries at once.
    await sleep(2500); // the bucket refills
    const floodPorts: number[] = [];
    const floodStart = Date.now();
    for (let i = 0; i < 400; i++) {
      const sport = nextPort++;
      floodPorts.push(sport);
      g.sendIp(g.address, g.hostAddress, F.PROTO_UDP, F.udp(g.address, g.hostAddress, sport, 53, queryOf('allowed.test')));
    }
    let floodAnswers = 0;
    const wanted = new Set(floodPorts);
    while (await g.waitFor(1500, (f) => f.udp?.sport === 53 && wanted.has(f.udp.dport))) floodAnswers++;
    const flood = { sent: 400, answered: floodAnswers, seconds: (Date.now() - floodStart) / 1000, stats: { ...net.resolverStats! } };
    await sleep(2500);
    const afterFlood = await resolve(g, 'allowed.test');

    // The rules replaced at runtime: allowed.test no longer, denied.test now; then its address denied.
    const updateStart = Date.now();
    await net.update({ allow: ['denied.test'], deny: [] });
    const updateMs = Date.now() - updateStart;
    const afterUpdate = {
      info: { allow: net.info.allow, deny: net.info.deny },
      set: setElements(table),
      allowed: await resolve(g, 'allowed.test'),
      reachAllowed: await reach('198.18.0.2'),
      denied: await resolve(g, 'denied.test'),
      setAfterDenied: setElements(table),
      reachDenied: await reach('198.18.0.3'),
      egressChain: sh(`nft list chain inet ${table} egress`),
    };
    await net.update({ deny: ['198.18.0.3/32'] });
    const afterCidrDeny = { set: setElements(table), denied: await resolve(g, 'denied.test'), reachDenied: await reach('198.18.0.3') };
    let badUpdate = '';
    try {
      await net.update({ allow: ['ok.test', 'bad..name'] });
    } catch (e) {
      badUpdate = `${(e as Error).name}: ${(e as Error).message}`;
    }
    const afterBadUpdate = { allow: net.info.allow };
    const stats = { ...net.resolverStats! };
    const down = teardown(net);
    // Another DNS server on every address's port 53: the setup fails, naming it, and leaves nothing.
    const squatter = createSocket('udp4');
    await new Promise<void>((r) => squatter.bind(53, '0.0.0.0', r));
    let portTaken = '';
    try {
      (await HostNetwork.create(plan)).close();
    } catch (e) {
      portTaken = `${(e as Error).name}: ${(e as Error).message}`;
    }
    squatter.close();
    const afterPortTaken = { tables: sh('nft list tables').trim(), links: sh('ip -o link show').split('\n').filter((l) => /: pv[0-9]+n[0-9]+[:@]/.test(l)) };
    return void console.log(JSON.stringify({ setup, before, names, set, reachAfter, upstream, hostile, afterHostile, flood, afterFlood, updateMs, afterUpdate, afterCidrDeny, badUpdate, afterBadUpdate, stats, teardown: down, portTaken, afterPortTaken }));
  } catch (e) {
    net.close();
    throw e;
  }
}

function teardown(net: HostNetwork) {
  const problem = net.close();
  return { problem, tables: sh('nft list tables').trim(), udp53: sh('ss -uln').includes(`${net.info.hostAddress}:53`) };
}

if (require.main === module) {
  main().then(
    () => process.exit(0),
    (e) => {
      console.error(e);
      process.exit(1);
    },
  );
}
