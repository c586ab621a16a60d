/**
 * virtio-net (device id 1): the guest's eth0, one receive and one transmit queue, backed by a TAP
 * device through the kernel's vhost-net (./vhost-net.ts). This model only negotiates: packets never
 * pass through it. At DRIVER_OK it hands vhost the features both sides agreed, guest RAM's map and
 * the rings; the guest's notifications reach vhost through KVM ioeventfds, and vhost raises the
 * guest's interrupt through a KVM irqfd (see {@link VirtioNet.bindKernelSignals}).
 *
 * The virtio-mmio driver reads InterruptStatus on each interrupt and looks at its rings only if
 * bit 0 is set; vhost's interrupts never pass the transport, so the transport reports "used
 * buffers" always for this device ({@link VirtioNet.signalsInKernel}). A spare look costs the
 * guest nothing but a ring read.
 *
 * While the machine is paused the TAP is detached from the rings, so no packet is written into
 * guest RAM that belongs to the memory strategies or to a snapshot; at resume it is attached
 * again and both queues kicked (a notification that came meanwhile was dropped by vhost).
 *
 * Saved state ({@link NetState}): the MAC and where vhost had got to in each ring. The
 * transport's own queue positions mean nothing for this device (vhost, not this process, takes
 * its rings); vhost's are read back with VHOST_GET_VRING_BASE while the rings are detached, and
 * a restore hands them to vhost as the rings' bases. A packet vhost had taken but not finished is
 * not lost: detaching waits for vhost's worker, which returns or puts back what it took.
 */
import { writeSync } from 'node:fs';
import { SnapshotError } from '../../../errors';
import { EVENTFD_ONE } from '../../../sys/libc';
import * as C from '../../../sys/constants';
import type { GuestMemory } from '../guest-memory';
import { arrayAt, checkVersion, objectAt, stringAt } from '../../../persist/state-fields';
import { VIRTIO_F_VERSION_1, type VirtioDevice } from '../virtio/mmio-transport';
import { QueueError, type QueueConfig, type SplitQueue } from '../virtio/queue';

// Feature bits (<linux/virtio_net.h>, <linux/virtio_ring.h>, <linux/virtio_config.h>).
export const VIRTIO_NET_F_CSUM = 1n << 0n;
export const VIRTIO_NET_F_GUEST_CSUM = 1n << 1n;
export const VIRTIO_NET_F_MAC = 1n << 5n;
export const VIRTIO_NET_F_GUEST_TSO4 = 1n << 7n;
export const VIRTIO_NET_F_HOST_TSO4 = 1n << 11n;
export const VIRTIO_NET_F_MRG_RXBUF = 1n << 15n;
export const VIRTIO_RING_F_INDIRECT_DESC = 1n << 28n;
export const VIRTIO_RING_F_EVENT_IDX = 1n << 29n;

/** Offloads the TAP carries out in the virtio-net header: not vhost's business, passed through. */
const OFFLOADS = VIRTIO_NET_F_CSUM | VIRTIO_NET_F_GUEST_CSUM | VIRTIO_NET_F_GUEST_TSO4 | VIRTIO_NET_F_HOST_TSO4;
/** Ring and header features pvisor offers when vhost implements them. */
const RING_FEATURES = VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MRG_RXBUF | VIRTIO_RING_F_INDIRECT_DESC | VIRTIO_RING_F_EVENT_IDX;

export const RECEIVEQ = 0;
export const TRANSMITQ = 1;

/** The part of vhost-net the device drives ({@link VhostNet}; a fake in unit tests). */
export interface NetDataPath {
  features(): bigint;
  setFeatures(features: bigint): void;
  setMemTable(mem: GuestMemory): void;
  setVring(index: number, mem: GuestMemory, ring: QueueConfig, base: number, kickFd: number, callFd: number): void;
  setBackend(index: number, fd: number): void;
  /** The next available entry vhost will take in ring `index` (VHOST_GET_VRING_BASE). */
  vringBase(index: number): number;
  close(): void;
}

/** The version of {@link NetState} this code writes and reads. */
export const NET_STATE_VERSION = 1;

