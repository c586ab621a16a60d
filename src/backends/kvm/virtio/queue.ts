/**
 * The split virtqueue (virtio 1.x, 2.7), device side: reading descriptor chains the driver made
 * available and returning them used. Everything the guest wrote is untrusted: addresses are
 * checked against guest RAM, chains are bounded (no loops), indirect descriptors are refused.
 */
import { SnapshotError } from '../../../errors';
import type { GuestMemory } from '../guest-memory';
import { checkVersion, integerAt, objectAt } from '../../../persist/state-fields';

// Descriptor flags (virtio 1.x, 2.7.5; <linux/virtio_ring.h>).
export const VIRTQ_DESC_F_NEXT = 1;
export const VIRTQ_DESC_F_WRITE = 2;
export const VIRTQ_DESC_F_INDIRECT = 4;
/** avail.flags: the driver does not want an interrupt when buffers are used. */
const VIRTQ_AVAIL_F_NO_INTERRUPT = 1;
/** used.flags: the device does not want a notification when buffers are made available. */
const VIRTQ_USED_F_NO_NOTIFY = 1;

/**
 * A full memory barrier between the device's stores to the rings and its next loads from them.
 * x86 may let a later load pass an earlier store; the driver, on a vCPU thread, pairs this with
 * its own barrier (virtio 1.x, 2.7.7 and 2.7.10). An atomic read-modify-write on shared memory is
 * a locked instruction, which orders every earlier store before every later load.
 */
const FENCE = new Int32Array(new SharedArrayBuffer(4));
function memoryBarrier(): void {
  Atomics.add(FENCE, 0, 0);
}

/** One buffer of a chain. */
export interface Descriptor {
  gpa: number;
  len: number;
  /** True if the device writes it (driver's "in" buffer). */
  writable: boolean;
}

/** A descriptor chain taken from the available ring. */
export interface DescriptorChain {
  head: number;
  descriptors: Descriptor[];
}

/** A chain the guest built wrongly; the device ends that request, never the host. */
export class QueueError extends Error {}

/**
 * The queue itself is broken (the driver's available index jumped further than the ring holds):
 * no chain can be trusted any more; the device stops using the queue until the driver resets it.
 */
export class QueueBrokenError extends QueueError {}

/** Queue configuration the driver writes through the transport. */
export interface QueueConfig {
  size: number;
  descGpa: number;
  availGpa: number;
  usedGpa: number;
}

/** The version of {@link QueueState} this code writes and reads. */
export const QUEUE_STATE_VERSION = 1;

/**
 * A queue's saved state (as rust-vmm's virtio-queue `QueueState`): where its rings are and how far
 * the device has gone in them. The rings themselves are in guest RAM, saved with it. Chains a
 * device has taken and not yet returned are the device's to save.
 */
export interface QueueState extends QueueConfig {
  version: typeof QUEUE_STATE_VERSION;
  /** The next available-ring entry the device reads. */
  nextAvail: number;
  /** The used index published to the driver. */
  nextUsed: number;
  /** Why the queue was broken, if it was: it stays broken until the driver resets the device. */
  brokenBy?: string;
}

/** Checks a queue state read back from a file. Throws {@link SnapshotError} naming the field. */
export function parseQueueState(value: unknown, path = 'queue'): QueueState {
  const o = objectAt(value, path);
  checkVersion(o, path, QUEUE_STATE_VERSION);
  const size = integerAt(o, 'size', path, 1, 32768);
  if ((size & (size - 1)) !== 0) throw new SnapshotError(`${path}.size: a split queue's size is a power of 2, not ${size}`);
  if (o.brokenBy !== undefined && typeof o.brokenBy !== 'string') throw new SnapshotError(`${path}.brokenBy: expected a string`);
  const gpa = (key: string) => integerAt(o, key, path, 0, Number.MAX_SAFE_INTEGER);
  return {
    version: QUEUE_STATE_VERSION,
    size,
    descGpa: gpa('descGpa'),
    availGpa: gpa('availGpa'),
    usedGpa: gpa('usedGpa'),
    nextAvail: integerAt(o, 'nextAvail', path, 0, 0xffff),
    nextUsed: integerAt(o, 'nextUsed', path, 0, 0xffff),
    ...(typeof o.brokenBy === 'string' && { brokenBy: o.brokenBy }),
  };
}

