// Hostname egress rules on pvisor's real host side, without a VM: as root, in network namespaces
// this test makes and deletes (the host's own network is not touched). "Outside" is a namespace
// behind a veth pair (198.18.0.0/24, never routed anywhere) with an authoritative DNS server
// (test/dns-test-server.ts) and a TCP server on every address; test/egress-tap-guest.ts sets up a
// 'nat' VM's host side with allow and deny lists and plays its guest with raw frames on the TAP.
// Skipped, saying why in its name, without root, /dev/net/tun, nft or ip.
import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import type { EgressGuestOptions } from '../egress-tap-guest';
import type { Zone } from '../dns-test-server';
import { MAX_ELEMENT_TTL_S, MIN_ELEMENT_TTL_S } from '../../src/network/egress-set';
import { QUERIES_PER_SECOND, QUERY_BURST } from '../../src/network/egress-resolver';

const HOST_NS = `pvt-egress-${process.pid}`;
const OUTSIDE_NS = `pvt-egout-${process.pid}`;
const UPSTREAM = '198.18.0.2';
const TCP_PORT = 8080;
const ZONE: Zone = {
  'allowed.test': { A: ['198.18.0.2'], ttl: 5 },
  'denied.test': { A: ['198.18.0.3'] },
  'www.wild.test': { CNAME: 'edge.cdn.test' },
  'edge.cdn.test': { A: ['198.18.0.4'], ttl: 7200 },
  'bad.wild.test': { A: ['198.18.0.5'] },
  'via-denied.wild.test': { CNAME: 'denied.test' },
  'wrongid.wild.test': { A: ['198.18.0.6'], wrongId: true },
  'wrongq.wild.test': { A: ['198.18.0.6'], wrongQuestion: true },
  'big.wild.test': { A: Array.from({ length: 30 }, (_, i) => `198.18.1.${i + 1}`), truncateUdp: true },
};
const options: EgressGuestOptions = { upstream: UPSTREAM, allow: ['allowed.test', '*.wild.test'], deny: ['denied.test', 'bad.wild.test'], tcpPort: TCP_PORT };
const OUTSIDE_TCP = `require('net').createServer((s) => s.on('error', () => {}).end('outside')).listen(${TCP_PORT}, '0.0.0.0', () => console.log('ready'));`;

function missing(): string | undefined {
  if (process.getuid?.() !== 0) return 'not root';
  if (!existsSync('/dev/net/tun')) return 'no /dev/net/tun';
  if (spawnSync('nft', ['--version']).status !== 0) return 'no nft (Debian package nftables)';
  if (spawnSync('ip', ['-V']).status !== 0) return 'no ip (Debian package iproute2)';
  return undefined;
}

function sh(cmd: string): string {
  const r = spawnSync('sh', ['-c', cmd], { encoding: 'utf8' });
  if (r.status !== 0) throw new Error(`${cmd}: ${r.stderr || r.stdout}`);
  return r.stdout;
}

function startInOutside(args: string[]): Promise<ChildProcess> {
  const child = spawn('ip', ['netns', 'exec', OUTSIDE_NS, process.execPath, ...args], { stdio: ['ignore', 'pipe', 'inherit'] });
  return new Promise((resolve, reject) => {
    let out = '';
    child.stdout!.on('data', (d) => (out += d).includes('ready') && resolve(child));
    child.once('exit', (code) => reject(new Error(`${args[0]} exited (${code})`)));
  });
}

const why = missing();

