/**
 * The cold compression table of `pvisor bench memory` (modes cold-compression and
 * cold-compression-mix): how long the store took to settle, its size, the scanner's CPU at idle,
 * the hot part's refaults, and the faults served when a host thread touches every stored block,
 * against a native userfaultfd loop measured in the same run (./floors.ts).
 */
import type { NativeFaultRate } from './floors';
import { BENCH_COLD_AFTER_MS, HOT_WINDOW_MS, MIX_SETTLE_MS, type CellResult } from './memory-modes';
import { printTableBlock } from './report';

const MiB = 2 ** 20;

/** A rate over a handful of blocks (random content leaves almost nothing stored) says nothing. */
const faultsTimedEnough = (c: CellResult) => c.faultsPerSecond !== undefined && (c.faultsTimed ?? 0) >= 64;

/** Faults served per second as a % of the native loop's, when enough blocks were timed to say. */
export function faultPercentOfNative(c: CellResult, nativeFaults: NativeFaultRate | undefined): number | undefined {
  return nativeFaults && faultsTimedEnough(c) ? (c.faultsPerSecond! / nativeFaults.faultsPerSecond.median) * 100 : undefined;
}

/** Prints the table of the cold cells among `cells`, if any. */
export function printColdTable(cells: CellResult[], nativeFaults: NativeFaultRate | undefined, coldCpuShare: number): void {
  const colds = cells.filter((c) => c.faultsPerSecond !== undefined);
  if (!colds.length) return;
  const native = nativeFaults ? `${Math.round(nativeFaults.faultsPerSecond.median)} faults/s (median of ${nativeFaults.faultsPerSecond.runsMs.length} runs)` : 'not measured';
  process.stdout.write(`Cold compression (coldAfter ${BENCH_COLD_AFTER_MS / 1000} s, cpuShare ${coldCpuShare}; "settled" = from the fill until the store last grew; hot refaults counted over ${HOT_WINDOW_MS / 1000} s from ${MIX_SETTLE_MS / 1000} s after the fill; native userfaultfd loop, 64 KiB blocks, this run: ${native})\n`);
  const tc: string[][] = [['mode', 'working set', 'settled after ms', 'blocks stored', 'store MiB', 'incompressible blocks', 'scanner CPU % at idle', 'hot refaults, % of hot pages/s', 'faults/s (host thread touching)', '% of native']];
  for (const c of colds) {
    const f = c.strategies.find((s) => s.strategy === 'cold-compression')?.figures ?? {};
    const pct = faultPercentOfNative(c, nativeFaults);
    tc.push([c.mode, c.content, c.operationMs.toFixed(0), String(f.blocksStored ?? 'n/a'), ((f.storeBytes ?? 0) / MiB).toFixed(2), String(f.blocksIncompressible ?? 'n/a'), (c.scannerCpuPercent ?? 0).toFixed(2), c.hotRefaultPercentPerSecond === undefined ? 'n/a' : c.hotRefaultPercentPerSecond.toFixed(3), faultsTimedEnough(c) ? `${Math.round(c.faultsPerSecond!)} (${c.faultsTimed} blocks)` : `n/a (${c.faultsTimed} blocks)`, pct === undefined ? 'n/a' : pct.toFixed(0)]);
  }
  printTableBlock(tc);
}
