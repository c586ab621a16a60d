/**
 * The resolver a NAT'd VM with egress rules is given: it listens on the host's end of the VM's TAP
 * (UDP and TCP port 53), answers only names the rules allow (any other gets REFUSED: the guest
 * learns the name is not its to resolve, and caches no false "does not exist"), asks the upstream
 * resolver for the others, and opens exactly the IPv4 addresses of each answer in the VM's nftables
 * set (./egress-set.ts) for the answer's TTL, before the answer reaches the guest.
 *
 * The guest is hostile, so everything it sends is bounded: a query is at most 512 bytes and one
 * question, anything dns-packet cannot decode (or a response, another opcode, a name pvisor would
 * not put in a rule) is dropped without an answer, queries beyond a rate per VM or beyond a number
 * in flight are dropped, TCP has a few connections per VM with an idle timeout. The upstream is
 * checked too: its answer must come from its address and port, carry the id pvisor chose (at
 * random, per query, from a socket of its own) and repeat the question; CNAME chains are followed
 * at most {@link MAX_CNAME_CHAIN} deep, and a denied name anywhere in the chain refuses the answer.
 * The guest gets a new message, never the upstream's bytes: the question as it asked it, and the
 * chain's CNAME records and final records of the asked type; nothing from the authority or
 * additional sections (glue would name addresses that were not opened).
 *
 * dns-packet (npm) encodes and decodes the wire format: it reads only inside the buffer and
 * follows only backward compression pointers, so a hostile message is an exception, not a loop.
 */
import { randomInt } from 'node:crypto';
import { createSocket, type Socket as UdpSocket } from 'node:dgram';
import { connect, createServer, type Server, type Socket } from 'node:net';
import * as dnsPacket from 'dns-packet';
import { parseIpv4 } from './addresses';
import { addressDenied, nameAllowed, nameDenied, normalizeName, type EgressPolicy } from './egress-rules';
import { elementTtlS } from './egress-set';

/** The largest query taken from the guest (RFC 1035's UDP size; a query with EDNS is far below it). */
export const MAX_QUERY_BYTES = 512;
/** The largest answer read from the upstream (a UDP datagram, or one TCP message). */
export const MAX_UPSTREAM_BYTES = 16384;
/** The largest UDP answer sent to a guest that advertised EDNS (DNS flag day 2020's figure). */
const MAX_EDNS_ANSWER_BYTES = 1232;
/** CNAMEs followed from the question to its records. */
export const MAX_CNAME_CHAIN = 8;
/** How long the upstream has to answer one query. */
export const UPSTREAM_TIMEOUT_MS = 2000;
/** Queries per second per VM, with a burst of {@link QUERY_BURST}: a guest resolving normally is far below. */
export const QUERIES_PER_SECOND = 50;
export const QUERY_BURST = 100;
/** Queries of one VM waiting for the upstream at once. */
export const MAX_IN_FLIGHT = 32;
/** TCP connections per VM at once, and how long one may sit idle. */
export const MAX_TCP_CONNECTIONS = 4;
export const TCP_IDLE_MS = 10_000;

const DNS_PORT = 53;
const OPCODE_QUERY = 0;
const RCODE = { NOERROR: 0, SERVFAIL: 2, NXDOMAIN: 3, REFUSED: 5 } as const;

/** What the resolver did, for tests and diagnostics (a type, not an interface: it is also a record of numbers). */
export type ResolverStats = {
  /** Queries taken (decoded, within bounds and rate). */
  queries: number;
  /** Answered with records or an upstream's negative answer. */
  answered: number;
  /** Answered REFUSED: a name the rules do not allow. */
  refused: number;
  /** Answered SERVFAIL: no upstream, no valid upstream answer in time, the set full. */
  failed: number;
  /** Dropped without an answer: too large, malformed, from elsewhere. */
  dropped: number;
  /** Dropped for the rate or the number in flight. */
  limited: number;
  /** Upstream messages ignored: wrong id, question or source, malformed, too large. */
  badUpstream: number;
};

