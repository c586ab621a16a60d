#!/usr/bin/env node
// Measures the size of real snapshots' state.json and manifest.json (docs/snapshots.md: what bounds
// a restore reads). Each argument is GUEST:VCPUS:MEMORY; the probe is given an 8 MiB working set,
// the Linux guest runs one command. On KVM (the Linux guest in the nested harness):
//   node scripts/with-kvm.js --linux node scripts/measure-snapshot-sizes.js probe:8:512MiB linux:2:256MiB
// Needs `npx tsc -p tsconfig.json` first.
'use strict';
const { mkdtempSync, rmSync, statSync } = require('node:fs');
const { join } = require('node:path');
const { Vm } = require('../dist/src');

(async () => {
  const base = mkdtempSync('/var/tmp/pvisor-snapshot-sizes-');
  try {
    for (const shape of process.argv.slice(2)) {
      const [guest, vcpus, memory] = shape.split(':');
      const vm = await Vm.start({ guest, vcpus: Number(vcpus), memory, bootTimeoutMs: 600000 });
      try {
        if (guest === 'probe') await vm.probe.fill({ sizeMiB: 8, content: 'random', seed: 1 });
        else await vm.exec('true');
        const dir = join(base, shape.replace(/:/g, '-'));
        await vm.snapshot(dir);
        console.log(`${shape}: state.json ${statSync(join(dir, 'state.json')).size} bytes, manifest.json ${statSync(join(dir, 'manifest.json')).size} bytes`);
      } finally {
        await vm.stop();
      }
    }
  } finally {
    rmSync(base, { recursive: true, force: true });
  }
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
