/**
 * The sandbox a jailed VMM runs in, as bubblewrap's arguments: its own mount, pid, ipc, uts,
 * cgroup and network namespaces; a root that is an empty tmpfs holding, read-only, only node, the
 * libraries it loads, the package's dist, node_modules and native-prebuilds and the VM's images;
 * its /dev/kvm (a node the launcher made for the jail's uid) and its own backing directory
 * read-write. bwrap runs as root and starts native-prebuilds' pvisor-jail-exec in the jail, which
 * drops to the jail's uid and gid, sets no_new_privs, installs the seccomp filter and execs node.
 *
 * Why bubblewrap: it is Debian's, small and audited (Flatpak's sandbox), and does the namespace
 * and mount dance in the right order (a new mount namespace, the tmpfs root, the binds, pivot_root,
 * the old root detached); a launcher of our own would repeat it. Why not its --uid and
 * --seccomp: see native-prebuilds/helpers/jail_exec.c (they need a user namespace).
 * @module
 */
import { execFileSync } from 'node:child_process';
import { readdirSync, readlinkSync, realpathSync, lstatSync } from 'node:fs';
import { dirname, join } from 'node:path';

/** What to put in the jail and how to start the VMM there. */
export interface SandboxPlan {
  /** Host paths mounted read-only at the same path (files or directories). */
  readOnly: readonly string[];
  /** Host paths mounted read-write at the same path (the backing directory, a writable rootfs). */
  readWrite: readonly string[];
  /** Device nodes made for the jail's uid (`node`), bound at `path` (/dev/kvm, /dev/userfaultfd). */
  devices: readonly { node: string; path: string }[];
  /** The host's usr-merge links (`/lib` -> `usr/lib`, ...), recreated in the jail. */
  links: readonly { path: string; target: string }[];
  /** The jail's uid and gid. */
  uid: number;
  gid: number;
  /** pvisor-jail-exec's path (inside native-prebuilds, so in the jail too). */
  jailExec: string;
  /** The fd pvisor-jail-exec reads the seccomp program from. */
  seccompFd: number;
  /** Environment of the VMM: nothing else of the launcher's reaches it. */
  env: Readonly<Record<string, string>>;
  /** The VMM's argv (node and its arguments). */
  command: readonly string[];
}

/** bubblewrap's arguments for `plan` (without the program name). Pure. */
export function bwrapArgs(plan: SandboxPlan): string[] {
  const a: string[] = [
    '--unshare-pid', '--unshare-ipc', '--unshare-uts', '--unshare-net', '--unshare-cgroup',
    '--hostname', 'pvisor-jail',
    // The VMM goes with its launcher, and has no terminal to push input into (TIOCSTI).
    '--die-with-parent', '--new-session',
    '--clearenv',
    // An empty root: only what follows is in it.
    '--tmpfs', '/',
    '--proc', '/proc',
    '--dev', '/dev',
    '--tmpfs', '/tmp',
  ];
  // bwrap makes the directories above each mount 0700 when it runs as root: the jail's uid
  // could not walk them. Every one is made 0755 first.
  for (const d of parentDirs([...plan.readOnly, ...plan.readWrite, ...plan.links.map((l) => l.path)])) a.push('--perms', '0755', '--dir', d);
  for (const p of plan.readOnly) a.push('--ro-bind', p, p);
  for (const p of plan.readWrite) a.push('--bind', p, p);
  for (const l of plan.links) a.push('--symlink', l.target, l.path);
  for (const d of plan.devices) a.push('--dev-bind', d.node, d.path);
  // A new tmpfs root is writable: seal it once everything is mounted.
  a.push('--remount-ro', '/');
  for (const [k, v] of Object.entries(plan.env)) a.push('--setenv', k, v);
  a.push('--', plan.jailExec, String(plan.uid), String(plan.gid), String(plan.seccompFd), ...plan.command);
  return a;
}

/** Every directory above `paths` (not `/`, not the paths themselves), parents first. Pure. */
export function parentDirs(paths: readonly string[]): string[] {
  const dirs = new Set<string>();
  for (const p of paths) {
    const parts = p.split('/').filter(Boolean);
    for (let i = 1; i < parts.length; i++) dirs.add(`/${parts.slice(0, i).join('/')}`);
  }
  return [...dirs].sort((x, y) => x.split('/').length - y.split('/').length || x.localeCompare(y));
}

/**
 * The shared libraries `files` load, from `ldd`'s output: every resolved path (`libc.so.6 =>
 * /lib/x86_64-linux-gnu/libc.so.6 (0x...)`) and the loader (`/lib64/ld-linux-x86-64.so.2
 * (0x...)`). Pure.
 */
export function librariesOfLdd(output: string): string[] {
  const out = new Set<string>();
  for (const line of output.split('\n')) {
    const arrow = /=>\s+(\/\S+)\s+\(0x/.exec(line);
    const bare = /^\s*(\/\S+)\s+\(0x/.exec(line);
    const path = arrow?.[1] ?? bare?.[1];
    if (path) out.add(path);
  }
  return [...out];
}

/** The top-level links of a usr-merged host (`/lib` -> `usr/lib`), to be recreated in the jail. */
export function usrMergeLinks(): { path: string; target: string }[] {
  const links: { path: string; target: string }[] = [];
  for (const d of ['bin', 'sbin', 'lib', 'lib32', 'lib64', 'libx32']) {
    try {
      if (lstatSync(`/${d}`).isSymbolicLink()) links.push({ path: `/${d}`, target: readlinkSync(`/${d}`) });
    } catch {
      // Not on this host.
    }
  }
  return links;
}

/**
 * What node needs to run in the jail, as real host paths (each mounted at its real path; the
 * usr-merge links make the paths ldd printed resolve there): node itself, every shared library
 * it or a native addon under `nodeModules` loads, and the loader's cache.
 */
export function nodeRuntimeFiles(nodeModules: string): string[] {
  const objects = [realpathSync(process.execPath), ...nativeAddons(nodeModules)];
  const files = new Set<string>(objects);
  // One ldd for all (each process start is dear under emulation); a static object among them
  // makes it exit 1 with the others' libraries still printed.
  let ldd: string;
  try {
    ldd = execFileSync('ldd', objects, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] });
  } catch (e) {
    ldd = String((e as { stdout?: unknown }).stdout ?? '');
  }
  for (const lib of librariesOfLdd(ldd)) files.add(realpathInDir(lib));
  files.add('/etc/ld.so.cache');
  return [...files];
}

/**
 * A library's real path, with its directory resolved but kept under the name the loader asks
 * for: /lib64/ld-linux-x86-64.so.2 is a link to ../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2,
 * and the jail must have a file at /usr/lib64/ld-linux-x86-64.so.2 (the bind follows the link).
 */
function realpathInDir(path: string): string {
  return join(realpathSync(dirname(path)), path.slice(path.lastIndexOf('/') + 1));
}

/** `.node` files (native addons) under `dir`, a few levels deep (node_modules/@scope/pkg/build/Release). */
function nativeAddons(dir: string, depth = 5): string[] {
  const out: string[] = [];
  let entries;
  try {
    entries = readdirSync(dir, { withFileTypes: true });
  } catch {
    return out;
  }
  for (const e of entries) {
    const p = join(dir, e.name);
    if (e.isFile() && e.name.endsWith('.node')) out.push(p);
    else if (e.isDirectory() && depth > 0 && e.name !== '.bin' && e.name !== 'test' && e.name !== 'src') out.push(...nativeAddons(p, depth - 1));
  }
  return out;
}
