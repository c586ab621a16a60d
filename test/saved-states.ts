// Valid saved-state descriptions for the tests of the state parsers (machine, VM, vCPU).
import type { MachineState } from '../src/backends/kvm/machine-state';
import type { VcpuState } from '../src/backends/kvm/vcpu-state';

/** `size` bytes of `fill`, as a state carries a blob (base64). */
export const blob = (size: number, fill = 0) => Buffer.alloc(size, fill).toString('base64');

/** A valid vCPU state description, as KVM on an XSAVE host with sregs2 gives one. */
export function vcpu(): VcpuState {
  return {
    version: 1, mpState: 0, regs: blob(144, 1), sregsFormat: 'sregs2', sregs: blob(320, 2), fpuFormat: 'xsave', fpu: blob(4096, 3),
    xcrs: blob(392), vcpuEvents: blob(64), debugregs: blob(128),
    msrs: [{ index: 0x10, value: '0xffffffffffffffff' }, { index: 0x6e0, value: '0x0' }], tscKhz: 2100000,
  };
}

/** A valid two-vCPU machine description with the in-kernel irqchip. */
export function machine(): MachineState {
  return {
    version: 1,
    vm: { version: 1, clock: blob(48), irqchip: { picMaster: blob(512), picSlave: blob(512), ioapic: blob(512) }, pit: blob(112) },
    vcpus: [{ kvm: vcpu(), activity: { kind: 'idle', seenUsedIndex: 7 } }, { kvm: vcpu(), activity: { kind: 'parked' } }],
  };
}
