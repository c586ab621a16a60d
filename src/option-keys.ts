/**
 * Refuses an options object with a key its interface does not have. A typo (`memroy: '1GiB'`)
 * would otherwise be dropped in silence and the VM start with the default, which a user finds out
 * only from what the VM does; plain JavaScript callers and objects built at run time get no
 * compile-time check.
 */
import { InvalidOptionError } from './errors';

/**
 * Every key of `T`, as a value the compiler checks against the interface: adding an option to
 * the interface without adding it here is a type error, so the list cannot fall behind.
 */
export function optionKeys<T>(keys: { [K in keyof Required<T>]: true }): readonly string[] {
  return Object.keys(keys);
}

/**
 * Throws an {@link InvalidOptionError} naming the first key of `options` that is not in `known`
 * (`where` says whose option, e.g. `Vm.start`), and the known key closest to it, if one is close
 * enough to be a typo. `undefined` and non-objects are left to the caller's own checks.
 */
export function checkOptionKeys(where: string, options: unknown, known: readonly string[], prefix = ''): void {
  if (typeof options !== 'object' || options === null) return;
  for (const key of Object.keys(options)) {
    if (known.includes(key)) continue;
    const near = closestKey(key, known);
    throw new InvalidOptionError(`${prefix}${key}`, `not an option of ${where}${near ? `; did you mean ${prefix}${near}?` : ''} (its options: ${known.join(', ')})`);
  }
}

/** The key of `known` within a third of `key`'s length in edits (at least 2), else undefined. */
export function closestKey(key: string, known: readonly string[]): string | undefined {
  const bound = Math.max(2, Math.floor(key.length / 3));
  let best: string | undefined;
  let bestDistance = bound + 1;
  for (const k of known) {
    const d = editDistance(key.toLowerCase(), k.toLowerCase());
    if (d < bestDistance) [best, bestDistance] = [k, d];
  }
  return best;
}

/** Damerau-Levenshtein distance with adjacent transpositions (`memroy` is 1 from `memory`). */
function editDistance(a: string, b: string): number {
  const d: number[][] = Array.from({ length: a.length + 1 }, (_, i) => Array.from({ length: b.length + 1 }, (_, j) => (i === 0 ? j : j === 0 ? i : 0)));
  for (let i = 1; i <= a.length; i++) {
    for (let j = 1; j <= b.length; j++) {
      const cost = a[i - 1] === b[j - 1] ? 0 : 1;
      d[i][j] = Math.min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost);
      if (i > 1 && j > 1 && a[i - 1] === b[j - 2] && a[i - 2] === b[j - 1]) d[i][j] = Math.min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.length][b.length];
}
