// Shared by the repo's scripts: what KVM this host has, and how to run a command on a KVM that can
// run it: directly, or inside scripts/nested-kvm.sh (an emulated L1 with a hardware-style KVM).
//  - no usable /dev/kvm (a PVM guest whose kvm_pvm does not bind): everything goes nested;
//  - kvm_pvm (paravirtualised KVM): the probe guest runs directly, at native speed; the Linux
//    guest cannot (its kernel code would be instruction-emulated), so what needs it goes nested;
//  - hardware KVM: everything runs directly.
'use strict';
const { accessSync, constants, existsSync } = require('node:fs');
const { join } = require('node:path');

function kvmUsable() {
  try {
    accessSync(process.env.PVISOR_KVM_DEVICE || '/dev/kvm', constants.R_OK | constants.W_OK);
    return true;
  } catch {
    return false;
  }
}

/**
 * 'none', 'pvm' (kvm_pvm: CPL3 guests only) or 'hardware'. PVISOR_FORCE_NESTED=1 says 'none', to
 * run everything in the nested harness as a host without KVM (CI's, so far) does.
 */
function kvmFlavour() {
  if (process.env.PVISOR_FORCE_NESTED === '1' || !kvmUsable()) return 'none';
  return existsSync('/sys/module/kvm_pvm') ? 'pvm' : 'hardware';
}

/** True if `argv` can run on this host's own /dev/kvm; `linux`: it boots the Linux guest. */
function runsHere(linux) {
  const flavour = kvmFlavour();
  return flavour === 'hardware' || (flavour === 'pvm' && !linux);
}

/** [command, args] that run `argv` on a KVM that can run it; `linux`: it boots the Linux guest. */
function onKvm(argv, { linux = false } = {}) {
  if (runsHere(linux)) return [argv[0], argv.slice(1)];
  return [join(__dirname, 'nested-kvm.sh'), ['--', ...argv]];
}

module.exports = { kvmUsable, kvmFlavour, runsHere, onKvm };
