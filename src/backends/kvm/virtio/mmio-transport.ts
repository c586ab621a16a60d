/**
 * The virtio-mmio transport (virtio 1.x "modern", register layout of spec 4.2.2): feature
 * negotiation, device status, queue configuration and notifications, dispatched to one device.
 */
import { SnapshotError } from '../../../errors';
import type { GuestMemory } from '../guest-memory';
import { arrayAt, booleanAt, checkVersion, integerAt, objectAt, u64At, hexU64 } from '../../../persist/state-fields';
import { QueueError, SplitQueue, parseQueueState, type QueueState } from './queue';

/** Register window size of one virtio-mmio device. */
export const VIRTIO_MMIO_SIZE = 0x200;

const MAGIC = 0x74726976; // "virt"
const VENDOR_ID = 0x5056; // "PV"
const MAX_QUEUE_SIZE = 256;

/** Offset of the QueueNotify register, which a KVM ioeventfd may take over. */
export const VIRTIO_MMIO_QUEUE_NOTIFY = 0x050;

/** VIRTIO_F_VERSION_1, bit 32: the modern interface, the only one pvisor speaks. */
export const VIRTIO_F_VERSION_1 = 2n ** 32n;

// Device status bits the transport acts on (virtio 1.x, 2.1).
const STATUS_DRIVER_OK = 4;
const STATUS_FEATURES_OK = 8;
const STATUS_NEEDS_RESET = 64;

const enum Reg {
  MagicValue = 0x000,
  Version = 0x004,
  DeviceId = 0x008,
  VendorId = 0x00c,
  DeviceFeatures = 0x010,
  DeviceFeaturesSel = 0x014,
  DriverFeatures = 0x020,
  DriverFeaturesSel = 0x024,
  QueueSel = 0x030,
  QueueNumMax = 0x034,
  QueueNum = 0x038,
  QueueReady = 0x044,
  QueueNotify = 0x050,
  InterruptStatus = 0x060,
  InterruptAck = 0x064,
  Status = 0x070,
  QueueDescLow = 0x080,
  QueueDescHigh = 0x084,
  QueueDriverLow = 0x090,
  QueueDriverHigh = 0x094,
  QueueDeviceLow = 0x0a0,
  QueueDeviceHigh = 0x0a4,
  ConfigGeneration = 0x0fc,
  Config = 0x100,
}

/** What a virtio device model implements; the transport does the rest. */
export interface VirtioDevice {
  readonly deviceId: number;
  readonly queueCount: number;
  /** Feature bits offered (including VIRTIO_F_VERSION_1). */
  readonly features: bigint;
  /** The largest size queue `index` may have (default {@link MAX_QUEUE_SIZE}). */
  maxQueueSize?(index: number): number;
  /** Bytes of the device config space, read at offset `off`. */
  readConfig(off: number, len: number): number;
  /** The driver set DRIVER_OK; `queues[i]` is null for a queue it did not make ready. */
  activate(queues: (SplitQueue | null)[], acked: bigint): void;
  /** The driver notified queue `index`. */
  notify(index: number): void;
  /** The driver reset the device (status 0). */
  reset(): void;
  /**
   * The device's queues signal the guest from inside the host kernel (vhost through an irqfd),
   * never through {@link MmioTransport.signalUsed}: InterruptStatus then always reports used
   * buffers, or the driver would not look at its rings after such an interrupt.
   */
  readonly signalsInKernel?: boolean;
  /**
   * For a device served in the kernel: the machine's eventfds, one per queue that KVM signals on
   * the guest's QueueNotify write (an ioeventfd), and one that raises the device's interrupt (an
   * irqfd). The machine owns and closes them.
   */
  bindKernelSignals?(kickFds: number[], callFd: number): void;
  /**
   * The device's own state for a snapshot, beyond its queues (the transport saves those): bytes
   * it holds for the guest, for instance. Absent on a device that cannot be snapshotted yet.
   */
  saveState?(): DeviceSavedState;
  /**
   * Takes a {@link saveState} value (unchecked, from a file) back in place of {@link activate}:
   * `queues` and `acked` are as they were. Checks all of `state` first and throws
   * {@link SnapshotError} naming the field under `path`, before it changes anything.
   */
  restoreState?(state: unknown, queues: (SplitQueue | null)[], acked: bigint, path: string): void;
}

