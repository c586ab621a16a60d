/**
 * Ethernet frames built and read byte by byte, as a guest's virtio-net driver hands them to the
 * host: ARP, IPv4, IPv6, TCP, UDP, ICMP and ICMPv6 with real checksums (a frame with a wrong one
 * would be dropped by the host and prove nothing). Addresses are Buffers (4 or 16 bytes).
 */

export const ETH_IPV4 = 0x0800;
export const ETH_ARP = 0x0806;
export const ETH_IPV6 = 0x86dd;
export const PROTO_ICMP = 1;
export const PROTO_TCP = 6;
export const PROTO_UDP = 17;
export const PROTO_ICMPV6 = 58;
export const TCP_FIN = 1;
export const TCP_SYN = 2;
export const TCP_RST = 4;
export const TCP_PSH = 8;
export const TCP_ACK = 16;
export const ARP_REQUEST = 1;
export const ARP_REPLY = 2;
export const ICMPV6_NEIGHBOR_SOLICIT = 135;
export const ICMPV6_NEIGHBOR_ADVERT = 136;

export function mac(text: string): Buffer {
  return Buffer.from(text.trim().split(':').map((h) => parseInt(h, 16)));
}

export function ipv4(text: string): Buffer {
  return Buffer.from(text.split('.').map(Number));
}

/** An IPv6 address in any of its text forms (`::` included, no embedded IPv4). */
export function ipv6(text: string): Buffer {
  const [head, tail] = text.includes('::') ? text.split('::') : [text, undefined];
  const groups = (s: string | undefined) => (s ? s.split(':').map((g) => parseInt(g, 16)) : []);
  const h = groups(head);
  const t = groups(tail);
  const all = tail === undefined ? h : [...h, ...new Array(8 - h.length - t.length).fill(0), ...t];
  const b = Buffer.alloc(16);
  all.forEach((g, i) => b.writeUInt16BE(g, 2 * i));
  return b;
}

export function formatIp(b: Buffer): string {
  if (b.length === 4) return [...b].join('.');
  return Array.from({ length: 8 }, (_, i) => b.readUInt16BE(2 * i).toString(16)).join(':');
}

/** The fe80:: address a Linux interface with `mac` takes by default (modified EUI-64). */
export function linkLocalOf(m: Buffer): Buffer {
  return Buffer.from([0xfe, 0x80, 0, 0, 0, 0, 0, 0, m[0] ^ 2, m[1], m[2], 0xff, 0xfe, m[3], m[4], m[5]]);
}

function ipv4OrIpv6(b: Buffer): 4 | 6 {
  if (b.length !== 4 && b.length !== 16) throw new RangeError(`not an IP address: ${b.length} bytes`);
  return b.length === 4 ? 4 : 6;
}

function onesComplementSum(parts: Buffer[]): number {
  let sum = 0;
  for (const p of parts) {
    for (let i = 0; i + 1 < p.length; i += 2) sum += p.readUInt16BE(i);
    if (p.length % 2) sum += p[p.length - 1] << 8;
  }
  while (sum > 0xffff) sum = (sum & 0xffff) + (sum >>> 16);
  return ~sum & 0xffff;
}

/** The checksum of an upper-layer `segment` (its checksum field zero) over the pseudo-header. */
function transportChecksum(src: Buffer, dst: Buffer, protocol: number, segment: Buffer): number {
  const pseudo = Buffer.alloc(src.length === 4 ? 12 : 40);
  src.copy(pseudo, 0);
  dst.copy(pseudo, src.length);
  if (src.length === 4) {
    pseudo[9] = protocol;
    pseudo.writeUInt16BE(segment.length, 10);
  } else {
    pseudo.writeUInt32BE(segment.length, 32);
    pseudo[39] = protocol;
  }
  return onesComplementSum([pseudo, segment]);
}

export function ethernet(dst: Buffer, src: Buffer, etherType: number, payload: Buffer): Buffer {
  const h = Buffer.alloc(14);
  dst.copy(h, 0);
  src.copy(h, 6);
  h.writeUInt16BE(etherType, 12);
  return Buffer.concat([h, payload]);
}

export function arp(op: number, senderMac: Buffer, senderIp: Buffer, targetMac: Buffer, targetIp: Buffer): Buffer {
  const b = Buffer.alloc(28);
  b.writeUInt16BE(1, 0); // Ethernet
  b.writeUInt16BE(ETH_IPV4, 2);
  b[4] = 6;
  b[5] = 4;
  b.writeUInt16BE(op, 6);
  senderMac.copy(b, 8);
  senderIp.copy(b, 14);
  targetMac.copy(b, 18);
  targetIp.copy(b, 24);
  return b;
}

/** An IP packet of either version, by the length of `src`. */
export function ip(src: Buffer, dst: Buffer, protocol: number, payload: Buffer): Buffer {
  if (ipv4OrIpv6(src) === 4) {
    const h = Buffer.alloc(20);
    h[0] = 0x45;
    h.writeUInt16BE(20 + payload.length, 2);
    h.writeUInt16BE(0x4000, 6); // DF
    h[8] = 64;
    h[9] = protocol;
    src.copy(h, 12);
    dst.copy(h, 16);
    h.writeUInt16BE(onesComplementSum([h]), 10);
    return Buffer.concat([h, payload]);
  }
  const h = Buffer.alloc(40);
  h.writeUInt32BE(0x60000000, 0);
  h.writeUInt16BE(payload.length, 4);
  h[6] = protocol;
  h[7] = protocol === PROTO_ICMPV6 ? 255 : 64; // neighbour discovery needs 255
  src.copy(h, 8);
  dst.copy(h, 24);
  return Buffer.concat([h, payload]);
}

