/**
 * Memory figures from /proc (the reference study's way of counting): PSS of the guest RAM mapping
 * from /proc/PID/smaps, and of the whole process from /proc/PID/smaps_rollup.
 */
import { readFileSync } from 'node:fs';

/** Resident figures of one address range or process, in bytes. */
export interface ResidentBytes {
  /** Proportional set size: shared pages split among their sharers. */
  pssBytes: number;
  /** Resident set size. */
  rssBytes: number;
  /** Pages swapped out (always 0 on hosts without swap). */
  swapBytes: number;
  /** Anonymous pages: private memory, including a private file mapping's written copies. */
  anonymousBytes: number;
}

/** One mapping (VMA) as /proc/PID/smaps shows it. */
export interface MappingInfo {
  start: number;
  end: number;
  /** The two-letter VmFlags, e.g. `mg` when the mapping accepted MADV_MERGEABLE. */
  flags: string[];
  /** Bytes of this mapping merged by KSM; undefined on kernels whose smaps has no `KSM:` line. */
  ksmBytes?: number;
}

/** The mappings inside [start, start+length) of process `pid`, with their flags. */
export function rangeMappings(start: number, length: number, pid: number | 'self' = 'self'): MappingInfo[] {
  const out: MappingInfo[] = [];
  let current: MappingInfo | undefined;
  for (const line of readFileSync(`/proc/${pid}/smaps`, 'utf8').split('\n')) {
    const header = /^([0-9a-f]+)-([0-9a-f]+) /.exec(line);
    if (header) {
      const lo = parseInt(header[1], 16);
      const hi = parseInt(header[2], 16);
      current = lo >= start && hi <= start + length ? { start: lo, end: hi, flags: [] } : undefined;
      if (current) out.push(current);
      continue;
    }
    if (!current) continue;
    if (line.startsWith('VmFlags:')) current.flags = line.slice(8).trim().split(/\s+/);
    const ksm = /^KSM:\s+(\d+) kB/.exec(line);
    if (ksm) current.ksmBytes = Number(ksm[1]) * 1024;
  }
  return out;
}

/** Sums smaps entries of the mappings inside [start, start+length) of process `pid`. */
export function rangeResident(start: number, length: number, pid: number | 'self' = 'self'): ResidentBytes {
  const text = readFileSync(`/proc/${pid}/smaps`, 'utf8');
  const out: ResidentBytes = { pssBytes: 0, rssBytes: 0, swapBytes: 0, anonymousBytes: 0 };
  const end = start + length;
  let inside = false;
  for (const line of text.split('\n')) {
    const header = /^([0-9a-f]+)-([0-9a-f]+) /.exec(line);
    if (header) {
      const lo = parseInt(header[1], 16);
      const hi = parseInt(header[2], 16);
      inside = lo >= start && hi <= end;
      continue;
    }
    if (inside) addField(out, line);
  }
  return out;
}

/** The whole process's figures (smaps_rollup). */
export function processResident(pid: number | 'self' = 'self'): ResidentBytes {
  const out: ResidentBytes = { pssBytes: 0, rssBytes: 0, swapBytes: 0, anonymousBytes: 0 };
  for (const line of readFileSync(`/proc/${pid}/smaps_rollup`, 'utf8').split('\n')) addField(out, line);
  return out;
}

function addField(out: ResidentBytes, line: string): void {
  const m = /^(Pss|Rss|Swap|Anonymous):\s+(\d+) kB/.exec(line);
  if (!m) return;
  const bytes = Number(m[2]) * 1024;
  if (m[1] === 'Pss') out.pssBytes += bytes;
  else if (m[1] === 'Rss') out.rssBytes += bytes;
  else if (m[1] === 'Anonymous') out.anonymousBytes += bytes;
  else out.swapBytes += bytes;
}

/** The host's MemTotal in bytes. */
export function hostMemTotalBytes(): number {
  const m = /^MemTotal:\s+(\d+) kB/m.exec(readFileSync('/proc/meminfo', 'utf8'));
  return m ? Number(m[1]) * 1024 : Number.MAX_SAFE_INTEGER;
}
