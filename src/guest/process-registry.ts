/**
 * The processes a VM has spawned (`vm.processes()`, `vm.process(pid)`): each running one, found by
 * its guest pid, so a caller that let go of its {@link GuestProcess} (a background server) can
 * find it again, with its kept output ({@link GuestProcess.keptOutput}) and its exit. Ended ones
 * go, except the last {@link MAX_ENDED_KEPT} whose output was kept, which stay to be read.
 */
import type { GuestProcess } from './guest-process';
import type { ExitStatus } from './guest-types';

/** Ended processes with kept output that stay listed: their tails are what a caller looks for. */
export const MAX_ENDED_KEPT = 64;

/**
 * A spawned process as {@link Vm.processes} reports it.
 * @category Guest
 */
export interface GuestProcessInfo {
  /** Its pid in the guest. */
  pid: number;
  /** The command as given (an argv joined with spaces). */
  command: string;
  /** `'running'`, or `'exited'` once the guest reported its end (and its output came). */
  state: 'running' | 'exited';
  /** How it ended, once it has (null while running, or if the host gave up on it). */
  exit: ExitStatus | null;
  /** When it started (its pid was reported), ms since the epoch. */
  startedAtMs: number;
}

interface Entry {
  process: GuestProcess;
  info: GuestProcessInfo;
}

/** One LinuxGuest's spawned processes. */
export class ProcessRegistry {
  /** By pid, in the order they started. */
  private readonly entries = new Map<number, Entry>();
  /** Ended entries still listed (their output kept), oldest first. */
  private ended: Entry[] = [];

  /** Lists `process` once it has a pid, until it ends (or, with output kept, a while after). */
  add(process: GuestProcess, command: string): void {
    process.pid.then(
      (pid) => {
        const entry: Entry = { process, info: { pid, command, state: 'running', exit: null, startedAtMs: Date.now() } };
        // A pid the guest reused: the earlier process has ended, the newer one is listed.
        this.entries.delete(pid);
        this.entries.set(pid, entry);
        const ended = (exit: ExitStatus | null) => {
          if (this.entries.get(pid) !== entry) return;
          entry.info.state = 'exited';
          entry.info.exit = exit;
          if (!process.keepsOutput) {
            this.entries.delete(pid);
            return;
          }
          this.ended.push(entry);
          while (this.ended.length > MAX_ENDED_KEPT) this.drop(this.ended.shift()!);
        };
        process.exited.then(ended, () => ended(null));
      },
      () => {}, // never started: never listed
    );
  }

  /** Forgets an ended entry, unless its pid names a newer process by now. */
  private drop(entry: Entry): void {
    if (this.entries.get(entry.info.pid) === entry) this.entries.delete(entry.info.pid);
  }

  /** Every listed process, oldest first (copies). */
  list(): GuestProcessInfo[] {
    return [...this.entries.values()].map((e) => ({ ...e.info, exit: e.info.exit && { ...e.info.exit } }));
  }

  /** The listed process of guest pid `pid`. A pid the guest reused names the newer process. */
  get(pid: number): GuestProcess | undefined {
    return this.entries.get(pid)?.process;
  }
}
