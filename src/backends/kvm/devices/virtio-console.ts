/**
 * virtio-console (device id 3): pvisor's agent channel, one port. Bytes the guest transmits go to
 * `onData`; bytes the host sends wait in a queue until the guest posts receive buffers.
 *
 * The device offers VIRTIO_CONSOLE_F_MULTIPORT so that Linux sees the port as a generic
 * virtio-serial port (/dev/vport0p0), not as a console (/dev/hvc0): the hvc console path sends
 * at most 4 KiB per request and then spins with interrupts off until the host has consumed it,
 * which costs an exit per 4 KiB and keeps a vCPU busy while the VMM works; a generic port sends
 * up to 32 KiB per request and never waits for the host. The probe guest does not negotiate
 * multiport and gets the plain two-queue console.
 */
import type { GuestMemory } from '../guest-memory';
import { arrayAt, base64Of, bytesAt, checkVersion, objectAt } from '../../../persist/state-fields';
import { VIRTIO_F_VERSION_1, type VirtioDevice } from '../virtio/mmio-transport';
import type { Descriptor, SplitQueue } from '../virtio/queue';

/** VIRTIO_CONSOLE_F_MULTIPORT (<linux/virtio_console.h>). */
const VIRTIO_CONSOLE_F_MULTIPORT = 1n << 1n;

// Queues with multiport and max_nr_ports = 1: port 0's receive and transmit queues, then the
// control queues (device-to-driver, driver-to-device).
const RECEIVEQ = 0;
const TRANSMITQ = 1;
const CONTROL_RECEIVEQ = 2;
const CONTROL_TRANSMITQ = 3;

// Control messages, struct virtio_console_control { le32 id; le16 event; le16 value; }.
const DEVICE_READY = 0;
const DEVICE_ADD = 1;
const PORT_READY = 3;
const PORT_OPEN = 6;
const PORT_NAME = 7;
const CONTROL_BYTES = 8;
/**
 * Control answers held for a driver that has posted no buffer for them. The handshake needs three;
 * a guest that asks again and again without taking them must not grow host memory (nor a saved
 * state past what a restore takes).
 */
const MAX_PENDING_CONTROL = 64;

/**
 * The most a transmit chain may carry: the largest frame either guest sends in one buffer (the
 * probe's 1 MiB PING echo and its header), with room to spare. Descriptors may all point at the
 * same region of guest RAM, so a chain is bounded by its sum, not by RAM: beyond it the chain is
 * refused and nothing of it copied (one chain could otherwise make the host copy 256 x RAM).
 */
const MAX_TRANSMIT_CHAIN_BYTES = 1024 * 1024 + 4096;
/** Bytes taken from the transmit queue in one turn of the event loop; the rest in the next. */
const TRANSMIT_BYTES_PER_TURN = 8 * 1024 * 1024;

/** The port's name, as the guest sees it in /sys/class/virtio-ports/vport0p0/name. */
const PORT_NAME_TEXT = 'pvisor.agent';
/** The port's device node in a Linux guest: virtio device 0 (the first on the command line), port 0. */
export const AGENT_PORT_PATH = '/dev/vport0p0';

/** The version of {@link ConsoleState} this code writes and reads. */
export const CONSOLE_STATE_VERSION = 1;

/**
 * Most bytes a saved console may hold for the guest. A snapshot's whole state is bounded tighter
 * (snapshot-dir.ts MAX_STATE_BYTES): this bounds the state given to the device alone.
 */
const MAX_SAVED_OUTBOX_BYTES = 64 * 1024 * 1024;

/**
 * The console's saved state: bytes the host queued for the guest that no receive buffer has taken
 * yet, kept whole so that the agent protocol's framing survives a restore (half a frame dropped
 * would desynchronise the guest's decoder for good). Which queues are which follows from the
 * features the driver acked, saved by the transport.
 */
export interface ConsoleState {
  version: typeof CONSOLE_STATE_VERSION;
  /** Port 0's pending bytes, base64. */
  outbox: string;
  /** Pending control messages, one base64 entry each (never split across buffers). */
  controlOutbox: string[];
}

/** The agent channel's device model. */
export class VirtioConsole implements VirtioDevice {
  readonly deviceId = 3;
  readonly queueCount = 4;
  readonly features = VIRTIO_F_VERSION_1 | VIRTIO_CONSOLE_F_MULTIPORT;
  private rx: SplitQueue | null = null;
  private tx: SplitQueue | null = null;
  private controlRx: SplitQueue | null = null;
  private controlTx: SplitQueue | null = null;
  private outbox: Buffer[] = [];
  private controlOutbox: Buffer[] = [];
  /** See {@link holdTransmit}. */
  private transmitHeldNow = false;

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

  readConfig(off: number, len: number): number {
    // struct virtio_console_config { le16 cols; le16 rows; le32 max_nr_ports; le32 emerg_wr; }
    return off === 4 && len === 4 ? 1 : 0;
  }

