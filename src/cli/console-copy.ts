/**
 * `pvisor run --console`: the guest's serial console lines, copied to a stream (our stderr).
 *
 * The guest decides how much it prints and the stream's reader how fast it takes it: a pipe to a
 * pager that stopped, a terminal that is scrolled back, a log shipper that fell behind. Node
 * buffers every write to a pipe that is not ready, so a guest printing without end into such a
 * stderr grows this process until it runs out of memory. The copy keeps at most `maxBufferedBytes`
 * waiting in the stream (plus one line: the UART cuts lines at 4 KiB); past that it drops lines,
 * counting them, and once the stream has drained says in one line how many it dropped. The console
 * is for reading along, not a channel: the guest cannot be held back through it (its kernel writes
 * the UART with interrupts off), and a lost line is better than a lost host.
 */
import type { Writable } from 'node:stream';

/** What stays buffered in the stream before lines are dropped: 1 MiB. */
export const CONSOLE_COPY_MAX_BUFFERED_BYTES = 2 ** 20;

/** Copies console lines to `out` as `[console] LINE`, bounded as the module says. */
export class ConsoleCopy {
  /** Lines dropped since the stream last caught up, and their bytes (not yet said). */
  private dropping: { lines: number; bytes: number } | null = null;
  /** Lines dropped over the copy's life. */
  droppedLines = 0;

  constructor(
    private readonly out: Writable,
    private readonly maxBufferedBytes = CONSOLE_COPY_MAX_BUFFERED_BYTES,
  ) {}

  /** One line the guest printed (without its newline). */
  line(text: string): void {
    // needDrain as well: a stream whose own high-water mark is above the bound never says 'drain'
    // before it passes that mark, and is bounded by it.
    if (this.dropping || (this.out.writableLength >= this.maxBufferedBytes && this.out.writableNeedDrain)) {
      this.drop(text);
      return;
    }
    this.out.write(`[console] ${text}\n`);
  }

  /** Says what was dropped, if anything is still unsaid (when the VM ends). */
  close(): void {
    this.out.off('drain', this.drained);
    this.sayDropped();
  }

  private drop(text: string): void {
    this.droppedLines++;
    if (!this.dropping) {
      this.dropping = { lines: 0, bytes: 0 };
      // A write has returned false (needDrain): 'drain' comes once it has written everything out.
      this.out.once('drain', this.drained);
    }
    this.dropping.lines++;
    this.dropping.bytes += Buffer.byteLength(text) + 1;
  }

  private readonly drained = (): void => {
    this.sayDropped();
  };

  private sayDropped(): void {
    const d = this.dropping;
    if (!d) return;
    this.dropping = null;
    this.out.write(`[console] pvisor: ${d.lines} console line(s), ${d.bytes} bytes, dropped: the output was not keeping up with the guest\n`);
  }
}
