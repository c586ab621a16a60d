#!/usr/bin/env node
// `npm test`: builds, runs the unit tests on this host, then the KVM tests on real KVM: directly
// where /dev/kvm is usable, otherwise inside scripts/nested-kvm.sh (a QEMU L1 whose emulated AMD
// SVM gives a real /dev/kvm). Ends with one 'N passed, N failed' line over both runs.
'use strict';
const { spawnSync } = require('node:child_process');
const { existsSync, mkdirSync, readFileSync, rmSync } = require('node:fs');
const { join } = require('node:path');
const { kvmUsable, onKvm } = require('./kvm-host');

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

const jest = (dir, out) => ['jest', '--ci', dir, '--json', `--outputFile=${join(resultsDir, out)}`, ...extra];
const unitStatus = run('npx', jest('dist/test/unit', 'unit.json'), 'unit tests (this host)');
const kvmStatus = run(
  ...onKvm(['npx', ...jest('dist/test/kvm', 'kvm.json')]),
  kvmUsable() ? "KVM tests (this host's /dev/kvm)" : 'KVM tests (no usable /dev/kvm here: nested KVM under QEMU)',
  // jest prints a file's results when the file ends; under emulation a file takes minutes.
  { PVISOR_NESTED_SILENCE_S: process.env.PVISOR_NESTED_SILENCE_S || '900' },
);

let passed = 0;
let failed = 0;
for (const f of ['unit.json', 'kvm.json']) {
  const p = join(resultsDir, f);
  if (!existsSync(p)) {
    console.log(`no results from ${f}: that run did not finish`);
    failed++;
    continue;
  }
  const j = JSON.parse(readFileSync(p, 'utf8'));
  passed += j.numPassedTests;
  failed += j.numFailedTests + j.numRuntimeErrorTestSuites;
}
console.log(`\n${passed} passed, ${failed} failed`);
process.exit(unitStatus === 0 && kvmStatus === 0 && failed === 0 && passed > 0 ? 0 : 1);
