/**
 * The probe guest's working-set content and digest, computed on the host: the same formulas as
 * the guest (docs/probe-guest.md), written independently, so a test can check the guest's digest
 * against one the host computed for the same content.
 */

/**
 * What the probe writes into its working set:
 * - `repetitive`: one 64-byte pattern on every page; compresses to almost nothing, and all pages
 *   are the same, so page sharing (KSM, a page pool) folds them too.
 * - `random`: a pseudo-random stream; incompressible, and no two pages alike.
 * - `compressible`: no two pages alike, as with `random`, yet each compresses several-fold: the
 *   content that compression can shrink and page sharing cannot.
 * @category Guest
 */
export type ProbeContent = 'repetitive' | 'random' | 'compressible';

/** Each content kind's code in the guest's FILL request (CONTENT_* in native-prebuilds/probe/content.h). */
export const PROBE_CONTENT_CODES: Readonly<Record<ProbeContent, number>> = { repetitive: 0, random: 1, compressible: 2 };

/** The content kinds' names, in the order of their codes. */
export const PROBE_CONTENTS = Object.keys(PROBE_CONTENT_CODES) as readonly ProbeContent[];

/** True if `name` names a content kind. */
export function isProbeContent(name: string): name is ProbeContent {
  return Object.hasOwn(PROBE_CONTENT_CODES, name);
}

const WORDS_PER_PAGE = 1024;

/**
 * A compressible page is lines of 32 words whose first 8 are fresh (random-kind words) and whose
 * other 24 repeat line 0's: a compressor keeps a quarter as literals and matches the rest.
 */
const LINE_WORDS = 32;
const FRESH_WORDS = 8;

/** murmur3's 32-bit finaliser. */
export function fmix32(x: number): number {
  x ^= x >>> 16;
  x = Math.imul(x, 0x85ebca6b);
  x ^= x >>> 13;
  x = Math.imul(x, 0xc2b2ae35);
  x ^= x >>> 16;
  return x >>> 0;
}

/** Writes page `page`'s 1024 words of content into `out` (length 1024). */
export function pageWords(content: ProbeContent, seed: number, page: number, out: Uint32Array): void {
  const s = seed >>> 0;
  if (content === 'repetitive') {
    for (let j = 0; j < 16; j++) out[j] = fmix32((s + j) >>> 0);
    for (let j = 16; j < WORDS_PER_PAGE; j++) out[j] = out[j & 15];
    return;
  }
  const salt = fmix32((s ^ 0x9e3779b9) >>> 0);
  const base = Math.imul(page, WORDS_PER_PAGE) >>> 0;
  const randomWord = (j: number) => fmix32((fmix32(((base + j) ^ s) >>> 0) + salt) >>> 0);
  if (content === 'random') {
    for (let j = 0; j < WORDS_PER_PAGE; j++) out[j] = randomWord(j);
    return;
  }
  for (let j = 0; j < WORDS_PER_PAGE; j++) out[j] = randomWord(j % LINE_WORDS < FRESH_WORDS ? j : j % LINE_WORDS);
}

/** True if REWRITE with `permille` rewrites page `page` (pages spread evenly). */
export function rewritesPage(page: number, permille: number): boolean {
  return Math.floor(((page + 1) * permille) / 1000) > Math.floor((page * permille) / 1000);
}

/** A working set as the host models it: a fill, then rewrites, then ranges zeroed (ZERO). */
export interface ProbeWorkingSet {
  content: ProbeContent;
  seed: number;
  sizeBytes: number;
  rewrites: { permille: number; seed: number }[];
  /** Byte ranges of the working set the guest zeroed after the rewrites. */
  zeroed?: { offset: number; length: number }[];
}

/** The digest the probe must report for `ws`: two 32-bit FNV-style lanes. */
export function expectedDigest(ws: ProbeWorkingSet): { h1: number; h2: number } {
  const pages = ws.sizeBytes / 4096;
  const words = new Uint32Array(WORDS_PER_PAGE);
  let h1 = 0x811c9dc5;
  let h2 = 0x01000193;
  for (let p = 0; p < pages; p++) {
    let seed = ws.seed;
    for (const r of ws.rewrites) if (rewritesPage(p, r.permille)) seed = r.seed;
    if (ws.zeroed?.some((z) => p * 4096 >= z.offset && p * 4096 < z.offset + z.length)) words.fill(0);
    else pageWords(ws.content, seed, p, words);
    for (let j = 0; j < WORDS_PER_PAGE; j += 2) {
      h1 = Math.imul(h1 ^ words[j], 0x01000193);
      h2 = Math.imul(h2 ^ words[j + 1], 0x5bd1e995);
    }
  }
  return { h1: h1 >>> 0, h2: h2 >>> 0 };
}

/** {@link expectedDigest} as the probe reports it (`ProbeGuest.digest().hex`): h2 then h1, 16 hex digits. */
export function expectedDigestHex(ws: ProbeWorkingSet): string {
  const { h1, h2 } = expectedDigest(ws);
  return h2.toString(16).padStart(8, '0') + h1.toString(16).padStart(8, '0');
}
