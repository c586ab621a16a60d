/**
 * virtio-console (device id 3), single port, no multiport: pvisor's agent channel. Bytes the
 * guest transmits go to `onData`; bytes the host sends wait in a queue until the guest posts
 * receive buffers.
 */
import type { GuestMemory } from '../guest-memory';
import { VIRTIO_F_VERSION_1, type VirtioDevice } from '../virtio/mmio-transport';
import type { SplitQueue } from '../virtio/queue';

const RECEIVEQ = 0;
const TRANSMITQ = 1;

/** The agent channel's device model. */
export class VirtioConsole implements VirtioDevice {
  readonly deviceId = 3;
  readonly queueCount = 2;
  readonly features = VIRTIO_F_VERSION_1;
  private rx: SplitQueue | null = null;
  private tx: SplitQueue | null = null;
  private outbox: Buffer[] = [];

  /**
   * @param onData bytes from the guest
   * @param onDelivered the host placed bytes in the guest's receive queue (wakes an idle vCPU)
   * @param onUsed the device returned buffers used (raise the interrupt)
   * @param onError a malformed request from the guest
   */
  constructor(
    private readonly mem: GuestMemory,
    private readonly onData: (bytes: Buffer) => void,
    private readonly onDelivered: () => void,
    private readonly onUsed: () => void,
    private readonly onError: (message: string) => void,
  ) {}

  readConfig(): number {
    return 0;
  }

  activate(queues: (SplitQueue | null)[]): void {
    this.rx = queues[RECEIVEQ];
    this.tx = queues[TRANSMITQ];
    this.flush();
  }

  reset(): void {
    this.rx = this.tx = null;
  }

  /** The receive queue's used index, as the guest will see it. */
  get receiveUsedIndex(): number {
    return this.rx?.usedIndex ?? 0;
  }

  /** Queues bytes for the guest and delivers what fits now. */
  send(bytes: Buffer): void {
    if (bytes.length) this.outbox.push(bytes);
    this.flush();
  }

  notify(index: number): void {
    if (index === TRANSMITQ) this.drainTransmit();
    else if (index === RECEIVEQ) this.flush();
  }

  private readonly queueError = (message: string) => this.onError(`virtio-console: ${message}`);

  private drainTransmit(): void {
    const tx = this.tx;
    if (!tx) return;
    const usedBefore = tx.usedIndex;
    let chain;
    while ((chain = tx.popValid(this.queueError))) {
      const parts: Buffer[] = [];
      for (const d of chain.descriptors) if (!d.writable && d.len) parts.push(Buffer.from(this.mem.read(d.gpa, d.len)));
      tx.push(chain.head, 0);
      this.onData(parts.length === 1 ? parts[0] : Buffer.concat(parts));
    }
    if (tx.usedIndex !== usedBefore) this.onUsed();
  }

  private flush(): void {
    const rx = this.rx;
    if (!rx || !this.outbox.length) return;
    const usedBefore = rx.usedIndex;
    let chain;
    while (this.outbox.length && (chain = rx.popValid(this.queueError))) {
      let written = 0;
      for (const d of chain.descriptors) {
        if (!d.writable) continue;
        let room = d.len;
        let at = d.gpa;
        while (room > 0 && this.outbox.length) {
          const head = this.outbox[0];
          const n = Math.min(room, head.length);
          this.mem.write(at, head.subarray(0, n));
          at += n;
          room -= n;
          written += n;
          if (n === head.length) this.outbox.shift();
          else this.outbox[0] = head.subarray(n);
        }
      }
      rx.push(chain.head, written);
    }
    if (rx.usedIndex !== usedBefore) {
      this.onUsed();
      this.onDelivered();
    }
  }
}
