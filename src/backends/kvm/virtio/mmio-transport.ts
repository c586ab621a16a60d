/**
 * The virtio-mmio transport (virtio 1.x "modern", register layout of spec 4.2.2): feature
 * negotiation, device status, queue configuration and notifications, dispatched to one device.
 */
import type { GuestMemory } from '../guest-memory';
import { QueueError, SplitQueue } from './queue';

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
}

interface QueueSlot {
  num: number;
  ready: boolean;
  desc: number;
  driver: number;
  device: number;
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
  private queues: QueueSlot[];
  /** The queues the device was activated with (null where the driver made none ready). */
  private liveQueues: (SplitQueue | null)[] = [];
  private active = false;

  constructor(
    readonly base: number,
    private readonly device: VirtioDevice,
    private readonly mem: GuestMemory,
    private readonly onInterrupt: () => void = () => {},
    private readonly onDeviceError: (message: string) => void = () => {},
  ) {
    this.queues = this.freshQueues();
  }

  private freshQueues(): QueueSlot[] {
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
      case Reg.InterruptStatus: return this.interruptStatus;
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
        // A budget-stopped device goes on in a later turn of the event loop, as if notified.
        queue.onBudgetRenewed = () => this.notify(i);
        queue.onBroken = (why) => this.needsReset(`queue ${i}: ${why}`);
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

function setLow(addr: number, value: number): number {
  return Math.floor(addr / 2 ** 32) * 2 ** 32 + (value >>> 0);
}

function setHigh(addr: number, value: number): number {
  return (value >>> 0) * 2 ** 32 + (addr % 2 ** 32);
}
