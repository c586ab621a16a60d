/**
 * One vCPU's KVM-side state as a versioned, JSON-serialisable description: capture from a stopped
 * vCPU, check a description read back from a file, restore it into a vCPU.
 *
 * Every struct is kept as the bytes KVM gave (see VCPU_STRUCTS in ioctls.ts for why). The caller
 * guarantees that the vCPU is not inside KVM_RUN and has no exit left half-done (kvm-machine.ts
 * settles it first): a vCPU stopped after an MMIO or port-I/O exit completes that instruction only
 * when it next enters KVM_RUN, and registers read before then would replay it.
 */
import { SnapshotError } from '../../errors';
import * as C from '../../sys/constants';
import { MAX_MSRS_PER_CALL, type Kvm, type MsrEntry, type VcpuFd, type VmFd } from './ioctls';
import { arrayAt, base64Of, bytesAt, checkVersion, choiceAt, hexU64, integerAt, kvmTakes, objectAt, u64At } from '../../persist/state-fields';

/** The version of {@link VcpuState} this code writes and reads. */
export const VCPU_STATE_VERSION = 1;

/** Largest XSAVE area accepted back (KVM_CAP_XSAVE2 with every extended state, AMX included, is about 11 KiB). */
const MAX_XSAVE_BYTES = 16384;
/** More MSRs than KVM has ever listed: a bound on what a file can make us send. */
const MAX_SAVED_MSRS = 1024;
/** IA32_TSC_DEADLINE: its value only holds while the LAPIC timer is in TSC-deadline mode. */
const MSR_IA32_TSC_DEADLINE = 0x6e0;

/** A vCPU's KVM state. Blobs are base64 of the kernel struct named beside each. */
export interface VcpuState {
  version: typeof VCPU_STATE_VERSION;
  /** struct kvm_mp_state's value (KVM_MP_STATE_RUNNABLE = 0, ...). */
  mpState: number;
  /** struct kvm_regs. */
  regs: string;
  /** struct kvm_sregs2 (KVM_CAP_SREGS2: also the PAE PDPTRs) or struct kvm_sregs. */
  sregsFormat: 'sregs2' | 'sregs';
  sregs: string;
  /** struct kvm_xsave (as large as KVM_CAP_XSAVE2 says; it holds the FPU too) or struct kvm_fpu. */
  fpuFormat: 'xsave' | 'fpu';
  fpu: string;
  /** struct kvm_xcrs, when the host has KVM_CAP_XCRS. */
  xcrs?: string;
  /** struct kvm_lapic_state, when the machine has the in-kernel irqchip (else there is no LAPIC in KVM). */
  lapic?: string;
  /** struct kvm_vcpu_events: pending exception, interrupt, NMI, SMI, interrupt shadow. */
  vcpuEvents: string;
  /** struct kvm_debugregs. */
  debugregs: string;
  /** Every MSR KVM lists as saved (and the feature MSRs the vCPU accepts), values as 0x-hex. */
  msrs: { index: number; value: string }[];
  /** The guest TSC's frequency (KVM_GET_TSC_KHZ). */
  tscKhz: number;
}

/** What this host's KVM offers for a machine's vCPUs: which struct formats, and which MSRs. */
export interface VcpuStateFormat {
  sregsFormat: 'sregs2' | 'sregs';
  /** Bytes of the XSAVE area, or 0: the host has no XSAVE and the FPU is saved as struct kvm_fpu. */
  xsaveBytes: number;
  xcrs: boolean;
  lapic: boolean;
  /** MSRs a vCPU of this machine lets read and write back. */
  msrIndices: number[];
}

/**
 * What a machine's vCPUs can save here. The MSRs are KVM_GET_MSR_INDEX_LIST's and the feature
 * MSRs', kept only if a vCPU both returns and takes back the value: KVM lists some it then refuses
 * in this machine's shape (measured: 0x4b564d06, MSR_KVM_ASYNC_PF_INT, is refused without an
 * in-kernel LAPIC). They are tried on a throwaway VM of the same shape, so that no write touches
 * the guest's own vCPUs.
 *
 * The answer depends only on the host's KVM and the machine's shape, so a process works it out
 * once per shape: a restore is timed to ready, and the throwaway VM with its MSR round trips was a
 * fifth of a Linux clone's restore in the nested harness, where every ioctl is expensive.
 */
