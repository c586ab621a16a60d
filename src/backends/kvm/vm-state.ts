/**
 * A VM's KVM-side state that belongs to no vCPU, as a versioned, JSON-serialisable description:
 * the in-kernel irqchip (both PICs and the I/O APIC) and PIT when the machine has them, and
 * kvm-clock. Capture and restore run while no vCPU is inside KVM_RUN.
 */
import * as C from '../../sys/constants';
import type { VmFd } from './ioctls';
import { base64Of, bytesAt, checkVersion, kvmTakes, objectAt } from '../../persist/state-fields';
import { SnapshotError } from '../../errors';

/** The version of {@link VmState} this code writes and reads. */
export const VM_STATE_VERSION = 1;

/** A VM's state outside its vCPUs. Blobs are base64 of the kernel struct named beside each. */
export interface VmState {
  version: typeof VM_STATE_VERSION;
  /** struct kvm_clock_data: the kvm-clock the guest reads. */
  clock: string;
  /** The 512-byte union of struct kvm_irqchip for each chip, when the machine has the in-kernel irqchip. */
  irqchip?: { picMaster: string; picSlave: string; ioapic: string };
  /** struct kvm_pit_state2, when the machine has the in-kernel PIT. */
  pit?: string;
}

/** The chips, in the order they are saved and restored. */
const CHIPS = Object.entries(C.KVM_IRQCHIP_IDS) as [keyof typeof C.KVM_IRQCHIP_IDS, number][];

/** Reads the VM's state; `inKernelIrqchip` says whether it has the irqchip and PIT. */
export function captureVm(vm: VmFd, inKernelIrqchip: boolean): VmState {
  const state: VmState = { version: VM_STATE_VERSION, clock: base64Of(vm.getClock()) };
  if (inKernelIrqchip) {
    const [picMaster, picSlave, ioapic] = CHIPS.map(([, id]) => base64Of(vm.getIrqchip(id)));
    state.irqchip = { picMaster, picSlave, ioapic };
    state.pit = base64Of(vm.getPit2());
  }
  return state;
}

/** Checks a description read back from a file; returns a copy with only the known fields. Throws {@link SnapshotError}. */
export function parseVmState(value: unknown, path = 'vm'): VmState {
  const o = objectAt(value, path);
  checkVersion(o, path, VM_STATE_VERSION);
  const state: VmState = { version: VM_STATE_VERSION, clock: base64Of(bytesAt(o, 'clock', path, C.KVM_CLOCK_DATA_SIZE)) };
  if ((o.irqchip === undefined) !== (o.pit === undefined)) throw new SnapshotError(`${path}: the irqchip and the PIT are saved together, this state has only ${o.pit === undefined ? 'the irqchip' : 'the PIT'}`);
  if (o.irqchip !== undefined) {
    const chips = objectAt(o.irqchip, `${path}.irqchip`);
    const [picMaster, picSlave, ioapic] = CHIPS.map(([key]) => base64Of(bytesAt(chips, key, `${path}.irqchip`, C.KVM_IRQCHIP_DATA_SIZE)));
    state.irqchip = { picMaster, picSlave, ioapic };
    state.pit = base64Of(bytesAt(o, 'pit', path, C.KVM_PIT_STATE2_SIZE));
  }
  return state;
}

/** Refuses a state whose irqchip does not match the machine's, before any ioctl. */
export function checkVmStateFits(state: VmState, inKernelIrqchip: boolean, path = 'vm'): void {
  if ((state.irqchip !== undefined) !== inKernelIrqchip) {
    throw new SnapshotError(`${path}: ${inKernelIrqchip ? 'has no irqchip, this machine has an in-kernel one' : 'has an irqchip, this machine has none in the kernel'}`);
  }
}

/**
 * Writes `state` (through {@link parseVmState} and {@link checkVmStateFits}) into the VM, before
 * its vCPUs: the vCPUs' kvm-clock MSRs and LAPICs are read against the clock and the chips.
 * KVM_CLOCK_REALTIME is cleared: with it KVM would advance the clock by the wall time since the
 * capture, and a restored guest must continue from the instant it was stopped (the agent sets the
 * guest's wall clock itself after a restore). A value KVM refuses is a {@link SnapshotError}
 * naming its field under `path`.
 */
export function restoreVm(vm: VmFd, state: VmState, path = 'vm'): void {
  const { irqchip, pit } = state;
  if (irqchip && pit) {
    for (const [key, id] of CHIPS) kvmTakes(`${path}.irqchip.${key}`, () => vm.setIrqchip(id, Buffer.from(irqchip[key], 'base64')));
    kvmTakes(`${path}.pit`, () => vm.setPit2(Buffer.from(pit, 'base64')));
  }
  const clock = Buffer.from(state.clock, 'base64');
  // >>> 0: a flag in bit 31 must stay a u32 for KVM to judge, not become a negative number.
  clock.writeUInt32LE((clock.readUInt32LE(C.KVM_CLOCK_DATA_FLAGS) & ~C.KVM_CLOCK_REALTIME) >>> 0, C.KVM_CLOCK_DATA_FLAGS);
  kvmTakes(`${path}.clock`, () => vm.setClock(clock));
}
