#!/usr/bin/env node
// Measures guest networking (docs/networking.md): TCP throughput guest -> outside and outside ->
// guest through 'nat', against the same transfer between two host processes; a small request's
// latency; the VMM's RSS during a stream. As root, on a host whose KVM runs the Linux guest:
//   node scripts/with-kvm.js --linux node scripts/measure-network.js [MiB]
// "Outside" is a network namespace behind a veth pair on this machine (198.18.0.0/30): nothing
// leaves the machine. Needs `npx tsc -p tsconfig.json` first.
'use strict';
const { execFileSync, spawn, spawnSync } = require('node:child_process');
const net = require('node:net');
const { readFileSync } = require('node:fs');
const { Vm } = require('../dist/src');

const NS = 'pvnet-measure';
const OUTSIDE = '198.18.0.2';
const MIB = 2 ** 20;
const sizeMiB = Number(process.argv[2] ?? 64);
const sh = (cmd) => execFileSync('sh', ['-c', cmd], { encoding: 'utf8' });
const collect = (stream) => new Promise((resolve) => { let text = ''; stream.on('data', (d) => (text += d)).on('end', () => resolve(text)); });
const rss = () => Number(/^VmRSS:\s+(\d+) kB/m.exec(readFileSync('/proc/self/status', 'utf8'))[1]) * 1024;

// In the namespace: 9000 counts what it is sent and reports the rate of each connection on
// stdout; 9001 sends sizeMiB and reports the rate once the peer has read it all and closed; 9002
// answers a connection's first bytes with them and closes (latency).
const SERVER = `
const net = require('net'); const n = ${sizeMiB} * 2 ** 20; const chunk = Buffer.alloc(2 ** 20);
net.createServer((s) => { let got = 0, t0; s.on('data', (d) => { t0 ??= process.hrtime.bigint(); got += d.length; });
  s.on('end', () => { const ms = Number(process.hrtime.bigint() - t0) / 1e6; console.log(JSON.stringify({ sink: got, ms })); s.end(); }); }).listen(9000, '${OUTSIDE}');
// allowHalfOpen: the guest's nc shuts its write side down at once (its stdin is empty); the
// server must go on sending.
net.createServer({ allowHalfOpen: true }, (s) => { const t0 = process.hrtime.bigint(); let sent = 0;
  const more = () => { while (sent < n) { sent += chunk.length; if (!s.write(chunk)) return s.once('drain', more); } s.end(); }; more();
  s.on('close', () => console.log(JSON.stringify({ source: sent, ms: Number(process.hrtime.bigint() - t0) / 1e6 }))); s.on('error', () => {}); }).listen(9001, '${OUTSIDE}');
net.createServer((s) => s.on('data', (d) => s.end(d))).listen(9002, '${OUTSIDE}', () => console.log(JSON.stringify({ up: true })));`;

