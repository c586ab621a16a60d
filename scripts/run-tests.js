#!/usr/bin/env node
// `npm test`: builds, runs the unit tests on this host and, beside them, the KVM tests on real KVM: directly
// where this host's /dev/kvm can run them, otherwise inside scripts/nested-kvm.sh (a QEMU L1 whose
// emulated AMD SVM gives a real /dev/kvm). Ends with one 'N passed, N failed' line over all runs.
'use strict';
const { spawnSync } = require('node:child_process');
const { existsSync, mkdirSync, readdirSync, readFileSync, rmSync } = require('node:fs');
const { basename, join } = require('node:path');
const { laneCount, runInLanes } = require('./lanes');
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

// The agent workload's image (scripts/agent-rootfs.sh: Debian packages, about 5 minutes once, then
// a stamp says it is up to date), which test/kvm/linux-agent-workload.test.ts boots: built here
// so that `npm test` sets up what it needs on a fresh machine. It needs root (debootstrap, a loop
// of mke2fs); elsewhere, or if the build fails, that file's tests are skipped, saying why.
// What a jailed VM needs (pvisor run jails by default): installed when missing, as for npm start.
run('bash', [join(root, 'scripts', 'jail-packages.sh')], 'what a jailed VM needs (bubblewrap, libseccomp2, prlimit)');
// The test object store's Debian packages (Ceph's radosgw), before any test runs: the store's unit
// tests start it on this host, and test/kvm/store-* start it inside L1s, which see this host's /usr
// and have no network, while the unit tests run beside them. Missing and not installable here
// (exit 3): those tests skip, saying why.
run('bash', [join(root, 'scripts', 'object-store.sh'), 'install'], "the test object store's packages (Ceph radosgw)");
if (process.getuid?.() === 0 && run('bash', [join(root, 'scripts', 'agent-rootfs.sh')], "the agent workload's image") !== 0) {
  console.log("the agent workload's image could not be built: its tests will be skipped");
}

// KVM tests, each file where it can run (scripts/kvm-host.js): files named linux-* boot the Linux
// guest, which a paravirtualised KVM (kvm_pvm) cannot run, so on such a host they go to the nested
// harness while the probe guest's files run on this host's /dev/kvm at native speed.
// In the harness the files are packed into buckets of about BUCKET_MINUTES each, one jest run in
// one L1 per bucket (an L1 boots in about 5 s), and the unit tests and buckets run two at a time
// (scripts/lanes.js), longest first. The longest files get an L1 of their own: the agent
// workload's and the memory study's; so do the floods, which otherwise shared a jest process with
// the files before them: after them, the console flood's command once never reported its start
// (2026-12-02, 1200 s; alone it passed in 31 s, and so did the same steps in a script).
// The memory study's L1 runs with nothing beside it: its first case runs three 2-vCPU Linux
// guests at once in the L1's one emulated CPU, and with another L1 on the host's other core its
// L1 went silent for 240 s, twice in a row (2026-12-03), where alone it had passed in CI.
// Under the harness, the emulated L1 now and then wedges for good (it stops dead, every process in
// it with it: a fault of QEMU's emulated SVM, seen with any test file). The reporter's heartbeat
// keeps a slow test from looking silent, so the watchdog can be short; when it fires (exit 124),
// the bucket's files that had not finished run once more in a fresh L1. A test that fails is never
// rerun.
// Minutes per file in the harness, from one `npm test` with two lanes on a host that ran two more
// L1s meanwhile (2026-12-03; the memory study's from CI, where it ran alone); a file not listed
// counts DEFAULT_MINUTES. They only order and pack the work: nothing is timed by them.
const MINUTES = {
  'linux-memory': 16, 'linux-agent-workload': 10, 'linux-jail': 9, 'cli-control': 7, 'store-snapshot': 7,
  'linux-store-clones': 6, 'store-hibernate': 5, 'store-clones': 4, 'linux-snapshot': 4, 'jail-handoffs': 4,
  'linux-flood': 4, 'linux-network': 4, 'linux-vm-api': 3, 'linux-files': 3, 'linux-streams': 3, soak: 3,
  'linux-guest': 1, 'linux-hibernate': 1, hibernate: 1, isolation: 0.5, 'host-access': 0.2, 'linux-commands': 0.2,
};
const DEFAULT_MINUTES = 2;
const BUCKET_MINUTES = 12;
const OWN_L1 = /^linux-(agent-|memory|flood)/;
const ALONE = /^linux-memory/;
const minutesOf = (file) => MINUTES[basename(file, '.test.js')] ?? DEFAULT_MINUTES;

