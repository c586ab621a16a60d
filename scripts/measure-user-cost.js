#!/usr/bin/env node
// What running as a user costs a request (the agent reads /etc/passwd and /etc/group, then
// setgroups + setfsgid + setfsuid for a file call, or setgroups/setgid/setuid in the child for an
// exec): medians of `exec true` and `files.stat` as root, as a name and as uid:gid, against the
// agent on this host (test/host-agent.ts, as the unit tests run it; as root). After `npm run build`:
//   node scripts/measure-user-cost.js                       # the agent under ASan + UBSan
//   native-prebuilds/agent/build.sh /tmp/agent && AGENT=/tmp/agent node scripts/measure-user-cost.js
'use strict';
const { join } = require('node:path');
const { buildAgent, findCompiler, startHostAgent } = require(join(__dirname, '..', 'dist', 'test', 'host-agent.js'));

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

(async () => {
  const built = process.env.AGENT ? { bin: process.env.AGENT, remove() {} } : buildAgent(findCompiler());
  const agent = await startHostAgent(built.bin);
  const N = 50;
  const time = async (run) => {
    const ts = [];
    for (let i = 0; i < N; i++) {
      const t = performance.now();
      await run();
      ts.push(performance.now() - t);
    }
    return median(ts);
  };
  try {
    for (const round of [0, 1]) {
      for (const user of [undefined, 'nobody', '65534:65534']) {
        const exec = await time(() => agent.linux.exec(['true'], user ? { user } : {}));
        const stat = await time(() => agent.linux.files.stat('/etc/hostname', user ? { user } : {}));
        if (round) console.log(`${user ?? 'root (no user)'}: exec true median ${exec.toFixed(2)} ms, files.stat median ${stat.toFixed(3)} ms (${N} each)`);
      }
    }
  } finally {
    await agent.stop();
    built.remove();
  }
})();
