/**
 * A machine's virtio devices, each owned by its role (as Cloud Hypervisor's device manager owns
 * devices by id): for every role, one entry in {@link ROLES} says whether a machine has the
 * device, how it is made, its slot and interrupt line (./device-layout.ts), what the kernel
 * command line says of it beyond its window, and what it does when the machine pauses, resumes
 * and stops. The manager makes each present device with its virtio-mmio transport, its eventfds
 * (ioeventfds, irqfds) and its interrupt, and saves and restores their state keyed by role and
 * slot (as Firecracker's device_manager/persist.rs does), never by position: a saved state with
 * its devices in another order restores the same, and a device missing from it or one this
 * machine lacks is a {@link SnapshotError}.
 *
 * Adding a device: its file under ./devices/ (a {@link VirtioDevice} with its saved state), its
 * entry in {@link ROLES}, and its option in {@link DeviceOptions}. The machine (./kvm-machine.ts)
 * knows only the console by name (its agent channel) and the balloon (whether free page reporting
 * is live).
 */
import { writeSync } from 'node:fs';
import { SnapshotError } from '../../errors';
import { closeFd, createEventFd, EVENTFD_ONE } from '../../sys/libc';
import { VirtioLayout, type VirtioPlace, type VirtioSlot } from './device-layout';
import { VirtioBalloon, type FreePageSink } from './devices/virtio-balloon';
import { VirtioBlk, type DiskConfig } from './devices/virtio-blk';
import { AGENT_PORT_PATH, VirtioConsole } from './devices/virtio-console';
import { VirtioNet, type NetDataPath, type NetTap } from './devices/virtio-net';
import type { GuestMemory } from './guest-memory';
import type { IoBus } from './io-bus';
import type { VmFd } from './ioctls';
import type { VirtioSignalling } from './signalling';
import { arrayAt, choiceAt, integerAt, objectAt } from '../../persist/state-fields';
import { MmioTransport, VIRTIO_MMIO_QUEUE_NOTIFY, VIRTIO_MMIO_SIZE, type TransportState, type VirtioDevice } from './virtio/mmio-transport';

/** Notify-record tags: slot * QUEUES_PER_TAG + queue index. */
export const QUEUES_PER_TAG = 256;

/** The guest's network device: its TAP (the caller's, still open after the machine stops), its data path and MAC. */
export interface NetConfig {
  tap: NetTap;
  /** Opens the data path; called once while the machine is built, closed when it stops. */
  openDataPath: () => NetDataPath;
  mac: Buffer;
}

/** What decides a machine's optional devices and how they are made. */
export interface DeviceOptions {
  /** What happens to ranges the guest reports free; undefined: reports are taken and nothing is dropped. */
  freePageSink?: FreePageSink;
  /**
   * Whether the balloon offers free page reporting. Default: when there is a sink. A machine that
   * will be given saved state offers it always, so that a guest which negotiated it goes on.
   */
  offerFreePageReporting?: boolean;
  /** A disk (virtio-blk): the guest's /dev/vda. */
  disk?: DiskConfig;
  /** A network device (virtio-net over vhost-net): the guest's eth0. Linux guest only. */
  net?: NetConfig;
}

/** What the machine gives its devices. */
export interface DeviceHost {
  readonly memory: GuestMemory;
  /** Bytes the guest sent on the agent channel. */
  onAgentData(bytes: Buffer): void;
  /** The console placed bytes in the guest's receive queue (an idle vCPU may wake). */
  onAgentDelivered(): void;
  /** A device saw a malformed request; the request was refused and the guest goes on. */
  onDeviceError(message: string): void;
  /**
   * A queue whose budget stopped its device goes on later, as a notification `tag` would (the
   * machine holds it while paused and drops it once stopped).
   */
  goOnLater(tag: number): void;
}

/** The part of the VM fd the devices' signals need. */
export type DeviceVm = Pick<VmFd, 'irqLine' | 'irqfd' | 'ioeventfd'>;

/** How the devices signal the guest: {@link VirtioSignalling}, or `polled` (the probe guest: exits, no interrupts). */
export type DeviceSignalling = VirtioSignalling | 'polled';

