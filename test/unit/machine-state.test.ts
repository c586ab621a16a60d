// The checks a saved machine state goes through when read back: every malformed, truncated or
// newer description is a SnapshotError naming the field, and a valid one reads back unchanged.
import { SnapshotError } from '../../src/errors';
import { parseMachineState } from '../../src/backends/kvm/machine-state';
import { checkVcpuStateFits, parseVcpuState, type VcpuStateFormat } from '../../src/backends/kvm/vcpu-state';
import { checkVmStateFits, parseVmState } from '../../src/backends/kvm/vm-state';
import { blob, machine, vcpu } from '../saved-states';

const format: VcpuStateFormat = { sregsFormat: 'sregs2', xsaveBytes: 4096, xcrs: true, lapic: false, msrIndices: [0x10, 0x6e0] };

function refused(f: () => unknown): SnapshotError {
  try {
    f();
  } catch (e) {
    expect(e).toBeInstanceOf(SnapshotError);
    expect((e as SnapshotError).code).toBe('PVISOR_SNAPSHOT');
    return e as SnapshotError;
  }
  throw new Error('accepted');
}

describe('machine state descriptions', () => {
  it('a valid description survives JSON and reads back equal, 64-bit values exact', () => {
    const m = machine();
    const back = parseMachineState(JSON.parse(JSON.stringify(m)));
    expect(back).toEqual(m);
    expect(BigInt(back.vcpus[0].kvm.msrs[0].value)).toBe(2n ** 64n - 1n);
  });

  it('unknown extra fields are dropped, not carried', () => {
    const m = machine() as any;
    m.vcpus[0].kvm.surprise = 1;
    m.vm.extra = 'x';
    const back = parseMachineState(m) as any;
    expect(back.vcpus[0].kvm.surprise).toBeUndefined();
    expect(back.vm.extra).toBeUndefined();
  });

  it.each<[string, (m: any) => void, RegExp]>([
    ['a newer machine version', (m) => { m.version = 2; }, /^machine\.version: this pvisor reads version 1, the state says number 2$/],
    ['no version', (m) => { delete m.vm.version; }, /^machine\.vm\.version: .* nothing \(missing\)$/],
    ['a newer vCPU version', (m) => { m.vcpus[1].kvm.version = 2; }, /^machine\.vcpus\[1\]\.kvm\.version/],
    ['regs of the wrong size', (m) => { m.vcpus[0].kvm.regs = blob(143); }, /^machine\.vcpus\[0\]\.kvm\.regs: expected 144 bytes, got 143$/],
    ['sregs of the other format\'s size', (m) => { m.vcpus[0].kvm.sregs = blob(312); }, /kvm\.sregs: expected 320 bytes, got 312/],
    ['an unknown sregs format', (m) => { m.vcpus[0].kvm.sregsFormat = 'sregs3'; }, /kvm\.sregsFormat: expected one of sregs2, sregs, got "sregs3"/],
    ['an XSAVE area too small', (m) => { m.vcpus[0].kvm.fpu = blob(416); }, /kvm\.fpu: expected 4096 to 16384 bytes, got 416/],
    ['base64 with stray characters', (m) => { m.vcpus[0].kvm.debugregs = `*${blob(128).slice(1)}`; }, /kvm\.debugregs: expected base64 bytes/],
    ['bytes as a number array', (m) => { m.vcpus[0].kvm.vcpuEvents = [...Buffer.alloc(64)]; }, /kvm\.vcpuEvents: expected base64 bytes, got an array of 64/],
    ['a missing field', (m) => { delete m.vcpus[0].kvm.tscKhz; }, /kvm\.tscKhz: expected an integer in \[1, 4294967295\], got nothing \(missing\)/],
    ['an MSR value as a number', (m) => { m.vcpus[0].kvm.msrs[0].value = 5; }, /kvm\.msrs\[0\]\.value: expected a 64-bit value/],
    ['an MSR index out of range', (m) => { m.vcpus[0].kvm.msrs[1].index = -1; }, /kvm\.msrs\[1\]\.index/],
    ['a PIT without an irqchip', (m) => { delete m.vm.irqchip; }, /^machine\.vm: the irqchip and the PIT are saved together, this state has only the PIT$/],
    ['a short IOAPIC', (m) => { m.vm.irqchip.ioapic = blob(500); }, /machine\.vm\.irqchip\.ioapic: expected 512 bytes, got 500/],
    ['a short clock', (m) => { m.vm.clock = blob(40); }, /machine\.vm\.clock: expected 48 bytes/],
    ['an idle vCPU without its index', (m) => { delete m.vcpus[0].activity.seenUsedIndex; }, /vcpus\[0\]\.activity\.seenUsedIndex/],
    ['vCPUs not a list', (m) => { m.vcpus = {}; }, /^machine\.vcpus: expected an array, got an object$/],
    ['more vCPUs than any machine has', (m) => { m.vcpus = Array(65).fill(m.vcpus[0]); }, /at most 64 entries, got 65/],
    ['null', (m) => { m.vm = null; }, /^machine\.vm: expected an object, got null$/],
  ])('refuses %s', (_what, mutate, message) => {
    const m = JSON.parse(JSON.stringify(machine()));
    mutate(m);
    expect(refused(() => parseMachineState(m)).message).toMatch(message);
  });

  it('a description that does not fit this host or machine is refused, naming the difference', () => {
    const v = parseVcpuState(vcpu());
    expect(() => checkVcpuStateFits(v, format)).not.toThrow();
    expect(refused(() => checkVcpuStateFits(v, { ...format, sregsFormat: 'sregs' })).message).toMatch(/vcpu: saved as sregs2, this host uses sregs/);
    expect(refused(() => checkVcpuStateFits(v, { ...format, xsaveBytes: 8192 })).message).toMatch(/XSAVE area of 4096 bytes, this host's is 8192/);
    expect(refused(() => checkVcpuStateFits(v, { ...format, lapic: true })).message).toMatch(/has no LAPIC, this machine has an in-kernel irqchip/);
    expect(refused(() => checkVcpuStateFits(v, { ...format, msrIndices: [0x10] })).message).toMatch(/MSR 0x6e0, which this host does not save/);
    const vm = parseVmState(machine().vm);
    expect(() => checkVmStateFits(vm, true)).not.toThrow();
    expect(refused(() => checkVmStateFits(vm, false)).message).toMatch(/has an irqchip, this machine has none in the kernel/);
  });
});