  maxQueueSize(index: number): number {
    // Linux fills every receive queue with page-sized buffers up front; control messages are few.
    return index === CONTROL_RECEIVEQ || index === CONTROL_TRANSMITQ ? 16 : 256;
  }

  activate(queues: (SplitQueue | null)[], acked: bigint): void {
    this.takeQueues(queues, acked);
    this.flush();
  }

  private takeQueues(queues: (SplitQueue | null)[], acked: bigint): void {
    this.rx = queues[RECEIVEQ];
    this.tx = queues[TRANSMITQ];
    const multiport = (acked & VIRTIO_CONSOLE_F_MULTIPORT) !== 0n;
    this.controlRx = multiport ? queues[CONTROL_RECEIVEQ] : null;
    this.controlTx = multiport ? queues[CONTROL_TRANSMITQ] : null;
  }

  reset(): void {
    this.rx = this.tx = this.controlRx = this.controlTx = null;
    this.controlOutbox = [];
  }

  /** See {@link ConsoleState}. */
  saveState(): ConsoleState {
    return {
      version: CONSOLE_STATE_VERSION,
      outbox: base64Of(Buffer.concat(this.outbox)),
      controlOutbox: this.controlOutbox.map(base64Of),
    };
  }

  restoreState(value: unknown, queues: (SplitQueue | null)[], acked: bigint, path: string): void {
    const o = objectAt(value, path);
    checkVersion(o, path, CONSOLE_STATE_VERSION);
    const outbox = bytesAt(o, 'outbox', path, { min: 0, max: MAX_SAVED_OUTBOX_BYTES });
    const controlOutbox = arrayAt(o, 'controlOutbox', path, MAX_PENDING_CONTROL).map((_, i) => bytesAt(o.controlOutbox as Record<string, unknown>, String(i), `${path}.controlOutbox`, { min: CONTROL_BYTES, max: 4096 }));
    this.outbox = outbox.length ? [outbox] : [];
    this.controlOutbox = controlOutbox;
    // As activate, but without delivering: the machine is paused; the notifications it gives
    // every live queue at resume flush them.
    this.takeQueues(queues, acked);
  }

  /** The receive queue's used index, as the guest will see it. */
  get receiveUsedIndex(): number {
    return this.rx?.usedIndex ?? 0;
  }

  /** Queues bytes for the guest and delivers what fits now. */
  send(bytes: Buffer): void {
    this.hold(bytes);
    this.flush();
  }

  /**
   * Queues bytes for the guest without touching guest RAM (while the machine is paused, RAM
   * belongs to the memory strategies and to a snapshot); {@link deliver} sends them later. They are
   * part of {@link saveState}.
   */
  hold(bytes: Buffer): void {
    if (bytes.length) this.outbox.push(bytes);
  }

  /** Delivers what {@link hold} queued, as far as receive buffers allow. */
  deliver(): void {
    this.flush();
  }

  /**
   * Stops taking the transmit queue while the machine is paused or stopped (guest RAM is then the
   * memory strategies' or a snapshot's, or gone), or takes it again. A notification while held
   * takes nothing; what waits is taken in a later turn once released. Nothing else holds it: the
   * agent's streams flow under credit (docs/agent-protocol.md, "Stream credit"), so the host
   * takes all the guest transmits and one consumer that does not read never stops the channel.
   */
  holdTransmit(held: boolean): void {
    if (held === this.transmitHeldNow) return;
    this.transmitHeldNow = held;
    const tx = this.tx;
    // A later turn: the resume that releases it may have the device's own delivery on the stack.
    if (!held && tx) setImmediate(() => this.drainLater(tx));
  }

  /** Whether the transmit queue is held ({@link holdTransmit}). */
  get transmitHeld(): boolean {
    return this.transmitHeldNow;
  }

  notify(index: number): void {
    if (index === TRANSMITQ) this.drainTransmit();
    else if (index === RECEIVEQ) this.flush();
    else if (index === CONTROL_TRANSMITQ) this.readControl();
    else if (index === CONTROL_RECEIVEQ) this.flushControl();
  }

  private readonly queueError = (message: string) => this.onError(`virtio-console: ${message}`);

  /** Raises the interrupt if the driver wants it; true if chains were returned at all. */
  private signal(q: SplitQueue, usedBefore: number): boolean {
    if (q.shouldInterrupt(usedBefore)) this.onUsed();
    return q.usedIndex !== usedBefore;
  }

  private drainTransmit(): void {
    const tx = this.tx;
    if (!tx || this.transmitHeldNow) return;
    const usedBefore = tx.usedIndex;
    let taken = 0;
    let chain;
    // onData may stop the machine: the next chain then stays the guest's.
    while (!this.transmitHeldNow && taken < TRANSMIT_BYTES_PER_TURN && (chain = tx.popValid(this.queueError))) {
      const readable = chain.descriptors.filter((d) => !d.writable && d.len);
      const bytes = readable.reduce((n, d) => n + d.len, 0);
      if (bytes > MAX_TRANSMIT_CHAIN_BYTES) {
        tx.push(chain.head, 0);
        this.queueError(`transmit chain ${chain.head} carries ${bytes} bytes, more than ${MAX_TRANSMIT_CHAIN_BYTES}: refused`);
        continue;
      }
      taken += bytes;
      const parts = readable.map((d) => Buffer.from(this.mem.read(d.gpa, d.len)));
      tx.push(chain.head, 0);
      this.onData(parts.length === 1 ? parts[0] : Buffer.concat(parts));
    }
    this.signal(tx, usedBefore);
    // The guest may have more: the rest in a later turn, so the event loop is not held.
    if (!this.transmitHeldNow && taken >= TRANSMIT_BYTES_PER_TURN && tx.hasAvailable()) setImmediate(() => this.drainLater(tx));
  }

