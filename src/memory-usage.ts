/**
 * Memory figures from /proc (the reference study's way of counting): PSS of the guest RAM mapping
 * from /proc/PID/smaps, and of the whole process from /proc/PID/smaps_rollup.
 */
import { closeSync, openSync, readFileSync, readSync } from 'node:fs';

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

/**
 * Calls `use` with each line of a /proc file, read 256 KiB at a time: a process whose guest RAM
 * is cut into thousands of mappings (the page pool) has an smaps of tens of MiB, which read whole
 * (as a string, then split) would grow the heap by several times that at each reading.
 */
function forEachLine(path: string, use: (line: string) => void): void {
  const fd = openSync(path, 'r');
  try {
    const buf = Buffer.allocUnsafe(256 * 1024);
    let rest = '';
    for (;;) {
      const n = readSync(fd, buf, 0, buf.length, null);
      if (n <= 0) break;
      const lines = (rest + buf.toString('latin1', 0, n)).split('\n');
      rest = lines.pop()!;
      for (const line of lines) use(line);
    }
    if (rest) use(rest);
  } finally {
    closeSync(fd);
  }
}

/** How many mappings lie inside [start, start+length) of process `pid` (/proc/PID/maps: cheaper than smaps). */
export function rangeMappingCount(start: number, length: number, pid: number | 'self' = 'self'): number {
  let n = 0;
  forEachLine(`/proc/${pid}/maps`, (line) => {
    const m = /^([0-9a-f]+)-([0-9a-f]+) /.exec(line);
    if (m && parseInt(m[1], 16) >= start && parseInt(m[2], 16) <= start + length) n++;
  });
  return n;
}

/** The mappings inside [start, start+length) of process `pid`, with their flags. */
export function rangeMappings(start: number, length: number, pid: number | 'self' = 'self'): MappingInfo[] {
  const out: MappingInfo[] = [];
  let current: MappingInfo | undefined;
  forEachLine(`/proc/${pid}/smaps`, (line) => {
    const header = /^([0-9a-f]+)-([0-9a-f]+) /.exec(line);
    if (header) {
      const lo = parseInt(header[1], 16);
      const hi = parseInt(header[2], 16);
      current = lo >= start && hi <= start + length ? { start: lo, end: hi, flags: [] } : undefined;
      if (current) out.push(current);
      return;
    }
    if (!current) return;
    if (line.startsWith('VmFlags:')) current.flags = line.slice(8).trim().split(/\s+/);
    const ksm = /^KSM:\s+(\d+) kB/.exec(line);
    if (ksm) current.ksmBytes = Number(ksm[1]) * 1024;
  });
  return out;
}

/** Sums smaps entries of the mappings inside [start, start+length) of process `pid`. */
export function rangeResident(start: number, length: number, pid: number | 'self' = 'self'): ResidentBytes {
  const out: ResidentBytes = { pssBytes: 0, rssBytes: 0, swapBytes: 0, anonymousBytes: 0 };
  const end = start + length;
  let inside = false;
  forEachLine(`/proc/${pid}/smaps`, (line) => {
    const header = /^([0-9a-f]+)-([0-9a-f]+) /.exec(line);
    if (header) {
      const lo = parseInt(header[1], 16);
      const hi = parseInt(header[2], 16);
      inside = lo >= start && hi <= end;
      return;
    }
    if (inside) addField(out, line);
  });
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