export interface EgressResolverOptions {
  /** Where it listens: the host's end of the TAP. */
  listenAddress: string;
  /** The only source it answers: the guest's address. */
  clientAddress: string;
  /** The upstream resolver (IPv4); undefined: every allowed name gets SERVFAIL. */
  upstream: string | undefined;
  /** The upstream's port; 53 but in tests. */
  upstreamPort?: number;
  /** The rules in force (read at each query: they change at runtime). */
  policy: () => EgressPolicy;
  /**
   * Opens `addresses` for `timeoutS` in the VM's set, `chain` being the names of the answer
   * (question first); resolves when the kernel has them.
   */
  open: (addresses: number[], timeoutS: number, chain: string[]) => Promise<void>;
}

/** A token bucket: `take` is false once the rate is used up. */
export class RateLimit {
  private tokens: number;
  private lastMs = Date.now();
  constructor(private readonly perSecond: number, private readonly burst: number) {
    this.tokens = burst;
  }
  take(): boolean {
    const now = Date.now();
    this.tokens = Math.min(this.burst, this.tokens + ((now - this.lastMs) * this.perSecond) / 1000);
    this.lastMs = now;
    if (this.tokens < 1) return false;
    this.tokens -= 1;
    return true;
  }
}

/** One VM's resolver; {@link close} stops it. */
export class EgressResolver {
  readonly stats: ResolverStats = { queries: 0, answered: 0, refused: 0, failed: 0, dropped: 0, limited: 0, badUpstream: 0 };
  private readonly rate = new RateLimit(QUERIES_PER_SECOND, QUERY_BURST);
  private inFlight = 0;
  private readonly tcpConnections = new Set<Socket>();
  private closed = false;

  private constructor(
    private readonly options: EgressResolverOptions,
    private readonly udp: UdpSocket,
    private readonly tcp: Server,
  ) {}

  /** Listens on `listenAddress`, UDP and TCP port 53 (needs CAP_NET_BIND_SERVICE, as root has). */
  static async start(options: EgressResolverOptions, port = DNS_PORT): Promise<EgressResolver> {
    const udp = createSocket({ type: 'udp4', recvBufferSize: 256 * 1024 });
    const tcp = createServer({ pauseOnConnect: false });
    const resolver = new EgressResolver(options, udp, tcp);
    try {
      await new Promise<void>((resolve, reject) => {
        udp.once('error', reject);
        udp.bind({ address: options.listenAddress, port, exclusive: true }, () => {
          udp.off('error', reject);
          resolve();
        });
      });
      await new Promise<void>((resolve, reject) => {
        tcp.once('error', reject);
        tcp.listen({ host: options.listenAddress, port, backlog: MAX_TCP_CONNECTIONS }, () => {
          tcp.off('error', reject);
          resolve();
        });
      });
    } catch (e) {
      resolver.close();
      throw e;
    }
    // A socket error after the start (none is expected on a bound socket) must not end the process.
    udp.on('error', () => undefined);
    tcp.on('error', () => undefined);
    udp.on('message', (msg, from) => {
      if (from.address !== options.clientAddress) {
        resolver.stats.dropped++;
        return;
      }
      void resolver.answer(msg, 'udp').then((reply) => {
        if (reply && !resolver.closed) udp.send(reply, from.port, from.address);
      });
    });
    tcp.on('connection', (conn) => resolver.serveTcp(conn));
    return resolver;
  }

