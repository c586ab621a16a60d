import { InvalidOptionError } from './errors';

const UNIT_BYTES: Record<string, number> = {
  '': 1, b: 1,
  k: 1024, kb: 1000, kib: 1024,
  m: 1024 ** 2, mb: 1000 ** 2, mib: 1024 ** 2,
  g: 1024 ** 3, gb: 1000 ** 3, gib: 1024 ** 3,
  t: 1024 ** 4, tb: 1000 ** 4, tib: 1024 ** 4,
};

/**
 * A size as bytes, or a string with a unit: `512MiB`, `1G`, `65536`.
 * @category VM
 */
export type Size = number | string;

/**
 * Parses a size (`512MiB`, `2G`, `4096`) into bytes. `K/M/G` mean binary units, as in QEMU and the
 * reference CLI. Throws {@link InvalidOptionError} naming `option` for anything else.
 */
export function parseSize(option: string, value: Size): number {
  if (typeof value === 'number') {
    if (!Number.isSafeInteger(value) || value < 0) throw new InvalidOptionError(option, `expected a whole number of bytes, got ${value}`);
    return value;
  }
  const m = /^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$/.exec(value);
  const unit = m ? UNIT_BYTES[m[2].toLowerCase()] : undefined;
  if (!m || unit === undefined) {
    throw new InvalidOptionError(option, `cannot parse size ${JSON.stringify(value)}; use e.g. 512MiB, 2GiB or a number of bytes`);
  }
  const bytes = Number(m[1]) * unit;
  if (!Number.isSafeInteger(bytes)) throw new InvalidOptionError(option, `size ${JSON.stringify(value)} is not a whole number of bytes`);
  return bytes;
}

/** The longest delay a Node timer keeps: above it, setTimeout fires after 1 ms. */
export const MAX_TIMEOUT_MS = 2 ** 31 - 1;

/**
 * Checks a timeout option: a whole number of milliseconds from 1 to {@link MAX_TIMEOUT_MS}
 * (NaN, Infinity, fractions, negatives, strings and larger values are refused, not rounded: a
 * timeout of 2^31 ms would fire at once). Throws {@link InvalidOptionError} naming `option`.
 */
export function parseTimeoutMs(option: string, value: unknown): number {
  if (typeof value !== 'number' || !Number.isInteger(value) || value < 1 || value > MAX_TIMEOUT_MS) {
    throw new InvalidOptionError(option, `expected a whole number of milliseconds from 1 to ${MAX_TIMEOUT_MS}, got ${typeof value === 'string' ? JSON.stringify(value) : String(value)}`);
  }
  return value;
}

/**
 * A boolean option: `fallback` when absent, else true or false; anything else (`'yes'`, 1, null)
 * is an {@link InvalidOptionError} naming `option`, not a truthy or falsy guess.
 */
export function booleanOption(option: string, value: unknown, fallback: boolean): boolean {
  if (value === undefined) return fallback;
  if (typeof value === 'boolean') return value;
  const got = typeof value === 'string' ? JSON.stringify(value)
    : typeof value === 'object' && value !== null ? 'an object'
    : typeof value === 'function' ? 'a function'
    : String(value);
  throw new InvalidOptionError(option, `expected true or false, got ${got}`);
}

/**
 * A numeric option of a strategy: `fallback` when absent, else a finite number that `ok` accepts;
 * anything else is an {@link InvalidOptionError} naming `option` and saying `what` it must be.
 */
export function numberOption(option: string, value: number | undefined, fallback: number, ok: (v: number) => boolean, what: string): number {
  if (value === undefined) return fallback;
  if (typeof value !== 'number' || !Number.isFinite(value) || !ok(value)) throw new InvalidOptionError(option, `must be ${what}, got ${String(value)}`);
  return value;
}

/** Formats bytes as MiB with one decimal, the unit of every memory figure pvisor prints. */
export function formatMiB(bytes: number): string {
  return `${(bytes / 1024 ** 2).toFixed(1)} MiB`;
}

/**
 * A duration given on a command line, in milliseconds: `30` is 30 s, as in the shell; `500ms`,
 * `1.5s` and `2m` say their unit. Throws {@link InvalidOptionError} naming `option`.
 */
export function parseDurationMs(option: string, text: string): number {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m)?$/.exec(text);
  if (!m) throw new InvalidOptionError(option, `expected a duration such as 30, 1.5s, 500ms or 2m, got ${JSON.stringify(text)}`);
  const ms = Math.round(Number(m[1]) * { ms: 1, s: 1000, m: 60000 }[m[2] ?? 's']!);
  if (ms > MAX_TIMEOUT_MS) throw new InvalidOptionError(option, `at most ${MAX_TIMEOUT_MS} ms, got ${JSON.stringify(text)}`);
  return ms;
}

/** A size given in MiB (fractions allowed) as bytes, which must be whole 4 KiB pages. */
export function pageMiBOption(option: string, value: number): number {
  if (!(Number.isFinite(value) && value >= 0)) throw new InvalidOptionError(option, `expected a size in MiB, got ${value}`);
  const bytes = Math.round(value * 1024 * 1024);
  if (bytes % 4096 !== 0) throw new InvalidOptionError(option, 'must be a whole number of 4 KiB pages');
  return bytes;
}

/** A whole number from 0 to 2^32-1 (a seed, a count the guest takes as u32). */
export function u32Option(option: string, value: number): number {
  if (!Number.isInteger(value) || value < 0 || value > 0xffffffff) throw new InvalidOptionError(option, 'expected a whole number from 0 to 2^32-1');
  return value;
}

/**
 * Milliseconds since `t0` (a `performance.now()` reading), to the microsecond: the public
 * durations (`SnapshotInfo.ms`, `RestoreInfo.readyMs`, ...) are fractional milliseconds, because a
 * probe VM restores in a few of them, but not the raw float's noise digits.
 */
export function elapsedMs(t0: number): number {
  return Math.round((performance.now() - t0) * 1000) / 1000;
}
