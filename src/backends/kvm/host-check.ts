/**
 * What the host's KVM can run, decided before anything is allocated, so that a VM on a host that
 * cannot run it fails fast with the cause and the way out instead of hanging.
 */
import { accessSync, constants, existsSync } from 'node:fs';
import { HostUnsupportedError } from '../../errors';

/** The kind of KVM the host provides. */
export interface KvmHostInfo {
  /** Path of the KVM device. */
  devicePath: string;
  /**
   * `pvm` for paravirtualised nested KVM (kvm_pvm): guest CPL3 code runs at native speed but CPL0
   * code is instruction-emulated, so a Linux kernel does not finish booting there.
   */
  flavour: 'hardware' | 'pvm';
}

/** Where pvisor looks for KVM; tests may point PVISOR_KVM_DEVICE elsewhere. */
export function kvmDevicePath(): string {
  return process.env.PVISOR_KVM_DEVICE ?? '/dev/kvm';
}

/**
 * Checks that /dev/kvm exists and can be opened read-write; throws {@link HostUnsupportedError}
 * with the reason and the fix otherwise.
 */
export function checkKvmHost(): KvmHostInfo {
  const devicePath = kvmDevicePath();
  const pvm = existsSync('/sys/module/kvm_pvm');
  if (!existsSync(devicePath)) {
    const why = pvm
      ? 'this host has the kvm_pvm module but no KVM device: it is itself a PVM guest, and its KVM does not bind (see dmesg: "kvm-pvm: ... not binding")'
      : 'the kvm module is not loaded or the CPU has no virtualisation extensions enabled';
    throw new HostUnsupportedError(
      `${devicePath} does not exist: ${why}. Run pvisor on a host with KVM (bare metal, or a VM with nested virtualisation), ` +
        'or run it inside the nested harness of the pvisor repository: scripts/nested-kvm.sh -- CMD.',
    );
  }
  try {
    accessSync(devicePath, constants.R_OK | constants.W_OK);
  } catch (e) {
    throw new HostUnsupportedError(
      `${devicePath} is not readable and writable by this user (uid ${process.getuid?.()}): add the user to the group that owns it (usually "kvm") or run as root.`,
      { cause: e },
    );
  }
  return { devicePath, flavour: pvm ? 'pvm' : 'hardware' };
}

/**
 * Throws when the host's KVM cannot run a guest that executes kernel-mode (CPL0) code, such as the
 * Linux guest: on paravirtualised nested KVM every CPL0 instruction is emulated and Linux never
 * reaches userspace (measured: still in early memory setup after 183 s). `audience` words the way
 * out for an SDK caller (`guest: "probe"`) or a `pvisor run` user (`--guest probe`).
 */
export function requireKernelModeGuests(info: KvmHostInfo, guest: string, audience: 'sdk' | 'cli' = 'sdk'): void {
  if (info.flavour === 'pvm') {
    const wayOut = audience === 'cli'
      ? 'Run the probe guest here (pvisor run --guest probe -- STEPS), run the Linux guest inside the nested harness of the pvisor repository (node scripts/with-kvm.js --linux CMD), or on a host with hardware virtualisation (VT-x/AMD-V, or nested virtualisation enabled).'
      : 'Use guest: "probe" here, or run on a host with hardware virtualisation (VT-x/AMD-V, or nested virtualisation enabled).';
    throw new HostUnsupportedError(
      `the ${guest} guest cannot run on this host: its KVM is paravirtualised nested KVM (kvm_pvm), where guest kernel code ` +
        `is instruction-emulated and a Linux kernel does not finish booting. ${wayOut}`,
    );
  }
}