/** One role's entry: see the module comment. */
interface RoleSpec<D extends VirtioDevice> {
  /** Fixed: its window, and its place on the kernel command line. */
  slot: number;
  irq: number;
  /** Whether a machine built with `options` has this device. */
  present(options: DeviceOptions): boolean;
  /** Makes the device; `used` raises its "used buffers" interrupt through its transport. */
  create(host: DeviceHost, options: DeviceOptions, used: () => void): D;
  /** What the Linux guest is told of it beyond its window, if anything. */
  cmdline?: string;
  /** The machine is pausing: from now on guest RAM is the memory strategies' or a snapshot's. */
  pause?(device: D): void;
  /** The machine has resumed: its vCPUs run again. */
  resume?(device: D): void;
  /** The machine stops: called before vCPU threads are joined and guest RAM is unmapped. */
  close?(device: D): void;
}

const role = <D extends VirtioDevice>(spec: RoleSpec<D>): RoleSpec<D> => spec;

/**
 * Every device a machine may have. ISA line 10 for the network device: 8 is the RTC's and 9
 * ACPI's on a PC (see device-layout.ts).
 */
const ROLES = {
  console: role({
    slot: 0,
    irq: 5,
    present: () => true,
    create: (h, _o, used) => new VirtioConsole(h.memory, (b) => h.onAgentData(b), () => h.onAgentDelivered(), used, (m) => h.onDeviceError(m)),
    // The agent's channel is the console device's generic port (see virtio-console.ts).
    cmdline: `pvisor.channel=${AGENT_PORT_PATH}`,
    pause: (d) => d.holdTransmit(true),
    resume: (d) => {
      d.holdTransmit(false);
      d.deliver();
    },
  }),
  balloon: role({
    slot: 1,
    irq: 6,
    present: () => true,
    // Free page reporting is offered only when something takes the reports (or to restore a guest that uses it).
    create: (h, o, used) => new VirtioBalloon(o.freePageSink ?? (() => {}), used, (m) => h.onDeviceError(m), o.offerFreePageReporting ?? o.freePageSink !== undefined),
  }),
  blk: role({
    slot: 2,
    irq: 7,
    present: (o) => o.disk !== undefined,
    create: (h, o, used) => new VirtioBlk(h.memory, o.disk!, used, (m) => h.onDeviceError(m)),
    close: (d) => d.close(),
  }),
  net: role({
    slot: 3,
    irq: 10,
    present: (o) => o.net !== undefined,
    create: (h, o) => {
      const net = o.net!;
      const path = net.openDataPath();
      try {
        return new VirtioNet(h.memory, net.tap, path, net.mac, (m) => h.onDeviceError(m));
      } catch (e) {
        path.close();
        throw e;
      }
    },
    pause: (d) => d.pause(),
    resume: (d) => d.resume(),
    // vhost's worker touches guest RAM: it stops before RAM is unmapped.
    close: (d) => d.close(),
  }),
};

/** The virtio devices a machine may have. */
export type VirtioRole = keyof typeof ROLES;
type DeviceOf<R extends VirtioRole> = (typeof ROLES)[R] extends RoleSpec<infer D> ? D : never;
const ROLE_NAMES = Object.keys(ROLES) as VirtioRole[];

/** Where each role sits, whatever a machine has: for tests and tools that read the layout. */
export function rolePlaces(roles: readonly VirtioRole[] = ROLE_NAMES): VirtioPlace<VirtioRole>[] {
  return roles.map((r) => ({ role: r, slot: ROLES[r].slot, irq: ROLES[r].irq }));
}

/** One virtio device's saved state: its role and slot, and its transport's state with the device's own. */
export interface VirtioDeviceState {
  role: VirtioRole;
  slot: number;
  transport: TransportState;
}

/** Most virtio device states a saved state may list. */
export const MAX_SAVED_DEVICES = 16;

const V1_ROLES = ['console', 'balloon', 'blk'] as const;

/**
 * The virtio devices' list in a machine's saved device state `o` (see kvm-machine.ts'
 * `DevicesState`) of version `version` (its `virtio`), or of version 1: its `transports`, a list
 * in build order (console, balloon, then blk if any; a networked VM could not be saved then),
 * each taken as the role of its place. Another version is a {@link SnapshotError}.
 */
