/**
 * Address decoding for port I/O and MMIO exits: each device claims a range, the bus finds it.
 */

/** What a handler may ask of the vCPU that made the access. */
export type VcpuAction =
  | { kind: 'continue' }
  /** Park until the console's receive used index differs from `seenUsedIndex`. */
  | { kind: 'idle'; seenUsedIndex: number }
  /** Park until the VM stops. */
  | { kind: 'park' }
  /** End the VM: the guest did something it must not. */
  | { kind: 'crash'; reason: string; message: string };

/** A device on a bus; offsets are relative to the range's base. */
export interface BusDevice {
  read(offset: number, size: number): number;
  write(offset: number, size: number, value: number): VcpuAction | void;
}

interface Range {
  base: number;
  size: number;
  device: BusDevice;
}

/** One address space (ports or MMIO). */
export class IoBus {
  private ranges: Range[] = [];

  constructor(readonly name: 'pio' | 'mmio') {}

  /** Claims [base, base+size) for `device`; overlapping claims are a programming error. */
  add(base: number, size: number, device: BusDevice): void {
    for (const r of this.ranges) {
      if (base < r.base + r.size && r.base < base + size) throw new Error(`${this.name} range 0x${base.toString(16)} overlaps 0x${r.base.toString(16)}`);
    }
    this.ranges.push({ base, size, device });
  }

  /**
   * The device and offset owning an access of `size` bytes at `addr`, or undefined. A port is one
   * address whatever the access width (`outl` to port P is P's, not P..P+3's); an MMIO access
   * must fit inside its device's window.
   */
  find(addr: number, size: number): { device: BusDevice; offset: number } | undefined {
    const span = this.name === 'pio' ? 1 : size;
    for (const r of this.ranges) if (addr >= r.base && addr + span <= r.base + r.size) return { device: r.device, offset: addr - r.base };
    return undefined;
  }
}
