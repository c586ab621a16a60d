/**
 * The MC146818 real-time clock behind CMOS ports 0x70/0x71, read-only: enough for Linux to set
 * its wall clock from the host's at boot (a sandbox with a wrong clock fails TLS and make). An
 * unclaimed port would read all ones, i.e. "update in progress" forever, and the kernel would
 * give up with "Unable to read current time from RTC" after polling it.
 */
import { checkVersion, integerAt, objectAt } from '../../../persist/state-fields';

/** The index port; 0x71 is data. */
export const CMOS_BASE = 0x70;
export const CMOS_PORTS = 2;

const SECONDS = 0x00;
const MINUTES = 0x02;
const HOURS = 0x04;
const WEEKDAY = 0x06;
const DAY = 0x07;
const MONTH = 0x08;
const YEAR = 0x09;
const STATUS_A = 0x0a;
const STATUS_B = 0x0b;
const STATUS_C = 0x0c;
const STATUS_D = 0x0d;
const CENTURY = 0x32;
/** Status A: 32.768 kHz time base, 1024 Hz rate; update-in-progress clear. */
const STATUS_A_VALUE = 0x26;
/** Status B: 24-hour mode, BCD values. */
const STATUS_B_VALUE = 0x02;
/** Status D: the RTC's battery is good (its time is valid). */
const STATUS_D_VALID = 0x80;

const bcd = (n: number) => ((Math.floor(n / 10) % 10) << 4) | n % 10;

/** The version of {@link CmosState} this code writes and reads. */
export const CMOS_STATE_VERSION = 1;

/**
 * The RTC's saved state: the register the guest selected. The time itself is the host's at each
 * read, so a restored guest reads the time of now, not of the snapshot.
 */
export interface CmosState {
  version: typeof CMOS_STATE_VERSION;
  index: number;
}

/** Reads the host's UTC time through the RTC's registers. */
export class CmosRtc {
  private index = 0;

  constructor(private readonly now: () => Date = () => new Date()) {}

  saveState(): CmosState {
    return { version: CMOS_STATE_VERSION, index: this.index };
  }

  /** Takes a {@link saveState} value (unchecked) back; a malformed one is a SnapshotError naming the field. */
  restoreState(value: unknown, path = 'cmos'): void {
    const o = objectAt(value, path);
    checkVersion(o, path, CMOS_STATE_VERSION);
    this.index = integerAt(o, 'index', path, 0, 0x7f);
  }

  write(offset: number, value: number): void {
    // Bit 7 of the index port is the NMI mask on a PC; only the register number matters here.
    if (offset === 0) this.index = value & 0x7f;
  }

  read(offset: number): number {
    if (offset === 0) return this.index;
    const t = this.now();
    switch (this.index) {
      case SECONDS: return bcd(t.getUTCSeconds());
      case MINUTES: return bcd(t.getUTCMinutes());
      case HOURS: return bcd(t.getUTCHours());
      case WEEKDAY: return bcd(t.getUTCDay() + 1);
      case DAY: return bcd(t.getUTCDate());
      case MONTH: return bcd(t.getUTCMonth() + 1);
      case YEAR: return bcd(t.getUTCFullYear() % 100);
      case CENTURY: return bcd(Math.floor(t.getUTCFullYear() / 100));
      case STATUS_A: return STATUS_A_VALUE;
      case STATUS_B: return STATUS_B_VALUE;
      case STATUS_C: return 0;
      case STATUS_D: return STATUS_D_VALID;
      default: return 0;
    }
  }
}
