/**
 * The cgroup v2 of one jailed VM: made under `<cgroup2 mount>/pvisor/` with its limits written
 * before any process enters it, read after the process ends (did the kernel kill for the memory
 * limit?), and removed. Only cgroup v2: v1 has no `memory.oom.group` and splits the controllers
 * over hierarchies, so a jail there could not say what killed its process.
 * @module
 */
import { accessSync, constants as fsConstants, existsSync, mkdirSync, readFileSync, rmdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { JailUnavailableError } from '../errors';
import { cgroupFiles, JAIL_CONTROLLERS, type JailLimits } from './limits';

/**
 * Where cgroup v2 is mounted, from `/proc/self/mountinfo`'s text: the mount point of the first
 * `cgroup2` filesystem, or `undefined`. Mount points with spaces are octal-escaped there (`\040`).
 */
export function cgroup2MountOf(mountinfo: string): string | undefined {
  for (const line of mountinfo.split('\n')) {
    const sep = line.indexOf(' - ');
    if (sep < 0) continue;
    const fstype = line.slice(sep + 3).split(' ')[0];
    if (fstype !== 'cgroup2') continue;
    const mountPoint = line.slice(0, sep).split(' ')[4];
    if (mountPoint) return mountPoint.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)));
  }
  return undefined;
}

/** The kernel's counts of `memory.events` (`oom_kill`, `max`, ...), from its text. */
export function parseMemoryEvents(text: string): Record<string, number> {
  const out: Record<string, number> = {};
  for (const line of text.split('\n')) {
    const m = /^([a-z_]+) (\d+)$/.exec(line.trim());
    if (m) out[m[1]] = Number(m[2]);
  }
  return out;
}

/**
 * Checks that this host has what a jail's cgroup needs (cgroup v2 mounted, offering the memory,
 * pids and cpu controllers, and writable by this process) without making anything; returns the
 * mount point. Throws a {@link JailUnavailableError} naming what is missing.
 */
export function checkCgroupHost(mountinfo: string = readFileSync('/proc/self/mountinfo', 'utf8')): string {
  const mount = cgroup2MountOf(mountinfo);
  if (!mount) throw new JailUnavailableError('no cgroup v2 is mounted (a jail limits its VM with cgroup v2; on a cgroup v1 or hybrid host mount one: mount -t cgroup2 none /sys/fs/cgroup)');
  const offered = readFileSync(join(mount, 'cgroup.controllers'), 'utf8').trim().split(/\s+/);
  const missing = JAIL_CONTROLLERS.filter((c) => !offered.includes(c));
  if (missing.length) throw new JailUnavailableError(`cgroup v2 at ${mount} does not offer the ${missing.join(', ')} controller(s) (bound to a cgroup v1 hierarchy?); a jail needs ${JAIL_CONTROLLERS.join(', ')}`);
  try {
    accessSync(mount, fsConstants.W_OK);
  } catch (e) {
    throw new JailUnavailableError(`cannot create cgroups under ${mount} (${(e as NodeJS.ErrnoException).code}): a jail needs root, or a cgroup delegated to this user`, { cause: e });
  }
  return mount;
}

/** The parent directory of every jail's cgroup, under the cgroup v2 mount. */
export const JAIL_CGROUP_PARENT = 'pvisor';

/** One jailed VM's cgroup. */
export class JailCgroup {
  private constructor(
    /** The cgroup's directory. */
    readonly path: string,
  ) {}

  /**
   * Makes the cgroup `name` under `<mount>/pvisor/` with `limits` written, controllers enabled on
   * the way down. Throws a {@link JailUnavailableError} saying what is missing: no cgroup v2
   * mounted, a controller the kernel does not offer, no right to create it (not root, no
   * delegation), or a cgroup of that name already there (another run of the same id).
   */
  static create(name: string, limits: JailLimits, mountinfo: string = readFileSync('/proc/self/mountinfo', 'utf8')): JailCgroup {
    const mount = checkCgroupHost(mountinfo);
    const parent = join(mount, JAIL_CGROUP_PARENT);
    const path = join(parent, name);
    try {
      enableControllers(mount);
      mkdirSync(parent, { recursive: true });
      enableControllers(parent);
      mkdirSync(path);
    } catch (e) {
      const code = (e as NodeJS.ErrnoException).code;
      if (code === 'EEXIST') throw new JailUnavailableError(`the cgroup ${path} already exists: another jailed run of ${name} is running, or one was killed before it could remove it (rmdir ${path} once it holds no process)`, { cause: e });
      throw new JailUnavailableError(`cannot create the cgroup ${path}: ${(e as Error).message} (a jail needs root, or a delegated cgroup)`, { cause: e });
    }
    const cg = new JailCgroup(path);
    try {
      for (const [file, value] of cgroupFiles(limits)) writeFileSync(join(path, file), value);
    } catch (e) {
      cg.remove();
      throw new JailUnavailableError(`cannot set the limits of ${path}: ${(e as Error).message}`, { cause: e });
    }
    return cg;
  }

  /**
   * The shell words that move the shell into this cgroup and exec the command after them, so that
   * the command and everything it starts are charged here from their first page.
   */
  enterArgv(command: readonly string[]): string[] {
    return ['/bin/sh', '-c', 'echo $$ > "$0" && exec "$@"', join(this.path, 'cgroup.procs'), ...command];
  }

  /** How many times the kernel killed a task of this cgroup for its memory limit. */
  oomKills(): number {
    try {
      return parseMemoryEvents(readFileSync(join(this.path, 'memory.events'), 'utf8')).oom_kill ?? 0;
    } catch {
      return 0;
    }
  }

  /** Whether a task is still in the cgroup (`cgroup.events` populated). */
  populated(): boolean {
    try {
      return /^populated 1$/m.test(readFileSync(join(this.path, 'cgroup.events'), 'utf8'));
    } catch {
      return false;
    }
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

  /** Removes the cgroup now; false if it is still populated or already gone. */
  remove(): boolean {
    try {
      rmdirSync(this.path);
      return true;
    } catch {
      return !existsSync(this.path);
    }
  }
}

/** Enables the jail's controllers for `dir`'s children, when not already enabled. */
function enableControllers(dir: string): void {
  const enabled = readFileSync(join(dir, 'cgroup.subtree_control'), 'utf8').trim().split(/\s+/);
  const wanted = JAIL_CONTROLLERS.filter((c) => !enabled.includes(c));
  if (wanted.length) writeFileSync(join(dir, 'cgroup.subtree_control'), wanted.map((c) => `+${c}`).join(' '));
}
