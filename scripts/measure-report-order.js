#!/usr/bin/env node
// Measures what the Linux guest's free page reporting order gives back to the host (the agent
// sets it to 5 at boot; native-prebuilds/agent/agent.c says why): for each order given, a 512 MiB
// VM with IdleRelease, the order written to /sys/module/page_reporting/parameters, then guest RAM
// on the host 15 s after boot, with 64 MiB of random data held by pvisor-workset, 15 s after
// 16 MiB of it in the middle is freed, and 15 s after all of it is freed. Needs a /dev/kvm that
// runs the Linux guest (scripts/with-kvm.js --linux) and `npx tsc -p tsconfig.json` first.
//   node scripts/with-kvm.js --linux node scripts/measure-report-order.js [ORDERS=10,9,5,2]
'use strict';
const { Vm, IdleRelease } = require('../dist/src/index.js');
const { LinuxWorkingSet } = require('../dist/src/guest/linux-workset.js');

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const orders = (process.argv[2] || '10,9,5,2').split(',').map(Number);
const t0 = Date.now();
// The harness's watchdog ends a run that says nothing for minutes.
const heartbeat = setInterval(() => console.log(`.. ${((Date.now() - t0) / 1000).toFixed(0)} s`), 30000);

(async () => {
  console.log('order | booted | 64 MiB held | 16 MiB of it freed | all freed   (guest RAM PSS on the host, MiB)');
  for (const order of orders) {
    const vm = await Vm.start({ memory: '512MiB', vcpus: 2, bootTimeoutMs: 600000, strategies: [new IdleRelease()] });
    try {
      await vm.exec(['sh', '-c', `echo ${order} > /sys/module/page_reporting/parameters/page_reporting_order`]);
      const guestMiB = () => (vm.memoryUsage().guestRamPssBytes / 2 ** 20).toFixed(1);
      await sleep(15000);
      const booted = guestMiB();
      const ws = await LinuxWorkingSet.start(vm);
      await ws.fill({ sizeMiB: 64, content: 'random', seed: 42 });
      await sleep(5000);
      const held = guestMiB();
      await ws.release({ offsetMiB: 16, sizeMiB: 16 });
      await sleep(15000);
      const part = guestMiB();
      await ws.check();
      await ws.release();
      await sleep(15000);
      console.log(`${order} | ${booted} | ${held} | ${part} | ${guestMiB()}`);
    } finally {
      await vm.stop();
    }
  }
  clearInterval(heartbeat);
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