export function vcpuStateFormat(kvm: Kvm, vm: VmFd, inKernelIrqchip: boolean, cpuid: Buffer): VcpuStateFormat {
  const features = kvm.checkExtension(C.KVM_CAP_GET_MSR_FEATURES) > 0 ? kvm.featureMsrIndexList() : [];
  const candidates = [...new Set([...kvm.msrIndexList(), ...features])];
  const key = `${candidates.join(',')}|${inKernelIrqchip}|${cpuid.toString('base64')}`;
  let format = knownFormats.get(key);
  if (!format) knownFormats.set(key, (format = probeVcpuStateFormat(kvm, vm, inKernelIrqchip, cpuid, candidates)));
  return { ...format, msrIndices: [...format.msrIndices] };
}

/** Formats this process worked out, by what KVM lists, the machine's shape and its CPUID. */
const knownFormats = new Map<string, VcpuStateFormat>();

function probeVcpuStateFormat(kvm: Kvm, vm: VmFd, inKernelIrqchip: boolean, cpuid: Buffer, candidates: readonly number[]): VcpuStateFormat {
  const xsave2 = vm.checkExtension(C.KVM_CAP_XSAVE2);
  const probeVm = kvm.createVm();
  try {
    if (inKernelIrqchip) probeVm.createIrqchip();
    const vcpu = probeVm.createVcpu(0, kvm.vcpuMmapSize());
    try {
      vcpu.setCpuid(cpuid);
      return {
        sregsFormat: vm.checkExtension(C.KVM_CAP_SREGS2) > 0 ? 'sregs2' : 'sregs',
        xsaveBytes: xsave2 > 0 ? Math.max(xsave2, C.KVM_XSAVE_SIZE) : vm.checkExtension(C.KVM_CAP_XSAVE) > 0 ? C.KVM_XSAVE_SIZE : 0,
        xcrs: vm.checkExtension(C.KVM_CAP_XCRS) > 0,
        lapic: inKernelIrqchip,
        msrIndices: msrsReadAndWrittenBack(vcpu, candidates),
      };
    } finally {
      vcpu.close();
    }
  } finally {
    probeVm.close();
  }
}

/**
 * The `candidates` a vCPU both returns and takes back, in order. KVM_GET_MSRS and KVM_SET_MSRS
 * each stop at the first MSR they refuse and say how many they did, so whole batches go in one
 * call each and a refusal costs one more call, not one call per MSR.
 */
export function msrsReadAndWrittenBack(vcpu: Pick<VcpuFd, 'getMsrs' | 'setMsrs'>, candidates: readonly number[]): number[] {
  const kept: number[] = [];
  let next = 0;
  while (next < candidates.length) {
    const batch = candidates.slice(next, next + MAX_MSRS_PER_CALL);
    const read = vcpu.getMsrs(batch);
    // The MSR after the prefix read is the one refused: skipped.
    next += read.length < batch.length ? read.length + 1 : batch.length;
    let rest = read;
    while (rest.length > 0) {
      const taken = Math.max(0, Math.min(vcpu.setMsrs(rest), rest.length));
      for (let i = 0; i < taken; i++) kept.push(rest[i].index);
      rest = rest.slice(taken + 1);
    }
  }
  return kept;
}

/**
 * Reads a stopped vCPU's state. MP state first: KVM_GET_MP_STATE first delivers INIT/SIPI the
 * LAPIC has latched, which can reset the rest of the vCPU; read after it, the rest agrees with it.
 * The LAPIC before the MSRs, as restore needs them (TSC deadline).
 */
