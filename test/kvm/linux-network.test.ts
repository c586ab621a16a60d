// Guest networking and port forwarding on real KVM with the Linux guest, as root (the nested harness's L1 is the
// test's to configure). "Outside" is a network namespace behind a veth pair on this machine
// (198.18.0.0/30, a range kept for tests and never routed): no packet leaves the machine.
import { execFileSync, spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { createServer, get, type Server } from 'node:http';
import { randomBytes } from 'node:crypto';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Vm } from '../../src';
import type { Zone } from '../dns-test-server';

const main = join(__dirname, '..', '..', 'src', 'cli', 'main.js');
const NS = 'pvnet-outside';
const OUTSIDE = '198.18.0.2';
/** A second address of the outside's, for the denied name. */
const OUTSIDE_2 = '198.18.0.6';
const MiB = 2 ** 20;

const sh = (cmd: string) => execFileSync('sh', ['-c', cmd], { encoding: 'utf8' });
const links = () => sh('ip -o link show');
const tables = () => sh('nft list tables');
const ourLinks = () => [...links().matchAll(/^[0-9]+: (pv[0-9]+n[0-9]+)[:@]/gm)].map((m) => m[1]);
/** pvisor's tables, as `FAMILY NAME`. */
const ourTables = () => [...tables().matchAll(/^table (ip|inet|netdev) (pvisor_[0-9]+_[0-9]+)$/gm)].map((m) => `${m[1]} ${m[2]}`).sort();
const fetchBytes = (url: string) =>
  new Promise<Buffer>((resolve, reject) => {
    get(url, (r) => {
      const parts: Buffer[] = [];
      r.on('data', (d: Buffer) => parts.push(d));
      r.on('end', () => (r.statusCode === 200 ? resolve(Buffer.concat(parts)) : reject(new Error(`HTTP ${r.statusCode}`))));
      r.on('error', reject);
    }).on('error', reject);
  });
const rssBytes = () => Number(/^VmRSS:\s+(\d+) kB/m.exec(readFileSync('/proc/self/status', 'utf8'))![1]) * 1024;

