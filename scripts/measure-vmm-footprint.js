#!/usr/bin/env node
// What the VMM process around guest RAM is made of: `pvisor run` of the Linux guest (or --probe),
// its /proc/PID/smaps grouped by what each mapping is, read once the command runs and again
// after `pvisor suspend --vm-offload`. Run in the nested harness on a host without KVM:
//   node scripts/with-kvm.js --linux node scripts/measure-vmm-footprint.js [--probe] [--json FILE]
'use strict';
const { spawn, spawnSync } = require('node:child_process');
const { readFileSync, writeFileSync } = require('node:fs');
const { join } = require('node:path');

const root = join(__dirname, '..');
const main = join(root, 'dist', 'src', 'cli', 'main.js');
const { PVISOR_NODE_FLAGS, PVISOR_NODE_ENV } = require(join(root, 'dist', 'src', 'node-flags.js'));
const probe = process.argv.includes('--probe');
const jsonAt = process.argv.indexOf('--json');
const name = `fp${process.pid}`;
const extraFlags = process.argv.filter((a, i) => process.argv[i - 1] === '--node-flag');
const env = { ...process.env, ...PVISOR_NODE_ENV };
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** PSS, private and RSS in KiB per kind of mapping. */
function footprint(pid) {
  const groups = {};
  let kind = null;
  for (const line of readFileSync(`/proc/${pid}/smaps`, 'utf8').split('\n')) {
    const head = /^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \d+\s*(.*)$/.exec(line);
    if (head) {
      const size = parseInt(head[2], 16) - parseInt(head[1], 16);
      const path = head[3];
      if (size >= 64 << 20 && (path === '' || path.startsWith('/memfd:') || path.includes('pvisor'))) kind = 'guest RAM';
      else if (path === process.execPath || path.endsWith('/node')) kind = 'node binary';
      else if (path.includes('.so') || path.endsWith('.node')) kind = `lib ${path.split('/').pop()}`;
      else if (path === '[heap]') kind = 'malloc heap';
      else if (path.startsWith('[stack')) kind = 'stacks';
      else if (path === '') kind = 'anonymous (V8 heap, thread stacks, arenas)';
      else kind = `other ${path}`;
      groups[kind] ??= { pss: 0, private: 0, dirty: 0, rss: 0 };
      continue;
    }
    const m = /^(Pss|Private_Clean|Private_Dirty|Rss):\s+(\d+) kB/.exec(line);
    if (!m || !kind) continue;
    const g = groups[kind];
    if (m[1] === 'Pss') g.pss += +m[2];
    else if (m[1] === 'Rss') g.rss += +m[2];
    else g.private += +m[2];
    if (m[1] === 'Private_Dirty') g.dirty += +m[2];
  }
  return groups;
}

function print(label, groups) {
  const rows = Object.entries(groups).filter(([, g]) => g.rss > 0).sort((a, b) => b[1].pss - a[1].pss);
  const total = rows.reduce((s, [k, g]) => (k === 'guest RAM' ? s : s + g.pss), 0);
  console.log(`\n${label}: process PSS besides guest RAM ${(total / 1024).toFixed(1)} MiB`);
  for (const [k, g] of rows) console.log(`  ${k.padEnd(44)} PSS ${(g.pss / 1024).toFixed(1).padStart(6)}  private ${(g.private / 1024).toFixed(1).padStart(6)} (dirty ${(g.dirty / 1024).toFixed(1)})  RSS ${(g.rss / 1024).toFixed(1).padStart(6)} MiB`);
  return total;
}

function cli(...args) {
  const r = spawnSync(process.execPath, [main, ...args], { env, encoding: 'utf8', timeout: 600_000 });
  if (r.status !== 0) throw new Error(`pvisor ${args.join(' ')}: exit ${r.status}: ${r.stderr}`);
  return r.stdout;
}

(async () => {
  const cmd = probe ? ['--guest', 'probe', '--', 'memory, wait'] : ['--', 'sh', '-c', 'echo ready; exec sleep 100000'];
  // --isolation none: what is measured is the VMM in the process started here, with these node
  // flags (a jailed VMM is another process, under the launcher's flags: scripts/measure-jail-cost.js).
  const run = spawn(process.execPath, [...PVISOR_NODE_FLAGS, ...extraFlags, main, 'run', '--isolation', 'none', '--name', name, '--vm-offload', ...cmd], { env, stdio: ['ignore', 'pipe', 'inherit'] });
  await new Promise((resolve, reject) => {
    let out = '';
    run.stdout.on('data', (d) => { out += d; if (/ready|resident|guest RAM/i.test(out)) resolve(); });
    run.on('exit', (c) => reject(new Error(`pvisor run ended (${c}) before its command ran`)));
  });
  await sleep(5000);
  const results = { running: footprint(run.pid) };
  const running = print('running, command idle', results.running);
  cli('suspend', name, '--vm-offload');
  await sleep(5000);
  results.suspended = footprint(run.pid);
  const suspended = print('suspended (offload), 5 s later', results.suspended);
  cli('stop', name);
  await new Promise((r) => run.on('exit', r));
  console.log(`\nsummary: besides guest RAM, running ${(running / 1024).toFixed(1)} MiB, suspended ${(suspended / 1024).toFixed(1)} MiB`);
  if (jsonAt > 0) writeFileSync(process.argv[jsonAt + 1], JSON.stringify(results, null, 2));
})().catch((e) => { console.error(e); process.exit(1); });
