// A rough token count, as agents use to budget their context before asking the model.

const WORD = /[A-Za-z]+|[0-9]+|\s+|[^A-Za-z0-9\s]/g;

export interface TokenCount {
  tokens: number;
  words: number;
  symbols: number;
}

export function countTokens(input: string): TokenCount {
  let tokens = 0;
  let words = 0;
  let symbols = 0;
  for (const match of input.matchAll(WORD)) {
    const piece = match[0];
    if (/^\s+$/.test(piece)) continue;
    if (/^[A-Za-z]+$/.test(piece)) {
      words++;
      // Long words are split into pieces of about four letters.
      tokens += Math.max(1, Math.ceil(piece.length / 4));
    } else if (/^[0-9]+$/.test(piece)) {
      tokens += Math.ceil(piece.length / 3);
    } else {
      symbols++;
      tokens++;
    }
  }
  return { tokens, words, symbols };
}

export class TokenCache {
  private readonly counts = new Map<string, number>();
  private hits = 0;
  private misses = 0;

  count(input: string): number {
    const known = this.counts.get(input);
    if (known !== undefined) {
      this.hits++;
      return known;
    }
    this.misses++;
    const n = countTokens(input).tokens;
    this.counts.set(input, n);
    return n;
  }

  get stats(): { hits: number; misses: number; entries: number } {
    return { hits: this.hits, misses: this.misses, entries: this.counts.size };
  }
}