async function until(what: string, check: () => boolean, timeoutMs: number): Promise<void> {
  for (const end = Date.now() + timeoutMs; !check();) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

/**
 * A UDP sender as fast as it can (busybox has no UDP sender): the guest's packet flood. It sends
 * for SECONDS, and on until it has sent MINIMUM datagrams, but never for longer than LIMIT seconds:
 * in the nested harness the same guest has sent 768 datagrams in 8 s in one run and 7680 in
 * another, and the flood must be one whatever the emulated machine's speed. Prints how many it
 * sent and in how many seconds.
 */
const FLOOD_C = `
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
int main(int argc, char **argv) {
  int s = socket(AF_INET, SOCK_DGRAM, 0);
  struct sockaddr_in to = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[2])) };
  inet_aton(argv[1], &to.sin_addr);
  static char payload[1400];
  long sent = 0, minimum = atol(argv[4]);
  time_t start = time(NULL), end = start + atoi(argv[3]), limit = start + atoi(argv[5]);
  while ((time(NULL) < end || sent < minimum) && time(NULL) < limit)
    for (int i = 0; i < 256; i++) if (sendto(s, payload, sizeof payload, 0, (struct sockaddr *)&to, sizeof to) > 0) sent++;
  printf("%ld %ld\\n", sent, (long)(time(NULL) - start));
  return 0;
}`;

const describeAsRoot = process.getuid?.() === 0 ? describe : describe.skip;

describeAsRoot('Linux guest networking', () => {
  let outside: ChildProcess;
  let hostServer: Server;
  let work: string;
  beforeAll(async () => {
    work = mkdtempSync(join(tmpdir(), 'pvnet-'));
    spawnSync('ip', ['netns', 'delete', NS]);
    sh(`ip netns add ${NS} && ip link add pvt-host type veth peer name pvt-out && ip link set pvt-out netns ${NS} &&
        ip addr add 198.18.0.1/30 dev pvt-host && ip link set pvt-host up &&
        ip netns exec ${NS} sh -c 'ip addr add ${OUTSIDE}/30 dev pvt-out && ip link set pvt-out up && ip link set lo up'`);
    // The outside's server: says who connected (the NAT's address, not the guest's), on two ports;
    // on a third it echoes the path it was asked for.
    const serve = `for (const p of [8080, 8081]) require('http').createServer((q, r) => r.end('hello ' + p + ' from ' + q.socket.remoteAddress)).listen(p, '${OUTSIDE}', () => console.log('up ' + p));
      require('http').createServer((q, r) => r.end('echo ' + q.url)).listen(8082, '${OUTSIDE}', () => console.log('up 8082'));`;
    outside = spawn('ip', ['netns', 'exec', NS, process.execPath, '-e', serve], { stdio: ['ignore', 'pipe', 'inherit'] });
    let up = '';
    await new Promise<void>((resolve, reject) => {
      outside.stdout!.on('data', (d) => (up += d) && ['8080', '8081', '8082'].every((p) => up.includes(`up ${p}`)) && resolve());
      outside.once('exit', (code) => reject(new Error(`the outside server exited (${code})`)));
    });
    // A server on the host itself, on every address: the guest must not reach it.
    hostServer = createServer((_q, r) => r.end('host')).listen(8090, '0.0.0.0');
    execFileSync('gcc', ['-static', '-O2', '-o', join(work, 'flood'), '-x', 'c', '-'], { input: FLOOD_C });
  }, 60_000);
  afterAll(() => {
    outside?.kill();
    hostServer?.close();
    spawnSync('ip', ['netns', 'delete', NS]);
    spawnSync('ip', ['link', 'delete', 'pvt-host']);
    rmSync(work, { recursive: true, force: true });
  });

  it("'nat' after a SIGKILLed owner: its leftovers are removed, the guest reaches the outside through NAT and not the host; pause detaches", async () => {
    // A pvisor run whose process is killed leaves its table; its TAP goes with its fds.
    const run = spawn(process.execPath, [main, 'run', '--memory', '128MiB', '--vcpus', '1', '--net', 'nat', '--', 'sleep', '600'], { stdio: 'ignore' });
    const pid = run.pid!;
    try {
      await until('the killed run to have its TAP and tables', () => ourLinks().includes(`pv${pid}n0`) && ourTables().includes(`inet pvisor_${pid}_0`), 180_000);
    } finally {
      run.kill('SIGKILL');
    }
    await new Promise((r) => run.once('exit', r));
    await until('the TAP to go with the killed process', () => !ourLinks().includes(`pv${pid}n0`), 10_000);
    expect(ourTables()).toEqual(expect.arrayContaining([`inet pvisor_${pid}_0`, `netdev pvisor_${pid}_0`]));

    const vm = await Vm.start({ memory: '256MiB', vcpus: 1, network: 'nat', bootTimeoutMs: 180_000 });
    try {
      expect(ourTables().filter((t) => t.endsWith(`pvisor_${pid}_0`))).toEqual([]); // removed by this start
      const net = vm.network;
      expect(net).toMatchObject({ mode: 'nat', tap: `pv${process.pid}n0`, allow: 'all', nftTable: `pvisor_${process.pid}_0` });
      expect(net.guestAddress).toMatch(/^10\.200\.[0-9]+\.[0-9]+\/30$/);
      expect(sh(`ip -4 -o addr show dev ${net.tap}`)).toContain(`${net.hostAddress}/30`);
      // IPv6 never came up on the TAP (the shipped guest kernel has no IPv6 at all, and no packet
      // sockets: test/unit/network-hostile-guest.test.ts sends what another guest kernel could).
      expect(readFileSync(`/proc/sys/net/ipv6/conf/${net.tap}/disable_ipv6`, 'utf8').trim()).toBe('1');
      expect(sh(`ip -6 -o addr show dev ${net.tap}`)).toBe('');
      expect(ourTables()).toEqual([`inet ${net.nftTable}`, `netdev ${net.nftTable}`].sort());
      const eth0 = await vm.exec('cat /sys/class/net/eth0/address; ip -4 -o addr show eth0 2>/dev/null || ifconfig eth0');
      expect(eth0.stdout).toContain(net.mac!);
      expect(eth0.stdout).toContain(net.guestAddress!.split('/')[0]);

      // timeout(1), not wget -T: Debian's busybox-static 1.35 wget segfaults with -T.
      const get = (url: string) => vm.exec(['timeout', '10', 'wget', '-q', '-O', '-', url]);
      expect(await get(`http://${OUTSIDE}:8080/`)).toMatchObject({ exitCode: 0, stdout: 'hello 8080 from 198.18.0.1' });
      expect(await get(`http://${OUTSIDE}:8081/`)).toMatchObject({ exitCode: 0, stdout: 'hello 8081 from 198.18.0.1' });
      // The host itself (its TAP end, where a server listens on every address) is not reachable.
      expect((await get(`http://${net.hostAddress}:8090/`)).exitCode).not.toBe(0);

      await vm.pause();
      expect(vm.kvmMachine.networkServing).toBe(false);
      await vm.resume();
      expect(vm.kvmMachine.networkServing).toBe(true);
      expect(await get(`http://${OUTSIDE}:8080/`)).toMatchObject({ exitCode: 0 });
    } finally {
      await vm.stop();
    }
    expect(ourLinks()).toEqual([]);
    expect(ourTables()).toEqual([]);
  }, 400_000);

  it("a 'nat' VM's snapshot: each clone has its own TAP and address, answers on a forwarded port, reaches the outside through NAT, and sees none of the other's traffic", async () => {
    const vm = await Vm.start({ memory: '128MiB', vcpus: 1, network: 'nat', bootTimeoutMs: 180_000 });
    const clones: Vm[] = [];
    try {
      // A server left running in the snapshot serves in every clone.
      await vm.files.write('/tmp/www/id', 'the snapshot');
      expect((await vm.exec('httpd -p 127.0.0.1:8000 -h /tmp/www')).exitCode).toBe(0);
      const dir = join(work, 'nat-snapshot');
      await vm.snapshot(dir);
      const original = vm.network;
      for (let i = 0; i < 2; i++) clones.push(await Vm.restore(dir, { readyTimeoutMs: 120_000 }));
      const nets = clones.map((c) => c.network);
      clones.forEach((c, i) => console.log(`clone ${i}: TAP ${nets[i].tap}, eth0 ${nets[i].guestAddress} via ${nets[i].hostAddress}, MAC ${nets[i].mac}; ready in ${c.restoreInfo!.readyMs.toFixed(0)} ms (agent ${c.restoreInfo!.agentMs.toFixed(0)} ms); the snapshot's: ${original.tap}, ${original.guestAddress}`));
      // Each has a TAP, a /30 and tables of its own, beside the original's; the guest keeps its MAC.
      expect(new Set([original, ...nets].map((n) => n.tap)).size).toBe(3);
      expect(new Set([original, ...nets].map((n) => n.guestAddress)).size).toBe(3);
      for (const n of nets) expect(n).toMatchObject({ mode: 'nat', mac: original.mac, allow: 'all', dns: original.dns });
      expect(ourTables()).toHaveLength(6);

      const get = (c: Vm, url: string) => c.exec(['timeout', '10', 'wget', '-q', '-O', '-', url]);
      for (const [i, c] of clones.entries()) {
        // The guest uses the address the host gave this clone, not the snapshot's.
        const eth0 = await c.exec('cat /sys/class/net/eth0/address; ip addr show eth0; ip route');
        expect(eth0.stdout).toContain(original.mac!);
        expect(eth0.stdout).toContain(`inet ${nets[i].guestAddress}`);
        expect(eth0.stdout).toContain(`default via ${nets[i].hostAddress}`);
        expect(eth0.stdout).not.toContain(`inet ${original.guestAddress}`);
        // The forwarded port reaches this clone's server.
        await c.files.write('/tmp/www/id', `clone ${i}`);
        const f = await c.forward(8000);
        expect((await fetchBytes(`http://127.0.0.1:${f.port}/id`)).toString()).toBe(`clone ${i}`);
        expect(await get(c, `http://${OUTSIDE}:8080/`)).toMatchObject({ exitCode: 0, stdout: 'hello 8080 from 198.18.0.1' });
      }

      // Both at once through NAT: each gets its own answers back.
      const burst = (i: number) => clones[i].exec(['sh', '-c', `for k in 1 2 3 4 5 6 7 8; do timeout 10 wget -q -O - http://${OUTSIDE}:8082/clone${i}-$k; echo; done`]);
      const both = await Promise.all([burst(0), burst(1)]);
      both.forEach((r, i) => expect(r.stdout.trim().split('\n')).toEqual([1, 2, 3, 4, 5, 6, 7, 8].map((k) => `echo /clone${i}-${k}`)));

      // One talks, the other hears nothing: not on its TAP, not on its eth0.
      const tapPackets = (n: typeof original) => Number(readFileSync(`/sys/class/net/${n.tap}/statistics/tx_packets`, 'utf8'));
      const eth0Packets = async (c: Vm) => Number((await c.exec('cat /sys/class/net/eth0/statistics/rx_packets')).stdout);
      for (const [talker, listener] of [[0, 1], [1, 0]]) {
        const before = { tap: tapPackets(nets[listener]), eth0: await eth0Packets(clones[listener]), talker: tapPackets(nets[talker]) };
        expect((await burst(talker)).exitCode).toBe(0);
        const talked = tapPackets(nets[talker]) - before.talker;
        const heard = { tap: tapPackets(nets[listener]) - before.tap, eth0: (await eth0Packets(clones[listener])) - before.eth0 };
        console.log(`clone ${talker} received ${talked} packets on its TAP for 8 requests; clone ${listener}, idle: ${heard.tap} on its TAP, ${heard.eth0} on its eth0`);
        expect(talked).toBeGreaterThanOrEqual(8 * 3);
        // At most an ARP exchange of its own (the host's neighbour entry for it going stale).
        expect(heard.tap).toBeLessThanOrEqual(2);
        expect(heard.eth0).toBeLessThanOrEqual(2);
      }
    } finally {
      for (const c of clones) c.stop();
      vm.stop();
    }
    expect(ourLinks()).toEqual([]);
    expect(ourTables()).toEqual([]);
  }, 300_000);

  it('an allow list reaches only what it lists; a flooding guest is dropped on the host, which stays responsive with bounded memory', async () => {
    const vm = await Vm.start({ memory: '256MiB', vcpus: 1, network: { mode: 'nat', allow: [`${OUTSIDE}/32:8080`] }, bootTimeoutMs: 180_000 });
    try {
      const get = (url: string) => vm.exec(['timeout', '10', 'wget', '-q', '-O', '-', url]);
      expect(await get(`http://${OUTSIDE}:8080/`)).toMatchObject({ exitCode: 0, stdout: 'hello 8080 from 198.18.0.1' });
      expect((await get(`http://${OUTSIDE}:8081/`)).exitCode).not.toBe(0);

      await vm.files.write('/tmp/flood', readFileSync(join(work, 'flood')));
      const tap = vm.network.tap!;
      const rxBefore = Number(readFileSync(`/sys/class/net/${tap}/statistics/rx_packets`, 'utf8'));
      const rssBefore = rssBytes();
      let worstLagMs = 0;
      let last = performance.now();
      const ticker = setInterval(() => {
        const now = performance.now();
        worstLagMs = Math.max(worstLagMs, now - last - 10);
        last = now;
      }, 10);
      let flood;
      try {
        // To a port the policy denies: every packet is the host kernel's to drop.
        // 8 s and at least 2000 datagrams, at most 60 s.
        flood = await vm.exec(['sh', '-c', `chmod +x /tmp/flood && /tmp/flood ${OUTSIDE} 9999 8 2000 60`]);
      } finally {
        clearInterval(ticker);
      }
      const [sent, seconds] = flood.stdout.trim().split(' ').map(Number);
      const rx = Number(readFileSync(`/sys/class/net/${tap}/statistics/rx_packets`, 'utf8')) - rxBefore;
      console.log(`flood: the guest sent ${sent} datagrams in ${seconds} s, the host's TAP took ${rx}; worst event-loop lag ${worstLagMs.toFixed(0)} ms; RSS ${(rssBefore / MiB).toFixed(0)} -> ${(rssBytes() / MiB).toFixed(0)} MiB`);
      expect(flood.exitCode).toBe(0);
      expect(sent).toBeGreaterThan(1000);
      expect(rx).toBeGreaterThan(1000);
      expect(rssBytes() - rssBefore).toBeLessThan(64 * MiB);
      expect(worstLagMs).toBeLessThan(2000);
      // And the VM still works: the allowed destination answers.
      expect(await get(`http://${OUTSIDE}:8080/`)).toMatchObject({ exitCode: 0 });
    } finally {
      await vm.stop();
    }
    expect(ourLinks()).toEqual([]);
    expect(ourTables()).toEqual([]);
    expect(sh('ip -4 -o addr show')).not.toMatch(/inet 10\.200\./);
  }, 300_000);

  it('hostname rules: the guest resolves an allowed name through pvisor\'s resolver and reaches it; a denied name neither by name nor by address; update changes it at runtime; a clone keeps the rules', async () => {
    // The names live on a DNS server in the outside namespace (test/dns-test-server.ts), on a second
    // address there, so that the two names' addresses differ.
    const zone: Zone = { 'allowed.test': { A: [OUTSIDE], ttl: 5 }, 'denied.test': { A: [OUTSIDE_2] }, 'www.alias.test': { CNAME: 'allowed.test' } };
    sh(`ip netns exec ${NS} ip addr add ${OUTSIDE_2}/32 dev pvt-out && ip route add ${OUTSIDE_2}/32 via ${OUTSIDE}`);
    const second = spawn('ip', ['netns', 'exec', NS, process.execPath, '-e', `require('http').createServer((q, r) => r.end('hello 8080 from ' + q.socket.remoteAddress)).listen(8080, '${OUTSIDE_2}', () => console.log('ready'))`], { stdio: ['ignore', 'pipe', 'inherit'] });
    const dns = spawn('ip', ['netns', 'exec', NS, process.execPath, join(__dirname, '..', 'dns-test-server.js'), OUTSIDE, JSON.stringify(zone)], { stdio: ['ignore', 'pipe', 'inherit'] });
    for (const child of [dns, second]) {
      await new Promise<void>((resolve, reject) => {
        child.stdout!.on('data', (d) => String(d).includes('ready') && resolve());
        child.once('exit', (code) => reject(new Error(`a server in the outside exited (${code})`)));
      });
    }
    const vm = await Vm.start({ memory: '128MiB', vcpus: 1, network: { mode: 'nat', allow: ['allowed.test', '*.alias.test'], deny: ['denied.test'], dns: OUTSIDE }, bootTimeoutMs: 180_000 });
    try {
      const net = vm.network;
      expect(net).toMatchObject({ mode: 'nat', dns: net.hostAddress, upstreamDns: OUTSIDE, allow: ['allowed.test', '*.alias.test'], deny: ['denied.test'] });
      expect((await vm.exec('cat /etc/resolv.conf')).stdout).toContain(`nameserver ${net.hostAddress}`);
      const get = (url: string) => vm.exec(['timeout', '10', 'wget', '-q', '-O', '-', url]);
      const lookup = (name: string) => vm.exec(['timeout', '10', 'nslookup', name]);

      // Nothing is open before the guest resolves: the allowed name's address is unreachable too.
      expect((await get(`http://${OUTSIDE}:8080/`)).exitCode).not.toBe(0);
      const allowed = await get('http://allowed.test:8080/');
      expect(allowed).toMatchObject({ exitCode: 0, stdout: 'hello 8080 from 198.18.0.1' });
      expect(sh(`nft list set inet ${net.nftTable} hosts`)).toMatch(new RegExp(`${OUTSIDE.replace(/\./g, '\\.')} timeout 30s`));
      expect((await get('http://www.alias.test:8081/')).stdout).toBe('hello 8081 from 198.18.0.1');
      // The denied name does not resolve, and its address is unreachable all the same.
      const denied = await lookup('denied.test');
      expect(denied.stdout + denied.stderr).not.toContain(OUTSIDE_2);
      expect((await get('http://denied.test:8080/')).exitCode).not.toBe(0);
      expect((await get(`http://${OUTSIDE_2}:8080/`)).exitCode).not.toBe(0);
      expect(sh(`nft list set inet ${net.nftTable} hosts`)).not.toContain(OUTSIDE_2);

      // At runtime: the names swap.
      await vm.network.update({ allow: ['denied.test'], deny: [] });
      expect(vm.network).toMatchObject({ allow: ['denied.test'], deny: [] });
      expect(sh(`nft list set inet ${net.nftTable} hosts`)).not.toContain(`${OUTSIDE} `);
      expect((await get(`http://${OUTSIDE}:8080/`)).exitCode).not.toBe(0);
      expect(await get(`http://denied.test:8080/`)).toMatchObject({ exitCode: 0, stdout: 'hello 8080 from 198.18.0.1' });
      expect((await get('http://allowed.test:8080/')).exitCode).not.toBe(0);
      await expect(vm.network.update({ allow: ['fine.test', 'not a name'] })).rejects.toThrow(/network\.update\.allow\[1\]: "not a name"/);

      // A snapshot carries the rules in force; its clone gets a resolver of its own, on its own TAP.
      const dir = join(work, 'egress-snapshot');
      await vm.snapshot(dir);
      const clone = await Vm.restore(dir, { readyTimeoutMs: 120_000 });
      try {
        const cn = clone.network;
        expect(cn).toMatchObject({ mode: 'nat', allow: ['denied.test'], deny: [], upstreamDns: OUTSIDE, dns: cn.hostAddress });
        expect(cn.hostAddress).not.toBe(net.hostAddress);
        expect((await clone.exec('cat /etc/resolv.conf')).stdout).toContain(`nameserver ${cn.hostAddress}`);
        expect(await clone.exec(['timeout', '10', 'wget', '-q', '-O', '-', 'http://denied.test:8080/'])).toMatchObject({ exitCode: 0, stdout: 'hello 8080 from 198.18.0.1' });
        expect((await clone.exec(['timeout', '10', 'wget', '-q', '-O', '-', 'http://allowed.test:8080/'])).exitCode).not.toBe(0);
      } finally {
        await clone.stop();
      }
    } finally {
      await vm.stop();
      dns.kill();
      second.kill();
    }
    expect(ourLinks()).toEqual([]);
    expect(ourTables()).toEqual([]);
  }, 300_000);

  it("'none' (the default): no network device in the guest, nothing on the host; a forwarded port reaches a guest server all the same", async () => {
    const linksBefore = links().split('\n').length;
    const vm = await Vm.start({ memory: '128MiB', vcpus: 1, bootTimeoutMs: 180_000 });
    let port = 0;
    try {
      expect(vm.network).toEqual({ mode: 'none' });
      expect((await vm.exec('ls /sys/class/net')).stdout.trim()).toBe('lo');
      expect((await vm.exec(['timeout', '10', 'wget', '-q', '-O', '-', `http://${OUTSIDE}:8080/`])).exitCode).not.toBe(0);
      expect(links().split('\n').length).toBe(linksBefore);
      expect(ourTables()).toEqual([]);

      const blob = randomBytes(MiB);
      await vm.files.write('/tmp/www/blob', blob);
      expect((await vm.exec('httpd -p 127.0.0.1:8000 -h /tmp/www')).exitCode).toBe(0);
      const f = await vm.forward(8000);
      port = f.port;
      expect(f).toMatchObject({ host: '127.0.0.1', guestPort: 8000 });
      const got = await fetchBytes(`http://127.0.0.1:${f.port}/blob`);
      expect(got.equals(blob)).toBe(true);
      // Nothing listens on the guest's port 8001: the connection ends, nothing hangs.
      const refused = await vm.forward(8001);
      await expect(fetchBytes(`http://127.0.0.1:${refused.port}/`)).rejects.toThrow();
    } finally {
      await vm.stop();
    }
    await expect(fetchBytes(`http://127.0.0.1:${port}/blob`)).rejects.toThrow(/ECONNREFUSED/);
  }, 200_000);
});
