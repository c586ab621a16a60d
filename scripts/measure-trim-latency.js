#!/usr/bin/env node
// What the first request after the VMM process gave its idle pages back costs (src/sys/process-pages.ts):
// a Linux VM in this process, `exec true` timed right after the start's trim and again after, with
// the trim and without it (PVISOR_KEEP_PROCESS_PAGES=1), each in a fresh process. In the harness:
//   node scripts/with-kvm.js --linux node --expose-gc scripts/measure-trim-latency.js
'use strict';
const { spawnSync } = require('node:child_process');
const { join } = require('node:path');

if (process.argv[2] === 'child') {
  const { Vm } = require(join(__dirname, '..', 'dist', 'src'));
  (async () => {
    const vm = await Vm.start({ memory: '512MiB', vcpus: 2, bootTimeoutMs: 600_000 });
    const times = [];
    for (let i = 0; i < 3; i++) await vm.exec(['true']); // warm
    await new Promise((r) => setTimeout(r, 4000)); // past the trim that follows a start (2 s)
    for (let i = 0; i < 5; i++) {
      const t0 = performance.now();
      await vm.exec(['true']);
      times.push(performance.now() - t0);
    }
    await vm.stop();
    console.log(JSON.stringify(times));
  })().catch((e) => { console.error(e); process.exit(1); });
} else {
  for (const keep of ['0', '1', '0', '1']) {
    const r = spawnSync(process.execPath, ['--expose-gc', __filename, 'child'], { encoding: 'utf8', env: { ...process.env, PVISOR_KEEP_PROCESS_PAGES: keep } });
    if (r.status !== 0) throw new Error(r.stderr);
    const t = JSON.parse(r.stdout).map((x) => x.toFixed(1));
    console.log(`${keep === '1' ? 'pages kept  ' : 'pages given back'}: exec true, ms: first ${t[0]}, then ${t.slice(1).join(', ')}`);
  }
}