export function virtioStatesOf(o: Record<string, unknown>, path: string, version: number): { list: unknown[]; path: string } {
  if (o.version === 1) {
    const transports = arrayAt(o, 'transports', path, V1_ROLES.length);
    const places = rolePlaces(V1_ROLES.slice(0, transports.length));
    return { list: transports.map((transport, i) => ({ role: places[i].role, slot: places[i].slot, transport })), path: `${path}.transports` };
  }
  if (o.version !== version) throw new SnapshotError(`${path}.version: this pvisor reads versions 1 and ${version}, the state says ${String(JSON.stringify(o.version)).slice(0, 40)}`);
  return { list: arrayAt(o, 'virtio', path, MAX_SAVED_DEVICES), path: `${path}.virtio` };
}

interface Entry {
  slot: VirtioSlot<VirtioRole>;
  spec: RoleSpec<VirtioDevice>;
  device: VirtioDevice;
  transport: MmioTransport;
}

/** A machine's virtio devices; see the module comment. */
export class DeviceManager {
  readonly layout: VirtioLayout<VirtioRole>;
  /** In slot order. */
  private readonly entries: Entry[] = [];
  /** irqfds and ioeventfds, closed by {@link releaseEventFds} once nothing signals them. */
  private readonly eventFds: number[] = [];

  /**
   * Makes every device `options` asks for, with its transport and interrupt, and puts its window
   * on `mmio`. A device served in the kernel (vhost) gets its ioeventfds and irqfd here. If one
   * cannot be made, those made before are closed and the error thrown.
   */
  constructor(
    options: DeviceOptions,
    host: DeviceHost,
    private readonly vm: DeviceVm,
    private readonly signalling: DeviceSignalling,
    mmio: IoBus,
  ) {
    this.layout = new VirtioLayout(rolePlaces(ROLE_NAMES.filter((r) => ROLES[r].present(options))));
    try {
      for (const slot of this.layout.slots) {
        const spec = ROLES[slot.role] as RoleSpec<VirtioDevice>;
        const tag = slot.slot * QUEUES_PER_TAG;
        let transport: MmioTransport | undefined;
        const device = spec.create(host, options, () => transport?.signalUsed());
        const t = (transport = new MmioTransport(slot.base, device, host.memory, this.interrupt(slot.irq), (m) => host.onDeviceError(m), (q) => host.goOnLater(tag + q)));
        this.entries.push({ slot, spec, device, transport: t });
        if (device.bindKernelSignals) {
          // Served in the kernel whatever the signalling: KVM hands the guest's notifications to
          // the device's eventfds and the device's interrupts to the irqchip, never to this thread.
          const kicks = Array.from({ length: device.queueCount }, (_, q) => this.ioeventfd(slot.base, q));
          const call = this.eventFd();
          vm.irqfd(call, slot.irq);
          device.bindKernelSignals(kicks, call);
        }
        mmio.add(slot.base, VIRTIO_MMIO_SIZE, { read: (o, s) => t.read(o, s), write: (o, s, v) => t.write(o, s, v) });
      }
    } catch (e) {
      this.close(() => {});
      this.releaseEventFds(() => {});
      throw e;
    }
  }

  /** The device of `role`, if this machine has one. */
  get<R extends VirtioRole>(r: R): DeviceOf<R> | undefined {
    return this.entries.find((e) => e.slot.role === r)?.device as DeviceOf<R> | undefined;
  }

  /**
   * With ioeventfd notifications, registers one per queue of each device served in this process
   * and hands it to `watch` with its tag (a native thread reports it); with exits, nothing.
   */
  watchNotifications(watch: (fd: number, tag: number) => void): void {
    if (this.signalling === 'polled' || this.signalling.notify !== 'ioeventfd') return;
    for (const e of this.entries) {
      if (e.transport.servedInKernel) continue;
      for (let q = 0; q < e.transport.queueCount; q++) watch(this.ioeventfd(e.slot.base, q), e.slot.slot * QUEUES_PER_TAG + q);
    }
  }

  /** The guest notified queue `tag % QUEUES_PER_TAG` of the device in slot `tag / QUEUES_PER_TAG`. */
  notify(tag: number): void {
    const slot = Math.floor(tag / QUEUES_PER_TAG);
    this.entries.find((e) => e.slot.slot === slot)?.transport.notify(tag % QUEUES_PER_TAG);
  }

  /** Every queue's notification tag, for a machine that notifies them all once (after a restore). */
  queueTags(): number[] {
    return this.entries.flatMap((e) => Array.from({ length: e.transport.queueCount }, (_, q) => e.slot.slot * QUEUES_PER_TAG + q));
  }

