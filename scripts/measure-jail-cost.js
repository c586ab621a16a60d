#!/usr/bin/env node
// What the jail (pvisor run --isolation process, src/jail/) costs per VM, against the same VM in
// its own `pvisor run` process (--isolation none), in one run: start time (spawn to the VM's
// "ready" line, which includes node's start, the jail's set-up and the boot) and PSS (every
// process of the run: for a jailed VM the launcher, bwrap and the jailed VMM; PSS splits shared
// pages among the processes that map them, so the runs of both kinds share node's text alike).
// VMs of both kinds are started alternately and all kept running while PSS is read. Needs root,
// KVM, bubblewrap and cgroup v2; in the harness:
//   node scripts/with-kvm.js node scripts/measure-jail-cost.js [--vms 3] [--guest probe|linux] [--net nat]
// (--net nat: each VM, of both kinds, with a network; the Linux guest only.)
'use strict';
const { spawn } = require('node:child_process');
const { mkdtempSync, readdirSync, readFileSync, rmSync } = require('node:fs');
const { join } = require('node:path');

const args = process.argv.slice(2);
const opt = (name, dflt) => (args.includes(name) ? args[args.indexOf(name) + 1] : dflt);
const vmsPerKind = Number(opt('--vms', '3'));
const guest = opt('--guest', 'probe');
const net = opt('--net', 'none');
if (net !== 'none' && guest !== 'linux') throw new Error('--net needs --guest linux');
const main = join(__dirname, '..', 'dist', 'src', 'cli', 'main.js');
const dir = mkdtempSync('/var/tmp/pvisor-jail-cost-');
const env = { ...process.env, PVISOR_RUNTIME_DIR: join(dir, 'run') };
const command = guest === 'probe' ? ['fill 32MiB random 7, digest, wait'] : ['sleep', '100000'];
const memory = guest === 'probe' ? '128MiB' : '256MiB';

function pssOf(pid) {
  try {
    const m = /^Pss:\s+(\d+) kB/m.exec(readFileSync(`/proc/${pid}/smaps_rollup`, 'utf8'));
    return m ? Number(m[1]) * 1024 : 0;
  } catch {
    return 0;
  }
}
/** `pid` and every process below it. */
function tree(pid) {
  const children = new Map();
  for (const p of readdirSync('/proc').filter((d) => /^\d+$/.test(d))) {
    try {
      const stat = readFileSync(`/proc/${p}/stat`, 'utf8');
      const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
      if (!children.has(ppid)) children.set(ppid, []);
      children.get(ppid).push(Number(p));
    } catch {
      // Gone meanwhile.
    }
  }
  const out = [];
  const walk = (p) => {
    out.push(p);
    for (const c of children.get(p) ?? []) walk(c);
  };
  walk(pid);
  return out;
}

function start(kind, i) {
  const name = `${kind === 'process' ? 'j' : 'n'}${i}`;
  const t0 = performance.now();
  const child = spawn(process.execPath, ['--expose-gc', main, 'run', '--isolation', kind, '--name', name, '--guest', guest, '--memory', memory, '--vcpus', '1', ...(net === 'none' ? [] : ['--net', net]), '--vm-backing-dir', dir, '--', ...command], { env, stdio: ['ignore', 'pipe', 'pipe'] });
  let err = '';
  let out = '';
  child.stdout.on('data', (d) => (out += d));
  return new Promise((resolve, reject) => {
    const check = () => {
      if (/ ready in \d+ ms/.test(err) && (guest !== 'probe' || /^digest: /m.test(out))) resolve({ kind, name, child, startMs: performance.now() - t0 });
    };
    child.stderr.on('data', (d) => ((err += d), check()));
    child.stdout.on('data', check);
    child.on('exit', (code) => reject(new Error(`${name} exited (${code}) before it was ready: ${err}`)));
  });
}

(async () => {
  const runs = [];
  try {
    for (let i = 0; i < vmsPerKind; i++) for (const kind of i % 2 ? ['process', 'none'] : ['none', 'process']) runs.push(await start(kind, i));
    // The processes' own trims settle (2 s after a start, src/sys/process-pages.ts).
    await new Promise((r) => setTimeout(r, 5000));
    const rows = runs.map((r) => {
      const pids = tree(r.child.pid);
      const comm = (p) => { try { return readFileSync(`/proc/${p}/comm`, 'utf8').trim(); } catch { return '?'; } };
      const pss = pids.map((p) => ({ pid: p, comm: comm(p), pss: pssOf(p) }));
      const vmm = pss.filter((p) => p.comm === 'node').at(-1);
      return { ...r, totalPss: pss.reduce((s, p) => s + p.pss, 0), vmmPss: vmm.pss, launcherPss: r.kind === 'process' ? pss[0].pss : 0, processes: pss.length };
    });
    const mib = (b) => (b / 1048576).toFixed(1);
    const stats = (xs) => { const s = [...xs].sort((a, b) => a - b); return { median: s[Math.floor(s.length / 2)], min: s[0], max: s.at(-1) }; };
    console.log(`guest ${guest}, ${memory}, 1 vCPU, network ${net}, ${vmsPerKind} VMs of each kind alive at once`);
    for (const kind of ['none', 'process']) {
      const mine = rows.filter((r) => r.kind === kind);
      const t = stats(mine.map((r) => r.startMs));
      const p = stats(mine.map((r) => r.totalPss));
      const v = stats(mine.map((r) => r.vmmPss));
      const l = stats(mine.map((r) => r.launcherPss));
      console.log(`${kind === 'none' ? 'in-process' : 'jailed    '}: start ${t.median.toFixed(0)} ms (${t.min.toFixed(0)}-${t.max.toFixed(0)}); PSS per VM ${mib(p.median)} MiB (${mib(p.min)}-${mib(p.max)}) in ${mine[0].processes} process(es): VMM ${mib(v.median)}${kind === 'process' ? `, launcher ${mib(l.median)}` : ''}`);
    }
    const med = (kind, f) => stats(rows.filter((r) => r.kind === kind).map(f)).median;
    console.log(`jail's cost per VM: start +${(med('process', (r) => r.startMs) - med('none', (r) => r.startMs)).toFixed(0)} ms (${(med('process', (r) => r.startMs) / med('none', (r) => r.startMs)).toFixed(2)}x), PSS +${mib(med('process', (r) => r.totalPss) - med('none', (r) => r.totalPss))} MiB (VMM process alone ${mib(med('process', (r) => r.vmmPss) - med('none', (r) => r.vmmPss))} MiB)`);
  } finally {
    // Each run stops its VM and removes what it made (a jailed one: its cgroup, jail directory and
    // network); under emulation that takes seconds, and a run killed before leaves them behind.
    const ended = (r) => r.child.exitCode !== null || r.child.signalCode !== null;
    for (const r of runs) r.child.kill('SIGTERM');
    for (const end = Date.now() + 120_000; runs.some((r) => !ended(r)) && Date.now() < end;) await new Promise((r) => setTimeout(r, 200));
    for (const r of runs) if (!ended(r)) r.child.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  }
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