export function captureVcpu(vcpu: VcpuFd, format: VcpuStateFormat): VcpuState {
  const mpState = vcpu.getStruct('mpState').readUInt32LE(0);
  const regs = base64Of(vcpu.getStruct('regs'));
  const sregs = base64Of(vcpu.getStruct(format.sregsFormat));
  const fpu = format.xsaveBytes > 0 ? vcpu.getStruct('xsave2', format.xsaveBytes) : vcpu.getStruct('fpu');
  const xcrs = format.xcrs ? base64Of(vcpu.getStruct('xcrs')) : undefined;
  const lapic = format.lapic ? base64Of(vcpu.getStruct('lapic')) : undefined;
  const msrs: MsrEntry[] = [];
  for (let i = 0; i < format.msrIndices.length; i += MAX_MSRS_PER_CALL) {
    const want = format.msrIndices.slice(i, i + MAX_MSRS_PER_CALL);
    const got = vcpu.getMsrs(want);
    if (got.length !== want.length) throw new SnapshotError(`vCPU ${vcpu.index}: KVM did not return MSR 0x${want[got.length].toString(16)}`);
    msrs.push(...got);
  }
  return {
    version: VCPU_STATE_VERSION,
    mpState,
    regs,
    sregsFormat: format.sregsFormat,
    sregs,
    fpuFormat: format.xsaveBytes > 0 ? 'xsave' : 'fpu',
    fpu: base64Of(fpu),
    ...(xcrs !== undefined && { xcrs }),
    ...(lapic !== undefined && { lapic }),
    vcpuEvents: base64Of(vcpu.getStruct('vcpuEvents')),
    debugregs: base64Of(vcpu.getStruct('debugregs')),
    msrs: msrs.map((m) => ({ index: m.index, value: hexU64(m.value) })),
    tscKhz: vcpu.getTscKhz(),
  };
}

/**
 * Checks a description read back from a file: version, every field present with the size its
 * struct has. Returns a copy holding only the known fields. Throws {@link SnapshotError}.
 */
export function parseVcpuState(value: unknown, path = 'vcpu'): VcpuState {
  const o = objectAt(value, path);
  checkVersion(o, path, VCPU_STATE_VERSION);
  const sregsFormat = choiceAt(o, 'sregsFormat', path, ['sregs2', 'sregs'] as const);
  const fpuFormat = choiceAt(o, 'fpuFormat', path, ['xsave', 'fpu'] as const);
  const blob = (key: string, size: number | { min: number; max: number }) => base64Of(bytesAt(o, key, path, size));
  const msrs = arrayAt(o, 'msrs', path, MAX_SAVED_MSRS).map((m, i) => {
    const e = objectAt(m, `${path}.msrs[${i}]`);
    return { index: integerAt(e, 'index', `${path}.msrs[${i}]`, 0, 0xffffffff), value: hexU64(u64At(e, 'value', `${path}.msrs[${i}]`)) };
  });
  return {
    version: VCPU_STATE_VERSION,
    mpState: integerAt(o, 'mpState', path, 0, 0xffffffff),
    regs: blob('regs', C.KVM_REGS_SIZE),
    sregsFormat,
    sregs: blob('sregs', sregsFormat === 'sregs2' ? C.KVM_SREGS2_SIZE : C.KVM_SREGS_SIZE),
    fpuFormat,
    fpu: blob('fpu', fpuFormat === 'xsave' ? { min: C.KVM_XSAVE_SIZE, max: MAX_XSAVE_BYTES } : C.KVM_FPU_SIZE),
    ...(o.xcrs !== undefined && { xcrs: blob('xcrs', C.KVM_XCRS_SIZE) }),
    ...(o.lapic !== undefined && { lapic: blob('lapic', C.KVM_LAPIC_STATE_SIZE) }),
    vcpuEvents: blob('vcpuEvents', C.KVM_VCPU_EVENTS_SIZE),
    debugregs: blob('debugregs', C.KVM_DEBUGREGS_SIZE),
    msrs,
    tscKhz: integerAt(o, 'tscKhz', path, 1, 0xffffffff),
  };
}

/**
 * Whether this machine can take `state` as it is: the same struct formats and sizes, a LAPIC
 * exactly when the machine has one, and no MSR it does not save. Throws {@link SnapshotError}
 * naming the first difference; runs before any ioctl.
 */