  /**
   * The rest of the transmit queue, in a later turn: no vCPU exit's handler is on the stack to end
   * the VM on a throw (the VM may have stopped and unmapped guest RAM since), so it is reported,
   * never left to end the host process as an uncaught exception.
   */
  private drainLater(tx: SplitQueue): void {
    if (this.tx !== tx || this.transmitHeldNow) return;
    try {
      this.drainTransmit();
    } catch (e) {
      this.queueError(`transmit queue: ${(e as Error).message}`);
    }
  }

  private flush(): void {
    const rx = this.rx;
    if (!rx) return;
    const usedBefore = rx.usedIndex;
    for (;;) {
      let chain;
      while (this.outbox.length && (chain = rx.popValid(this.queueError))) rx.push(chain.head, this.fill(chain.descriptors, this.outbox));
      // Notifications of new receive buffers matter only while bytes wait for one: the guest
      // re-posts a buffer after each read, and each notification is an exit.
      rx.setNotifications(this.outbox.length > 0);
      if (!this.outbox.length || !rx.hasAvailable()) break;
    }
    if (this.signal(rx, usedBefore)) this.onDelivered();
  }

  /** Copies queued bytes into a chain's writable buffers; returns the bytes written. */
  private fill(descriptors: Descriptor[], queue: Buffer[]): number {
    let written = 0;
    for (const d of descriptors) {
      if (!d.writable) continue;
      let room = d.len;
      let at = d.gpa;
      while (room > 0 && queue.length) {
        const head = queue[0];
        const n = Math.min(room, head.length);
        this.mem.write(at, head.subarray(0, n));
        at += n;
        room -= n;
        written += n;
        if (n === head.length) queue.shift();
        else queue[0] = head.subarray(n);
      }
    }
    return written;
  }

  /** The driver's control messages: the port handshake (virtio 1.x, 5.3.6.2). */
  private readControl(): void {
    const q = this.controlTx;
    if (!q) return;
    const usedBefore = q.usedIndex;
    let chain;
    while ((chain = q.popValid(this.queueError))) {
      const d = chain.descriptors.find((x) => !x.writable);
      q.push(chain.head, 0);
      if (!d || d.len < CONTROL_BYTES) {
        this.queueError(`control message of ${d?.len ?? 0} bytes, expected ${CONTROL_BYTES}`);
        continue;
      }
      const msg = this.mem.read(d.gpa, CONTROL_BYTES);
      const id = msg.readUInt32LE(0);
      const event = msg.readUInt16LE(4);
      const value = msg.readUInt16LE(6);
      if (event === DEVICE_READY && value === 1) this.control(0, DEVICE_ADD, 1);
      else if (event === PORT_READY && id === 0 && value === 1) {
        this.control(0, PORT_NAME, 1, PORT_NAME_TEXT);
        // The host side of the port is always open: until it says so, Linux refuses writes.
        this.control(0, PORT_OPEN, 1);
      }
      // Other messages (the guest opening or closing the port) need no answer.
    }
    this.signal(q, usedBefore);
  }

  private control(id: number, event: number, value: number, text = ''): void {
    if (this.controlOutbox.length >= MAX_PENDING_CONTROL) {
      this.queueError(`control answer ${event} dropped: ${MAX_PENDING_CONTROL} wait already for the driver's buffers`);
      return;
    }
    const msg = Buffer.alloc(CONTROL_BYTES + Buffer.byteLength(text));
    msg.writeUInt32LE(id, 0);
    msg.writeUInt16LE(event, 4);
    msg.writeUInt16LE(value, 6);
    msg.write(text, CONTROL_BYTES);
    this.controlOutbox.push(msg);
    this.flushControl();
  }

  /** One control message per buffer, never split. */
  private flushControl(): void {
    const q = this.controlRx;
    if (!q) return;
    const usedBefore = q.usedIndex;
    let chain;
    while (this.controlOutbox.length && (chain = q.popValid(this.queueError))) {
      const room = chain.descriptors.reduce((n, d) => n + (d.writable ? d.len : 0), 0);
      if (room < this.controlOutbox[0].length) {
        q.push(chain.head, 0);
        this.queueError(`control buffer of ${room} bytes is too small`);
        continue;
      }
      q.push(chain.head, this.fill(chain.descriptors, [this.controlOutbox.shift()!]));
    }
    this.signal(q, usedBefore);
  }
}
