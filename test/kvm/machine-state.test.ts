// Capture and restore of the KVM-side machine state (vCPUs, VM) on real KVM with the probe guest:
// a restore after clobbering the registers puts the guest back where it was, and a malformed
// description is refused before any of it reaches KVM. Needs /dev/kvm.
import { SnapshotError, SystemCallError, Vm, VmStateError } from '../../src';
import { Kvm } from '../../src/backends/kvm/ioctls';
import { parseMachineState, type MachineState } from '../../src/backends/kvm/machine-state';
import { msrsReadAndWrittenBack } from '../../src/backends/kvm/vcpu-state';
import * as C from '../../src/sys/constants';
import { hexOf } from '../probe-digest';

const MiB = 1024 * 1024;

/** A deep copy of `state` whose vCPU `index` has RIP and RSP set to `value`. */
function withRipRsp(state: MachineState, index: number, value: bigint): MachineState {
  const copy = JSON.parse(JSON.stringify(state)) as MachineState;
  const regs = Buffer.from(copy.vcpus[index].kvm.regs, 'base64');
  regs.writeBigUInt64LE(value, C.KVM_REGS.rip * 8);
  regs.writeBigUInt64LE(value, C.KVM_REGS.rsp * 8);
  copy.vcpus[index].kvm.regs = regs.toString('base64');
  return copy;
}

/** A copy of `state` (through JSON, as a snapshot carries it) changed by `f`. */
function mutated(state: MachineState, f: (s: any) => void): unknown {
  const copy = JSON.parse(JSON.stringify(state));
  f(copy);
  return copy;
}

function ripOf(state: MachineState, index: number): bigint {
  return Buffer.from(state.vcpus[index].kvm.regs, 'base64').readBigUInt64LE(C.KVM_REGS.rip * 8);
}

