/**
 * The VMM process's own pages, given back when it need not hold them: a moment after a VM starts,
 * and while every VM in it is suspended.
 *
 * A suspended VM whose strategies offloaded its RAM still costs the process around it: Node's
 * text that only this process touched, V8's heap, malloc's free chunks. None of it is needed
 * until a VM runs again, so once the last VM of the process is suspended and its memory released,
 * the process drops what it can without swap: a full collection (when the embedder exposed
 * `gc`, as the `pvisor` bin does), malloc's free pages (malloc_trim), and the clean pages of its
 * executable and shared libraries that no other process maps (MADV_PAGEOUT skips shared pages).
 * What is dropped comes back on first use, from the page cache or the file. The same happens
 * once, a moment after a VM starts, for what only starting it needed. An application that embeds
 * the SDK and wants none of this in its process sets PVISOR_KEEP_PROCESS_PAGES=1.
 * docs/memory-layer.md ("The VMM process") has the measurements.
 */
import { readFileSync } from 'node:fs';
import { MADV_PAGEOUT } from './constants';
import { releaseFreeHeap, tryMadvise } from './libc';

/** Code mappings: the node executable, shared libraries and native addons. */
function isCodeFile(path: string): boolean {
  return path === process.execPath || /\.so(\.[0-9.]+)?$/.test(path) || path.endsWith('.node');
}

/**
 * Address ranges of this process's read-only or executable mappings of code files (never guest
 * RAM: that is writable, or anonymous, or a RAM file, never a library).
 */
export function codeMappings(maps: string): Array<{ start: number; length: number; path: string }> {
  const out: Array<{ start: number; length: number; path: string }> = [];
  for (const line of maps.split('\n')) {
    const m = /^([0-9a-f]+)-([0-9a-f]+) r-[-x]p \S+ \S+ \d+\s+(\/.*)$/.exec(line);
    if (!m || !isCodeFile(m[3]!)) continue;
    const start = parseInt(m[1]!, 16);
    out.push({ start, length: parseInt(m[2]!, 16) - start, path: m[3]! });
  }
  return out;
}

/**
 * Gives back what this process holds but does not need while idle. Returns how many code
 * mappings the kernel took the advice for (0 on a kernel without MADV_PAGEOUT).
 */
export function releaseIdleProcessPages(): number {
  (globalThis as { gc?: () => void }).gc?.();
  releaseFreeHeap();
  let advised = 0;
  for (const { start, length } of codeMappings(readFileSync('/proc/self/maps', 'utf8'))) {
    if (tryMadvise(start, length, MADV_PAGEOUT)) advised++;
  }
  return advised;
}

/** VMs of this process that are not idle (starting, running, paused, or suspending), by identity. */
const busy = new Set<object>();

let settleTimer: NodeJS.Timeout | undefined;

/**
 * Gives the process's idle pages back once it has settled: the work around a start or a suspend
 * (the kernel image's buffers, module compilation, the control socket's answer, the strategies'
 * last writes) touches code and allocates, so the pages go back a moment after the last such
 * event, once for several VMs that start or suspend together.
 */
function settle(): void {
  if (process.env.PVISOR_KEEP_PROCESS_PAGES === '1') return;
  if (settleTimer) settleTimer.refresh();
  else settleTimer = setTimeout(() => {
    settleTimer = undefined;
    try {
      releaseIdleProcessPages();
    } catch {
      // Advice only: a process that cannot read its maps or reach libc keeps its pages, and a
      // timer's exception must not end the process and every VM in it.
    }
  }, SETTLE_MS).unref();
}

/** How long after the last start or suspend the process gives its idle pages back. */
const SETTLE_MS = 2000;

/**
 * A VM of this process has just started or been restored: what the process needed only to start
 * it (boot-time code, the kernel image's buffers, module compilation) is given back once things
 * have settled. The VM runs on meanwhile; what it still uses comes back on first use.
 */
export function vmStarted(vm: object): void {
  busy.add(vm);
  settle();
}

/** `vm` runs, or is about to: the process is not idle. */
export function vmBusy(vm: object): void {
  busy.add(vm);
}

/**
 * `vm` is suspended and what its strategies set out to release is released. When it was the last
 * busy VM of the process, the process's idle pages are given back.
 */
export function vmIdle(vm: object): void {
  if (busy.delete(vm) && busy.size === 0) settle();
}

/** `vm` has ended. */
export function vmGone(vm: object): void {
  busy.delete(vm);
}
