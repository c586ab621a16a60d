#!/usr/bin/env node
// Runs a command on real KVM: directly where /dev/kvm is usable, otherwise inside the nested
// harness (scripts/nested-kvm.sh), with a note saying so. Exits with the command's status.
'use strict';
const { spawnSync } = require('node:child_process');
const { kvmUsable, onKvm } = require('./kvm-host');

const argv = process.argv.slice(2);
if (!argv.length) {
  console.error('usage: scripts/with-kvm.js CMD [ARGS...]');
  process.exit(2);
}
if (!kvmUsable()) {
  console.error('with-kvm: this host has no usable /dev/kvm (e.g. it is itself a PVM guest); running inside scripts/nested-kvm.sh (QEMU with emulated AMD SVM)');
}
const [cmd, args] = onKvm(argv);
const r = spawnSync(cmd, args, { stdio: 'inherit' });
if (r.error) throw r.error;
process.exit(r.status ?? 1);
