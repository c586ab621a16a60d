#!/usr/bin/env node
// What the jail's seccomp filter (src/jail/seccomp.ts) costs per system call, with ioctl allowed
// request by request (the filter pvisor installs) against ioctl allowed by driver type byte (the
// filter before it) and no filter at all, in one run: its size in BPF instructions, and the time
// of a loop of calls made in the real sandbox (bubblewrap, pvisor-jail-exec, the filter) by a small
// C program (compiled here with gcc, so node's own overhead is not in the figure). The calls:
// ioctl(-1, KVM_RUN), which every vCPU entry makes and which sits far down the request chain;
// ioctl(-1, TCGETS); and read(-1), which is not an ioctl. No KVM needed (fd -1: the kernel answers
// EBADF after the filter let the call through). Needs root and bubblewrap:
//   node scripts/measure-filter-cost.js [--calls 2000000]
// With --starts N (needs KVM too: in the harness, node scripts/with-kvm.js node scripts/...), it
// also starts N jailed probe VMs under each filter, alternately, and times each from the launch to
// the end of its run (`digest`; the jail's set-up, node's start, the boot, teardown).
'use strict';
const { spawnSync } = require('node:child_process');
const { chmodSync, closeSync, mkdtempSync, openSync, realpathSync, rmSync, writeFileSync } = require('node:fs');
const { tmpdir } = require('node:os');
const { join } = require('node:path');
const seccomp = require('../dist/src/jail/seccomp');
const sandbox = require('../dist/src/jail/sandbox');
const { nativePrebuild, PACKAGE_ROOT } = require('../dist/src/native');
const C = require('../dist/src/sys/constants');
const { evaluateSeccomp: evaluate } = require('../dist/test/seccomp-eval');

const args = process.argv.slice(2);
const calls = Number(args.includes('--calls') ? args[args.indexOf('--calls') + 1] : 2_000_000);
const starts = Number(args.includes('--starts') ? args[args.indexOf('--starts') + 1] : 0);

/** Starts jailed probe VMs under each filter's rules, alternately; prints the median time to the end of each run. */
async function measureStarts(rulesByName) {
  const { JailedVmm } = require('../dist/src/jail/launcher');
  const { resolveLimits } = require('../dist/src/jail/limits');
  const buildFilter = seccomp.buildFilter;
  const backing = mkdtempSync('/var/tmp/pvisor-filter-start-');
  const times = {};
  try {
    for (let i = 0; i < starts; i++) {
      for (const [name, rules] of Object.entries(rulesByName)) {
        // The launcher builds its filter through the module's export: give it these rules.
        seccomp.buildFilter = () => buildFilter(rules);
        const t0 = performance.now();
        const vmm = await JailedVmm.start({ id: `FS${i}`, limits: resolveLimits(undefined, { memoryBytes: 64 * 2 ** 20, vcpus: 1 }), runArgv: ['--guest', 'probe', '--memory', '64MiB', '--vcpus', '1', '--quiet', '--', 'fill 8MiB, digest'], readOnly: [], readWrite: [], backingParent: backing }, { stdout: 'ignore', stderr: 'inherit' });
        const outcome = await vmm.exited();
        if (!('exitCode' in outcome) || outcome.exitCode !== 0) throw new Error(`${name}: the jailed run ended ${JSON.stringify(outcome)}`);
        (times[name] ??= []).push(performance.now() - t0);
      }
    }
  } finally {
    seccomp.buildFilter = buildFilter;
    rmSync(backing, { recursive: true, force: true });
  }
  const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
  console.log(`jailed probe runs (launch to end of 'fill 8MiB, digest'), ${starts} each, alternately:`);
  for (const [name, xs] of Object.entries(times)) console.log(`  ${name}: median ${median(xs).toFixed(0)} ms (${xs.map((x) => x.toFixed(0)).join(', ')})`);
}

