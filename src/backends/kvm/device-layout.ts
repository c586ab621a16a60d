/**
 * Where a machine's virtio devices sit: the one place that knows their order, hands each its MMIO
 * window and interrupt line, and writes the part of the Linux command line that tells the kernel.
 * The order is fixed (console, balloon, then the disk and the network device): the agent channel's device node depends on
 * the console being virtio device 0, the probe guest finds the console and the balloon at the
 * addresses its boot info gives, and a snapshot's device state is matched to devices by position.
 */
import { AGENT_PORT_PATH } from './devices/virtio-console';
import { VIRTIO_MMIO_SIZE } from './virtio/mmio-transport';

/** The virtio devices a machine may have, in the order they are laid out. */
export type VirtioRole = 'console' | 'balloon' | 'disk' | 'net';

const ORDER: readonly VirtioRole[] = ['console', 'balloon', 'disk', 'net'];
/** First window; one 4 KiB page per device, in the MMIO hole below the probe doorbell. */
const FIRST_BASE = 0xd0000000;
const WINDOW_STRIDE = 0x1000;
/**
 * ISA lines free on the PC the MP table describes (4 is COM1's), routed to the I/O APIC; 8 is the
 * RTC's and 9 ACPI's on a PC, so the network device takes 10.
 */
const IRQS: Record<VirtioRole, number> = { console: 5, balloon: 6, disk: 7, net: 10 };

/** One virtio device's place. */
export interface VirtioSlot {
  role: VirtioRole;
  /** Guest-physical base of its register window. */
  base: number;
  irq: number;
}

/** The virtio devices of one machine and their places. */
export class VirtioLayout {
  readonly slots: readonly VirtioSlot[];

  /** Console and balloon always; the disk and the network device when the machine has them. */
  constructor(options: { disk: boolean; net?: boolean }) {
    const roles = ORDER.filter((r) => (r !== 'disk' || options.disk) && (r !== 'net' || options.net));
    // A device keeps its window and line whether or not an earlier optional one is present.
    this.slots = roles.map((role) => ({ role, base: FIRST_BASE + ORDER.indexOf(role) * WINDOW_STRIDE, irq: IRQS[role] }));
  }

  /** The place of `role`; throws if this machine has no such device. */
  slot(role: VirtioRole): VirtioSlot {
    const s = this.slots.find((x) => x.role === role);
    if (!s) throw new Error(`this machine has no virtio ${role}`);
    return s;
  }

  /** What a Linux kernel must be told of the devices: where each is, and which port is the agent's. */
  linuxCmdline(): string {
    return [
      ...this.slots.map((s) => `virtio_mmio.device=${VIRTIO_MMIO_SIZE}@0x${s.base.toString(16)}:${s.irq}`),
      // The agent's channel is the console device's generic port (see virtio-console.ts).
      `pvisor.channel=${AGENT_PORT_PATH}`,
    ].join(' ');
  }
}
