/**
 * A VM's `warning` events under a token bucket. Most warnings are the guest's doing (a malformed
 * queue request, garbage on the agent channel), and a guest can cause them as fast as it runs:
 * a listener that writes each to stderr (the CLI does) would let it flood the host's logs, and
 * a pipe's unread output grows the host process. What is dropped is counted and said in one
 * warning once the bucket allows again.
 */
import { InvalidOptionError } from './errors';

/**
 * How many warnings a VM emits: `burst` at once, then `perSecond` on average (`warningLimit`).
 * @category VM
 */
export interface WarningLimit {
  /**
   * Warnings let through at once before the rate applies: a whole number from 1, or Infinity.
   * Default 20.
   */
  burst?: number;
  /** Warnings per second after the burst: a number above 0, or Infinity. Default 2. */
  perSecond?: number;
}

/** The default {@link WarningLimit}. */
export const DEFAULT_WARNING_LIMIT = { burst: 20, perSecond: 2 } as const;

/** A {@link WarningLimit} option checked, its defaults filled in. */
export function parseWarningLimit(value: unknown): Required<WarningLimit> {
  if (value === undefined) return { ...DEFAULT_WARNING_LIMIT };
  if (typeof value !== 'object' || value === null) throw new InvalidOptionError('warningLimit', `expected { burst, perSecond }, got ${JSON.stringify(value)}`);
  const { burst = DEFAULT_WARNING_LIMIT.burst, perSecond = DEFAULT_WARNING_LIMIT.perSecond } = value as WarningLimit;
  if (burst !== Infinity && (typeof burst !== 'number' || !Number.isSafeInteger(burst) || burst < 1)) {
    throw new InvalidOptionError('warningLimit.burst', `expected a whole number from 1, or Infinity, got ${JSON.stringify(burst) ?? String(burst)}`);
  }
  if (typeof perSecond !== 'number' || Number.isNaN(perSecond) || perSecond <= 0) {
    throw new InvalidOptionError('warningLimit.perSecond', `expected a number above 0, or Infinity, got ${JSON.stringify(perSecond) ?? String(perSecond)}`);
  }
  return { burst, perSecond };
}

/** Passes messages on under a token bucket; see the module comment. */
export class WarningLimiter {
  private tokens: number;
  private last: number;
  private dropped = 0;
  private droppedSince = 0;
  private timer: NodeJS.Timeout | undefined;

  constructor(
    private readonly emit: (message: string) => void,
    private readonly limit: Required<WarningLimit> = { ...DEFAULT_WARNING_LIMIT },
    private readonly now: () => number = () => performance.now(),
  ) {
    this.tokens = limit.burst;
    this.last = now();
  }

  /** Emits `message` if the bucket allows, else counts it. */
  warn(message: string): void {
    if (!this.take()) {
      if (this.dropped++ === 0) this.droppedSince = this.now();
      // Said even if no warning comes after: once a token is back.
      this.timer ??= setTimeout(() => this.onRefill(), Math.ceil(1000 / this.limit.perSecond)).unref();
      return;
    }
    this.sayDropped();
    this.emit(message);
  }

  private onRefill(): void {
    this.timer = undefined;
    if (!this.dropped) return;
    if (this.take()) this.sayDropped();
    // A warning took the token first (and said the count, unless it was dropped too): try again.
    else this.timer = setTimeout(() => this.onRefill(), Math.ceil(1000 / this.limit.perSecond)).unref();
  }

  private sayDropped(): void {
    if (!this.dropped) return;
    const s = ((this.now() - this.droppedSince) / 1000).toFixed(1);
    this.emit(`${this.dropped} more warning${this.dropped === 1 ? '' : 's'} dropped over ${s} s (at most ${this.limit.burst} at once, then ${this.limit.perSecond} a second: see the warningLimit option)`);
    this.dropped = 0;
  }

  private take(): boolean {
    if (this.limit.perSecond === Infinity) return true;
    const now = this.now();
    this.tokens = Math.min(this.limit.burst, this.tokens + ((now - this.last) / 1000) * this.limit.perSecond);
    this.last = now;
    if (this.tokens < 1) return false;
    this.tokens -= 1;
    return true;
  }
}