/** What a device's {@link VirtioDevice.saveState} returns: JSON, with its own version. */
export interface DeviceSavedState {
  version: number;
}

/** The version of {@link TransportState} this code writes and reads. */
export const TRANSPORT_STATE_VERSION = 1;

/** One queue's registers as the driver wrote them (whether or not the device was activated). */
export interface QueueSlotState {
  num: number;
  ready: boolean;
  desc: number;
  driver: number;
  device: number;
}

/**
 * A transport's saved state: its registers, and once the driver set DRIVER_OK, the live queues'
 * positions and the device's own state. An interrupt pending in `interruptStatus` is raised again
 * at resume ({@link MmioTransport.raisePendingInterrupt}); a device the driver has not activated
 * has no device state.
 */
export interface TransportState {
  version: typeof TRANSPORT_STATE_VERSION;
  deviceId: number;
  status: number;
  deviceFeaturesSel: number;
  driverFeaturesSel: number;
  /** 64 bits, as `0x` hex. */
  driverFeatures: string;
  queueSel: number;
  interruptStatus: number;
  configGeneration: number;
  queues: QueueSlotState[];
  /** Present once activated: one entry per queue, null where the driver made none ready. */
  active?: { queues: (QueueState | null)[]; device: DeviceSavedState };
}

/** A device's register window; `interrupt` raises its interrupt line (edge). */
export class MmioTransport {
  private status = 0;
  private deviceFeaturesSel = 0;
  private driverFeaturesSel = 0;
  private driverFeatures = 0n;
  private queueSel = 0;
  private interruptStatus = 0;
  private configGeneration = 0;
  private queues: QueueSlotState[];
  /** The queues the device was activated with (null where the driver made none ready). */
  private liveQueues: (SplitQueue | null)[] = [];
  private active = false;

  constructor(
    readonly base: number,
    private readonly device: VirtioDevice,
    private readonly mem: GuestMemory,
    private readonly onInterrupt: () => void = () => {},
    private readonly onDeviceError: (message: string) => void = () => {},
    /**
     * How a queue whose budget stopped its device goes on in a later turn: by default a
     * notification at once. A machine passes its own, which waits while it is paused (guest RAM is
     * then the memory strategies') and does nothing once it has stopped.
     */
    private readonly goOnLater: (queueIndex: number) => void = (i) => this.notify(i),
  ) {
    this.queues = this.freshQueues();
  }

  /** This transport's state, for a snapshot of a paused machine (see {@link TransportState}). */
  saveState(): TransportState {
    const d = this.device;
    if (this.active && !d.saveState) throw new SnapshotError(`virtio device ${d.deviceId} cannot save its state yet`);
    return {
      version: TRANSPORT_STATE_VERSION,
      deviceId: d.deviceId,
      status: this.status,
      deviceFeaturesSel: this.deviceFeaturesSel,
      driverFeaturesSel: this.driverFeaturesSel,
      driverFeatures: hexU64(this.driverFeatures),
      queueSel: this.queueSel,
      interruptStatus: this.interruptStatus,
      configGeneration: this.configGeneration,
      queues: this.queues.map((q) => ({ ...q })),
      ...(this.active && { active: { queues: this.liveQueues.map((q) => q?.saveState() ?? null), device: d.saveState!() } }),
    };
  }

