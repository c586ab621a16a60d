#!/usr/bin/env node
// Measures what clients cost the page pool's daemon (docs/page-pool.md, "Trust"), in its
// /proc/PID/smaps_rollup. No KVM needed. Needs `npx tsc -p tsconfig.json` first.
//   node scripts/measure-pool-daemon.js cycles [CYCLES=4000] [BATCHES=3] [ORPHANS=0]
//     From this one process: connect, Hello, Put one page, disconnect, again and again; each
//     batch's time and the daemon's memory after it. ORPHANS scopes are first left with an orphan
//     each, so that the cycles run beside them.
//   node scripts/measure-pool-daemon.js unread [CONNECTIONS=32] [DAEMON OPTIONS...]
//     CONNECTIONS connections each say Hello and send 24 Offers of 65536 entries, and never read;
//     the daemon's peak memory over 6 s, while one client that reads is served every 100 ms.
// PVISOR_BUILD=DIR measures the build in DIR (its dist/) instead of this one.
'use strict';
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');

const root = process.env.PVISOR_BUILD ?? path.join(__dirname, '..');
const { PoolLink, poolStatus } = require(`${root}/dist/src/memory/pool-link.js`);
const { encodeOffer, encodePut, poolRequest } = require(`${root}/dist/test/pool-wire.js`);
const { encodeFrame } = require(`${root}/dist/src/protocol/frame.js`);
const OP_HELLO = 1, OP_OFFER = 2, OP_PUT = 3, REQUEST = 1;

const mib = (kb) => (kb / 1024).toFixed(1);
function memory(pid) {
  const t = fs.readFileSync(`/proc/${pid}/smaps_rollup`, 'utf8');
  const kb = (f) => Number(new RegExp(`^${f}:\\s+(\\d+)`, 'm').exec(t)[1]);
  return { rss: kb('Rss'), pss: kb('Pss') };
}
const shown = (m) => `rss ${mib(m.rss)} MiB, pss ${mib(m.pss)} MiB`;

async function startDaemon(socket, extra) {
  const d = spawn(process.execPath, [`${root}/dist/src/cli/daemon-main.js`, 'serve', '--memory-pool', '--socket', socket, '--max-pool', '64MiB', ...extra], { stdio: ['ignore', 'ignore', 'pipe'] });
  await new Promise((resolve, reject) => {
    let err = '';
    d.stderr.on('data', (b) => ((err += b), /page pool of up to/.test(err) && resolve()));
    d.once('exit', (code) => reject(new Error(`the daemon exited with ${code}: ${err}`)));
  });
  return d;
}

async function cycles(socket, d, [count = 4000, batches = 3, orphans = 0]) {
  const put = encodePut([{ page: 0, bytes: Buffer.alloc(4096, 1) }]);
  const cycle = async (scope) => {
    const l = await PoolLink.connect(socket, { scope, name: 'cycle' }, 10_000);
    await poolRequest(l, OP_PUT, put, 10_000);
    l.close();
    fs.closeSync(l.poolFd);
  };
  console.log(`before: ${shown(memory(d.pid))}`);
  for (let i = 0; i < orphans; i++) await cycle(`other ${i}`);
  if (orphans) {
    await new Promise((r) => setTimeout(r, 300));
    console.log(`${orphans} scopes left with an orphan each: ${(await poolStatus(socket, 60_000)).orphanedClients} orphans; ${shown(memory(d.pid))}`);
  }
  for (let b = 1; b <= batches; b++) {
    const t0 = process.hrtime.bigint();
    for (let i = 0; i < count; i++) await cycle('cycles');
    const s = Number(process.hrtime.bigint() - t0) / 1e9;
    await new Promise((r) => setTimeout(r, 300));
    const st = await poolStatus(socket, 60_000);
    console.log(`batch ${b}: ${count} cycles in ${s.toFixed(1)} s; ${st.orphanedClients} orphans, ${st.references} references; ${shown(memory(d.pid))}`);
  }
}

async function unread(socket, d, count) {
  const reader = await PoolLink.connect(socket, { scope: 'reader', name: 'reader' }, 5000);
  const before = memory(d.pid);
  const entries = Array.from({ length: 65536 }, (_, k) => ({ page: k, key: { lo: k, hi: 1 } }));
  // One frame, written 24 times on every connection: Node keeps references, not copies.
  const offers = encodeFrame({ type: REQUEST, id: 2, op: OP_OFFER, payload: encodeOffer(entries) });
  const slow = [];
  for (let i = 0; i < count; i++) {
    const s = net.connect(socket);
    s.pause();
    s.on('error', () => {});
    s.write(encodeFrame({ type: REQUEST, id: 1, op: OP_HELLO, payload: Buffer.from(`{"version":1,"scope":"slow","name":"slow ${i}"}`) }));
    for (let k = 0; k < 24; k++) s.write(offers);
    slow.push(s);
  }
  const peak = { rss: 0, pss: 0 };
  let served = 0, slowestMs = 0;
  for (let t = 0; t < 60; t++) {
    const m = memory(d.pid);
    peak.rss = Math.max(peak.rss, m.rss);
    peak.pss = Math.max(peak.pss, m.pss);
    const t0 = Date.now();
    await poolRequest(reader, OP_OFFER, encodeOffer([{ page: 0, key: { lo: 1, hi: 2 } }]), 60_000);
    served++;
    slowestMs = Math.max(slowestMs, Date.now() - t0);
    await new Promise((r) => setTimeout(r, 100));
  }
  console.log(`${count} connections that do not read: daemon before ${shown(before)}; peak ${shown(peak)}; a reader served ${served} times, slowest ${slowestMs} ms`);
  for (const s of slow) s.destroy();
  reader.close();
  fs.closeSync(reader.poolFd);
}

async function main() {
  const [what, ...args] = process.argv.slice(2);
  if (what !== 'cycles' && what !== 'unread') throw new Error('usage: measure-pool-daemon.js cycles [CYCLES] [BATCHES] [ORPHANS] | unread [CONNECTIONS] [DAEMON OPTIONS...]');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pvisor-pool-measure-'));
  const socket = path.join(dir, 'pool.sock');
  // cycles: three numbers; unread: a number, then the daemon's options.
  const d = await startDaemon(socket, what === 'unread' ? args.slice(1) : []);
  try {
    await (what === 'cycles' ? cycles(socket, d, args.map(Number)) : unread(socket, d, Number(args[0] ?? 32)));
  } finally {
    d.kill('SIGTERM');
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

main().catch((e) => {
  console.error(e.message);
  process.exit(1);
});
