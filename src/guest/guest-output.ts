/**
 * One output stream of a guest request (a command's stdout or stderr, a file read as a stream) as
 * a Readable under stream credit (docs/agent-protocol.md, "Stream credit"): what its consumer
 * takes out of the stream's buffer is granted back to the guest, so the guest sends at most a
 * window ahead of the consumer. A consumer that does not read stops only this stream's writer in
 * the guest; destroying the stream drops and grants back whatever comes, so the writer runs on.
 */
import { Readable } from 'node:stream';
import { TakenReadable } from '../taken-readable';
import type { AgentClient, OutputChannel } from '../protocol/agent-client';
import { STREAM_WINDOW_BYTES } from '../protocol/stream-window';

export class GuestOutput {
  readonly readable: Readable;
  /** The request whose output this is ({@link attach}). */
  private id: number | undefined;
  private pushedBytes = 0;
  private reportedBytes = 0;

  /** @param onRead the consumer wants more (and has taken what it took) */
  constructor(
    private readonly agent: AgentClient,
    private readonly channel: OutputChannel,
    onRead: () => void = () => {},
  ) {
    this.readable = new TakenReadable(
      {
        highWaterMark: STREAM_WINDOW_BYTES,
        read: () => {
          this.report();
          onRead();
        },
      },
      () => this.report(),
    );
    this.readable.once('close', () => this.letGo());
  }

  /** The request is sent: its id names the stream in grants. */
  attach(id: number): void {
    this.id = id;
    if (this.readable.destroyed) this.letGo();
  }

  /**
   * A chunk from the guest. True if the stream wants more (its buffer is below a window); a
   * destroyed stream drops it.
   */
  deliver(chunk: Buffer): boolean {
    const s = this.readable;
    if (s.destroyed || s.readableEnded) {
      this.letGo();
      return true;
    }
    this.pushedBytes += chunk.length;
    return s.push(chunk);
  }

  /** No more comes: the stream ends once its consumer has read what it holds. */
  end(): void {
    if (!this.readable.destroyed && !this.readable.readableEnded) this.readable.push(null);
  }

  /**
   * Tells the agent client what the consumer has taken since the last report (what was pushed less
   * what the buffer still holds) and how much it may hold (its high-water mark). (With `setEncoding` the buffer counts characters, which makes
   * this an overestimate by at most the multi-byte characters held: the host then holds up to four
   * windows of text, still bounded.)
   */
  private report(): void {
    if (this.id === undefined) return;
    const taken = this.pushedBytes - this.readable.readableLength;
    // read(size) beyond the buffer raises its high-water mark and waits for that many bytes.
    const wants = this.readable.readableHighWaterMark;
    if (taken <= this.reportedBytes && wants <= STREAM_WINDOW_BYTES) return;
    this.agent.consumed(this.id, this.channel, taken - this.reportedBytes, wants);
    this.reportedBytes = taken;
  }

  private letGo(): void {
    if (this.id !== undefined) this.agent.discard(this.id, this.channel);
  }
}