  /** What the Linux kernel must be told of the devices: each window and line, then each role's own fragment. */
  linuxCmdline(): string {
    return [this.layout.linuxCmdline(), ...this.entries.flatMap((e) => (e.spec.cmdline ? [e.spec.cmdline] : []))].join(' ');
  }

  /** Each device's {@link RoleSpec.pause}, in slot order. */
  pause(): void {
    for (const e of this.entries) e.spec.pause?.(e.device);
  }

  /** Each device's {@link RoleSpec.resume}, in slot order. */
  resume(): void {
    for (const e of this.entries) e.spec.resume?.(e.device);
  }

  /** Raises each pending interrupt again, once (see {@link MmioTransport.raisePendingInterrupt}). */
  raisePendingInterrupts(): void {
    for (const e of this.entries) e.transport.raisePendingInterrupt();
  }

  /**
   * Each device's {@link RoleSpec.close}, last slot first; `step` runs each and reports what
   * failed, so that every one runs whatever an earlier one threw.
   */
  close(step: (what: string, work: () => void) => void): void {
    for (const e of [...this.entries].reverse()) {
      const close = e.spec.close;
      if (close) step(`virtio ${e.slot.role} close`, () => close(e.device));
    }
  }

  /** Closes the eventfds, once no vCPU thread or watcher can signal them. */
  releaseEventFds(step: (what: string, work: () => void) => void): void {
    for (const fd of this.eventFds.splice(0)) step('eventfd close', () => closeFd(fd));
  }

  /** Every device's state, in slot order, each with its role and slot. */
  saveState(): VirtioDeviceState[] {
    return this.entries.map((e) => ({ role: e.slot.role, slot: e.slot.slot, transport: e.transport.saveState() }));
  }

  /**
   * Puts {@link saveState}'s list (unchecked, from a file) into these fresh devices, matching
   * each entry to the device of its role, whatever the order. The list is checked whole first: an
   * unknown role, a role given twice, a slot other than this machine's for the role, a device
   * this machine lacks, or one of its devices missing, is a {@link SnapshotError} naming the
   * field, and nothing changes. A device's own state that does not fit is one too; devices
   * restored before it keep what they took (the machine is then stopped, never run).
   */
  restoreState(list: readonly unknown[], path: string): void {
    if (list.length > MAX_SAVED_DEVICES) throw new SnapshotError(`${path}: at most ${MAX_SAVED_DEVICES} entries, got ${list.length}`);
    const matched = list.map((item, i) => {
      const at = `${path}[${i}]`;
      const o = objectAt(item, at);
      const r = choiceAt(o, 'role', at, ROLE_NAMES);
      const entry = this.entries.find((e) => e.slot.role === r);
      if (!entry) throw new SnapshotError(`${at}: the state has a virtio ${r}, this machine none`);
      const slot = integerAt(o, 'slot', at, 0, 0xffff);
      if (slot !== entry.slot.slot) throw new SnapshotError(`${at}.slot: the state has the virtio ${r} in slot ${slot}, this machine in ${entry.slot.slot}`);
      if (list.findIndex((x) => (x as { role?: unknown }).role === r) !== i) throw new SnapshotError(`${at}.role: the state has the virtio ${r} twice`);
      return { entry, transport: o.transport, at: `${at}.transport` };
    });
    const missing = this.entries.filter((e) => !matched.some((m) => m.entry === e));
    if (missing.length) throw new SnapshotError(`${path}: the state has no virtio ${missing.map((e) => e.slot.role).join(', ')}, which this machine has`);
    for (const m of matched) m.entry.transport.restoreState(m.transport, m.at);
  }

  /** An edge on ISA line `irq`: a pulse per event (the probe polls and needs none). */
  private interrupt(irq: number): () => void {
    const s = this.signalling;
    if (s === 'polled') return () => {};
    if (s.interrupt === 'irq-line') {
      return () => {
        this.vm.irqLine(irq, 1);
        this.vm.irqLine(irq, 0);
      };
    }
    const fd = this.eventFd();
    this.vm.irqfd(fd, irq);
    return () => writeSync(fd, EVENTFD_ONE);
  }

  private ioeventfd(base: number, queue: number): number {
    const fd = this.eventFd();
    this.vm.ioeventfd(fd, base + VIRTIO_MMIO_QUEUE_NOTIFY, 4, queue);
    return fd;
  }

  private eventFd(): number {
    const fd = createEventFd();
    this.eventFds.push(fd);
    return fd;
  }
}