  /**
   * Puts a {@link saveState} value (unchecked, from a file) into this transport, which must be
   * fresh (built, never driven) over the restored guest RAM. Everything is checked first, the
   * device's part included; a mismatch with this device (another id, queue count, features it
   * does not offer) or a malformed field is a {@link SnapshotError} naming it, and nothing changes.
   */
  restoreState(value: unknown, path = 'transport'): void {
    const o = objectAt(value, path);
    checkVersion(o, path, TRANSPORT_STATE_VERSION);
    const d = this.device;
    const deviceId = integerAt(o, 'deviceId', path, 0, 0xffff);
    if (deviceId !== d.deviceId) throw new SnapshotError(`${path}.deviceId: the state is of virtio device ${deviceId}, this transport drives ${d.deviceId}`);
    const u32 = (key: string) => integerAt(o, key, path, 0, 0xffffffff);
    const driverFeatures = u64At(o, 'driverFeatures', path);
    const slots = arrayAt(o, 'queues', path, d.queueCount).map((q, i) => parseSlot(q, `${path}.queues[${i}]`));
    if (slots.length !== d.queueCount) throw new SnapshotError(`${path}.queues: the state has ${slots.length} queues, this device ${d.queueCount}`);
    const status = integerAt(o, 'status', path, 0, 0xff);
    const fields = {
      deviceFeaturesSel: u32('deviceFeaturesSel'), driverFeaturesSel: u32('driverFeaturesSel'), queueSel: u32('queueSel'),
      interruptStatus: integerAt(o, 'interruptStatus', path, 0, 3), configGeneration: u32('configGeneration'),
    };
    let live: (SplitQueue | null)[] = [];
    if (o.active !== undefined) {
      const at = `${path}.active`;
      const a = objectAt(o.active, at);
      // Features agreed with the driver must be ones this device offers: a snapshot of a balloon
      // with free page reporting cannot go into one without it.
      const unknown = driverFeatures & ~d.features;
      if (unknown !== 0n) throw new SnapshotError(`${path}.driverFeatures: ${hexU64(unknown)} are features this device does not offer`);
      if (!(status & STATUS_DRIVER_OK)) throw new SnapshotError(`${path}.status: an active device has DRIVER_OK set, the state has ${status}`);
      const queues = arrayAt(a, 'queues', at, d.queueCount);
      if (queues.length !== d.queueCount) throw new SnapshotError(`${at}.queues: the state has ${queues.length} queues, this device ${d.queueCount}`);
      live = queues.map((q, i) => {
        if (q === null) return null;
        const qPath = `${at}.queues[${i}]`;
        const state = parseQueueState(q, qPath);
        // No larger than a driver could make it: the size is also the queue's budget per turn.
        if (state.size > this.maxQueueSize(i)) throw new SnapshotError(`${qPath}.size: ${state.size}, more than the ${this.maxQueueSize(i)} this device's queue takes`);
        return SplitQueue.fromState(this.mem, state, qPath);
      });
      if (!d.restoreState) throw new SnapshotError(`${at}.device: virtio device ${d.deviceId} cannot restore its state yet`);
      d.restoreState(a.device, live, driverFeatures, `${at}.device`);
      live.forEach((q, i) => q && this.wireQueue(q, i));
    }
    this.status = status;
    this.driverFeatures = driverFeatures;
    this.queues = slots;
    Object.assign(this, fields);
    this.liveQueues = live;
    this.active = o.active !== undefined;
  }

  private wireQueue(queue: SplitQueue, i: number): void {
    // A budget-stopped device goes on in a later turn of the event loop, as if notified. No vCPU
    // exit's handler is on the stack there to end the VM on a throw: one would be an uncaught
    // exception, the end of the host process (the VM may even have stopped and unmapped guest RAM
    // since), so it is reported instead.
    queue.onBudgetRenewed = () => {
      try {
        this.goOnLater(i);
      } catch (e) {
        this.onDeviceError(`virtio device ${this.device.deviceId}: queue ${i}: ${(e as Error).message}`);
      }
    };
    queue.onBroken = (why) => this.needsReset(`queue ${i}: ${why}`);
  }

  private freshQueues(): QueueSlotState[] {
    return Array.from({ length: this.device.queueCount }, () => ({ num: 0, ready: false, desc: 0, driver: 0, device: 0 }));
  }

  private maxQueueSize(index: number): number {
    return this.device.maxQueueSize?.(index) ?? MAX_QUEUE_SIZE;
  }

  /**
   * The device cannot go on until the driver resets it (virtio 1.x, 2.1.2): DEVICE_NEEDS_RESET,
   * and a configuration change interrupt so that the driver looks.
   */
  private needsReset(why: string): void {
    this.status |= STATUS_NEEDS_RESET;
    this.interruptStatus |= 2;
    this.onInterrupt();
    this.onDeviceError(`virtio device ${this.device.deviceId} needs a reset: ${why}`);
  }

