/**
 * Seeded randomness for the property and fuzz suites: every run of a property draws from its own
 * generator, derived from one seed, the property's name and the run's number, so a failure
 * reproduces from the seed it prints, alone or with the whole suite.
 *
 * - `PVISOR_FUZZ_SEED`: the seed (an integer from 0 to 2^32-1); default a fresh random one.
 * - `PVISOR_FUZZ_RUNS`: runs of every property, in place of each property's own default (those
 *   keep the unit suite's fuzzing to seconds on two slow cores); timing properties keep theirs.
 * - `PVISOR_FUZZ_RUN`: only this run of each property (the number a failure prints).
 */
import { createCipheriv, randomInt } from 'node:crypto';
import { isDeepStrictEqual } from 'node:util';

function envInteger(name: string, max: number): number | undefined {
  const v = process.env[name];
  if (v === undefined || v === '') return undefined;
  const n = Number(v);
  if (!Number.isSafeInteger(n) || n < 0 || n > max) throw new Error(`${name}: expected an integer from 0 to ${max}, got ${JSON.stringify(v)}`);
  return n;
}

/** The seed of this test process. */
export const FUZZ_SEED = envInteger('PVISOR_FUZZ_SEED', 0xffffffff) ?? randomInt(0, 2 ** 32);
const RUNS = envInteger('PVISOR_FUZZ_RUNS', 1e9);
const ONLY_RUN = envInteger('PVISOR_FUZZ_RUN', 1e9);

/** A 32-bit string hash (FNV-1a), to give each property its own stream. */
function hash32(s: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 0x01000193);
  return h >>> 0;
}

/**
 * A small, fast generator (sfc32, from PractRand's tests): deterministic for a seed on every
 * platform, no dependency.
 */
export class Rng {
  private a: number;
  private b: number;
  private c: number;
  private d: number;

  constructor(...seeds: number[]) {
    this.a = 0x9e3779b9;
    this.b = 0x243f6a88;
    this.c = 0xb7e15162;
    this.d = 1;
    for (const s of seeds) {
      this.a ^= s >>> 0;
      for (let i = 0; i < 12; i++) this.u32();
    }
  }

  /** A uniform integer in [0, 2^32). */
  u32(): number {
    const t = (((this.a + this.b) | 0) + this.d) | 0;
    this.d = (this.d + 1) | 0;
    this.a = this.b ^ (this.b >>> 9);
    this.b = (this.c + (this.c << 3)) | 0;
    this.c = (this.c << 21) | (this.c >>> 11);
    this.c = (this.c + t) | 0;
    return t >>> 0;
  }

  /** A uniform integer in [0, n), n up to 2^53. */
  int(n: number): number {
    if (n <= 0x100000000) return Math.floor((this.u32() / 0x100000000) * n);
    return Math.floor(((this.u32() * 0x200000 + (this.u32() >>> 11)) / 2 ** 53) * n);
  }

  /** A uniform integer in [lo, hi]. */
  between(lo: number, hi: number): number {
    return lo + this.int(hi - lo + 1);
  }

  /** True with probability p. */
  chance(p: number): boolean {
    return this.u32() / 0x100000000 < p;
  }

  pick<T>(items: readonly T[]): T {
    return items[this.int(items.length)];
  }

  /** One of `choices`, each with its weight. */
  weighted<T>(choices: readonly (readonly [number, T])[]): T {
    let r = this.int(choices.reduce((n, [w]) => n + w, 0));
    for (const [w, v] of choices) {
      if (r < w) return v;
      r -= w;
    }
    return choices[choices.length - 1][1];
  }

  /**
   * A size skewed to the small (edge cases live there) but reaching `max`: 0, 1, a power of two
   * and its neighbours, or uniform.
   */
  size(max: number): number {
    switch (this.int(5)) {
      case 0: return this.int(Math.min(max, 16) + 1);
      case 1: {
        const p = 2 ** this.int(Math.floor(Math.log2(Math.max(1, max))) + 1);
        return Math.max(0, Math.min(max, p + this.between(-1, 1)));
      }
      case 2: return max;
      default: return this.int(max + 1);
    }
  }

  /** `n` random bytes: AES-128 in counter mode, keyed from this generator (fast for large n). */
  bytes(n: number): Buffer {
    if (n < 256) {
      const b = Buffer.allocUnsafe(n);
      for (let i = 0; i < n; i++) b[i] = this.u32() & 0xff;
      return b;
    }
    const key = Buffer.alloc(16);
    for (let i = 0; i < 16; i += 4) key.writeUInt32LE(this.u32(), i);
    return createCipheriv('aes-128-ctr', key, Buffer.alloc(16)).update(Buffer.alloc(n));
  }

  shuffle<T>(items: T[]): T[] {
    for (let i = items.length - 1; i > 0; i--) {
      const j = this.int(i + 1);
      [items[i], items[j]] = [items[j], items[i]];
    }
    return items;
  }
}

/** How to reproduce run `run` of a property. */
function reproduction(run: number): string {
  return `PVISOR_FUZZ_SEED=${FUZZ_SEED} PVISOR_FUZZ_RUN=${run}`;
}

/** Runs of a property: `PVISOR_FUZZ_RUNS`, or its own default. */
export function fuzzRuns(defaultRuns: number): number {
  return RUNS ?? defaultRuns;
}

/**
 * A property as a jest test: `body` runs `runs` times (see {@link fuzzRuns}; `{ fixed }` for a
 * property whose runs are measurements, which more runs would only make slower), each with its
 * own generator. A failing run fails the test with the seed and run number in its message.
 */
export function property(name: string, runsOrFixed: number | { fixed: number }, body: (rng: Rng, run: number) => void | Promise<void>, timeoutMs?: number): void {
  it(`${name} (seeded)`, async () => {
    const runs = typeof runsOrFixed === 'number' ? fuzzRuns(runsOrFixed) : runsOrFixed.fixed;
    for (let run = 0; run < runs; run++) {
      if (ONLY_RUN !== undefined && run !== ONLY_RUN) continue;
      const rng = new Rng(FUZZ_SEED, hash32(name), run);
      try {
        await body(rng, run);
      } catch (e) {
        const err = e instanceof Error ? e : new Error(String(e));
        const header = `run ${run} of ${runs} failed; reproduce with ${reproduction(run)}`;
        err.message = `${header}\n${err.message}`;
        throw err;
      }
    }
  }, timeoutMs);
}

/** Calls `f`; returns what it threw, or undefined. */
export function thrown(f: () => unknown): unknown {
  try {
    f();
  } catch (e) {
    return e;
  }
  return undefined;
}

/**
 * `expect(actual).toEqual(expected)`, paying for jest's matcher only when the two differ: a
 * property checks thousands of times per run, and a matcher call costs far more than the check.
 */
export function same(actual: unknown, expected: unknown): void {
  if (!isDeepStrictEqual(actual, expected)) expect(actual).toEqual(expected);
}