/** virtio-net's own saved state (see the header comment). */
export interface NetState {
  version: typeof NET_STATE_VERSION;
  /** The MAC the guest was given, 12 hex digits: a restore must give it the same. */
  mac: string;
  /** vhost's next available entry in the receive and the transmit ring. */
  ringBases: [number, number];
}

/** The TAP the device's packets go through. */
export interface NetTap {
  fd: number;
  /** TUNSETOFFLOAD: which offloads the TAP may hand the guest (TUN_F_* bits). */
  setOffload(flags: number): void;
}

/** What virtio-net offers, given what vhost implements: VERSION_1 is required. */
export function offeredNetFeatures(vhostFeatures: bigint): bigint {
  if (!(vhostFeatures & VIRTIO_F_VERSION_1)) throw new QueueError('vhost-net does not implement VIRTIO_F_VERSION_1 (a kernel before 4.0?)');
  return (RING_FEATURES & vhostFeatures) | OFFLOADS | VIRTIO_NET_F_MAC;
}

/** The features vhost is told: those the driver acked that vhost itself acts on. */
export function vhostFeaturesFor(acked: bigint, vhostFeatures: bigint): bigint {
  return acked & vhostFeatures & RING_FEATURES;
}

/** TUNSETOFFLOAD flags for what the driver acked: the TAP may only give the guest what it takes. */
export function tapOffloadsFor(acked: bigint): number {
  if (!(acked & VIRTIO_NET_F_GUEST_CSUM)) return 0;
  return C.TUN_F_CSUM | (acked & VIRTIO_NET_F_GUEST_TSO4 ? C.TUN_F_TSO4 : 0);
}

/** The guest's network device. */
export class VirtioNet implements VirtioDevice {
  readonly deviceId = 1;
  readonly queueCount = 2;
  readonly features: bigint;
  readonly signalsInKernel = true;
  private kickFds: number[] = [];
  private callFd = -1;
  private active = false;
  private attached = false;
  private paused = false;
  /** Restored: the first attach raises the interrupt once (see {@link restoreState}). */
  private interruptOwed = false;

  /**
   * @param mac the guest's MAC address (6 bytes)
   * @param vhost the data path; the device owns it (closed by {@link close})
   */
  constructor(
    private readonly mem: GuestMemory,
    private readonly tap: NetTap,
    private readonly vhost: NetDataPath,
    private readonly mac: Buffer,
    private readonly onError: (message: string) => void,
  ) {
    if (mac.length !== 6) throw new RangeError('a MAC address is 6 bytes');
    this.features = offeredNetFeatures(vhost.features());
  }

  /**
   * The machine's eventfds for this device: one per queue that KVM signals on the guest's
   * QueueNotify write (an ioeventfd) and one that raises its interrupt line (an irqfd). vhost
   * reads the first and writes the second; the machine closes them.
   */
  bindKernelSignals(kickFds: number[], callFd: number): void {
    if (kickFds.length !== this.queueCount) throw new RangeError(`virtio-net needs ${this.queueCount} kick eventfds`);
    this.kickFds = kickFds;
    this.callFd = callFd;
  }

  readConfig(off: number, len: number): number {
    // struct virtio_net_config { u8 mac[6]; le16 status; ... }: only the MAC is offered.
    let v = 0;
    for (let i = 0; i < len; i++) v |= (off + i < 6 ? this.mac[off + i] : 0) << (8 * i);
    return v >>> 0;
  }

  activate(queues: (SplitQueue | null)[], acked: bigint): void {
    const rx = queues[RECEIVEQ];
    const tx = queues[TRANSMITQ];
    if (!rx || !tx) throw new QueueError('virtio-net needs both its receive and transmit queues ready');
    if (this.callFd < 0) throw new QueueError('virtio-net was not given its eventfds');
    this.start([rx, tx], acked, [0, 0]);
  }

