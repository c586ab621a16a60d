#!/usr/bin/env node
// Runs a command on real KVM: directly where this host's /dev/kvm can run it, otherwise inside the
// nested harness (scripts/nested-kvm.sh), with a note saying so. `--linux` first: the command
// boots the Linux guest, which a paravirtualised KVM (kvm_pvm) cannot run. Exits with its status.
'use strict';
const { spawnSync } = require('node:child_process');
const { kvmFlavour, onKvm, runsHere } = require('./kvm-host');

let argv = process.argv.slice(2);
const linux = argv[0] === '--linux';
if (linux) argv = argv.slice(1);
if (!argv.length) {
  console.error('usage: scripts/with-kvm.js [--linux] CMD [ARGS...]');
  process.exit(2);
}
if (!runsHere(linux)) {
  const why = kvmFlavour() === 'pvm'
    ? "this host's KVM is paravirtualised (kvm_pvm), which cannot run the Linux guest"
    : 'this host has no usable /dev/kvm (e.g. it is itself a PVM guest)';
  console.error(`with-kvm: ${why}; running inside scripts/nested-kvm.sh (QEMU with emulated AMD SVM)`);
}
const [cmd, args] = onKvm(argv, { linux });
const r = spawnSync(cmd, args, { stdio: 'inherit' });
if (r.error) throw r.error;
process.exit(r.status ?? 1);
