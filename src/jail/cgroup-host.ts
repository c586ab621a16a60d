/**
 * Where this host lets a jail put its cgroups: under cgroup v2 when its mount offers the memory,
 * pids and cpu controllers, otherwise under the cgroup v1 hierarchies that hold them (a v1 or
 * hybrid host, as systemd's legacy layouts and many CI machines are). Read from
 * `/proc/self/mountinfo` and `/proc/self/cgroup`; makes nothing.
 * @module
 */
import { accessSync, constants as fsConstants, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { JailUnavailableError } from '../errors';
import { JAIL_CONTROLLERS, type JailController } from './limits';

/** The parent directory of every jail's cgroup (under the v2 mount; under this process's own cgroup in v1). */
export const JAIL_CGROUP_PARENT = 'pvisor';

/**
 * Where a jail's cgroup `name` goes: `v2`, one directory `<mount>/pvisor/name`; `v1`, one per
 * controller, `<hierarchy>/<this process's cgroup>/pvisor/name`.
 */
export type CgroupHost = { version: 2; mount: string } | { version: 1; parents: Record<JailController, string> };

interface MountLine {
  root: string;
  point: string;
  fstype: string;
  superOptions: string[];
}

/** `/proc/self/mountinfo`'s lines; mount points with spaces are octal-escaped there (`\040`). */
function mountLines(mountinfo: string): MountLine[] {
  const unescape = (s: string) => s.replace(/\\([0-7]{3})/g, (_, o: string) => String.fromCharCode(parseInt(o, 8)));
  const out: MountLine[] = [];
  for (const line of mountinfo.split('\n')) {
    const sep = line.indexOf(' - ');
    if (sep < 0) continue;
    const before = line.slice(0, sep).split(' ');
    const after = line.slice(sep + 3).split(' ');
    if (!before[3] || !before[4] || !after[0]) continue;
    out.push({ root: unescape(before[3]), point: unescape(before[4]), fstype: after[0], superOptions: (after[2] ?? '').split(',') });
  }
  return out;
}

/**
 * Where cgroup v2 is mounted, from `/proc/self/mountinfo`'s text: the mount point of the first
 * `cgroup2` filesystem, or `undefined`.
 */
export function cgroup2MountOf(mountinfo: string): string | undefined {
  return mountLines(mountinfo).find((m) => m.fstype === 'cgroup2')?.point;
}

/**
 * For each jail controller, the directory under which a jail's v1 cgroups go: the hierarchy's
 * mount point joined with this process's own cgroup in it (from `/proc/self/cgroup`), so that a
 * jail is charged inside whatever limits this process already runs under. `undefined` for a
 * controller no v1 hierarchy holds.
 */
export function cgroupV1ParentsOf(mountinfo: string, selfCgroup: string): Partial<Record<JailController, string>> {
  const own = new Map<string, string>();
  for (const line of selfCgroup.split('\n')) {
    const m = /^\d+:([^:]*):(.*)$/.exec(line);
    if (m) for (const c of m[1].split(',')) if (c) own.set(c, m[2]);
  }
  const out: Partial<Record<JailController, string>> = {};
  for (const c of JAIL_CONTROLLERS) {
    const mount = mountLines(mountinfo).find((l) => l.fstype === 'cgroup' && l.superOptions.includes(c));
    if (!mount) continue;
    const path = own.get(c) ?? '/';
    // A hierarchy mounted from a subtree (a container's) shows that subtree as its root.
    const inMount = mount.root !== '/' && (path === mount.root || path.startsWith(`${mount.root}/`)) ? path.slice(mount.root.length) : mount.root === '/' ? path : '/';
    out[c] = join(mount.point, inMount, JAIL_CGROUP_PARENT);
  }
  return out;
}

/**
 * Checks that this host has what a jail's cgroup needs, without making anything: cgroup v2
 * offering the memory, pids and cpu controllers, else cgroup v1 hierarchies holding all three;
 * writable by this process either way. Throws a {@link JailUnavailableError} naming what is missing.
 */
export function checkCgroupHost(mountinfo: string = readFileSync('/proc/self/mountinfo', 'utf8'), selfCgroup: string = readFileSync('/proc/self/cgroup', 'utf8')): CgroupHost {
  const mount = cgroup2MountOf(mountinfo);
  let v2Missing = 'no cgroup v2 is mounted';
  if (mount) {
    let offered: string[] = [];
    try {
      offered = readFileSync(join(mount, 'cgroup.controllers'), 'utf8').trim().split(/\s+/);
    } catch {
      // Unreadable: it offers the jail nothing; v1 may still.
    }
    const missing = JAIL_CONTROLLERS.filter((c) => !offered.includes(c));
    if (!missing.length) {
      writable(mount);
      return { version: 2, mount };
    }
    v2Missing = `cgroup v2 at ${mount} does not offer the ${missing.join(', ')} controller(s)`;
  }
  const parents = cgroupV1ParentsOf(mountinfo, selfCgroup);
  const v1Missing = JAIL_CONTROLLERS.filter((c) => parents[c] === undefined);
  if (v1Missing.length) throw new JailUnavailableError(`${v2Missing}, and no cgroup v1 hierarchy holds the ${v1Missing.join(', ')} controller(s); a jail needs ${JAIL_CONTROLLERS.join(', ')} (mount cgroup v2 with them: mount -t cgroup2 none /sys/fs/cgroup)`);
  const complete = parents as Record<JailController, string>;
  // The parents' own parent exists (this process's cgroup); `pvisor/` is made at the first jail.
  for (const c of JAIL_CONTROLLERS) writable(join(complete[c], '..'));
  return { version: 1, parents: complete };
}

function writable(dir: string): void {
  try {
    accessSync(dir, fsConstants.W_OK);
  } catch (e) {
    throw new JailUnavailableError(`cannot create cgroups under ${dir} (${(e as NodeJS.ErrnoException).code}): a jail needs root, or a cgroup delegated to this user`, { cause: e });
  }
}