  /** Stops listening and ends the TCP connections. Idempotent. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    try {
      this.udp.close();
    } catch {
      // Never bound.
    }
    this.tcp.close();
    for (const c of this.tcpConnections) c.destroy();
  }

  /**
   * The answer to one query from the guest, or undefined to drop it. Every bound and check of the
   * module is here; the transports only frame messages.
   */
  async answer(query: Buffer, transport: 'udp' | 'tcp'): Promise<Buffer | undefined> {
    if (query.length < 12 || query.length > MAX_QUERY_BYTES) {
      this.stats.dropped++;
      return undefined;
    }
    if (!this.rate.take() || this.inFlight >= MAX_IN_FLIGHT) {
      this.stats.limited++;
      return undefined;
    }
    let q: dnsPacket.DecodedPacket;
    try {
      q = dnsPacket.decode(query);
    } catch {
      this.stats.dropped++;
      return undefined;
    }
    const question = q.questions?.[0];
    const opcode = (query[2] >> 3) & 0xf;
    const name = question && normalizeName(question.name);
    if (q.flag_qr || opcode !== OPCODE_QUERY || q.questions!.length !== 1 || q.answers!.length || q.authorities!.length || !name || (question.class ?? 'IN') !== 'IN') {
      this.stats.dropped++;
      return undefined;
    }
    this.stats.queries++;
    const opt = q.additionals!.find((a): a is dnsPacket.OptAnswer => a.type === 'OPT');
    const limitBytes = transport === 'tcp' ? 65535 : opt ? Math.max(MAX_QUERY_BYTES, Math.min(opt.udpPayloadSize, MAX_EDNS_ANSWER_BYTES)) : MAX_QUERY_BYTES;
    const reply = (rcode: number, answers: dnsPacket.Answer[] = []): Buffer => {
      const flags = (q.flags! & dnsPacket.RECURSION_DESIRED) | dnsPacket.RECURSION_AVAILABLE | rcode;
      const message = dnsPacket.encode({ type: 'response', id: q.id, flags, questions: [question], answers });
      if (message.length <= limitBytes) return message;
      // Too large for UDP: the guest's resolver asks again over TCP.
      return dnsPacket.encode({ type: 'response', id: q.id, flags: flags | dnsPacket.TRUNCATED_RESPONSE, questions: [question] });
    };
    const policy = this.options.policy();
    // A type dns-packet does not know cannot be asked again upstream as it was asked.
    if (!nameAllowed(policy, name) || question.type.startsWith('UNKNOWN_')) {
      this.stats.refused++;
      return reply(RCODE.REFUSED);
    }
    if (this.options.upstream === undefined) {
      this.stats.failed++;
      return reply(RCODE.SERVFAIL);
    }
    this.inFlight++;
    try {
      const upstream = await this.ask(name, question.type);
      if (!upstream) {
        this.stats.failed++;
        return reply(RCODE.SERVFAIL);
      }
      if (upstream.rcode !== RCODE.NOERROR) {
        this.stats.answered++;
        return reply(upstream.rcode === RCODE.NXDOMAIN ? RCODE.NXDOMAIN : RCODE.SERVFAIL);
      }
      const chain = followChain(name, question.type, upstream.packet.answers ?? [], this.options.policy());
      if (chain.kind === 'refused') {
        this.stats.refused++;
        return reply(RCODE.REFUSED);
      }
      if (chain.kind === 'broken') {
        this.stats.failed++;
        return reply(RCODE.SERVFAIL);
      }
      const timeoutS = elementTtlS(chain.ttlS);
      // The rules may have changed while the upstream answered: the addresses are checked now.
      const now = this.options.policy();
      const addresses = chain.addresses.filter((a) => !addressDenied(now, a));
      const records = chain.records.filter((r) => r.type !== 'A' || addresses.includes(parseIpv4(r.data as string)!));
      if (addresses.length) {
        try {
          await this.options.open(addresses, timeoutS, chain.names);
        } catch {
          this.stats.failed++;
          return reply(RCODE.SERVFAIL);
        }
      }
      this.stats.answered++;
      // The guest caches an answer no longer than its addresses stay open.
      return reply(RCODE.NOERROR, records.map((r) => ({ ...r, ttl: Math.min(r.ttl ?? 0, timeoutS) })));
    } finally {
      this.inFlight--;
    }
  }

