/**
 * The probe guest's doorbell page (docs/probe-guest.md): console bytes, idle, AP park and abort,
 * each a 32-bit store to an unbacked guest-physical page in the MMIO hole.
 *
 * Why not ports: paravirtualised KVM (kvm_pvm) clears RFLAGS.IOPL, so an `out` at CPL3 is a #GP
 * there, while a store to an address no memory slot covers exits as KVM_EXIT_MMIO on every KVM.
 * A guest at CPL3 cannot `hlt` either (a #GP), so it parks by ringing the doorbell.
 */
import type { BusDevice, VcpuAction } from '../io-bus';

/** Guest-physical address of the doorbell page. */
export const PROBE_DOORBELL_BASE = 0xd000f000;
/** Bytes the doorbell claims. */
export const PROBE_DOORBELL_SIZE = 0x1000;

const CONSOLE = 0x00;
const IDLE = 0x04;
const AP_PARK = 0x08;
const ABORT = 0x0c;
const IGNORED = 0x10;

/** Decodes the probe's doorbell stores into vCPU actions; reads return 0. */
export class ProbeDoorbell implements BusDevice {
  /** @param console receives each console byte the probe prints */
  constructor(private readonly console: (byte: number) => void) {}

  read(): number {
    return 0;
  }

  write(offset: number, _size: number, value: number): VcpuAction {
    switch (offset) {
      case CONSOLE:
        this.console(value & 0xff);
        return { kind: 'continue' };
      case IDLE: return { kind: 'idle', seenUsedIndex: value & 0xffff };
      case AP_PARK: return { kind: 'park' };
      case ABORT: return { kind: 'crash', reason: 'guest-abort', message: `the probe guest aborted with code ${value >>> 0}` };
      case IGNORED: return { kind: 'continue' };
      default:
        return { kind: 'crash', reason: 'unhandled-mmio', message: `the probe guest wrote 0x${(value >>> 0).toString(16)} to doorbell offset 0x${offset.toString(16)}, which means nothing` };
    }
  }
}