async function main() {
  spawnSync('ip', ['netns', 'delete', NS]);
  spawnSync('ip', ['link', 'delete', 'pvm-host']);
  sh(`ip netns add ${NS} && ip link add pvm-host type veth peer name pvm-out && ip link set pvm-out netns ${NS} &&
      ip addr add 198.18.0.1/30 dev pvm-host && ip link set pvm-host up &&
      ip netns exec ${NS} sh -c 'ip addr add ${OUTSIDE}/30 dev pvm-out && ip link set pvm-out up && ip link set lo up'`);
  const server = spawn('ip', ['netns', 'exec', NS, process.execPath, '-e', SERVER], { stdio: ['ignore', 'pipe', 'inherit'] });
  const reports = [];
  let waiting;
  let buf = '';
  server.stdout.on('data', (d) => {
    buf += d;
    for (let i; (i = buf.indexOf('\n')) >= 0;) {
      reports.push(JSON.parse(buf.slice(0, i)));
      buf = buf.slice(i + 1);
      waiting?.();
    }
  });
  const next = () => new Promise((r) => (reports.length ? r(reports.shift()) : (waiting = () => { waiting = undefined; r(reports.shift()); })));
  await next(); // up
  const mibps = (r) => ((r.sink ?? r.source) / MIB / (r.ms / 1000)).toFixed(1);
  const out = new Proxy({}, { set(o, k, v) { o[k] = v; console.error(`measure: ${String(k)} = ${JSON.stringify(v)}`); return true; } });
  try {
    // Two host processes: this one and the server, across the same veth.
    await new Promise((resolve) => {
      const s = net.connect(9000, OUTSIDE, () => {
        const chunk = Buffer.alloc(MIB);
        let sent = 0;
        const more = () => { while (sent < sizeMiB) { sent++; if (!s.write(chunk)) return s.once('drain', more); } s.end(); };
        more();
      });
      s.on('close', resolve);
      s.resume();
    });
    out.hostToOutside = mibps(await next());
    await new Promise((resolve) => net.connect(9001, OUTSIDE).on('close', resolve).resume());
    out.outsideToHost = mibps(await next());

    const vm = await Vm.start({ memory: '512MiB', vcpus: 1, network: 'nat', bootTimeoutMs: 180_000 });
    try {
      let peak = 0;
      const before = rss();
      const sampler = setInterval(() => (peak = Math.max(peak, rss())), 50);
      const up = await vm.exec(['sh', '-c', `dd if=/dev/zero bs=65536 count=${sizeMiB * 16} 2>/dev/null | nc ${OUTSIDE} 9000`]);
      out.guestToOutside = mibps(await next());
      const down = await vm.exec(['sh', '-c', `nc ${OUTSIDE} 9001 | wc -c`]);
      out.outsideToGuest = mibps(await next());
      clearInterval(sampler);
      if (up.exitCode !== 0 || Number(down.stdout.trim()) !== sizeMiB * MIB) throw new Error(`transfer failed: ${JSON.stringify({ up, down })}`);
      out.vmmRssMiB = { beforeStreams: (before / MIB).toFixed(0), peakDuringStreams: (peak / MIB).toFixed(0) };
      // Small requests: 20 connections that each send a line and wait for its echo, from the
      // guest (busybox nc: a process each, so the same loop spawning a process without the
      // network is measured beside it) and from this host process.
      const rounds = 20;
      const timed = async (body) => {
        const t0 = performance.now();
        const r = await vm.exec(['sh', '-c', `i=0; while [ $i -lt ${rounds} ]; do ${body}; i=$((i+1)); done`]);
        if (r.exitCode !== 0) throw new Error(`${body}: ${JSON.stringify(r)}`);
        return Math.round(((performance.now() - t0) / rounds) * 1000);
      };
      out.guestConnectRequestUs = await timed(`echo x | nc -w 2 ${OUTSIDE} 9002 >/dev/null`);
      out.guestSameLoopWithoutNetworkUs = await timed('echo x | cat >/dev/null');
      const t0 = performance.now();
      for (let i = 0; i < rounds; i++) {
        await new Promise((resolve) => { const s = net.connect(9002, OUTSIDE, () => s.end('x\n')); s.on('data', () => {}); s.on('close', resolve); });
      }
      out.hostConnectRequestUs = Math.round(((performance.now() - t0) / rounds) * 1000);

      // Through a forwarded port (the agent channel, no network): host -> guest and guest -> host,
      // against the same transfers between two host processes (this one and the server) above.
      const fwMiB = Math.max(1, Math.floor(sizeMiB / 2));
      // A guest listener, once busybox netstat shows it listening (a forwarded connection that
      // comes first finds nothing and is reset).
      const listen = async (cmd, port) => {
        const p = vm.spawn(['sh', '-c', cmd]);
        for (let i = 0; i < 50; i++) {
          if ((await vm.exec(['sh', '-c', `netstat -tln | grep -q ':${port} '`])).exitCode === 0) return p;
          await new Promise((r) => setTimeout(r, 200));
        }
        throw new Error(`the guest's listener on ${port} did not come up`);
      };
      // Host -> guest. The sink is busybox nc, which exits when the connection ends but shuts its
      // own write side down at EOF of its stdin, and the forwarding nc ends as soon as its server
      // half-closes: so the sink's stdin must stay open without being a pipeline that outlives
      // nc (`sleep | nc` waited for the sleep). A fifo that a background sleep holds open does
      // that; the sink counts what it got (wc -c) and the sleep is killed once nc is gone.
      const sinkProc = await listen(
        'rm -f /tmp/fw-in && mkfifo /tmp/fw-in && { sleep 1000 >/tmp/fw-in & s=$!; nc -l -p 7000 </tmp/fw-in | wc -c; kill $s; }', 7000);
      const sinkOut = collect(sinkProc.stdout);
      const fin = await vm.forward(7000);
      let t1 = performance.now();
      await new Promise((resolve, reject) => {
        const s = net.connect(fin.port, fin.host, () => {
          t1 = performance.now();
          const chunk = Buffer.alloc(MIB);
          let sent = 0;
          const more = () => { while (sent < fwMiB) { sent++; if (!s.write(chunk)) return s.once('drain', more); } s.end(); };
          more();
        });
        s.resume();
        s.on('close', resolve).on('error', reject);
      });
      const sinkExit = await sinkProc.exited;
      out.hostToGuestForwarded = (fwMiB / ((performance.now() - t1) / 1000)).toFixed(1);
      if (sinkExit.exitCode !== 0 || Number((await sinkOut).trim()) !== fwMiB * MIB) {
        throw new Error(`forwarded host -> guest: the guest got ${JSON.stringify(await sinkOut)} bytes (${JSON.stringify(sinkExit)}), expected ${fwMiB * MIB}`);
      }
      await fin.close();
      // Guest -> host: nc sends dd's output, then half-closes; the forwarding nc ends with it.
      const sourceProc = await listen(`dd if=/dev/zero bs=65536 count=${fwMiB * 16} 2>/dev/null | nc -l -p 7001`, 7001);
      const fout = await vm.forward(7001);
      let got = 0;
      t1 = performance.now();
      await new Promise((resolve, reject) => net.connect(fout.port, fout.host).on('data', (d) => (got += d.length)).on('close', resolve).on('error', reject));
      out.guestToHostForwarded = (fwMiB / ((performance.now() - t1) / 1000)).toFixed(1);
      if (got !== fwMiB * MIB) throw new Error(`forwarded guest -> host: ${got} bytes, expected ${fwMiB * MIB}`);
      await sourceProc.exited;
      await fout.close();
      out.forwardedMiB = fwMiB;

      // A small request through a forwarded port: connect, one line, its echo, close, as above
      // (busybox nc -ll -e cat: a persistent server, one cat per connection). Each connection
      // also starts the guest's forwarding nc, an exec through the agent.
      await listen('nc -ll -p 7002 -e cat', 7002);
      const fecho = await vm.forward(7002);
      const t2 = performance.now();
      for (let i = 0; i < rounds; i++) {
        let echo = '';
        await new Promise((resolve, reject) => {
          const s = net.connect(fecho.port, fecho.host, () => s.end('x\n'));
          s.on('data', (d) => (echo += d)).on('close', resolve).on('error', reject);
        });
        if (echo !== 'x\n') throw new Error(`forwarded echo: got ${JSON.stringify(echo)}`);
      }
      out.hostForwardedRequestUs = Math.round(((performance.now() - t2) / rounds) * 1000);
      await fecho.close();
    } finally {
      await vm.stop();
    }
  } finally {
    server.kill();
    spawnSync('ip', ['netns', 'delete', NS]);
    spawnSync('ip', ['link', 'delete', 'pvm-host']);
  }
  out.ratioGuestToOutside = (out.guestToOutside / out.hostToOutside).toFixed(3);
  out.ratioOutsideToGuest = (out.outsideToGuest / out.outsideToHost).toFixed(3);
  out.ratioHostToGuestForwarded = (out.hostToGuestForwarded / out.hostToOutside).toFixed(3);
  out.ratioGuestToHostForwarded = (out.guestToHostForwarded / out.outsideToHost).toFixed(3);
  console.log(JSON.stringify({ sizeMiB, MiBps: out }, null, 1));
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