/** The device side of one split virtqueue. */
export class SplitQueue {
  private nextAvail = 0;
  private nextUsed = 0;
  /**
   * Descriptors walked since the last notification or turn of the event loop, and whether the
   * budget stopped a taker. Descriptors, not chains: a driver may name one chain of a ring's worth
   * of descriptors in every avail entry (or loop one), which walks size x size descriptors in a
   * ring of chains, while a driver that does not alias has at most a ring's worth in flight.
   */
  private takenThisTurn = 0;
  /**
   * Bytes the device counted this turn for chains of this queue, and whether they reached its own
   * budget (see {@link spendBytes}). Unlike the descriptor budget, a notification does not renew
   * it: a driver notifies as often as it likes, only the turn of the event loop ends it.
   */
  private bytesThisTurn = 0;
  private bytesSpent = false;
  private stoppedByBudget = false;
  /** A renewal of the budgets is scheduled for the next turn of the event loop. */
  private renewalPending = false;
  /** Why the queue is broken, once it is (see {@link QueueBrokenError}). */
  private brokenBy: string | undefined;
  /**
   * Called in a later turn of the event loop when the budget stopped a taker of chains: the
   * owner (the transport) lets the device take the rest. A vCPU may post chains as fast as the
   * device takes them (with an ioeventfd it never waits for the device): without a budget one
   * notification kept the event loop, timers starved (docs/design-figures.md).
   */
  onBudgetRenewed: (() => void) | undefined;
  /** Called once when the queue breaks (see {@link QueueBrokenError}), with why. */
  onBroken: ((why: string) => void) | undefined;

  constructor(private readonly mem: GuestMemory, readonly config: QueueConfig) {
    const { size, descGpa, availGpa, usedGpa } = config;
    if (!mem.contains(descGpa, 16 * size) || !mem.contains(availGpa, 6 + 2 * size) || !mem.contains(usedGpa, 6 + 8 * size)) {
      throw new QueueError('virtqueue rings lie outside guest RAM');
    }
    // The split ring's alignment (virtio 1.x, 2.7) keeps every ring field inside one guest RAM
    // view, whose seams are page-aligned: a field across one cannot be written through a view.
    // The transport checks it when the driver sets DRIVER_OK; a saved state must pass it too.
    if (descGpa % 16 || availGpa % 2 || usedGpa % 4) throw new QueueError('virtqueue rings are not aligned (descriptors 16, available 2, used 4 bytes)');
  }

  /** This queue's state, for a snapshot (see {@link QueueState}). */
  saveState(): QueueState {
    const { size, descGpa, availGpa, usedGpa } = this.config;
    return {
      version: QUEUE_STATE_VERSION, size, descGpa, availGpa, usedGpa, nextAvail: this.nextAvail, nextUsed: this.nextUsed,
      ...(this.brokenBy !== undefined && { brokenBy: this.brokenBy }),
    };
  }

  /**
   * A queue as {@link saveState} left it, over `mem` (the restored guest RAM). `state` has been
   * through {@link parseQueueState}; rings outside guest RAM are a {@link SnapshotError}.
   */
  static fromState(mem: GuestMemory, state: QueueState, path = 'queue'): SplitQueue {
    let q: SplitQueue;
    try {
      q = new SplitQueue(mem, { size: state.size, descGpa: state.descGpa, availGpa: state.availGpa, usedGpa: state.usedGpa });
    } catch (e) {
      throw new SnapshotError(`${path}: ${(e as Error).message}`);
    }
    q.nextAvail = state.nextAvail;
    q.nextUsed = state.nextUsed;
    q.brokenBy = state.brokenBy;
    return q;
  }

