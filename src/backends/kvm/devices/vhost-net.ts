/**
 * The host kernel's virtio-net data path (/dev/vhost-net): a kernel thread moves packets between
 * a TAP device and the guest's rings in guest RAM, so no packet passes through Node. One fd per
 * device, owned by this process (VHOST_SET_OWNER); it is told where guest RAM is mapped, where
 * each ring is, the eventfd the guest's notifications arrive on (a KVM ioeventfd) and the eventfd
 * that raises the guest's interrupt (a KVM irqfd). Closing the fd stops the thread.
 */
import * as C from '../../../sys/constants';
import { closeFd, ioctl, openFile } from '../../../sys/libc';
import { scratchStruct } from '../../../sys/scratch';
import type { GuestMemory } from '../guest-memory';
import type { QueueConfig } from '../virtio/queue';

/** The vhost-net device node. */
export const VHOST_NET_PATH = '/dev/vhost-net';

/** One vhost-net instance. */
export class VhostNet {
  private constructor(readonly fd: number) {}

  /** Opens /dev/vhost-net and takes ownership (the kernel worker runs in this process's mm). */
  static open(): VhostNet {
    const fd = openFile(VHOST_NET_PATH, C.O_RDWR | C.O_CLOEXEC);
    try {
      ioctl(fd, C.VHOST_SET_OWNER, 0, 'VHOST_SET_OWNER');
    } catch (e) {
      closeFd(fd);
      throw e;
    }
    return new VhostNet(fd);
  }

  /** Feature bits the kernel's vhost-net implements (ring and header features, not offloads). */
  features(): bigint {
    const s = scratchStruct(8);
    ioctl(this.fd, C.VHOST_GET_FEATURES, s.addr, 'VHOST_GET_FEATURES');
    return s.view.readBigUInt64LE(0);
  }

  setFeatures(features: bigint): void {
    const s = scratchStruct(8);
    s.view.writeBigUInt64LE(features, 0);
    ioctl(this.fd, C.VHOST_SET_FEATURES, s.addr, 'VHOST_SET_FEATURES');
  }

  /** Where guest RAM is, region by region, in this process. */
  setMemTable(mem: GuestMemory): void {
    const s = scratchStruct(C.VHOST_MEMORY_HEADER_SIZE + mem.regions.length * C.VHOST_MEMORY_REGION_SIZE);
    s.view.writeUInt32LE(mem.regions.length, 0);
    mem.regions.forEach((r, i) => {
      const at = C.VHOST_MEMORY_HEADER_SIZE + i * C.VHOST_MEMORY_REGION_SIZE;
      s.view.writeBigUInt64LE(BigInt(r.guestPhysAddr), at);
      s.view.writeBigUInt64LE(BigInt(r.sizeBytes), at + 8);
      s.view.writeBigUInt64LE(BigInt(mem.hostAddr + r.hostOffset), at + 16);
    });
    ioctl(this.fd, C.VHOST_SET_MEM_TABLE, s.addr, 'VHOST_SET_MEM_TABLE');
  }

  /**
   * Ring `index` as the driver configured it: its size, where it starts (`base`: the next
   * available entry; 0 for a fresh ring), its rings' host addresses, and its two eventfds.
   */
  setVring(index: number, mem: GuestMemory, ring: QueueConfig, base: number, kickFd: number, callFd: number): void {
    this.vringState(C.VHOST_SET_VRING_NUM, 'VHOST_SET_VRING_NUM', index, ring.size);
    this.vringState(C.VHOST_SET_VRING_BASE, 'VHOST_SET_VRING_BASE', index, base);
    const host = (gpa: number, len: number) => BigInt(mem.hostAddr + mem.hostOffset(gpa, len));
    const s = scratchStruct(C.VHOST_VRING_ADDR_SIZE);
    s.view.writeUInt32LE(index, 0);
    s.view.writeBigUInt64LE(host(ring.descGpa, 16 * ring.size), 8);
    s.view.writeBigUInt64LE(host(ring.usedGpa, 6 + 8 * ring.size), 16);
    s.view.writeBigUInt64LE(host(ring.availGpa, 6 + 2 * ring.size), 24);
    ioctl(this.fd, C.VHOST_SET_VRING_ADDR, s.addr, 'VHOST_SET_VRING_ADDR');
    this.vringFile(C.VHOST_SET_VRING_KICK, 'VHOST_SET_VRING_KICK', index, kickFd);
    this.vringFile(C.VHOST_SET_VRING_CALL, 'VHOST_SET_VRING_CALL', index, callFd);
  }

  /**
   * Where vhost has got to in ring `index`: the next available entry it will take (its
   * last_avail_idx), what {@link setVring}'s `base` puts back. Read with the ring detached, it
   * no longer moves.
   */
  vringBase(index: number): number {
    const s = scratchStruct(8);
    s.view.writeUInt32LE(index, 0);
    ioctl(this.fd, C.VHOST_GET_VRING_BASE, s.addr, 'VHOST_GET_VRING_BASE');
    return s.view.readUInt32LE(4);
  }

  /** Attaches ring `index` to the TAP `fd`, or with -1 detaches it (the worker stops touching the ring). */
  setBackend(index: number, fd: number): void {
    this.vringFile(C.VHOST_NET_SET_BACKEND, 'VHOST_NET_SET_BACKEND', index, fd);
  }

  close(): void {
    closeFd(this.fd);
  }

  private vringState(request: number, name: string, index: number, num: number): void {
    const s = scratchStruct(8);
    s.view.writeUInt32LE(index, 0);
    s.view.writeUInt32LE(num, 4);
    ioctl(this.fd, request, s.addr, name);
  }

  private vringFile(request: number, name: string, index: number, fd: number): void {
    const s = scratchStruct(8);
    s.view.writeUInt32LE(index, 0);
    s.view.writeInt32LE(fd, 4);
    ioctl(this.fd, request, s.addr, name);
  }
}
