/**
 * Stream credit, the host's side (docs/agent-protocol.md, "Stream credit"): the guest may send a
 * stream of output (an EXEC's stdout or stderr, a FILE_READ's content, a FILE_LIST's entries) only
 * as far as the host has granted. Each stream starts with {@link STREAM_WINDOW_BYTES}; the host
 * grants more as its consumer takes what came. So one stream nobody reads stops only its own
 * writer in the guest, the channel goes on for every other answer, and the host holds at most a
 * window per stream. Pure accounting, no I/O: {@link AgentClient} sends the grants.
 */

/** The credit every stream starts with, and the most the host holds of a stream its consumer does not read. */
export const STREAM_WINDOW_BYTES = 256 * 1024;

/**
 * The least a grant gives while the guest still has this much credit left: consumption is
 * gathered into grants of a quarter window, so a consumer that takes 4 KiB at a time does not
 * cost a frame (and a guest interrupt) per 4 KiB.
 */
const GRANT_STEP_BYTES = STREAM_WINDOW_BYTES / 4;

/**
 * One stream's credit: what the guest has been granted in all, sent, and what the host's consumer
 * has taken. Invariant for a guest that keeps to its credit: the bytes the host holds
 * (received - consumed) never exceed the window, {@link STREAM_WINDOW_BYTES} unless the consumer
 * widened it ({@link widen}).
 */
export class StreamWindow {
  private window = STREAM_WINDOW_BYTES;
  private granted = STREAM_WINDOW_BYTES;
  private received = 0;
  private consumed = 0;
  private discarding = false;

  /** Bytes the guest may still send before it hears from the host again. */
  get credit(): number {
    return this.granted - this.received;
  }

  /** Bytes received that the consumer has not taken yet. */
  get heldBytes(): number {
    return this.received - this.consumed;
  }

  /**
   * The guest sent `bytes`: false, and nothing counted, if that is more than its credit (a guest
   * that ignores the protocol; the caller fails the stream).
   */
  receive(bytes: number): boolean {
    if (bytes > this.credit) return false;
    this.received += bytes;
    if (this.discarding) this.consumed = this.received;
    return true;
  }

  /** The consumer took `bytes` more of what was received (never more than that). */
  consume(bytes: number): void {
    this.consumed = Math.min(this.received, this.consumed + bytes);
  }

  /**
   * The consumer wants to hold `bytes` at once (a Readable's `read(size)` beyond a window waits
   * for that many): the window grows to it, never shrinks. Without it such a read would wait for
   * bytes the guest may never send.
   */
  widen(bytes: number): void {
    this.window = Math.max(this.window, bytes);
  }

  /** The consumer is gone: what is held, and all that comes from now on, counts as taken. */
  discard(): void {
    this.discarding = true;
    this.consumed = this.received;
  }

  /**
   * What to grant now, 0 for nothing; a positive value is counted as granted. The guest's credit
   * is topped up to a window beyond what the consumer took, once that adds a quarter window or
   * the guest's credit is below a quarter window. Nothing is held back while the guest's credit
   * is low, so a stream never waits on a grant that is only gathering.
   */
  takeGrant(): number {
    const grant = this.consumed + this.window - this.granted;
    if (grant <= 0 || (grant < GRANT_STEP_BYTES && this.credit >= GRANT_STEP_BYTES)) return 0;
    this.granted += grant;
    return grant;
  }
}