  /** The upstream's answer to `name` `type`, checked; over TCP if the UDP one came truncated. */
  private async ask(name: string, type: dnsPacket.RecordType): Promise<{ rcode: number; packet: dnsPacket.DecodedPacket } | undefined> {
    const id = randomInt(0, 65536);
    const query = dnsPacket.encode({
      type: 'query', id, flags: dnsPacket.RECURSION_DESIRED, questions: [{ name, type, class: 'IN' }],
      additionals: [{ type: 'OPT', name: '.', udpPayloadSize: MAX_EDNS_ANSWER_BYTES, extendedRcode: 0, ednsVersion: 0, flags: 0, flag_do: false, options: [] }],
    });
    const check = (message: Buffer) => {
      const checked = checkUpstream(message, id, name, type);
      if (!checked) this.stats.badUpstream++;
      return checked;
    };
    const port = this.options.upstreamPort ?? DNS_PORT;
    const viaUdp = await udpExchange(query, this.options.upstream!, port, check);
    if (!viaUdp || !viaUdp.packet.flag_tc) return viaUdp;
    return tcpExchange(query, this.options.upstream!, port, check);
  }

  /** DNS over TCP from the guest: 2-byte length, message; one query at a time per connection. */
  private serveTcp(conn: Socket): void {
    if (this.closed || this.tcpConnections.size >= MAX_TCP_CONNECTIONS || conn.remoteAddress !== this.options.clientAddress) {
      this.stats.limited++;
      conn.destroy();
      return;
    }
    this.tcpConnections.add(conn);
    conn.on('close', () => this.tcpConnections.delete(conn));
    conn.on('error', () => undefined);
    conn.setTimeout(TCP_IDLE_MS, () => conn.destroy());
    let pending = Buffer.alloc(0);
    let busy = false;
    const next = (): void => {
      if (busy || pending.length < 2) return;
      const length = pending.readUInt16BE(0);
      if (length > MAX_QUERY_BYTES) {
        this.stats.dropped++;
        conn.destroy();
        return;
      }
      if (pending.length < 2 + length) return;
      const query = pending.subarray(2, 2 + length);
      pending = pending.subarray(2 + length);
      busy = true;
      conn.pause();
      void this.answer(Buffer.from(query), 'tcp').then((reply) => {
        busy = false;
        if (conn.destroyed) return;
        if (reply) {
          const framed = Buffer.alloc(2 + reply.length);
          framed.writeUInt16BE(reply.length, 0);
          reply.copy(framed, 2);
          conn.write(framed);
        }
        conn.resume();
        next();
      });
    };
    conn.on('data', (d: Buffer) => {
      pending = Buffer.concat([pending, d]);
      // More than one whole query waiting means a client that does not wait for its answers.
      if (pending.length > 2 * (2 + MAX_QUERY_BYTES)) {
        this.stats.dropped++;
        conn.destroy();
        return;
      }
      next();
    });
  }
}

/** An upstream message, if it is the answer to the query (`id`, `name`, `type`) pvisor sent. */
export function checkUpstream(message: Buffer, id: number, name: string, type: string): { rcode: number; packet: dnsPacket.DecodedPacket } | undefined {
  if (message.length < 12 || message.length > MAX_UPSTREAM_BYTES) return undefined;
  let p: dnsPacket.DecodedPacket;
  try {
    p = dnsPacket.decode(message);
  } catch {
    return undefined;
  }
  const q = p.questions?.[0];
  if (!p.flag_qr || p.id !== id || p.questions!.length !== 1 || !q || normalizeName(q.name) !== name || q.type !== type || (q.class ?? 'IN') !== 'IN') return undefined;
  return { rcode: message[3] & 0xf, packet: p };
}

/** What an upstream answer's records say of a question. */
export type Chain =
  | { kind: 'ok'; names: string[]; records: Record[]; addresses: number[]; ttlS: number }
  | { kind: 'refused'; name: string }
  | { kind: 'broken'; why: string };

/**
 * Follows the CNAMEs from `name` through `answers`: the chain's names (question first), its CNAME
 * records and final records of `type`, the IPv4 addresses of its A records, and the smallest TTL of
 * them all. A denied name in the chain refuses it; a loop, a chain longer than
 * {@link MAX_CNAME_CHAIN} or a name pvisor would not put in a rule breaks it. Records off the
 * chain are left out.
 */