export function checkVcpuStateFits(state: VcpuState, format: VcpuStateFormat, path = 'vcpu'): void {
  const fail = (what: string) => {
    throw new SnapshotError(`${path}: ${what}`);
  };
  if (state.sregsFormat !== format.sregsFormat) fail(`saved as ${state.sregsFormat}, this host uses ${format.sregsFormat}`);
  const fpuFormat = format.xsaveBytes > 0 ? 'xsave' : 'fpu';
  if (state.fpuFormat !== fpuFormat) fail(`FPU saved as ${state.fpuFormat}, this host uses ${fpuFormat}`);
  if (fpuFormat === 'xsave' && Buffer.byteLength(state.fpu, 'base64') !== format.xsaveBytes) {
    fail(`XSAVE area of ${Buffer.byteLength(state.fpu, 'base64')} bytes, this host's is ${format.xsaveBytes}`);
  }
  if ((state.xcrs !== undefined) !== format.xcrs) fail(state.xcrs !== undefined ? 'has XCRs, this host has no KVM_CAP_XCRS' : 'has no XCRs, which this host saves');
  if ((state.lapic !== undefined) !== format.lapic) fail(state.lapic !== undefined ? 'has a LAPIC, this machine has no in-kernel irqchip' : 'has no LAPIC, this machine has an in-kernel irqchip');
  const known = new Set(format.msrIndices);
  const unknown = state.msrs.find((m) => !known.has(m.index));
  if (unknown) fail(`MSR 0x${unknown.index.toString(16)}, which this host does not save`);
}

/**
 * Writes `state` (already through {@link parseVcpuState} and {@link checkVcpuStateFits}) into a
 * stopped vCPU. The order is KVM's, as other VMMs learnt it:
 * - TSC frequency before the MSRs, so that IA32_TSC counts at the saved rate (set only when it
 *   differs: without TSC scaling KVM refuses any change);
 * - sregs before the LAPIC (they carry APIC_BASE) and before the MSRs (EFER, CR4 decide which
 *   MSRs are valid);
 * - LAPIC before the MSRs: KVM keeps IA32_TSC_DEADLINE only while the LAPIC timer is in deadline
 *   mode, so it goes last of all MSRs;
 * - pending events after everything that can raise or clear them; MP state last, since setting
 *   the LAPIC or sregs can change it.
 * A value KVM refuses is a {@link SnapshotError} naming its field under `path`; the vCPU is then
 * half restored, and its machine must be stopped, never run.
 */
export function restoreVcpu(vcpu: VcpuFd, state: VcpuState, path = 'vcpu'): void {
  const bytes = (b64: string) => Buffer.from(b64, 'base64');
  const set = (field: string, name: Parameters<VcpuFd['setStruct']>[0], b64: string) => kvmTakes(`${path}.${field}`, () => vcpu.setStruct(name, bytes(b64)));
  if (vcpu.getTscKhz() !== state.tscKhz) kvmTakes(`${path}.tscKhz`, () => vcpu.setTscKhz(state.tscKhz));
  set('sregs', state.sregsFormat, state.sregs);
  set('regs', 'regs', state.regs);
  set('fpu', state.fpuFormat === 'xsave' ? 'xsave2' : 'fpu', state.fpu);
  if (state.xcrs !== undefined) set('xcrs', 'xcrs', state.xcrs);
  if (state.lapic !== undefined) set('lapic', 'lapic', state.lapic);
  const msrs = state.msrs.map((m, i) => ({ index: m.index, value: BigInt(m.value), at: i }));
  const ordered = [...msrs.filter((m) => m.index !== MSR_IA32_TSC_DEADLINE), ...msrs.filter((m) => m.index === MSR_IA32_TSC_DEADLINE)];
  for (let i = 0; i < ordered.length; i += MAX_MSRS_PER_CALL) {
    const batch = ordered.slice(i, i + MAX_MSRS_PER_CALL);
    const n = kvmTakes(`${path}.msrs[${batch[0].at}..]`, () => vcpu.setMsrs(batch));
    if (n !== batch.length) throw new SnapshotError(`${path}.msrs[${batch[n].at}]: KVM refused MSR 0x${batch[n].index.toString(16)} = ${hexU64(batch[n].value)}`);
  }
  set('vcpuEvents', 'vcpuEvents', state.vcpuEvents);
  set('debugregs', 'debugregs', state.debugregs);
  const mp = Buffer.alloc(C.KVM_MP_STATE_SIZE);
  mp.writeUInt32LE(state.mpState, 0);
  kvmTakes(`${path}.mpState`, () => vcpu.setStruct('mpState', mp));
}
