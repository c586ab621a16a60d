/**
 * KSM's host-wide settings (/sys/kernel/mm/ksm), changed for one bench cell and put back as they
 * were: after the cell, on an error, and on SIGINT/SIGTERM or process exit, since a bench that
 * leaves ksmd scanning at a high rate costs every later user of the host CPU.
 */
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';

const KSM_SYSFS = '/sys/kernel/mm/ksm';

/** A setting's current value; a choice such as `advisor_mode` ("[none] scan-time") reads as the chosen one. */
function readSetting(name: string): string {
  const text = readFileSync(join(KSM_SYSFS, name), 'utf8').trim();
  return /\[(\w[\w-]*)\]/.exec(text)?.[1] ?? text;
}

/** Host-wide KSM counters (they count every process that KSM merges, not only the bench's). */
export interface KsmCounters {
  pagesShared: number;
  pagesSharing: number;
  fullScans: number;
}

/** Reads the host-wide counters. */
export function ksmCounters(): KsmCounters {
  const n = (name: string) => Number(readSetting(name));
  return { pagesShared: n('pages_shared'), pagesSharing: n('pages_sharing'), fullScans: n('full_scans') };
}

/** Pages of process `pid` that KSM has merged (0 once the process has gone). */
export function processKsmPages(pid: number): number {
  try {
    return Number(readFileSync(`/proc/${pid}/ksm_merging_pages`, 'utf8').trim());
  } catch {
    return 0;
  }
}

/** Settings changed by {@link KsmHost.apply}, with the values found before. */
export class KsmHost {
  private restored = false;
  private readonly onSignal = (signal: NodeJS.Signals) => {
    this.restore();
    // Then the signal's own default action, as if nobody had listened.
    process.kill(process.pid, signal);
  };
  private readonly onExit = () => this.restore();

  private constructor(
    /** Every setting written, with the value it had, in the order written. */
    readonly changed: { name: string; before: string; now: string }[],
  ) {}

  /**
   * Writes `settings` (name to value, written in the given order; a setting that already has the
   * value, or that this kernel lacks, is left alone) and arranges for the old values to come back. A write that fails puts
   * back what was written so far and throws.
   */
  static apply(settings: [name: string, value: string][]): KsmHost {
    const host = new KsmHost([]);
    process.once('SIGINT', host.onSignal);
    process.once('SIGTERM', host.onSignal);
    process.once('exit', host.onExit);
    try {
      for (const [name, value] of settings) {
        // A setting this kernel does not have (advisor_mode came in 6.9) is left out, not an error.
        if (!existsSync(join(KSM_SYSFS, name))) continue;
        const before = readSetting(name);
        if (before === value) continue;
        writeFileSync(join(KSM_SYSFS, name), value);
        host.changed.push({ name, before, now: value });
      }
    } catch (e) {
      host.restore();
      throw e;
    }
    return host;
  }

  /** Puts back every value changed, last written first (so `run` goes back before the rates). Idempotent. */
  restore(): void {
    if (this.restored) return;
    this.restored = true;
    process.removeListener('SIGINT', this.onSignal);
    process.removeListener('SIGTERM', this.onSignal);
    process.removeListener('exit', this.onExit);
    const failed: string[] = [];
    for (const { name, before } of [...this.changed].reverse()) {
      try {
        writeFileSync(join(KSM_SYSFS, name), before);
      } catch (e) {
        failed.push(`${name}=${before}: ${(e as Error).message}`);
      }
    }
    if (failed.length) process.stderr.write(`bench: warning: could not put back KSM settings ${failed.join('; ')}\n`);
  }
}
