// The resolver's sockets against hostile clients, on loopback (no root, no namespace): its real UDP
// and TCP listeners and a real upstream (test/dns-test-server.ts's answers, served here). Only the
// nft set is stood in for by a recorder (egress-resolver.test.ts runs the real one as root), which
// lets this test see that an address is opened before its answer leaves.
import { createSocket } from 'node:dgram';
import { connect, createServer, type Server, type Socket } from 'node:net';
import * as dnsPacket from 'dns-packet';
import { EgressResolver, MAX_QUERY_BYTES, MAX_TCP_CONNECTIONS } from '../../src/network/egress-resolver';
import { parseEgressPolicy } from '../../src/network/egress-rules';
import { formatIpv4 } from '../../src/network/addresses';
import { answerFrom, type Zone } from '../dns-test-server';

const ZONE: Zone = { 'allowed.test': { A: ['192.0.2.10'], ttl: 120 } };
const query = (name: string, id = 1) => dnsPacket.encode({ type: 'query', id, flags: dnsPacket.RECURSION_DESIRED, questions: [{ name, type: 'A', class: 'IN' }] });
const framed = (m: Buffer) => Buffer.concat([Buffer.from([m.length >> 8, m.length & 255]), m]);

describe('the resolver on its sockets, with hostile clients', () => {
  const events: string[] = [];
  let resolver: EgressResolver;
  let upstreamTcp: Server;
  const upstreamUdp = createSocket('udp4');
  let port = 0;

  beforeAll(async () => {
    upstreamUdp.on('message', (m, from) => {
      const a = answerFrom(ZONE, m, 'udp');
      if (a) upstreamUdp.send(a, from.port, from.address);
    });
    await new Promise<void>((r) => upstreamUdp.bind(0, '127.0.0.1', r));
    const upstreamPort = upstreamUdp.address().port;
    upstreamTcp = createServer(() => undefined);
    await new Promise<void>((r) => upstreamTcp.listen(upstreamPort, '127.0.0.1', r));
    // A port of its own for the resolver: what is free now (port 53 needs root).
    const probe = createServer();
    await new Promise<void>((r) => probe.listen(0, '127.0.0.1', r));
    port = (probe.address() as { port: number }).port;
    await new Promise((r) => probe.close(r));
    resolver = await EgressResolver.start({
      listenAddress: '127.0.0.1', clientAddress: '127.0.0.1', upstream: '127.0.0.1', upstreamPort,
      policy: () => parseEgressPolicy(['allowed.test'], undefined),
      open: async (addresses, timeoutS) => {
        await new Promise((r) => setTimeout(r, 50));
        events.push(`open ${addresses.map(formatIpv4).join(',')} ${timeoutS}s`);
      },
    }, port);
  });

  afterAll(async () => {
    resolver?.close();
    upstreamUdp.close();
    await new Promise((r) => upstreamTcp.close(r));
  });

  const tcpAsk = (payload: Buffer): Promise<{ answer?: Buffer; closed: boolean }> =>
    new Promise((resolve) => {
      const s = connect(port, '127.0.0.1');
      let got = Buffer.alloc(0);
      const end = (closed: boolean) => {
        s.destroy();
        resolve({ answer: got.length >= 2 ? got.subarray(2, 2 + got.readUInt16BE(0)) : undefined, closed });
      };
      s.on('data', (d: Buffer) => {
        got = Buffer.concat([got, d]);
        if (got.length >= 2 && got.length >= 2 + got.readUInt16BE(0)) {
          events.push('answer');
          end(false);
        }
      });
      s.on('close', () => end(true));
      s.on('error', () => undefined);
      s.write(payload);
      setTimeout(() => end(false), 3000);
    });

  it('answers a query over TCP, having opened its address first', async () => {
    events.length = 0;
    const r = await tcpAsk(framed(query('allowed.test', 42)));
    const p = dnsPacket.decode(r.answer!);
    expect(p.id).toBe(42);
    expect(p.answers!.map((a) => (a as { data: string }).data)).toEqual(['192.0.2.10']);
    expect(events).toEqual(['open 192.0.2.10 120s', 'answer']);
  });

  it('closes a TCP connection that announces a message larger than a query, without an answer', async () => {
    const before = resolver.stats.dropped;
    const big = Buffer.alloc(2 + MAX_QUERY_BYTES + 1);
    big.writeUInt16BE(MAX_QUERY_BYTES + 1, 0);
    expect(await tcpAsk(big)).toEqual({ answer: undefined, closed: true });
    expect(resolver.stats.dropped).toBe(before + 1);
  });

  it(`takes at most ${MAX_TCP_CONNECTIONS} TCP connections at once: the next is closed, and it answers again once they go`, async () => {
    const held: Socket[] = [];
    for (let i = 0; i < MAX_TCP_CONNECTIONS; i++) {
      const s = connect(port, '127.0.0.1');
      await new Promise((r) => s.once('connect', r));
      held.push(s);
    }
    await new Promise((r) => setTimeout(r, 100));
    expect(await tcpAsk(framed(query('allowed.test')))).toEqual({ answer: undefined, closed: true });
    for (const s of held) s.destroy();
    await new Promise((r) => setTimeout(r, 100));
    expect((await tcpAsk(framed(query('allowed.test')))).answer).toBeDefined();
  });

  it('refuses an unlisted name over UDP, and drops a datagram from another address than the guest', async () => {
    const ask = (from: string, m: Buffer) =>
      new Promise<Buffer | undefined>((resolve) => {
        const s = createSocket('udp4');
        const done = (v: Buffer | undefined) => {
          clearTimeout(t);
          s.close();
          resolve(v);
        };
        const t = setTimeout(() => done(undefined), 1000);
        s.on('message', (a) => done(a));
        s.bind(0, from, () => s.send(m, port, '127.0.0.1'));
      });
    const refused = await ask('127.0.0.1', query('elsewhere.test', 9));
    expect(dnsPacket.decode(refused!)).toMatchObject({ id: 9, rcode: 'REFUSED' });
    const before = resolver.stats.dropped;
    expect(await ask('127.0.0.2', query('allowed.test'))).toBeUndefined();
    expect(resolver.stats.dropped).toBe(before + 1);
  });
});
