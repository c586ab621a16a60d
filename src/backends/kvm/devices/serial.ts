/**
 * An 8250/16450 UART at 0x3f8: what a guest needs to print. The probe writes THR and polls LSR;
 * Linux's 8250 driver also probes it (IER read-back, loopback through MCR/MSR, scratch register)
 * and, once userspace writes to the port, waits for the "transmitter empty" interrupt on IRQ 4.
 * Transmit completes at once; there is no receive path (input goes through the agent channel).
 */
import { base64Of, booleanAt, bytesAt, checkVersion, integerAt, objectAt } from '../../../persist/state-fields';

/** First port of COM1. */
export const COM1_BASE = 0x3f8;
/** Ports the UART decodes. */
export const COM1_PORTS = 8;
/** The ISA interrupt line of COM1. */
export const COM1_IRQ = 4;

const THR = 0; // DLL when LCR.DLAB
const IER = 1; // DLM when LCR.DLAB
const IIR = 2;
const LCR = 3;
const MCR = 4;
const LSR = 5;
const MSR = 6;
const SCR = 7;
const LCR_DLAB = 0x80;
const IER_THRI = 0x02;
const IIR_NO_INTERRUPT = 0x01;
const IIR_THRI = 0x02;
const LSR_THR_EMPTY = 0x20;
const LSR_TX_IDLE = 0x40;
const MCR_LOOP = 0x10;

/** The version of {@link SerialState} this code writes and reads. */
export const SERIAL_STATE_VERSION = 1;

/** The UART's saved registers, and the line the guest was printing (so it is not cut in two). */
export interface SerialState {
  version: typeof SERIAL_STATE_VERSION;
  ier: number;
  lcr: number;
  mcr: number;
  scr: number;
  dll: number;
  dlm: number;
  thriPending: boolean;
  /** Bytes of the unfinished line, base64. */
  line: string;
}

/** The UART; `onOutput` receives each line (or partial line on flush) the guest prints. */
export class Serial8250 {
  private ier = 0;
  private lcr = 0;
  private mcr = 0;
  private scr = 0;
  private dll = 0;
  private dlm = 0;
  /** A "transmitter empty" interrupt is pending until IIR is read or THR written. */
  private thriPending = false;
  private line: number[] = [];

  /** @param interrupt pulses IRQ 4 (absent for the probe guest, which polls) */
  constructor(
    private readonly onOutput: (text: string) => void,
    private readonly interrupt: () => void = () => {},
  ) {}

  /** See {@link SerialState}. */
  saveState(): SerialState {
    const { ier, lcr, mcr, scr, dll, dlm, thriPending } = this;
    return { version: SERIAL_STATE_VERSION, ier, lcr, mcr, scr, dll, dlm, thriPending, line: base64Of(Buffer.from(this.line)) };
  }

  /** Takes a {@link saveState} value (unchecked) back; a malformed one is a SnapshotError naming the field, and nothing changes. */
  restoreState(value: unknown, path = 'serial'): void {
    const o = objectAt(value, path);
    checkVersion(o, path, SERIAL_STATE_VERSION);
    const byte = (key: string) => integerAt(o, key, path, 0, 0xff);
    const regs = { ier: integerAt(o, 'ier', path, 0, 0x0f), lcr: byte('lcr'), mcr: integerAt(o, 'mcr', path, 0, 0x1f), scr: byte('scr'), dll: byte('dll'), dlm: byte('dlm') };
    const thriPending = booleanAt(o, 'thriPending', path);
    const line = bytesAt(o, 'line', path, { min: 0, max: 4095 });
    Object.assign(this, regs);
    this.thriPending = thriPending;
    this.line = [...line];
  }

  write(offset: number, value: number): void {
    const dlab = (this.lcr & LCR_DLAB) !== 0;
    switch (offset) {
      case THR:
        if (dlab) this.dll = value;
        else this.transmit(value);
        break;
      case IER:
        if (dlab) this.dlm = value;
        else {
          this.ier = value & 0x0f;
          // Enabling THRI while the transmitter is empty raises it at once (what Linux expects).
          if (this.ier & IER_THRI) this.raiseThri();
          else this.thriPending = false;
        }
        break;
      case LCR:
        this.lcr = value;
        break;
      case MCR:
        this.mcr = value & 0x1f;
        break;
      case SCR:
        this.scr = value;
        break;
    }
  }

  read(offset: number): number {
    const dlab = (this.lcr & LCR_DLAB) !== 0;
    switch (offset) {
      case THR:
        return dlab ? this.dll : 0;
      case IER:
        return dlab ? this.dlm : this.ier;
      case IIR:
        if (this.thriPending) {
          this.thriPending = false;
          return IIR_THRI;
        }
        return IIR_NO_INTERRUPT;
      case LCR:
        return this.lcr;
      case MCR:
        return this.mcr;
      case LSR:
        return LSR_THR_EMPTY | LSR_TX_IDLE;
      case MSR:
        // In loopback the modem inputs follow MCR: DTR->DSR, RTS->CTS, OUT1->RI, OUT2->DCD.
        if (this.mcr & MCR_LOOP) {
          return ((this.mcr & 0x02) << 3) | ((this.mcr & 0x01) << 5) | ((this.mcr & 0x04) << 4) | ((this.mcr & 0x08) << 4);
        }
        return 0xb0; // CTS, DSR, DCD: a terminal is attached
      case SCR:
        return this.scr;
      default:
        return 0;
    }
  }

  /** Emits a pending partial line. */
  flush(): void {
    if (!this.line.length) return;
    const text = Buffer.from(this.line).toString('utf8');
    this.line = [];
    this.onOutput(text);
  }

  private transmit(value: number): void {
    // Loopback sends nothing out; either way the byte is gone at once and THR is empty again.
    if (!(this.mcr & MCR_LOOP)) {
      if (value === 0x0a) this.flush();
      else if (value !== 0x0d) this.line.push(value);
      if (this.line.length >= 4096) this.flush();
    }
    this.thriPending = false;
    if (this.ier & IER_THRI) this.raiseThri();
  }

  private raiseThri(): void {
    this.thriPending = true;
    this.interrupt();
  }
}