  /**
   * Raises the interrupt again if one is pending, once, as a restored machine resumes: an edge
   * the snapshotted machine raised through an irqfd is injected by a kernel worker, and may not
   * have reached the irqchip state that was saved; a driver that never sees it would not look at
   * its used ring. A spare one is harmless: the driver reads InterruptStatus and acts on what is set.
   */
  raisePendingInterrupt(): void {
    if (this.interruptStatus) this.onInterrupt();
  }

  /** Signals "used buffers" to the driver (interrupt status bit 0). */
  signalUsed(): void {
    this.interruptStatus |= 1;
    this.onInterrupt();
  }

  /** The driver notified queue `index` (a QueueNotify write, or its ioeventfd). */
  notify(index: number): void {
    if (!this.active || index >= this.queues.length) return;
    this.liveQueues[index]?.renewBudget();
    this.device.notify(index);
  }

  /** Whether the device's queues are served in the kernel (see {@link VirtioDevice.bindKernelSignals}). */
  get servedInKernel(): boolean {
    return this.device.bindKernelSignals !== undefined;
  }

  /** Queues the device has, for whoever registers an ioeventfd per queue. */
  get queueCount(): number {
    return this.device.queueCount;
  }

  read(off: number, len: number): number {
    if (off >= Reg.Config) return this.device.readConfig(off - Reg.Config, len);
    if (len !== 4) return 0;
    const q = this.queues[this.queueSel];
    switch (off) {
      case Reg.MagicValue: return MAGIC;
      case Reg.Version: return 2;
      case Reg.DeviceId: return this.device.deviceId;
      case Reg.VendorId: return VENDOR_ID;
      case Reg.DeviceFeatures:
        return this.deviceFeaturesSel > 1 ? 0 : Number((this.device.features >> BigInt(32 * this.deviceFeaturesSel)) & 0xffffffffn);
      case Reg.QueueNumMax: return q ? this.maxQueueSize(this.queueSel) : 0;
      case Reg.QueueReady: return q?.ready ? 1 : 0;
      case Reg.InterruptStatus: return this.device.signalsInKernel ? this.interruptStatus | 1 : this.interruptStatus;
      case Reg.Status: return this.status;
      case Reg.ConfigGeneration: return this.configGeneration;
      default: return 0;
    }
  }

  write(off: number, len: number, value: number): void {
    if (off >= Reg.Config || len !== 4) return; // config space is read-only for pvisor's devices
    const q = this.queues[this.queueSel];
    switch (off) {
      case Reg.DeviceFeaturesSel: this.deviceFeaturesSel = value; break;
      case Reg.DriverFeaturesSel: this.driverFeaturesSel = value; break;
      case Reg.DriverFeatures:
        // Features are fixed once FEATURES_OK is set (virtio 1.x, 3.1.1): a later write is ignored.
        if (this.status & STATUS_FEATURES_OK) {
          this.onDeviceError(`virtio device ${this.device.deviceId}: the driver rewrote its features after FEATURES_OK; ignored`);
          break;
        }
        if (this.driverFeaturesSel <= 1) {
          const shift = BigInt(32 * this.driverFeaturesSel);
          this.driverFeatures = (this.driverFeatures & ~(0xffffffffn << shift)) | (BigInt(value >>> 0) << shift);
        }
        break;
      case Reg.QueueSel: this.queueSel = value; break;
      case Reg.QueueNum: if (q && !q.ready) q.num = value; break;
      case Reg.QueueReady: if (q) q.ready = value === 1; break;
      case Reg.QueueDescLow: if (q) q.desc = setLow(q.desc, value); break;
      case Reg.QueueDescHigh: if (q) q.desc = setHigh(q.desc, value); break;
      case Reg.QueueDriverLow: if (q) q.driver = setLow(q.driver, value); break;
      case Reg.QueueDriverHigh: if (q) q.driver = setHigh(q.driver, value); break;
      case Reg.QueueDeviceLow: if (q) q.device = setLow(q.device, value); break;
      case Reg.QueueDeviceHigh: if (q) q.device = setHigh(q.device, value); break;
      case Reg.QueueNotify: this.notify(value); break;
      case Reg.InterruptAck: this.interruptStatus &= ~value; break;
      case Reg.Status: this.writeStatus(value); break;
      default: break;
    }
  }

