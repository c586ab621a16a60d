/**
 * How every bench reports: progress lines on stderr (stdout carries the tables and JSON), tables
 * padded to their widest cell, pvisor's figure beside the study's, min/median/max of timings, and
 * the goals tables, whose rows say ours, the bound and whether it was met.
 */

/** A progress line on stderr (stdout carries the tables and JSON). */
export const progress = (line: string) => process.stderr.write(`bench: ${line}\n`);

/** Min, median and max of some timings. */
export function stats(xs: number[]): { min: number; median: number; max: number } {
  const s = [...xs].sort((a, b) => a - b);
  const mid = s.length >> 1;
  return { min: s[0], median: s.length % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2, max: s[s.length - 1] };
}

/** Prints rows as a table on stdout, columns padded to their widest cell. */
export function printTable(rows: string[][]): void {
  const width = rows[0].map((_, i) => Math.max(...rows.map((r) => r[i].length)));
  for (const r of rows) process.stdout.write(`${r.map((c, i) => c.padEnd(width[i])).join(' | ')}\n`);
}

/** A table and a blank line after it, as the memory tables print each of theirs. */
export function printTableBlock(rows: string[][]): void {
  printTable(rows);
  process.stdout.write('\n');
}

/** Formats ours beside the study's figure: `35.6 (35.6)`. */
export function beside(ours: number | null | undefined, study: number | undefined, digits = 1): string {
  const o = ours === null || ours === undefined ? 'n/a' : ours.toFixed(digits);
  return study === undefined ? o : `${o} (${study.toFixed(1)})`;
}

/**
 * A goals table: one row per goal judged, whose last cell says whether it was met, and beside it
 * the same goal as JSON for the bench's result.
 */
export class GoalTable {
  private readonly rows: string[][];
  /** Each goal judged, as the bench's JSON carries it. */
  readonly results: object[] = [];

  constructor(header: string[]) {
    this.rows = [[...header, 'met']];
  }

  /** Adds a goal: its cells (without `met`), whether it was met, and its JSON. */
  add(cells: string[], met: boolean, result: object): void {
    this.rows.push([...cells, met ? 'yes' : 'NO']);
    this.results.push(result);
  }

  /** Prints the table and a blank line. */
  print(): void {
    printTableBlock(this.rows);
  }
}
