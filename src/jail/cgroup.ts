/**
 * The cgroup of one jailed VM: made where ./cgroup-host.ts says (`<cgroup2 mount>/pvisor/name`,
 * or on a v1 host one directory per controller under this process's own cgroup) with its limits
 * written before any process enters it, read after the process ends (did the kernel kill for the
 * memory limit?), and removed.
 * @module
 */
import { existsSync, mkdirSync, readFileSync, rmdirSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { JailUnavailableError } from '../errors';
import { checkCgroupHost, JAIL_CGROUP_PARENT, type CgroupHost } from './cgroup-host';
import { cgroupFiles, cgroupV1Files, JAIL_CONTROLLERS, type JailController, type JailLimits } from './limits';

/** The kernel's counts of `memory.events` (v2) or `memory.oom_control` (v1): `oom_kill`, `max`, ... */
export function parseMemoryEvents(text: string): Record<string, number> {
  const out: Record<string, number> = {};
  for (const line of text.split('\n')) {
    const m = /^([a-z_]+) (\d+)$/.exec(line.trim());
    if (m) out[m[1]] = Number(m[2]);
  }
  return out;
}

/** The limits a jail's cgroup holds, as the kernel reports them back. */
export interface CgroupLimitsRead {
  memoryBytes: number;
  /** Swap the cgroup may use beyond memory (v2 `memory.swap.max`; v1 memsw minus memory); undefined where the kernel does not account swap. */
  swapBytes: number | undefined;
  pids: number;
  cpuQuotaUs: number;
  cpuPeriodUs: number;
}

/** One jailed VM's cgroup. */
export class JailCgroup {
  private constructor(
    private readonly host: CgroupHost,
    /** The cgroup's name (the VM's id). */
    readonly name: string,
  ) {}

  /** The cgroup's directory holding `controller`'s files (the one directory, in v2). */
  dirOf(controller: JailController): string {
    return this.host.version === 2 ? join(this.host.mount, JAIL_CGROUP_PARENT, this.name) : join(this.host.parents[controller], this.name);
  }

  /** Its directories: one in v2, one per controller in v1. */
  get dirs(): string[] {
    return [...new Set(JAIL_CONTROLLERS.map((c) => this.dirOf(c)))];
  }

  /**
   * Makes the cgroup `name` with `limits` written, controllers enabled on the way down (v2).
   * Throws a {@link JailUnavailableError} saying what is missing: no cgroup with the controllers,
   * no right to create it (not root, no delegation), or a cgroup of that name already there
   * (another run of the same id); what it made by then is removed.
   */
  static create(name: string, limits: JailLimits, host: CgroupHost = checkCgroupHost()): JailCgroup {
    const cg = new JailCgroup(host, name);
    const made: string[] = [];
    try {
      if (host.version === 2) {
        enableControllers(host.mount);
        mkdirSync(dirname(cg.dirs[0]), { recursive: true });
        enableControllers(dirname(cg.dirs[0]));
      }
      for (const dir of cg.dirs) {
        mkdirSync(dirname(dir), { recursive: true });
        mkdirSync(dir);
        made.push(dir);
      }
    } catch (e) {
      for (const dir of made) tryRmdir(dir);
      const code = (e as NodeJS.ErrnoException).code;
      const path = (e as NodeJS.ErrnoException).path ?? cg.dirs[0];
      if (code === 'EEXIST') throw new JailUnavailableError(`the cgroup ${path} already exists: another jailed run of ${name} is running, or one was killed before it could remove it (rmdir ${path} once it holds no process)`, { cause: e });
      throw new JailUnavailableError(`cannot create the cgroup ${path}: ${(e as Error).message} (a jail needs root, or a delegated cgroup)`, { cause: e });
    }
    try {
      if (host.version === 2) for (const [file, value] of cgroupFiles(limits)) writeFileSync(join(cg.dirs[0], file), value);
      else {
        for (const [controller, file, value, optional] of cgroupV1Files(limits)) {
          const path = join(cg.dirOf(controller), file);
          if (optional && !existsSync(path)) continue;
          writeFileSync(path, value);
        }
      }
    } catch (e) {
      cg.remove();
      throw new JailUnavailableError(`cannot set the limits of ${cg.dirs.join(', ')}: ${(e as Error).message}`, { cause: e });
    }
    return cg;
  }

  /** The jail cgroup `name` as it is now on this host, or `undefined` if it does not exist. */
  static find(name: string, host: CgroupHost = checkCgroupHost()): JailCgroup | undefined {
    const cg = new JailCgroup(host, name);
    return cg.dirs.some((d) => existsSync(d)) ? cg : undefined;
  }

  /**
   * The shell words that move the shell into this cgroup (each of its directories) and exec the
   * command after them, so that the command and everything it starts are charged here from their
   * first page.
   */
  enterArgv(command: readonly string[]): string[] {
    const procs = this.dirs.map((d) => join(d, 'cgroup.procs'));
    // sh -c's words: $0, $1, ... are the procs files; `shift` leaves the command in "$@".
    const script = `${procs.map((_, i) => `echo $$ > "$${i}"`).join(' && ')} && shift ${procs.length - 1} && exec "$@"`;
    return ['/bin/sh', '-c', script, ...procs, ...command];
  }

  /** The tasks' process ids (the memory controller's directory, which every task enters). */
  pids(): number[] {
    try {
      return readFileSync(join(this.dirOf('memory'), 'cgroup.procs'), 'utf8').split('\n').filter(Boolean).map(Number);
    } catch {
      return [];
    }
  }

  /** The limits as the kernel holds them. */
  limits(): CgroupLimitsRead {
    const read = (c: JailController, file: string) => readFileSync(join(this.dirOf(c), file), 'utf8').trim();
    if (this.host.version === 2) {
      const [quota, period] = read('cpu', 'cpu.max').split(' ');
      return { memoryBytes: Number(read('memory', 'memory.max')), swapBytes: Number(read('memory', 'memory.swap.max')), pids: Number(read('pids', 'pids.max')), cpuQuotaUs: Number(quota), cpuPeriodUs: Number(period) };
    }
    const memoryBytes = Number(read('memory', 'memory.limit_in_bytes'));
    const memsw = existsSync(join(this.dirOf('memory'), 'memory.memsw.limit_in_bytes')) ? Number(read('memory', 'memory.memsw.limit_in_bytes')) : undefined;
    return { memoryBytes, swapBytes: memsw === undefined ? undefined : memsw - memoryBytes, pids: Number(read('pids', 'pids.max')), cpuQuotaUs: Number(read('cpu', 'cpu.cfs_quota_us')), cpuPeriodUs: Number(read('cpu', 'cpu.cfs_period_us')) };
  }

  /** How many times the kernel killed a task of this cgroup for its memory limit. */
  oomKills(): number {
    const file = this.host.version === 2 ? 'memory.events' : 'memory.oom_control';
    try {
      return parseMemoryEvents(readFileSync(join(this.dirOf('memory'), file), 'utf8')).oom_kill ?? 0;
    } catch {
      return 0;
    }
  }

  /** Whether a task is still in the cgroup (v2 `cgroup.events` populated; v1 a task in any of its directories). */
  populated(): boolean {
    if (this.host.version === 2) {
      try {
        return /^populated 1$/m.test(readFileSync(join(this.dirs[0], 'cgroup.events'), 'utf8'));
      } catch {
        return false;
      }
    }
    return this.dirs.some((d) => {
      try {
        return readFileSync(join(d, 'cgroup.procs'), 'utf8').trim() !== '';
      } catch {
        return false;
      }
    });
  }

  /**
   * Removes the cgroup once its tasks are gone (the kernel refuses to remove a populated one:
   * EBUSY). Waits up to `waitMs` for the last task's exit to be accounted; returns whether it is gone.
   */
  async removeWhenEmpty(waitMs = 5000): Promise<boolean> {
    const end = Date.now() + waitMs;
    while (this.populated() && Date.now() < end) await new Promise((r) => setTimeout(r, 20));
    return this.remove();
  }

  /** Removes the cgroup now; false if it is still populated (any of its directories). */
  remove(): boolean {
    let gone = true;
    for (const dir of this.dirs) gone = tryRmdir(dir) && gone;
    return gone;
  }
}

/** Removes `dir`; true if it is gone (removed, or was not there). */
function tryRmdir(dir: string): boolean {
  try {
    rmdirSync(dir);
    return true;
  } catch {
    return !existsSync(dir);
  }
}

/** Enables the jail's controllers for `dir`'s children, when not already enabled. */
function enableControllers(dir: string): void {
  const enabled = readFileSync(join(dir, 'cgroup.subtree_control'), 'utf8').trim().split(/\s+/);
  const wanted = JAIL_CONTROLLERS.filter((c) => !enabled.includes(c));
  if (wanted.length) writeFileSync(join(dir, 'cgroup.subtree_control'), wanted.map((c) => `+${c}`).join(' '));
}