const kvmFiles = readdirSync(join(root, 'dist', 'test', 'kvm')).filter((f) => f.endsWith('.test.js')).sort().map((f) => join(root, 'dist', 'test', 'kvm', f));
const here = kvmFiles.filter((f) => runsHere(/^linux-/.test(basename(f))));
const nested = kvmFiles.filter((f) => !here.includes(f)).sort((a, b) => minutesOf(b) - minutesOf(a));
const buckets = [];
for (const file of nested) {
  const own = OWN_L1.test(basename(file));
  const fit = own ? undefined : buckets.find((b) => !b.own && b.minutes + minutesOf(file) <= BUCKET_MINUTES);
  if (fit) {
    fit.files.push(file);
    fit.minutes += minutesOf(file);
  } else buckets.push({ own, alone: ALONE.test(basename(file)), files: [file], minutes: minutesOf(file) });
}

const jobs = [{ name: 'unit', cmd: 'npx', args: jest(['dist/test/unit'], 'unit.json'), minutes: 9 }];
if (here.length) {
  const [cmd, args] = onKvm(['npx', ...jest(here, 'kvm-here.json')]);
  jobs.push({ name: `kvm-here (${kvmFlavour()})`, cmd, args, minutes: here.reduce((m, f) => m + minutesOf(f), 0) / 10, env: { PVISOR_TEST_PROGRESS_FILE: join(resultsDir, 'kvm-progress-here.jsonl') } });
}
const why = kvmFlavour() === 'pvm' ? "this host's kvm_pvm cannot run the Linux guest" : 'no usable /dev/kvm here';
for (const [n, bucket] of buckets.entries()) jobs.push(nestedJob(`L1-${n + 1}`, bucket.files, bucket.minutes, 1, bucket.alone));

/** One bucket's jest run in a fresh L1; on the watchdog's exit 124, its unfinished files once more. */
function nestedJob(name, files, minutes, attempt, alone = false) {
  const progress = join(resultsDir, `kvm-progress-${name}-${attempt}.jsonl`);
  const [cmd, args] = onKvm(['npx', ...jest(files, `kvm-${name}-${attempt}.json`)], { linux: true });
  console.log(`${name}${attempt > 1 ? ` (attempt ${attempt})` : ''}: ${files.length} file(s) in nested KVM under QEMU (${why}), about ${Math.round(minutes)} min: ${files.map((f) => basename(f, '.test.js')).join(', ')}`);
  return {
    name: attempt > 1 ? `${name}-retry` : name,
    cmd,
    args,
    minutes,
    exclusive: alone,
    // 3000 s: CI once saw an L1 take 917 s to boot; the silence watchdog still catches a wedged one early.
    env: { PVISOR_NESTED_SILENCE_S: process.env.PVISOR_NESTED_SILENCE_S || '240', PVISOR_NESTED_TIMEOUT_S: process.env.PVISOR_NESTED_TIMEOUT_S || '3000', PVISOR_TEST_PROGRESS_FILE: progress },
    then(status) {
      if (status !== 124 || attempt > 1) return [];
      const finished = new Set(progressLines().map((l) => l.file));
      const remaining = files.filter((f) => !finished.has(f));
      if (!remaining.length) return [];
      console.log(`\n${name}: the nested harness went silent (a wedged L1); ${remaining.length} file(s) had not finished`);
      return [nestedJob(name, remaining, remaining.reduce((m, f) => m + minutesOf(f), 0), attempt + 1, alone)];
    },
  };
}

const began = Date.now();
runInLanes(jobs, { lanes: laneCount(), cwd: root }).then((statuses) => report(statuses.get('unit'), began));

/** Every finished KVM test file so far: one JSON line per file from the reporter, in per-run files. */
function progressLines() {
  return readdirSync(resultsDir)
    .filter((f) => f.startsWith('kvm-progress-'))
    .flatMap((f) => readFileSync(join(resultsDir, f), 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l)));
}

function report(unitStatus, began) {
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
  // Minutes per file, to keep MINUTES above near the truth.
  const took = [...kvmDone.values()].filter((l) => l.ms !== undefined).map((l) => `${basename(l.file, '.test.js')} ${(l.ms / 60_000).toFixed(1)}`);
  if (took.length) console.log(`\nminutes per KVM test file: ${took.join(', ')}`);
  const unfinished = kvmFiles.filter((f) => !kvmDone.has(f));
  if (unfinished.length) {
    console.log(`KVM test files that never finished: ${unfinished.map((f) => basename(f)).join(', ')}`);
    failed += unfinished.length;
  }
  console.log(`\n${passed} passed, ${failed} failed (${Math.round((Date.now() - began) / 1000)} s of tests)`);
  process.exit(unitStatus === 0 && failed === 0 && passed > 0 ? 0 : 1);
}