export interface TcpFields {
  sport: number;
  dport: number;
  seq: number;
  ack: number;
  flags: number;
  data?: Buffer;
}

export function tcp(src: Buffer, dst: Buffer, f: TcpFields): Buffer {
  const data = f.data ?? Buffer.alloc(0);
  const s = Buffer.alloc(20 + data.length);
  s.writeUInt16BE(f.sport, 0);
  s.writeUInt16BE(f.dport, 2);
  s.writeUInt32BE(f.seq >>> 0, 4);
  s.writeUInt32BE(f.ack >>> 0, 8);
  s[12] = 5 << 4;
  s[13] = f.flags;
  s.writeUInt16BE(64240, 14);
  data.copy(s, 20);
  s.writeUInt16BE(transportChecksum(src, dst, PROTO_TCP, s), 16);
  return s;
}

export function udp(src: Buffer, dst: Buffer, sport: number, dport: number, data: Buffer): Buffer {
  const s = Buffer.alloc(8 + data.length);
  s.writeUInt16BE(sport, 0);
  s.writeUInt16BE(dport, 2);
  s.writeUInt16BE(s.length, 4);
  data.copy(s, 8);
  s.writeUInt16BE(transportChecksum(src, dst, PROTO_UDP, s) || 0xffff, 6);
  return s;
}

/** An ICMP (IPv4) message: type, code, then `rest` (the 4 bytes after the checksum and what follows). */
export function icmp(type: number, code: number, rest: Buffer): Buffer {
  const m = Buffer.concat([Buffer.from([type, code, 0, 0]), rest]);
  m.writeUInt16BE(onesComplementSum([m]), 2);
  return m;
}

export function icmpv6(src: Buffer, dst: Buffer, type: number, code: number, body: Buffer): Buffer {
  const m = Buffer.concat([Buffer.from([type, code, 0, 0]), body]);
  m.writeUInt16BE(transportChecksum(src, dst, PROTO_ICMPV6, m), 2);
  return m;
}

/** A neighbour advertisement (solicited, override) for `target` at `targetMac`. */
export function neighbourAdvert(src: Buffer, dst: Buffer, target: Buffer, targetMac: Buffer): Buffer {
  const body = Buffer.concat([Buffer.from([0x60, 0, 0, 0]), target, Buffer.from([2, 1]), targetMac]);
  return icmpv6(src, dst, ICMPV6_NEIGHBOR_ADVERT, 0, body);
}

/** What a frame holds, as far as these tests look. */
export interface Frame {
  dstMac: Buffer;
  srcMac: Buffer;
  etherType: number;
  arp?: { op: number; senderMac: Buffer; senderIp: Buffer; targetIp: Buffer };
  ip?: { version: 4 | 6; src: Buffer; dst: Buffer; protocol: number };
  tcp?: TcpFields & { data: Buffer };
  udp?: { sport: number; dport: number; data: Buffer };
  /** ICMP or ICMPv6: type, code and the bytes after the checksum. */
  icmp?: { type: number; code: number; body: Buffer };
}

/** Reads a frame; what is too short to hold a header is left out rather than trusted. */
export function parseFrame(b: Buffer): Frame {
  const f: Frame = { dstMac: b.subarray(0, 6), srcMac: b.subarray(6, 12), etherType: b.length >= 14 ? b.readUInt16BE(12) : 0 };
  const p = b.subarray(14);
  if (f.etherType === ETH_ARP && p.length >= 28) {
    f.arp = { op: p.readUInt16BE(6), senderMac: p.subarray(8, 14), senderIp: p.subarray(14, 18), targetIp: p.subarray(24, 28) };
    return f;
  }
  let l4: Buffer;
  if (f.etherType === ETH_IPV4 && p.length >= 20) {
    const ihl = (p[0] & 15) * 4;
    f.ip = { version: 4, src: p.subarray(12, 16), dst: p.subarray(16, 20), protocol: p[9] };
    l4 = p.subarray(ihl, Math.min(p.length, p.readUInt16BE(2)));
  } else if (f.etherType === ETH_IPV6 && p.length >= 40) {
    f.ip = { version: 6, src: p.subarray(8, 24), dst: p.subarray(24, 40), protocol: p[6] };
    l4 = p.subarray(40, 40 + p.readUInt16BE(4));
  } else {
    return f;
  }
  if (f.ip.protocol === PROTO_TCP && l4.length >= 20) {
    f.tcp = { sport: l4.readUInt16BE(0), dport: l4.readUInt16BE(2), seq: l4.readUInt32BE(4), ack: l4.readUInt32BE(8), flags: l4[13], data: l4.subarray((l4[12] >> 4) * 4) };
  } else if (f.ip.protocol === PROTO_UDP && l4.length >= 8) {
    f.udp = { sport: l4.readUInt16BE(0), dport: l4.readUInt16BE(2), data: l4.subarray(8) };
  } else if ((f.ip.protocol === PROTO_ICMP || f.ip.protocol === PROTO_ICMPV6) && l4.length >= 4) {
    f.icmp = { type: l4[0], code: l4[1], body: l4.subarray(4) };
  }
  return f;
}
