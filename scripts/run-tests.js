#!/usr/bin/env node
// `npm test`: builds, runs the unit tests on this host, then the KVM tests on real KVM: directly
// where this host's /dev/kvm can run them, otherwise inside scripts/nested-kvm.sh (a QEMU L1 whose
// emulated AMD SVM gives a real /dev/kvm). Ends with one 'N passed, N failed' line over all runs.
'use strict';
const { spawnSync } = require('node:child_process');
const { existsSync, mkdirSync, readdirSync, readFileSync, rmSync } = require('node:fs');
const { join } = require('node:path');
const { kvmFlavour, onKvm, runsHere } = require('./kvm-host');

const root = join(__dirname, '..');
const resultsDir = join(root, '.cache', 'test-results');
rmSync(resultsDir, { recursive: true, force: true });
mkdirSync(resultsDir, { recursive: true });

function run(cmd, args, label, env = {}) {
  console.log(`\n== ${label}: ${[cmd, ...args].join(' ')}`);
  const r = spawnSync(cmd, args, { cwd: root, stdio: 'inherit', env: { ...process.env, ...env } });
  if (r.error) throw r.error;
  return r.status ?? 1;
}

const extra = process.argv.slice(2);
if (run('npx', ['tsc', '-p', 'tsconfig.json'], 'build') !== 0) process.exit(1);

const jest = (paths, out) => ['jest', '--ci', ...paths, '--json', `--outputFile=${join(resultsDir, out)}`, ...extra];
const unitStatus = run('npx', jest(['dist/test/unit'], 'unit.json'), 'unit tests (this host)');

// KVM tests, each file where it can run (scripts/kvm-host.js): files named linux-* boot the Linux
// guest, which a paravirtualised KVM (kvm_pvm) cannot run, so on such a host they go to the nested
// harness while the probe guest's files run on this host's /dev/kvm at native speed.
// Under the nested harness, the emulated L1 now and then wedges for good (it stops dead, every
// process in it with it: a fault of QEMU's emulated SVM, seen with any test file). The reporter's
// heartbeat keeps a slow test from looking silent, so the watchdog can be short; when it fires
// (exit 124), the files that had not finished run once more in a fresh L1. A test that fails is
// never rerun.
// The agent workload's image (scripts/agent-rootfs.sh: Debian packages, about 5 minutes once, then
// a stamp says it is up to date), which test/kvm/linux-agent-workload.test.ts boots: built here
// so that `npm test` sets up what it needs on a fresh machine. It needs root (debootstrap, a loop
// of mke2fs); elsewhere, or if the build fails, that file's tests are skipped, saying why.
// What a jailed VM needs (pvisor run jails by default): installed when missing, as for npm start.
run('bash', [join(root, 'scripts', 'jail-packages.sh')], 'what a jailed VM needs (bubblewrap, libseccomp2, prlimit)');
if (process.getuid?.() === 0 && run('bash', [join(root, 'scripts', 'agent-rootfs.sh')], "the agent workload's image") !== 0) {
  console.log("the agent workload's image could not be built: its tests will be skipped");
}

const kvmFiles = readdirSync(join(root, 'dist', 'test', 'kvm')).filter((f) => f.endsWith('.test.js')).sort().map((f) => join(root, 'dist', 'test', 'kvm', f));
const progressFile = join(resultsDir, 'kvm-progress.jsonl');
// One group (one jest run, and under the harness one L1 with its own time limit) per place and
// guest: on a host without KVM the probe's files and the Linux guest's each get an L1, so that
// neither's run time counts against the other's limit (all in one L1 ran past its 1800 s). For
// the same reason, the longest Linux files get an L1 each: the agent workload's (Node.js and
// TypeScript in the guest, 12-16 min in the harness) and the memory study's (every strategy over
// pvisor-workset, 16 min). So do the floods, which otherwise share a jest process with the files
// before them: after them, the console flood's command once never reported its start (2026-12-02,
// 1200 s; alone it passed in 31 s, and so did the same steps in a script).
const OWN_L1 = /^linux-(agent-|memory|flood)/;
const groups = [];
for (const file of kvmFiles) {
  const name = file.split('/').pop();
  const linux = /^linux-/.test(name);
  const own = OWN_L1.test(name) ? name : '';
  const here = runsHere(linux);
  let g = groups.find((x) => x.here === here && x.linux === linux && x.own === own);
  if (!g) groups.push((g = { here, linux, own, files: [] }));
  g.files.push(file);
}
for (const [n, group] of groups.entries()) {
  const nested = !group.here;
  let remaining = group.files;
  for (let attempt = 1; attempt <= (nested ? 2 : 1) && remaining.length; attempt++) {
    const where = nested ? `nested KVM under QEMU (${kvmFlavour() === 'pvm' ? "this host's kvm_pvm cannot run the Linux guest" : 'no usable /dev/kvm here'})` : `this host's /dev/kvm (${kvmFlavour()})`;
    const status = run(
      ...onKvm(['npx', ...jest(remaining, `kvm-${n}-${attempt}.json`)], { linux: nested }),
      `KVM tests, ${remaining.length} file(s) on ${where}${attempt > 1 ? `, attempt ${attempt}` : ''}`,
      // 3000 s: the Linux files take about 900 s in an L1 that boots in 10 s, and CI once saw an
      // L1 take 917 s to boot; the silence watchdog still catches a wedged one early.
      { PVISOR_NESTED_SILENCE_S: process.env.PVISOR_NESTED_SILENCE_S || '240', PVISOR_NESTED_TIMEOUT_S: process.env.PVISOR_NESTED_TIMEOUT_S || '3000', PVISOR_TEST_PROGRESS_FILE: progressFile },
    );
    if (!nested || status !== 124) break;
    const finished = new Set(progressLines().map((l) => l.file));
    remaining = remaining.filter((f) => !finished.has(f));
    if (remaining.length) console.log(`\nthe nested harness went silent (a wedged L1); ${remaining.length} file(s) had not finished: ${remaining.map((f) => f.split('/').pop()).join(', ')}`);
  }
}

function progressLines() {
  if (!existsSync(progressFile)) return [];
  return readFileSync(progressFile, 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l));
}

let passed = 0;
let failed = 0;
const unitResults = join(resultsDir, 'unit.json');
if (existsSync(unitResults)) {
  const j = JSON.parse(readFileSync(unitResults, 'utf8'));
  passed += j.numPassedTests;
  failed += j.numFailedTests + j.numRuntimeErrorTestSuites;
} else {
  console.log('no results from the unit tests: that run did not finish');
  failed++;
}
// KVM results per file, from the reporter: a file counts once, from the attempt that finished it.
const kvmDone = new Map(progressLines().map((l) => [l.file, l]));
for (const l of kvmDone.values()) {
  passed += l.passed;
  failed += l.failed;
}
const unfinished = kvmFiles.filter((f) => !kvmDone.has(f));
if (unfinished.length) {
  console.log(`KVM test files that never finished: ${unfinished.map((f) => f.split('/').pop()).join(', ')}`);
  failed += unfinished.length;
}
console.log(`\n${passed} passed, ${failed} failed`);
process.exit(unitStatus === 0 && failed === 0 && passed > 0 ? 0 : 1);