async function main() {
  const dir = mkdtempSync(join(tmpdir(), 'pvisor-filter-cost-'));
  // The jail's uid runs the loop from here.
  chmodSync(dir, 0o755);
  try {
    const src = join(dir, 'loop.c');
    writeFileSync(src, `#include <stdio.h>
  #include <stdlib.h>
  #include <sys/syscall.h>
  #include <time.h>
  #include <unistd.h>
  int main(int argc, char **argv) {
    long nr = atol(argv[1]), req = strtol(argv[2], 0, 0), n = atol(argv[3]);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) syscall(nr, -1L, req, 0L);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.1f\\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
  }
  `);
    const bin = join(dir, 'loop');
    const cc = spawnSync('gcc', ['-O2', '-o', bin, src], { encoding: 'utf8' });
    if (cc.status !== 0) throw new Error(`gcc: ${cc.stderr || cc.error}`);

    const byRequest = seccomp.filterRules();
    // The filter before: every request of KVM's, userfaultfd's and vhost's type byte, and the few others one by one.
    const byType = `${byRequest.split('\n').filter((l) => l.startsWith('allow ')).join('\n')}\nioctl-type 0xae\nioctl-type 0xaa\nioctl-type 0xaf\n${[0x5401, 0x5413, 0x5421, 0x541b, 0x5450, 0x5451, 0x400454d0].map((r) => `ioctl 0x${r.toString(16)}`).join('\n')}\n`;
    const filters = { 'none (allow all)': null, 'ioctl by type byte (before)': seccomp.buildFilter(byType), 'ioctl by request (now)': seccomp.buildFilter(byRequest) };
    const nodeModules = realpathSync(join(PACKAGE_ROOT, 'node_modules'));
    const readOnly = [...sandbox.nodeRuntimeFiles(nodeModules), join(PACKAGE_ROOT, 'native-prebuilds'), dir];
    const measure = (program, nr, request) => {
      const filterPath = join(dir, 'filter.bpf');
      // No filter: one rule that allows every call (pvisor-jail-exec always installs one).
      writeFileSync(filterPath, program ?? Buffer.from([0x06, 0, 0, 0, 0, 0, 0xff, 0x7f]));
      const fd = openSync(filterPath, 'r');
      try {
        const a = sandbox.bwrapArgs({ readOnly, readWrite: [], devices: [], links: sandbox.usrMergeLinks(), uid: 65534, gid: 65534, jailExec: nativePrebuild('pvisor-jail-exec'), seccompFd: 5, env: {}, command: [bin, String(nr), String(request), String(calls)] });
        const r = spawnSync('/usr/bin/bwrap', a, { stdio: ['ignore', 'pipe', 'pipe', 'ignore', 'ignore', fd], encoding: 'utf8' });
        if (r.status !== 0) throw new Error(`the loop ended ${r.status}: ${r.stderr}`);
        return Number(r.stdout.trim());
      } finally {
        closeSync(fd);
      }
    };
    const SYS_ioctl = 16, SYS_read = 0;
    const probes = [['ioctl(-1, KVM_RUN)', SYS_ioctl, C.KVM_RUN], ['ioctl(-1, TCGETS)', SYS_ioctl, C.TCGETS], ['read(-1)', SYS_read, 0]];
    console.log(`${calls} calls each; ns per call, best of 3 rounds (filters interleaved)`);
    const best = {};
    for (let round = 0; round < 3; round++) {
      for (const [name, program] of Object.entries(filters)) {
        for (const [probe, nr, req] of probes) {
          const k = `${name}|${probe}`;
          best[k] = Math.min(best[k] ?? Infinity, measure(program, nr, req));
        }
      }
    }
    for (const [name, program] of Object.entries(filters)) {
      const size = program ? `${program.length / seccomp.BPF_INSTRUCTION_BYTES} BPF instructions` : '1 BPF instruction';
      console.log(`${name}: ${size}; ${probes.map(([p]) => `${p} ${best[`${name}|${p}`].toFixed(1)} ns`).join(', ')}`);
    }
      const actionName = (a) => (a === 0x7fff0000 ? 'allow' : a === 0x80000000 ? 'kill' : `0x${a.toString(16)}`);
    const judged = [['ioctl(fd, KVM_RUN)', SYS_ioctl, C.KVM_RUN], ['ioctl(fd, KVM_IRQ_LINE)', SYS_ioctl, C.KVM_IRQ_LINE], ['ioctl(fd, UFFDIO_COPY)', SYS_ioctl, C.UFFDIO_COPY], ['ioctl(fd, TCGETS)', SYS_ioctl, C.TCGETS], ['ioctl(fd, KVM_SET_USER_MEMORY_REGION2)', SYS_ioctl, C.KVM_SET_USER_MEMORY_REGION2], ['read', SYS_read, 0], ['futex', 202, 0]];
    console.log('BPF instructions the kernel executes for one call (exact, by running the program here):');
    for (const [name, program] of Object.entries(filters)) {
      if (!program) continue;
      console.log(`  ${name}: ${judged.map(([c, nr, req]) => { const r = evaluate(program, nr, [3, req, 0, 0, 0, 0]); return `${c} ${r.executed} (${actionName(r.action)})`; }).join(', ')}`);
    }
  if (starts > 0) await measureStarts({ 'ioctl by type byte (before)': byType, 'ioctl by request (now)': byRequest });
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
