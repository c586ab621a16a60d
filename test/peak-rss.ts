import { readFileSync, writeFileSync } from 'node:fs';

/** A field of /proc/self/status given in kB (VmRSS, VmHWM), in bytes. */
function statusBytes(field: 'VmRSS' | 'VmHWM'): number {
  const m = new RegExp(`^${field}:\\s+(\\d+) kB$`, 'm').exec(readFileSync('/proc/self/status', 'utf8'));
  if (!m) throw new Error(`no ${field} in /proc/self/status`);
  return Number(m[1]) * 1024;
}

/**
 * Runs `run` and says how far this process's resident memory rose above what it was when `run`
 * began, at its peak: the kernel's own high-water mark (VmHWM), reset first through
 * /proc/self/clear_refs, so that a peak between two samples is not missed.
 */
export async function peakRssGrowth<T>(run: () => Promise<T>): Promise<{ result: T; growthBytes: number }> {
  writeFileSync('/proc/self/clear_refs', '5'); // VmHWM := VmRSS
  const before = statusBytes('VmRSS');
  const result = await run();
  return { result, growthBytes: statusBytes('VmHWM') - before };
}
