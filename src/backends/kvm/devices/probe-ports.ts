/**
 * The probe guest's control ports (docs/probe-guest.md): idle, AP park and abort. A guest at CPL3
 * cannot `hlt` (it is a #GP there), so it asks the VMM to park it through a port write instead.
 */
import type { BusDevice, VcpuAction } from '../io-bus';

/** First control port. */
export const PROBE_PORTS_BASE = 0x600;
/** Ports claimed. */
export const PROBE_PORTS_COUNT = 3;

const IDLE = 0;
const AP_PARK = 1;
const ABORT = 2;

/** Decodes the probe's control ports into vCPU actions. */
export class ProbePorts implements BusDevice {
  read(): number {
    return 0;
  }

  write(offset: number, _size: number, value: number): VcpuAction {
    switch (offset) {
      case IDLE: return { kind: 'idle', seenUsedIndex: value & 0xffff };
      case AP_PARK: return { kind: 'park' };
      case ABORT: return { kind: 'crash', reason: 'guest-abort', message: `the probe guest aborted with code ${value}` };
      default: return { kind: 'continue' };
    }
  }
}
