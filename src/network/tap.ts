/**
 * TAP devices through /dev/net/tun. pvisor's own TAPs are not persistent: the device (and the
 * address on it) exists while the fd is open, so it disappears with the process, even one killed
 * by SIGKILL. A user's TAP (`{ tap: NAME }`) is opened by name, as a persistent TAP made with
 * `ip tuntap add NAME mode tap` is.
 */
import * as C from '../sys/constants';
import { closeFd, ioctl, openFile } from '../sys/libc';
import { scratchStruct } from '../sys/scratch';

/** The clone device. */
export const TUN_PATH = '/dev/net/tun';
/** virtio-net header bytes with VIRTIO_F_VERSION_1 (struct virtio_net_hdr_mrg_rxbuf). */
const VNET_HDR_BYTES = 12;

/** An open TAP. */
export class Tap {
  private constructor(readonly fd: number, readonly name: string) {}

  /**
   * Opens (creating it, if no device has that name and the caller may) TAP `name` with the
   * virtio-net header on every packet, as vhost-net wants it.
   */
  static open(name: string): Tap {
    if (Buffer.byteLength(name) >= C.IFNAMSIZ) throw new RangeError(`interface name ${name} is longer than ${C.IFNAMSIZ - 1} bytes`);
    const fd = openFile(TUN_PATH, C.O_RDWR | C.O_CLOEXEC);
    try {
      const s = scratchStruct(C.IFREQ_SIZE);
      s.view.write(name, 0, 'latin1');
      s.view.writeUInt16LE(C.IFF_TAP | C.IFF_NO_PI | C.IFF_VNET_HDR, C.IFNAMSIZ);
      ioctl(fd, C.TUNSETIFF, s.addr, `TUNSETIFF ${name}`);
      const h = scratchStruct(4);
      h.view.writeInt32LE(VNET_HDR_BYTES, 0);
      ioctl(fd, C.TUNSETVNETHDRSZ, h.addr, 'TUNSETVNETHDRSZ');
    } catch (e) {
      closeFd(fd);
      throw e;
    }
    return new Tap(fd, name);
  }

  /**
   * A TAP another process opened and set up (TUNSETIFF, TUNSETVNETHDRSZ), whose fd this process
   * was handed: a jailed VMM's, whose launcher made it (src/jail/launcher.ts). This process then
   * needs no /dev/net/tun and no CAP_NET_ADMIN, only TUNSETOFFLOAD on the fd.
   */
  static adopt(fd: number, name: string): Tap {
    return new Tap(fd, name);
  }

  /** TUNSETOFFLOAD: the offloads (TUN_F_*) the guest accepts in packets it is given. */
  setOffload(flags: number): void {
    ioctl(this.fd, C.TUNSETOFFLOAD, flags, 'TUNSETOFFLOAD');
  }

  /** Closes the fd: a non-persistent TAP goes away with it. */
  close(): void {
    closeFd(this.fd);
  }
}
