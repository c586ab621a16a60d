// Shared by the repo's scripts: is there a /dev/kvm this user can use, and how to run a command
// on real KVM either way (directly, or inside scripts/nested-kvm.sh when this host has none).
'use strict';
const { accessSync, constants } = require('node:fs');
const { join } = require('node:path');

function kvmUsable() {
  try {
    accessSync(process.env.PVISOR_KVM_DEVICE || '/dev/kvm', constants.R_OK | constants.W_OK);
    return true;
  } catch {
    return false;
  }
}

/** [command, args] that run `argv` where a /dev/kvm exists. */
function onKvm(argv) {
  if (kvmUsable()) return [argv[0], argv.slice(1)];
  return [join(__dirname, 'nested-kvm.sh'), ['--', ...argv]];
}

module.exports = { kvmUsable, onKvm };