(why ? describe.skip : describe)(`hostname egress rules, resolver and nft set, from raw frames${why ? ` (skipped: ${why})` : ''}`, () => {
  const children: ChildProcess[] = [];
  let r: any;

  beforeAll(async () => {
    for (const ns of [HOST_NS, OUTSIDE_NS]) spawnSync('ip', ['netns', 'delete', ns]);
    sh(`ip netns add ${HOST_NS} && ip netns add ${OUTSIDE_NS} &&
        ip -n ${HOST_NS} link add pvh0 type veth peer name pvo0 netns ${OUTSIDE_NS} &&
        ip -n ${HOST_NS} addr add 198.18.0.1/24 dev pvh0 && ip -n ${HOST_NS} link set pvh0 up && ip -n ${HOST_NS} link set lo up &&
        for a in 2 3 4 5 6; do ip -n ${OUTSIDE_NS} addr add 198.18.0.$a/24 dev pvo0; done &&
        ip -n ${OUTSIDE_NS} addr add 198.18.1.1/24 dev pvo0 &&
        ip -n ${OUTSIDE_NS} link set pvo0 up && ip -n ${OUTSIDE_NS} link set lo up`);
    children.push(await startInOutside([join(__dirname, '..', 'dns-test-server.js'), UPSTREAM, JSON.stringify(ZONE)]));
    children.push(await startInOutside(['-e', OUTSIDE_TCP]));
    const run = spawnSync('ip', ['netns', 'exec', HOST_NS, process.execPath, join(__dirname, '..', 'egress-tap-guest.js'), JSON.stringify(options)], { encoding: 'utf8', timeout: 120_000 });
    const last = run.stdout.trim().split('\n').pop();
    if (!last?.startsWith('{')) throw new Error(`egress-tap-guest printed no report (status ${run.status}, signal ${run.signal}): ${run.stderr}`);
    r = JSON.parse(last);
    if (process.env.PVISOR_EGRESS_REPORT) require('node:fs').writeFileSync(process.env.PVISOR_EGRESS_REPORT, last);
  }, 150_000);

  afterAll(() => {
    for (const c of children) c.kill();
    for (const ns of [HOST_NS, OUTSIDE_NS]) spawnSync('ip', ['netns', 'delete', ns]);
  });

  it("gives the guest pvisor's resolver on the TAP's host end, asking the upstream, with an empty set that has timeouts and a size", () => {
    expect(r.setup.info).toMatchObject({ mode: 'nat', dns: r.setup.info.hostAddress, upstreamDns: UPSTREAM, allow: options.allow, deny: options.deny });
    expect(r.setup.setDeclaration).toMatch(/type ipv4_addr\s+size 4096\s+flags timeout/);
    expect(r.before).toEqual({ reachAllowedAddress: 'none', set: {} });
  });

  it('answers an allowed name and opens exactly its address, for its TTL bounded below; refuses denied and unlisted names', () => {
    // From the guest's query to its answer: the upstream's round trip and one nft run for the set.
    console.log(`allowed.test answered in ${r.names['allowed.test'].elapsedMs} ms (set opened first); refused in ${r.names['unlisted.test'].elapsedMs} ms`);
    expect(r.names['allowed.test']).toMatchObject({ rcode: 'NOERROR', idMatches: true, addresses: ['198.18.0.2'], ttls: [5] });
    expect(r.names['ALLOWED.test.']).toMatchObject({ rcode: 'NOERROR', addresses: ['198.18.0.2'] });
    for (const n of ['denied.test', 'unlisted.test', 'bad.wild.test']) expect(r.names[n]).toMatchObject({ rcode: 'REFUSED', addresses: [] });
    expect(r.names['missing.wild.test']).toMatchObject({ rcode: 'NXDOMAIN', addresses: [] });
    expect(Object.keys(r.set).sort()).toEqual(['198.18.0.2', '198.18.0.4']);
    // TTL 5 opens for the minimum; nft rounds what is left down to whole seconds.
    expect(r.set['198.18.0.2']).toBeLessThanOrEqual(MIN_ELEMENT_TTL_S);
    expect(r.set['198.18.0.2']).toBeGreaterThan(MIN_ELEMENT_TTL_S - 10);
    expect(r.reachAfter).toEqual({ allowed: 'syn-ack', denied: 'none', cnameTarget: 'syn-ack', badWild: 'none' });
  });

  it('follows a CNAME chain to its addresses (the smallest TTL of the chain, bounded above), and refuses a chain through a denied name', () => {
    expect(r.names['www.wild.test']).toMatchObject({ rcode: 'NOERROR', cnames: ['edge.cdn.test'], addresses: ['198.18.0.4'], ttls: [60, 60] });
    expect(r.set['198.18.0.4']).toBeLessThanOrEqual(60);
    expect(r.set['198.18.0.4']).toBeLessThan(MAX_ELEMENT_TTL_S);
    expect(r.names['via-denied.wild.test']).toMatchObject({ rcode: 'REFUSED', addresses: [] });
  });

  it("checks the upstream's answers (id, question), and asks it over TCP for an answer too large for UDP", () => {
    expect(r.upstream.wrongId).toMatchObject({ rcode: 'SERVFAIL', addresses: [] });
    expect(r.upstream.wrongId.elapsedMs).toBeGreaterThanOrEqual(1900); // the spoofed answer was not taken
    expect(r.upstream.wrongQuestion).toMatchObject({ rcode: 'SERVFAIL', addresses: [] });
    expect(r.stats.badUpstream).toBeGreaterThanOrEqual(2);
    expect(r.upstream.bigWithEdns.rcode).toBe('NOERROR');
    // 30 A records: about 900 bytes, as dns-packet writes no compressed names.
    expect(r.upstream.bigWithEdns.addresses).toHaveLength(30);
    // Without EDNS the guest gets 512 bytes at most: truncated, to ask again over TCP.
    expect(r.upstream.bigWithoutEdns).toMatchObject({ rcode: 'NOERROR', truncated: true, addresses: [] });
    // Asked again over TCP (to pvisor's resolver, as a guest does), it gets them all; the rules hold there too.
    expect(r.upstream.bigOverTcp).toMatchObject({ rcode: 'NOERROR', truncated: false, idMatches: true });
    expect(r.upstream.bigOverTcp.addresses).toHaveLength(30);
    expect(r.upstream.deniedOverTcp).toMatchObject({ rcode: 'REFUSED', addresses: [] });
  });

  it('drops oversized, malformed and non-query messages without an answer, and goes on answering', () => {
    expect(r.hostile).toEqual({ oversized: false, isResponse: false, twoQuestions: false, badPointer: false, garbage: false, empty: false });
    expect(r.afterHostile).toMatchObject({ rcode: 'NOERROR' });
    expect(r.stats.dropped).toBeGreaterThanOrEqual(5);
  });

  it('limits the rate of a flood of queries per VM, and answers again once it is over', () => {
    const { answered, seconds, stats } = r.flood;
    console.log(`flood: 400 queries, ${answered} answered in ${seconds.toFixed(1)} s; limited ${stats.limited}`);
    // Some are answered all the same (the burst, less what waits on the upstream beyond MAX_IN_FLIGHT).
    expect(answered).toBeGreaterThanOrEqual(20);
    expect(answered).toBeLessThanOrEqual(QUERY_BURST + QUERIES_PER_SECOND * seconds + 5);
    expect(stats.limited).toBeGreaterThanOrEqual(400 - answered - 5);
    expect(r.afterFlood).toMatchObject({ rcode: 'NOERROR', addresses: ['198.18.0.2'] });
  });

  it('update replaces the rules at runtime: addresses no longer allowed are closed, newly allowed names open; a bad list changes nothing', () => {
    const u = r.afterUpdate;
    console.log(`update took ${r.updateMs} ms`);
    expect(u.info).toEqual({ allow: ['denied.test'], deny: [] });
    expect(u.set).toEqual({});
    expect(u.allowed).toMatchObject({ rcode: 'REFUSED' });
    expect(u.reachAllowed).toBe('none');
    expect(u.denied).toMatchObject({ rcode: 'NOERROR', addresses: ['198.18.0.3'] });
    expect(Object.keys(u.setAfterDenied)).toEqual(['198.18.0.3']);
    expect(u.reachDenied).toBe('syn-ack');
    expect(u.egressChain).toContain('ip daddr @hosts accept');
    // A CIDR deny wins over the name's allow: the address is neither answered nor opened.
    expect(r.afterCidrDeny).toMatchObject({ set: {}, denied: { rcode: 'NOERROR', addresses: [] }, reachDenied: 'none' });
    expect(r.badUpdate).toMatch(/^InvalidOptionError: network\.update\.allow\[1\]: "bad\.\.name"/);
    expect(r.afterBadUpdate).toEqual({ allow: ['denied.test'] });
  });

  it('close stops the resolver and removes the tables', () => {
    expect(r.teardown.problem).toBeUndefined();
    expect(r.teardown.tables).not.toMatch(/pvisor_/);
    expect(r.teardown.udp53).toBe(false);
  });

  it('a DNS server already on every address\'s port 53 fails the setup with a NetworkSetupError naming the conflict, and nothing is left', () => {
    expect(r.portTaken).toMatch(/^NetworkSetupError: .*cannot listen on 10\.200\.[0-9.]+:53, which another DNS server holds/);
    expect(r.afterPortTaken.tables).not.toMatch(/pvisor_/);
    expect(r.afterPortTaken.links).toEqual([]);
  });
});
