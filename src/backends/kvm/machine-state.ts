/**
 * A whole machine's KVM-side state: the VM's ({@link VmState}) and every vCPU's
 * ({@link VcpuState}), with what the VMM knows of each vCPU beyond KVM (whether the guest had
 * parked or idled it). Versioned and JSON-serialisable; a later snapshot step writes it into a
 * checksummed manifest. Device state is not part of it yet.
 */
import { arrayAt, checkVersion, choiceAt, integerAt, objectAt } from '../../persist/state-fields';
import { parseVcpuState, type VcpuState } from './vcpu-state';
import { parseVmState, type VmState } from './vm-state';

/** The version of {@link MachineState} this code writes and reads. */
export const MACHINE_STATE_VERSION = 1;

/** Most vCPUs a description may carry (the vCPU runner's limit). */
export const MAX_SAVED_VCPUS = 64;

/**
 * Where the VMM had left a vCPU: `runnable` goes on at resume; `idle` waits until the console's
 * receive used index moves past `seenUsedIndex`; `parked` stays stopped until the VM ends (the
 * probe's doorbell, docs/probe-guest.md).
 */
export type VcpuActivity = { kind: 'runnable' } | { kind: 'idle'; seenUsedIndex: number } | { kind: 'parked' };

/** One machine's state. */
export interface MachineState {
  version: typeof MACHINE_STATE_VERSION;
  vm: VmState;
  vcpus: { kvm: VcpuState; activity: VcpuActivity }[];
}

/** Checks a description read back from a file, all of it. Throws {@link SnapshotError} naming the field. */
export function parseMachineState(value: unknown, path = 'machine'): MachineState {
  const o = objectAt(value, path);
  checkVersion(o, path, MACHINE_STATE_VERSION);
  const vcpus = arrayAt(o, 'vcpus', path, MAX_SAVED_VCPUS).map((v, i) => {
    const at = `${path}.vcpus[${i}]`;
    const e = objectAt(v, at);
    const a = objectAt(e.activity, `${at}.activity`);
    const kind = choiceAt(a, 'kind', `${at}.activity`, ['runnable', 'idle', 'parked'] as const);
    const activity: VcpuActivity = kind === 'idle' ? { kind, seenUsedIndex: integerAt(a, 'seenUsedIndex', `${at}.activity`, 0, 0xffff) } : { kind };
    return { kvm: parseVcpuState(e.kvm, `${at}.kvm`), activity };
  });
  return { version: MACHINE_STATE_VERSION, vm: parseVmState(o.vm, `${path}.vm`), vcpus };
}
