/**
 * An authoritative DNS server for tests, run inside a network namespace a test made
 * (`ip netns exec NS node dns-test-server.js ADDRESS ZONE_JSON`): UDP and TCP port 53 on ADDRESS,
 * answering from ZONE (name -> records) and nothing else (NXDOMAIN). It prints `ready` once both
 * listen. What a zone entry can ask for, besides records:
 * - `wrongId`: every answer over UDP carries another id (a spoofed answer);
 * - `wrongQuestion`: every answer names another question;
 * - `truncateUdp`: over UDP only a truncated (TC) empty answer, the records over TCP.
 */
import { createSocket } from 'node:dgram';
import { createServer } from 'node:net';
import * as dnsPacket from 'dns-packet';

export interface ZoneEntry {
  A?: string[];
  CNAME?: string;
  ttl?: number;
  wrongId?: boolean;
  wrongQuestion?: boolean;
  truncateUdp?: boolean;
}

export type Zone = Record<string, ZoneEntry>;

/** The answer to `query` from `zone`, or undefined for a message that is no query. */
export function answerFrom(zone: Zone, query: Buffer, transport: 'udp' | 'tcp'): Buffer | undefined {
  let q: dnsPacket.DecodedPacket;
  try {
    q = dnsPacket.decode(query);
  } catch {
    return undefined;
  }
  const question = q.questions?.[0];
  if (!question) return undefined;
  const answers: dnsPacket.Answer[] = [];
  let entry: ZoneEntry | undefined;
  let rcode = 0;
  for (let name = question.name.toLowerCase(), hops = 0; hops < 16; hops++) {
    const e = zone[name];
    entry ??= e;
    if (!e) {
      if (hops === 0) rcode = 3;
      break;
    }
    if (e.CNAME) {
      answers.push({ type: 'CNAME', name, ttl: e.ttl ?? 60, class: 'IN', data: e.CNAME });
      name = e.CNAME;
      continue;
    }
    if (question.type === 'A') for (const a of e.A ?? []) answers.push({ type: 'A', name, ttl: e.ttl ?? 60, class: 'IN', data: a });
    break;
  }
  const truncated = transport === 'udp' && entry?.truncateUdp;
  return dnsPacket.encode({
    type: 'response',
    id: entry?.wrongId ? (q.id! + 1) % 65536 : q.id,
    flags: dnsPacket.AUTHORITATIVE_ANSWER | rcode | (truncated ? dnsPacket.TRUNCATED_RESPONSE : 0),
    questions: [entry?.wrongQuestion ? { ...question, name: `other.${question.name}` } : question],
    answers: truncated ? [] : answers,
  });
}

function main(): void {
  const [address, zoneJson] = process.argv.slice(2);
  const zone = JSON.parse(zoneJson) as Zone;
  const udp = createSocket('udp4');
  udp.on('message', (m, from) => {
    const a = answerFrom(zone, m, 'udp');
    if (a) udp.send(a, from.port, from.address);
  });
  const tcp = createServer((c) => {
    let buf = Buffer.alloc(0);
    c.on('error', () => undefined);
    c.on('data', (d: Buffer) => {
      buf = Buffer.concat([buf, d]);
      while (buf.length >= 2 && buf.length >= 2 + buf.readUInt16BE(0)) {
        const a = answerFrom(zone, buf.subarray(2, 2 + buf.readUInt16BE(0)), 'tcp');
        buf = buf.subarray(2 + buf.readUInt16BE(0));
        if (!a) return c.destroy();
        const framed = Buffer.alloc(2);
        framed.writeUInt16BE(a.length, 0);
        c.write(Buffer.concat([framed, a]));
      }
    });
  });
  let up = 0;
  const ready = () => ++up === 2 && console.log('ready');
  udp.bind(53, address, ready);
  tcp.listen(53, address, ready);
}

if (require.main === module) main();