describe('machine state on KVM (probe guest)', () => {
  let vm: Vm;
  beforeAll(async () => {
    vm = await Vm.start({ guest: 'probe', memory: '256MiB', vcpus: 2 });
  });
  afterAll(() => vm?.stop());

  it('a paused machine captures every vCPU and the VM as JSON that reads back the same', async () => {
    await vm.probe.fill({ sizeMiB: 16, content: 'random', seed: 5 });
    await vm.pause();
    try {
      const state = await vm.kvmMachine.captureState();
      expect(state.vcpus).toHaveLength(2);
      // vCPU 1 parks at its doorbell for good; vCPU 0 idles there, or is on its way after answering.
      expect(state.vcpus[1].activity).toEqual({ kind: 'parked' });
      expect(['idle', 'runnable']).toContain(state.vcpus[0].activity.kind);
      // The probe machine has no in-kernel irqchip: no LAPIC, PIC, IOAPIC or PIT to save.
      expect(state.vm.irqchip).toBeUndefined();
      expect(state.vcpus[0].kvm.lapic).toBeUndefined();
      expect(state.vcpus[0].kvm.msrs.length).toBeGreaterThan(10);
      const json = JSON.stringify(state);
      expect(parseMachineState(JSON.parse(json))).toEqual(state);
      const perVcpu = JSON.stringify(state.vcpus[0]).length;
      console.log(`machine state: ${json.length} bytes of JSON, ${perVcpu} per vCPU, ${state.vcpus[0].kvm.msrs.length} MSRs`);
    } finally {
      await vm.resume();
    }
  });

  it('restoring after the registers were clobbered puts the guest back: its digest is the host model\'s', async () => {
    await vm.probe.fill({ sizeMiB: 32, content: 'random', seed: 9 });
    await vm.pause();
    const state = await vm.kvmMachine.captureState();
    // Clobber both vCPUs through KVM_SET_REGS, and check KVM holds the garbage.
    await vm.kvmMachine.restoreState(withRipRsp(withRipRsp(state, 0, 0xdead0000n), 1, 0xbeef0000n));
    const clobbered = await vm.kvmMachine.captureState();
    expect(ripOf(clobbered, 0)).toBe(0xdead0000n);
    expect(ripOf(clobbered, 1)).toBe(0xbeef0000n);
    await vm.kvmMachine.restoreState(JSON.parse(JSON.stringify(state)));
    const back = await vm.kvmMachine.captureState();
    for (const i of [0, 1]) {
      expect(back.vcpus[i].kvm.regs).toBe(state.vcpus[i].kvm.regs);
      expect(back.vcpus[i].kvm.sregs).toBe(state.vcpus[i].kvm.sregs);
      expect(back.vcpus[i].activity).toEqual(state.vcpus[i].activity);
    }
    await vm.resume();
    expect((await vm.probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 9, sizeBytes: 32 * MiB, rewrites: [] }));
    const r = await vm.probe.rewrite({ fraction: 0.25, seed: 3 });
    expect(r.pagesRewritten).toBe((32 * MiB) / 4096 / 4);
    expect((await vm.probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 9, sizeBytes: 32 * MiB, rewrites: [{ permille: 250, seed: 3 }] }));
  });

  it('a guest stopped in the middle of its work continues it after a restore', async () => {
    const filling = vm.probe.fill({ sizeMiB: 64, content: 'random', seed: 42 });
    await new Promise((r) => setTimeout(r, 60));
    await vm.pause();
    const state = await vm.kvmMachine.captureState();
    await vm.kvmMachine.restoreState(withRipRsp(state, 0, 0n));
    await vm.kvmMachine.restoreState(state);
    await vm.resume();
    await filling;
    expect((await vm.probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 42, sizeBytes: 64 * MiB, rewrites: [] }));
  });

  it('a malformed description is refused with SnapshotError before any ioctl', async () => {
    await vm.probe.fill({ sizeMiB: 8, content: 'repetitive', seed: 4 });
    await vm.pause();
    const state = await vm.kvmMachine.captureState();
    const mutate = (f: (s: any) => void) => mutated(state, f);
    // vCPU 0's part is valid (garbage RIP), vCPU 1's is not: nothing may be applied, vCPU 0 included.
    const halfBad = (f: (s: any) => void) => mutate((s) => {
      s.vcpus[0].kvm.regs = withRipRsp(state, 0, 0x1234n).vcpus[0].kvm.regs;
      f(s);
    });
    const cases: [string, unknown, RegExp][] = [
      ['a newer version', mutate((s) => { s.version = 2; }), /machine\.version: this pvisor reads version 1, the state says number 2/],
      ['a vCPU of a newer version', halfBad((s) => { s.vcpus[1].kvm.version = 2; }), /machine\.vcpus\[1\]\.kvm\.version/],
      ['a short regs blob', halfBad((s) => { s.vcpus[1].kvm.regs = Buffer.alloc(100).toString('base64'); }), /vcpus\[1\]\.kvm\.regs: expected 144 bytes, got 100/],
      ['a missing field', halfBad((s) => { delete s.vcpus[1].kvm.debugregs; }), /vcpus\[1\]\.kvm\.debugregs: expected base64 bytes, got nothing \(missing\)/],
      ['a damaged blob', halfBad((s) => { s.vcpus[1].kvm.sregs = `!${s.vcpus[1].kvm.sregs.slice(1)}`; }), /vcpus\[1\]\.kvm\.sregs: expected base64 bytes/],
      ['an MSR value beyond 64 bits', halfBad((s) => { s.vcpus[1].kvm.msrs[0].value = '0x10000000000000000'; }), /msrs\[0\]\.value/],
      ['an MSR this host does not save', halfBad((s) => { s.vcpus[1].kvm.msrs.push({ index: 0x12345678, value: '0x0' }); }), /MSR 0x12345678, which this host does not save/],
      ['a LAPIC the machine does not have', halfBad((s) => { s.vcpus[1].kvm.lapic = Buffer.alloc(1024).toString('base64'); }), /has a LAPIC, this machine has no in-kernel irqchip/],
      ['an irqchip the machine does not have', halfBad((s) => { s.vm.irqchip = { picMaster: '', picSlave: '', ioapic: '' }; }), /machine\.vm: the irqchip and the PIT are saved together/],
      ['another vCPU count', mutate((s) => { s.vcpus.pop(); }), /the state has 1 vCPUs, this machine 2/],
      ['another activity', halfBad((s) => { s.vcpus[1].activity = { kind: 'sleeping' }; }), /vcpus\[1\]\.activity\.kind/],
      ['not an object', 'state', /machine: expected an object, got "state"/],
    ];
    try {
      for (const [what, bad, message] of cases) {
        const err = await vm.kvmMachine.restoreState(bad).then(() => undefined, (e: unknown) => e);
        expect([what, err]).toEqual([what, expect.any(SnapshotError)]);
        expect((err as SnapshotError).code).toBe('PVISOR_SNAPSHOT');
        expect((err as Error).message).toMatch(message);
      }
      const after = await vm.kvmMachine.captureState();
      expect(after.vcpus[0].kvm.regs).toBe(state.vcpus[0].kvm.regs);
    } finally {
      await vm.resume();
    }
    expect((await vm.probe.digest()).hex).toBe(hexOf({ content: 'repetitive', seed: 4, sizeBytes: 8 * MiB, rewrites: [] }));
  });

  it('a value KVM refuses on restore is a SnapshotError naming its field, with KVM\'s error as cause', async () => {
    await vm.probe.fill({ sizeMiB: 8, content: 'repetitive', seed: 6 });
    await vm.pause();
    const state = await vm.kvmMachine.captureState();
    const mutate = (f: (s: any) => void) => mutated(state, f);
    const blob = (b64: string, offset: number, value: bigint) => {
      const b = Buffer.from(b64, 'base64');
      b.writeBigUInt64LE(value, offset);
      return b.toString('base64');
    };
    // Each passes the shape checks; KVM judges the value (the probe machine has no in-kernel LAPIC,
    // so only RUNNABLE is a valid MP state; kvm_debugregs.flags and kvm_clock_data.flags take no
    // unknown bits).
    const cases: [string, unknown, RegExp][] = [
      ['an MP state', mutate((s) => { s.vcpus[1].kvm.mpState = 1; }), /^machine\.vcpus\[1\]\.kvm\.mpState: KVM refused the saved value \(ioctl\(KVM_SET_MP_STATE\) failed: errno 22 \(EINVAL\)/],
      ['debug register flags', mutate((s) => { s.vcpus[0].kvm.debugregs = blob(s.vcpus[0].kvm.debugregs, 48, 1n); }), /^machine\.vcpus\[0\]\.kvm\.debugregs: KVM refused the saved value \(.*EINVAL/],
      ['clock flags', mutate((s) => { s.vm.clock = blob(s.vm.clock, 8, 0x80000000n); }), /^machine\.vm\.clock: KVM refused the saved value \(.*EINVAL/],
    ];
    try {
      for (const [what, bad, message] of cases) {
        const err = await vm.kvmMachine.restoreState(bad).then(() => undefined, (e: unknown) => e);
        expect([what, err]).toEqual([what, expect.any(SnapshotError)]);
        expect((err as Error).message).toMatch(message);
        expect((err as Error).cause).toBeInstanceOf(SystemCallError);
      }
      // A machine half restored is put right by a whole state.
      await vm.kvmMachine.restoreState(state);
    } finally {
      await vm.resume();
    }
    expect((await vm.probe.digest()).hex).toBe(hexOf({ content: 'repetitive', seed: 6, sizeBytes: 8 * MiB, rewrites: [] }));
  });

  it('only a paused machine captures or restores', async () => {
    await expect(vm.kvmMachine.captureState()).rejects.toThrow(VmStateError);
    await expect(vm.kvmMachine.restoreState({})).rejects.toThrow(/pause it first/);
  });
});

describe('the MSRs a vCPU saves (real KVM)', () => {
  it('asked in batches, they are the ones that read and write back one at a time', () => {
    const kvm = Kvm.open();
    const vm = kvm.createVm();
    try {
      const vcpu = vm.createVcpu(0, kvm.vcpuMmapSize());
      try {
        vcpu.setCpuid(kvm.supportedCpuid());
        const candidates = [...new Set([...kvm.msrIndexList(), ...(kvm.checkExtension(C.KVM_CAP_GET_MSR_FEATURES) > 0 ? kvm.featureMsrIndexList() : [])])];
        const oneByOne = candidates.filter((index) => {
          const read = vcpu.getMsrs([index]);
          return read.length === 1 && vcpu.setMsrs(read) === 1;
        });
        expect(oneByOne.length).toBeGreaterThan(10);
        expect(msrsReadAndWrittenBack(vcpu, candidates)).toEqual(oneByOne);
      } finally {
        vcpu.close();
      }
    } finally {
      vm.close();
      kvm.close();
    }
  });
});
