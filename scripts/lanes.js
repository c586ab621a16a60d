// Runs jobs a few at a time ("lanes"), longest first, each one's output prefixed with its name.
// Shared by scripts/run-tests.js and scripts/run-examples.js: on a host without a usable /dev/kvm
// every KVM test and example runs in an emulated L1 (scripts/nested-kvm.sh) whose one vCPU keeps
// one core busy, so on CI's 2 cores two L1s side by side take about half the time of one after
// the other (CI ran them one after the other and took 5,206 s of its 5,400 s limit, 2026-12-02).
'use strict';
const { spawn } = require('node:child_process');
const { createWriteStream } = require('node:fs');

/**
 * Runs `jobs` ({name, cmd, args, env?, minutes?, log?, exclusive?}) at most `lanes` at a time, the
 * largest `minutes` first; an `exclusive` job runs with no other beside it. Each output line goes
 * to stdout as `[name] line` (and whole to `log` if given). A job's `then(status)` may return
 * more jobs (a retry), queued at once. Resolves with Map name -> exit status once every job has
 * ended.
 */
function runInLanes(jobs, { lanes = 2, cwd } = {}) {
  const queue = [...jobs].sort((a, b) => (b.minutes ?? 1) - (a.minutes ?? 1));
  const results = new Map();
  let running = 0;
  let alone = false;
  return new Promise((resolve) => {
    const next = () => {
      while (running < lanes && queue.length && !alone) {
        // An exclusive job waits for the lanes to empty, and the jobs after it wait for it.
        if (queue[0].exclusive && running > 0) break;
        start(queue.shift());
      }
      if (!running && !queue.length) resolve(results);
    };
    const start = (job) => {
      running++;
      alone = Boolean(job.exclusive);
      const began = Date.now();
      console.log(`\n== [${job.name}] start: ${[job.cmd, ...job.args].join(' ')}`);
      const child = spawn(job.cmd, job.args, { cwd, env: { ...process.env, ...job.env }, stdio: ['ignore', 'pipe', 'pipe'] });
      const log = job.log ? createWriteStream(job.log) : null;
      const relay = (stream) => {
        let partial = '';
        stream.on('data', (chunk) => {
          log?.write(chunk);
          const lines = (partial + chunk.toString('utf8')).split('\n');
          partial = lines.pop();
          for (const line of lines) process.stdout.write(`[${job.name}] ${line}\n`);
        });
        stream.on('end', () => partial && process.stdout.write(`[${job.name}] ${partial}\n`));
      };
      relay(child.stdout);
      relay(child.stderr);
      let ended = false;
      const finish = (status) => {
        if (ended) return;
        ended = true;
        log?.end();
        const secs = Math.round((Date.now() - began) / 1000);
        console.log(`== [${job.name}] exit ${status} after ${secs} s`);
        results.set(job.name, status);
        running--;
        if (job.exclusive) alone = false;
        for (const more of job.then?.(status) ?? []) queue.unshift(more);
        next();
      };
      child.on('error', (e) => {
        console.log(`== [${job.name}] could not start: ${e.message}`);
        finish(127);
      });
      child.on('close', (code, signal) => finish(code ?? (signal ? 128 : 1)));
    };
    next();
  });
}

/** Lanes to use: PVISOR_TEST_LANES if set (1 runs everything one after the other), else 2. */
function laneCount() {
  const n = Number(process.env.PVISOR_TEST_LANES ?? 2);
  return Number.isInteger(n) && n >= 1 ? n : 2;
}

module.exports = { runInLanes, laneCount };
