/**
 * Where a machine's virtio devices sit: each device's MMIO window comes from its fixed slot (a
 * window number), its interrupt is a line of its own, and the Linux kernel is told of them in slot
 * order. The device manager (./device-manager.ts) says which role has which slot and line; this
 * module only turns those into addresses and checks that no two devices share either.
 *
 * A role's slot never changes and does not depend on which other devices a machine has: a
 * saved device state names its role and slot, the probe guest finds the console and the balloon
 * at the addresses its boot info gives, and the agent channel's device node (/dev/vport0p0)
 * depends on the console being the first device the kernel is told of, so the console has slot 0.
 */
import { VIRTIO_MMIO_SIZE } from './virtio/mmio-transport';

/** First window; one 4 KiB page per device, in the MMIO hole below the probe doorbell. */
export const FIRST_WINDOW_BASE = 0xd0000000;
export const WINDOW_STRIDE = 0x1000;
/** Windows there is room for below the probe doorbell (0xd000f000, probe-doorbell.ts). */
export const MAX_WINDOWS = 15;
/**
 * ISA lines a virtio device may take on the PC the MP table describes (mptable.ts routes lines
 * 0-23 to the I/O APIC pins of their number): not 0 (the PIT), 1 (the keyboard), 2 (the PIC
 * cascade, no pin), 4 (COM1), 8 (the RTC), 9 (ACPI on a PC).
 */
const RESERVED_IRQS = new Set([0, 1, 2, 4, 8, 9]);
const MAX_IRQ = 23;

/** Where a role asks to be: its slot (the number of its window) and its interrupt line. */
export interface VirtioPlace<R extends string = string> {
  role: R;
  slot: number;
  irq: number;
}

/** One virtio device's place. */
export interface VirtioSlot<R extends string = string> extends VirtioPlace<R> {
  /** Guest-physical base of its register window. */
  base: number;
}

/** The virtio devices of one machine and their places, in slot order. */
export class VirtioLayout<R extends string = string> {
  readonly slots: readonly VirtioSlot<R>[];

  /**
   * Lays out `places`; a slot or line out of range, reserved, or taken twice, or a role given
   * twice, is a RangeError (a mistake in the device table, never the guest's doing).
   */
  constructor(places: readonly VirtioPlace<R>[]) {
    const seen = { role: new Set<string>(), slot: new Set<number>(), irq: new Set<number>() };
    for (const p of places) {
      if (!Number.isInteger(p.slot) || p.slot < 0 || p.slot >= MAX_WINDOWS) throw new RangeError(`virtio ${p.role}: ${p.slot} is not a slot from 0 to ${MAX_WINDOWS - 1}`);
      if (!Number.isInteger(p.irq) || p.irq < 0 || p.irq > MAX_IRQ || RESERVED_IRQS.has(p.irq)) throw new RangeError(`virtio ${p.role}: line ${p.irq} is not a free ISA line (0-${MAX_IRQ}, not ${[...RESERVED_IRQS].join(', ')})`);
      for (const [what, v] of [['role', p.role], ['slot', p.slot], ['irq', p.irq]] as const) {
        const set = seen[what] as Set<unknown>;
        if (set.has(v)) throw new RangeError(`virtio ${p.role}: ${what} ${v} is taken twice`);
        set.add(v);
      }
    }
    this.slots = [...places].sort((a, b) => a.slot - b.slot).map((p) => ({ ...p, base: FIRST_WINDOW_BASE + p.slot * WINDOW_STRIDE }));
  }

  /** The place of `role`; throws if this machine has no such device. */
  slot(role: R): VirtioSlot<R> {
    const s = this.slots.find((x) => x.role === role);
    if (!s) throw new Error(`this machine has no virtio ${role}`);
    return s;
  }

  /** What a Linux kernel must be told of the devices: where each is and its line, in slot order. */
  linuxCmdline(): string {
    return this.slots.map((s) => `virtio_mmio.device=${VIRTIO_MMIO_SIZE}@0x${s.base.toString(16)}:${s.irq}`).join(' ');
  }
}