  private writeStatus(value: number): void {
    // The device status is 8 bits (virtio 1.x, 2.1), as QEMU keeps it: the register's upper bits
    // mean nothing, and kept they made a status that a saved state cannot hold.
    value &= 0xff;
    if (value === 0) {
      this.status = 0;
      this.driverFeatures = 0n;
      this.queues = this.freshQueues();
      this.interruptStatus = 0;
      if (this.active) this.device.reset();
      this.active = false;
      this.liveQueues = [];
      return;
    }
    // The driver never clears a status bit but by a reset (virtio 1.x, 2.1.2): dropping
    // FEATURES_OK would re-open feature negotiation on a live device, and dropping DRIVER_OK leaves
    // an active device that a snapshot's restore refuses. DEVICE_NEEDS_RESET is the device's.
    const cleared = this.status & ~STATUS_NEEDS_RESET & ~value;
    if (cleared !== 0) {
      this.onDeviceError(`virtio device ${this.device.deviceId}: the driver cleared status bits 0x${cleared.toString(16)} without a reset; ignored`);
      return;
    }
    value = (value & ~STATUS_NEEDS_RESET) | (this.status & STATUS_NEEDS_RESET);
    if (value & STATUS_FEATURES_OK && !(this.status & STATUS_FEATURES_OK)) {
      // Refuse features the device did not offer, and a driver that does not speak virtio 1.
      const unknown = this.driverFeatures & ~this.device.features;
      if (unknown !== 0n || !(this.driverFeatures & VIRTIO_F_VERSION_1)) value &= ~STATUS_FEATURES_OK;
    }
    if (value & STATUS_DRIVER_OK && !(this.status & STATUS_DRIVER_OK) && !this.active) {
      this.status = value;
      // A device is only used with features both sides agreed on (FEATURES_OK accepted).
      if (!(value & STATUS_FEATURES_OK)) {
        this.status |= STATUS_NEEDS_RESET;
        this.onDeviceError(`virtio device ${this.device.deviceId}: DRIVER_OK without FEATURES_OK; the device needs a reset`);
        return;
      }
      this.activate();
      return;
    }
    this.status = value;
  }

  private activate(): void {
    try {
      const queues = this.queues.map((q, i) => {
        if (!q.ready) return null;
        const max = this.maxQueueSize(i);
        if (q.num === 0 || q.num > max || (q.num & (q.num - 1)) !== 0) throw new QueueError(`queue ${i} size ${q.num} is not a power of two <= ${max}`);
        // The alignment the split ring needs (virtio 1.x, 2.7): it also keeps every ring field
        // inside one guest RAM view, whose seams are page-aligned.
        if (q.desc % 16 || q.driver % 2 || q.device % 4) throw new QueueError(`queue ${i} rings are not aligned (descriptors 16, available 2, used 4 bytes)`);
        const queue = new SplitQueue(this.mem, { size: q.num, descGpa: q.desc, availGpa: q.driver, usedGpa: q.device });
        this.wireQueue(queue, i);
        return queue;
      });
      this.device.activate(queues, this.driverFeatures);
      this.liveQueues = queues;
      this.active = true;
    } catch (e) {
      // A driver that configured its queues wrongly gets DEVICE_NEEDS_RESET, as the spec asks.
      this.status |= STATUS_NEEDS_RESET;
      this.onDeviceError(`virtio device ${this.device.deviceId}: ${(e as Error).message}`);
    }
  }
}

function parseSlot(value: unknown, path: string): QueueSlotState {
  const q = objectAt(value, path);
  // A 64-bit register as the driver wrote it, whatever it holds: the queue is checked when it is
  // used. (A high word beyond 2^21 makes a number past 2^53, which JSON carries as it is.)
  const gpa = (key: string) => integerAt(q, key, path, 0, 2 ** 64);
  return { num: integerAt(q, 'num', path, 0, 0xffffffff), ready: booleanAt(q, 'ready', path), desc: gpa('desc'), driver: gpa('driver'), device: gpa('device') };
}

function setLow(addr: number, value: number): number {
  return Math.floor(addr / 2 ** 32) * 2 ** 32 + (value >>> 0);
}

function setHigh(addr: number, value: number): number {
  return (value >>> 0) * 2 ** 32 + (addr % 2 ** 32);
}