  /** The used index as last published to the driver. */
  get usedIndex(): number {
    return this.nextUsed;
  }

  /**
   * Whether the device wants the driver to notify it of new available buffers (used.flags). A
   * device that has nothing to put in them turns notifications off: each one is a VM exit.
   * After turning them back on, check {@link hasAvailable} again: the driver may have added a
   * buffer in between without notifying.
   */
  setNotifications(wanted: boolean): void {
    this.mem.writeU16(this.config.usedGpa, wanted ? 0 : VIRTQ_USED_F_NO_NOTIFY);
    memoryBarrier(); // the flag must be visible before hasAvailable() reads avail.idx
  }

  /** Whether the driver wants an interrupt for buffers returned used (avail.flags). */
  get interruptWanted(): boolean {
    memoryBarrier(); // used.idx must be visible before avail.flags is read
    return (this.mem.readU16(this.config.availGpa) & VIRTQ_AVAIL_F_NO_INTERRUPT) === 0;
  }

  /**
   * True if chains were returned used since the used index was `usedBefore` and the driver wants
   * an interrupt for them. Each interrupt costs the guest two exits (status read, acknowledge).
   */
  shouldInterrupt(usedBefore: number): boolean {
    return this.nextUsed !== usedBefore && this.interruptWanted;
  }

  /**
   * True if the driver has made a chain available that the device may take now (false while the
   * queue is broken or this turn's budget is spent). A chain that waits for the budget counts as a
   * taker stopped by it: {@link onBudgetRenewed} follows, as after a pop the budget refused (a
   * device that stopped for a reason of its own, and asked here, would otherwise never go on).
   */
  hasAvailable(): boolean {
    if (this.brokenBy !== undefined) return false;
    const available = this.mem.readU16(this.config.availGpa + 2) !== this.nextAvail;
    if (available && this.budgetSpent) {
      this.stoppedByBudget = true;
      return false;
    }
    return available;
  }

  /** Why the queue is broken, or undefined. */
  get broken(): string | undefined {
    return this.brokenBy;
  }

  /**
   * Takes the next available chain, or null (none, the queue is broken, or this turn's budget is
   * spent: one ring's worth of descriptors, or the device's bytes, see {@link spendBytes};
   * {@link onBudgetRenewed} then says when to go on). A malformed chain throws {@link QueueError}
   * after consuming it, so the caller can return it used with length 0 and go on; an available
   * index further ahead than the ring holds throws {@link QueueBrokenError}, once.
   */
  pop(): DescriptorChain | null {
    if (this.brokenBy !== undefined) return null;
    const availIdx = this.mem.readU16(this.config.availGpa + 2);
    if (availIdx === this.nextAvail) return null;
    const { size } = this.config;
    const pending = (availIdx - this.nextAvail) & 0xffff;
    if (pending > size) {
      this.brokenBy = `available index ${availIdx} is ${pending} ahead of the device's ${this.nextAvail}, more than the ${size} the ring holds`;
      this.onBroken?.(this.brokenBy);
      throw new QueueBrokenError(this.brokenBy);
    }
    if (!this.spend()) return null;
    const head = this.mem.readU16(this.config.availGpa + 4 + 2 * (this.nextAvail % size));
    this.nextAvail = (this.nextAvail + 1) & 0xffff;
    if (head >= size) throw new QueueError(`descriptor head ${head} out of range (queue size ${size})`, { cause: head });
    const descriptors: Descriptor[] = [];
    let i = head;
    for (;;) {
      if (descriptors.length >= size) throw new ChainError(head, 'descriptor chain loops');
      if (descriptors.length > 0) this.takenThisTurn++; // spend() counted the head
      const d = this.config.descGpa + 16 * i;
      const gpa = this.mem.readU64(d);
      const len = this.mem.readU32(d + 8);
      const flags = this.mem.readU16(d + 12);
      const next = this.mem.readU16(d + 14);
      if (flags & VIRTQ_DESC_F_INDIRECT) throw new ChainError(head, 'indirect descriptors were not negotiated');
      if (!this.mem.contains(gpa, len)) throw new ChainError(head, `buffer 0x${gpa.toString(16)}+${len} outside guest RAM`);
      descriptors.push({ gpa, len, writable: (flags & VIRTQ_DESC_F_WRITE) !== 0 });
      if (!(flags & VIRTQ_DESC_F_NEXT)) break;
      if (next >= size) throw new ChainError(head, `next ${next} out of range`);
      i = next;
    }
    return { head, descriptors };
  }