export function followChain(name: string, type: string, answers: readonly dnsPacket.Answer[], policy: EgressPolicy): Chain {
  const names = [name];
  const records: Record[] = [];
  const inClass = answers.filter((a): a is Record => a.type !== 'OPT' && (a.class ?? 'IN') === 'IN');
  let ttlS = Infinity;
  for (let current = name; ;) {
    const cname = type === 'CNAME' ? undefined : inClass.find((a) => a.type === 'CNAME' && normalizeName(a.name) === current);
    if (!cname) break;
    if (names.length > MAX_CNAME_CHAIN) return { kind: 'broken', why: `a CNAME chain longer than ${MAX_CNAME_CHAIN}` };
    const target = typeof cname.data === 'string' ? normalizeName(cname.data) : undefined;
    if (!target) return { kind: 'broken', why: 'a CNAME to a name that is not one' };
    if (names.includes(target)) return { kind: 'broken', why: 'a CNAME loop' };
    if (nameDenied(policy, target)) return { kind: 'refused', name: target };
    records.push(cname);
    ttlS = Math.min(ttlS, cname.ttl ?? 0);
    names.push(target);
    current = target;
  }
  const last = names[names.length - 1];
  const finals = inClass.filter((a) => a.type === type && normalizeName(a.name) === last);
  const addresses: number[] = [];
  for (const r of finals) {
    if (r.type === 'A') {
      const a = typeof r.data === 'string' ? parseIpv4(r.data) : undefined;
      if (a === undefined) return { kind: 'broken', why: 'an A record that is not an IPv4 address' };
      addresses.push(a);
    }
    records.push(r);
    ttlS = Math.min(ttlS, r.ttl ?? 0);
  }
  return { kind: 'ok', names, records, addresses, ttlS: Number.isFinite(ttlS) ? ttlS : 0 };
}

/** A resource record (OPT is a pseudo-record of EDNS, never in an answer section pvisor keeps). */
type Record = Exclude<dnsPacket.Answer, dnsPacket.OptAnswer>;

type Check = (message: Buffer) => { rcode: number; packet: dnsPacket.DecodedPacket } | undefined;

/** Sends `query` from a socket of its own, connected to the upstream, and waits for an answer `check` takes. */
function udpExchange(query: Buffer, address: string, port: number, check: Check): Promise<ReturnType<Check>> {
  return new Promise((resolve) => {
    const socket = createSocket('udp4');
    const done = (result: ReturnType<Check>) => {
      clearTimeout(timer);
      socket.removeAllListeners('message');
      try {
        socket.close();
      } catch {
        // Closed already.
      }
      resolve(result);
    };
    const timer = setTimeout(() => done(undefined), UPSTREAM_TIMEOUT_MS);
    socket.on('error', () => done(undefined));
    // Connected: the kernel delivers only datagrams from the upstream's address and port.
    socket.on('message', (m) => {
      const checked = check(m);
      if (checked) done(checked);
    });
    socket.connect(port, address, () => socket.send(query));
  });
}

/** The same over TCP (2-byte length, message), for answers too large for UDP. */
function tcpExchange(query: Buffer, address: string, port: number, check: Check): Promise<ReturnType<Check>> {
  return new Promise((resolve) => {
    const socket = connect({ host: address, port });
    let received = Buffer.alloc(0);
    const done = (result: ReturnType<Check>) => {
      clearTimeout(timer);
      socket.destroy();
      resolve(result);
    };
    const timer = setTimeout(() => done(undefined), UPSTREAM_TIMEOUT_MS);
    socket.on('error', () => done(undefined));
    socket.on('close', () => done(undefined));
    socket.on('connect', () => {
      const framed = Buffer.alloc(2 + query.length);
      framed.writeUInt16BE(query.length, 0);
      query.copy(framed, 2);
      socket.write(framed);
    });
    socket.on('data', (d: Buffer) => {
      received = Buffer.concat([received, d]);
      if (received.length < 2) return;
      const length = received.readUInt16BE(0);
      if (length > MAX_UPSTREAM_BYTES) return done(undefined);
      if (received.length >= 2 + length) done(check(received.subarray(2, 2 + length)));
    });
  });
}