  private start(rings: SplitQueue[], acked: bigint, bases: readonly number[]): void {
    const v = this.vhost;
    v.setFeatures(vhostFeaturesFor(acked, v.features()));
    v.setMemTable(this.mem);
    rings.forEach((q, i) => v.setVring(i, this.mem, q.config, bases[i], this.kickFds[i], this.callFd));
    this.tap.setOffload(tapOffloadsFor(acked));
    this.active = true;
    if (!this.paused) this.attach();
  }

  /** See {@link NetState}; the rings must be detached (the machine paused). */
  saveState(): NetState {
    if (this.attached) throw new SnapshotError('virtio-net: its rings are still attached to the TAP; pause the machine first');
    return { version: NET_STATE_VERSION, mac: this.mac.toString('hex'), ringBases: [this.vhost.vringBase(RECEIVEQ), this.vhost.vringBase(TRANSMITQ)] };
  }

  /**
   * Takes a {@link saveState} value (unchecked) in place of {@link activate}: vhost is given the
   * rings where it had left them. Another MAC, or a ring missing, is a {@link SnapshotError}
   * before vhost is told anything. The guest may have missed an interrupt vhost raised just before
   * the snapshot (an irqfd's injection is not in the saved irqchip state), so the first attach
   * raises it once; a spare one costs the driver a look at its rings.
   */
  restoreState(value: unknown, queues: (SplitQueue | null)[], acked: bigint, path: string): void {
    const o = objectAt(value, path);
    checkVersion(o, path, NET_STATE_VERSION);
    const mac = stringAt(o, 'mac', path, 12, /^[0-9a-f]{12}$/);
    if (mac !== this.mac.toString('hex')) throw new SnapshotError(`${path}.mac: the saved guest has MAC ${mac}, this device ${this.mac.toString('hex')}`);
    const bases = arrayAt(o, 'ringBases', path, 2).map((b, i) => {
      if (typeof b !== 'number' || !Number.isInteger(b) || b < 0 || b > 0xffff) throw new SnapshotError(`${path}.ringBases[${i}]: expected an integer in [0, 65535]`);
      return b;
    });
    if (bases.length !== 2) throw new SnapshotError(`${path}.ringBases: expected 2 entries, got ${bases.length}`);
    const rx = queues[RECEIVEQ];
    const tx = queues[TRANSMITQ];
    if (!rx || !tx) throw new SnapshotError(`${path}: an active virtio-net has both its queues, the state lacks one`);
    if (this.callFd < 0) throw new SnapshotError(`${path}: this virtio-net was not given its eventfds`);
    this.interruptOwed = true;
    this.start([rx, tx], acked, bases);
  }

  notify(): void {
    // Reached only through an MMIO exit whose value KVM's ioeventfd did not match: no such queue.
  }

  reset(): void {
    this.detach();
    this.active = false;
    this.interruptOwed = false;
  }

  /** The machine is pausing: vhost lets go of the rings (see the header comment). */
  pause(): void {
    this.paused = true;
    this.detach();
  }

  /** The machine resumes: the rings are served again. */
  resume(): void {
    this.paused = false;
    if (this.active) this.attach();
  }

  /** Whether vhost is serving the rings now. */
  get serving(): boolean {
    return this.attached;
  }

  /** Stops vhost and closes its fd (the TAP belongs to whoever made it). */
  close(): void {
    this.detach();
    this.vhost.close();
  }

  private attach(): void {
    if (this.attached) return;
    this.vhost.setBackend(RECEIVEQ, this.tap.fd);
    this.vhost.setBackend(TRANSMITQ, this.tap.fd);
    this.attached = true;
    // Notifications the guest gave while detached were dropped: look at both rings now.
    for (const fd of this.kickFds) writeSync(fd, EVENTFD_ONE);
    if (this.interruptOwed) {
      this.interruptOwed = false;
      writeSync(this.callFd, EVENTFD_ONE);
    }
  }

  private detach(): void {
    if (!this.attached) return;
    this.attached = false;
    for (const q of [RECEIVEQ, TRANSMITQ]) {
      try {
        this.vhost.setBackend(q, -1);
      } catch (e) {
        this.onError(`virtio-net: detaching queue ${q} from the TAP: ${(e as Error).message}`);
      }
    }
  }
}