  /**
   * Takes the next well-formed chain, or null when none is left. A malformed chain is returned
   * used with length 0 and reported through `onError`: that request fails, the device goes on.
   */
  popValid(onError: (message: string) => void): DescriptorChain | null {
    for (;;) {
      try {
        return this.pop();
      } catch (e) {
        if (!(e instanceof QueueError)) throw e;
        if (e instanceof ChainError) this.push(e.head, 0);
        onError(e.message);
        if (e instanceof QueueBrokenError) return null;
      }
    }
  }

  /**
   * A notification from the driver: the device may walk a ring's worth of descriptors again. The
   * transport calls it before it hands the device each notification.
   */
  renewBudget(): void {
    this.takenThisTurn = 0;
  }

  /**
   * Counts `bytes` for a chain the device took from this queue (what serving it moves, or a bound
   * of that) against a budget of its own, `bytesPerTurn` a turn of the event loop. Once they reach
   * it, the queue gives no chain ({@link pop} null, {@link hasAvailable} false) until a later turn,
   * whatever notifications come in between; then {@link onBudgetRenewed}, as for the descriptor
   * budget. A chain the device has taken it serves whole, so a turn moves at most the budget and
   * one chain's bytes.
   */
  spendBytes(bytes: number, bytesPerTurn: number): void {
    this.scheduleRenewal();
    this.bytesThisTurn += bytes;
    if (this.bytesThisTurn >= bytesPerTurn) this.bytesSpent = true;
  }

  private get budgetSpent(): boolean {
    return this.bytesSpent || this.takenThisTurn >= this.config.size;
  }

  /**
   * Counts a chain's head against this turn's budget (pop counts the rest of its descriptors);
   * false (and a renewal later) once it, or the device's byte budget, is spent.
   */
  private spend(): boolean {
    this.scheduleRenewal();
    if (this.budgetSpent) {
      this.stoppedByBudget = true;
      return false;
    }
    this.takenThisTurn++;
    return true;
  }

  /** Renews both budgets in the next turn of the event loop, and lets a stopped taker go on. */
  private scheduleRenewal(): void {
    if (this.renewalPending) return;
    this.renewalPending = true;
    setImmediate(() => {
      const stopped = this.stoppedByBudget;
      this.renewalPending = false;
      this.takenThisTurn = 0;
      this.bytesThisTurn = 0;
      this.bytesSpent = false;
      this.stoppedByBudget = false;
      if (stopped && this.brokenBy === undefined) this.onBudgetRenewed?.();
    });
  }

  /** Returns chain `head` to the driver with `writtenBytes` written into its writable buffers. */
  push(head: number, writtenBytes: number): void {
    const { size, usedGpa } = this.config;
    const elem = usedGpa + 4 + 8 * (this.nextUsed % size);
    this.mem.writeU32(elem, head);
    this.mem.writeU32(elem + 4, writtenBytes);
    this.nextUsed = (this.nextUsed + 1) & 0xffff;
    // The element must be visible before the index; the vCPU runs on another host thread, and
    // V8's stores through a Buffer are plain stores that x86's TSO keeps in program order.
    this.mem.writeU16(usedGpa + 2, this.nextUsed);
  }
}

/** A malformed chain whose head is known: the device returns it used with length 0. */
export class ChainError extends QueueError {
  constructor(readonly head: number, message: string) {
    super(`chain ${head}: ${message}`);
  }
}
