#!/usr/bin/env node
// Runs every compiled example (dist/examples/*.js) on real KVM, two at a time (scripts/lanes.js),
// each in a process of its own and, where this host cannot run it, in a fresh L1 of its own:
// those named linux-* boot the Linux guest (scripts/with-kvm.js --linux). Exit 124 is the nested
// harness's watchdog (a wedged emulated L1, see scripts/run-tests.js): that example runs once more
// in a fresh L1; any other failure is final. Exits 0 only if every example exited 0.
'use strict';
const { readdirSync } = require('node:fs');
const { basename, join } = require('node:path');
const { laneCount, runInLanes } = require('./lanes');

const root = join(__dirname, '..');
const dir = join(root, 'dist', 'examples');
const examples = readdirSync(dir).filter((f) => f.endsWith('.js')).sort();
if (!examples.length) {
  console.error(`no examples in ${dir}: build first (npm run build)`);
  process.exit(1);
}

function job(file, attempt) {
  const linux = basename(file).startsWith('linux-');
  return {
    name: `${basename(file, '.js')}${attempt > 1 ? '-again' : ''}`,
    cmd: process.execPath,
    args: [join(__dirname, 'with-kvm.js'), ...(linux ? ['--linux'] : []), process.execPath, join(dir, file)],
    // The Linux guest boots under emulation: those take longest, so they start first.
    minutes: linux ? 3 : 1,
    then: (status) => (status === 124 && attempt === 1 ? [job(file, 2)] : []),
  };
}

runInLanes(examples.map((f) => job(f, 1)), { lanes: laneCount(), cwd: root }).then((statuses) => {
  // An example counts by its last attempt.
  const last = new Map();
  for (const [name, status] of statuses) last.set(name.replace(/-again$/, ''), status);
  const failed = [...last].filter(([, status]) => status !== 0);
  console.log(`\nexamples: ${last.size - failed.length} of ${last.size} exited 0${failed.length ? `; failed: ${failed.map(([n, s]) => `${n} (exit ${s})`).join(', ')}` : ''}`);
  process.exit(failed.length ? 1 : 0);
});
