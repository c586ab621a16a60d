/**
 * A minimal 8250 UART at 0x3f8: enough for a guest to print. Transmit is always ready; there is
 * no receive path and no interrupt yet (the Linux guest's console will add IRQ 4).
 */

/** First port of COM1. */
export const COM1_BASE = 0x3f8;
/** Ports the UART decodes. */
export const COM1_PORTS = 8;

const THR = 0;
const LSR = 5;
const LSR_THR_EMPTY = 0x20;
const LSR_TX_IDLE = 0x40;
const LCR = 3;
const LCR_DLAB = 0x80;

/** The UART; `onOutput` receives each line (or partial line on flush) the guest prints. */
export class Serial8250 {
  private lcr = 0;
  private line: number[] = [];

  constructor(private readonly onOutput: (text: string) => void) {}

  write(offset: number, value: number): void {
    if (offset === LCR) this.lcr = value;
    if (offset !== THR || this.lcr & LCR_DLAB) return;
    if (value === 0x0a) this.flush();
    else if (value !== 0x0d) this.line.push(value);
    if (this.line.length >= 4096) this.flush();
  }

  read(offset: number): number {
    if (offset === LSR) return LSR_THR_EMPTY | LSR_TX_IDLE;
    if (offset === LCR) return this.lcr;
    return 0;
  }

  /** Emits a pending partial line. */
  flush(): void {
    if (!this.line.length) return;
    const text = Buffer.from(this.line).toString('utf8');
    this.line = [];
    this.onOutput(text);
  }
}
