#!/usr/bin/env node
// Measures hibernation from the command line (README, "Suspend and resume from another shell";
// docs/snapshots.md): a probe VM of `pvisor run` with a random working set is suspended with
// --vm-offload and resumed, then hibernated and resumed, and each time the figures are read:
// the run's start to ready, the process's PSS running, suspended and after the resume, the
// hibernation's time and bytes on disk, the resume's time (the command's, and the new process's
// restore to ready) and the guest's digest before and after. Needs /dev/kvm (scripts/with-kvm.js)
// and `npx tsc -p tsconfig.json` first.
//   node scripts/measure-hibernate.js [RUNS=3] [MEMORY=512MiB] [WORKING_SET_MIB=64]
'use strict';
const { execFile, spawn } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');

const root = path.join(__dirname, '..');
const main = path.join(root, 'dist', 'src', 'cli', 'main.js');
const { controlRequest } = require(`${root}/dist/src/control-socket.js`);
const [runs = 3, memory = '512MiB', wsMiB = 64] = process.argv.slice(2).map((a, i) => (i === 1 ? a : Number(a)));
const dir = fs.mkdtempSync('/var/tmp/pvisor-measure-hibernate-');
const env = { ...process.env, PVISOR_RUNTIME_DIR: path.join(dir, 'run') };
const MiB = 2 ** 20;
const mib = (b) => (b / MiB).toFixed(1);

const pvisor = (...args) =>
  new Promise((resolve) => {
    const t0 = performance.now();
    execFile(process.execPath, [main, ...args], { env, encoding: 'utf8' }, (error, stdout, stderr) =>
      resolve({ status: error ? error.code : 0, stdout, stderr, ms: performance.now() - t0 }));
  });
const must = async (...args) => {
  const r = await pvisor(...args);
  if (r.status !== 0) throw new Error(`pvisor ${args.join(' ')}: exit ${r.status}: ${r.stderr}`);
  return r;
};
const status = async (id) => JSON.parse((await must('ps', '--json')).stdout).find((r) => r.id === id);
const digest = async (id) => {
  const r = await controlRequest(path.join(dir, 'run', `${id}.sock`), id, { op: 'exec', command: 'digest' }, 600000);
  return /^digest: (\w+)/m.exec(r.exec.stdout)[1];
};

async function once(n) {
  const id = `M${n}`;
  // --isolation none: the figures are the in-process hibernation's (docs/hibernation.md); a jailed one adds the copy out of its jail.
  const run = spawn(process.execPath, [main, 'run', '--isolation', 'none', '--guest', 'probe', '--name', id, '--memory', String(memory), '--vm-backing-dir', dir, '--', `fill ${wsMiB}MiB random 42, digest, wait`], { env, stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  let err = '';
  run.stdout.on('data', (d) => (out += d));
  run.stderr.on('data', (d) => (err += d));
  const exited = new Promise((resolve) => run.on('exit', (code) => resolve(code)));
  while (!/^digest: /m.test(out)) {
    if (run.exitCode !== null) throw new Error(`run ended: ${err}`);
    await new Promise((r) => setTimeout(r, 50));
  }
  const f = { startMs: Number(/ready in (\d+) ms/.exec(err)[1]), digest: /^digest: (\w+)/m.exec(out)[1] };
  f.running = (await status(id)).response.memory.processPssBytes;
  const s = JSON.parse((await must('suspend', id, '--vm-offload', '--json')).stdout);
  f.suspended = (await status(id)).response.memory.processPssBytes;
  f.suspendedGuest = s.memory.guestRamResidentBytes;
  await must('resume', id);
  const h = await must('suspend', id, '--hibernate', '--json');
  const answer = JSON.parse(h.stdout);
  f.hibernateMs = answer.tookMs;
  f.hibernateCommandMs = h.ms;
  f.onDisk = answer.hibernation.bytesOnDisk;
  f.runExit = await exited;
  const row = await status(id);
  f.hibernatedRow = row.hibernated ? 'hibernated, no process' : JSON.stringify(row);
  const r = JSON.parse((await must('resume', id, '--json')).stdout);
  f.resumeCommandMs = r.tookMs;
  f.readyMs = r.readyMs;
  f.resumedReady = r.processPssBytes;
  f.digestAfter = await digest(id);
  f.resumedAfterDigest = (await status(id)).response.memory.processPssBytes;
  await must('stop', id);
  return f;
}

(async () => {
  const all = [];
  try {
    for (let n = 1; n <= runs; n++) {
      const f = await once(n);
      all.push(f);
      console.log(
        `run ${n}: start to ready ${f.startMs} ms; process PSS running ${mib(f.running)} MiB, suspended (--vm-offload) ${mib(f.suspended)} MiB ` +
          `(guest RAM ${mib(f.suspendedGuest)}), hibernated 0 (${f.hibernatedRow}); hibernate ${f.hibernateMs} ms (command ${f.hibernateCommandMs.toFixed(0)} ms, ` +
          `${mib(f.onDisk)} MiB on disk, the run exited ${f.runExit}); resume command ${f.resumeCommandMs} ms, restore to ready ${f.readyMs} ms; ` +
          `process PSS at ready ${mib(f.resumedReady)} MiB, after a digest ${mib(f.resumedAfterDigest)} MiB; digest ${f.digest === f.digestAfter ? 'same' : `DIFFERENT ${f.digest} ${f.digestAfter}`}`,
      );
    }
    const med = (k) => all.map((f) => f[k]).sort((a, b) => a - b)[Math.floor(all.length / 2)];
    console.log(`medians of ${all.length}: start ${med('startMs')} ms, hibernate ${med('hibernateMs')} ms, resume command ${med('resumeCommandMs')} ms, restore to ready ${med('readyMs')} ms; PSS running ${mib(med('running'))}, suspended ${mib(med('suspended'))}, hibernated 0, resumed ${mib(med('resumedAfterDigest'))} MiB`);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
