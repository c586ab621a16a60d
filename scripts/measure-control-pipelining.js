#!/usr/bin/env node
// Measures what a control-socket client that pipelines requests and never reads the answers costs
// the server (docs/reliability.md): the real ControlServer in a child process, answering `status`
// as `pvisor run` does (VM info and memory figures), and a client that writes N request lines
// without reading. Prints the server's RSS before the client and once it has stopped answering
// (no answer for 2 s, or 120 s at most), and how many requests it answered. Needs
// `npx tsc -p tsconfig.json` first.
//   node scripts/measure-control-pipelining.js [requests=326000]
'use strict';
const { fork } = require('node:child_process');
const { mkdtempSync, rmSync } = require('node:fs');
const { createConnection } = require('node:net');
const { tmpdir } = require('node:os');
const { join } = require('node:path');

const MIB = 2 ** 20;

if (process.argv[2] === '--server') {
  const { ControlServer } = require('../dist/src/control-socket');
  const vm = { id: 'M', pid: process.pid, state: 'running', guest: 'linux', memoryBytes: 512 * MIB, vcpus: 2 };
  const memory = {
    guestRamResidentBytes: 37 * MIB, guestRamRssBytes: 38 * MIB, processPssBytes: 95 * MIB, bytesOnDisk: 0,
    strategies: [{ strategy: 'idle-release', figures: { pagesReleased: 12345, lastReleaseMs: 12.5, releases: 7 }, notes: ['free page reporting is on'] }],
  };
  let answered = 0;
  ControlServer.listen(process.argv[3], 'M', async () => {
    answered++;
    return { response: { ok: true, vm, memory } };
  }).then(() => {
    const report = () => process.send({ answered, rssBytes: process.memoryUsage().rss });
    report();
    setInterval(report, 250);
  });
  return;
}

const requests = Number(process.argv[2] ?? 326_000);
const dir = mkdtempSync(join(tmpdir(), 'pvisor-ctl-measure-'));
const path = join(dir, 'M.sock');
const server = fork(__filename, ['--server', path]);
let latest;
let changedAt = Date.now();
let before;
server.on('message', (m) => {
  if (latest === undefined || m.answered !== latest.answered) changedAt = Date.now();
  latest = m;
  before ??= m.rssBytes;
});

const wait = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
(async () => {
  while (before === undefined) await wait(50);
  await wait(500);
  before = latest.rssBytes;
  const c = createConnection(path);
  c.pause(); // never read an answer
  await new Promise((resolve, reject) => c.once('connect', resolve).once('error', reject));
  const t0 = Date.now();
  c.write('{"v":1,"op":"status"}\n'.repeat(requests));
  changedAt = Date.now();
  let peak = before;
  while (Date.now() - changedAt < 2000 && Date.now() - t0 < 120_000) {
    await wait(250);
    peak = Math.max(peak, latest.rssBytes);
  }
  const mib = (b) => (b / MIB).toFixed(1);
  console.log(`${requests} requests pipelined, none read: the server answered ${latest.answered} in ${((changedAt - t0) / 1000).toFixed(1)} s; ` +
    `its RSS ${mib(before)} MiB before, ${mib(latest.rssBytes)} MiB after (+${mib(latest.rssBytes - before)}; peak +${mib(peak - before)}); ` +
    `${mib(c.writableLength)} MiB of requests still in the client's buffer`);
  c.destroy();
  server.kill();
  rmSync(dir, { recursive: true, force: true });
})();
