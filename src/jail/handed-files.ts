/**
 * Open files a jailed VMM is handed instead of paths: what the jail's uid could not open itself,
 * or should not. Its launcher (./launcher.ts, root or the user) opens them and the VMM inherits
 * the fds, as it inherits the TAP's (../network/handed-network.ts):
 * - a writable rootfs: the image is the user's, and the jail's uid (nobody) may not write it; the
 *   launcher opens it O_RDWR and the VMM's virtio-blk uses that open file (a dup of it);
 * - the pool daemon's socket: the launcher connects, so the daemon reads the launcher's
 *   credentials (the user's uid, whose scopes they are) and not the jail's, which every jailed VM
 *   shares; the VMM sends Hello on that connection. It is one connection: if the daemon goes, the
 *   jailed VM runs on with what it maps and does not reconnect (it could only connect as nobody).
 *
 * The environment comes from the launcher (bubblewrap clears everything else), so it is trusted;
 * it is still parsed strictly, so that a mistake is an error, not a wrong file.
 * @module
 */

/** The environment variables that carry them. */
export const HANDED_FILES_ENV = {
  /** `FD`: the rootfs image, open read-write. */
  rootfs: 'PVISOR_JAIL_ROOTFS_FD',
  /** `FD`: a connection to the pool daemon, not yet greeted. */
  pool: 'PVISOR_JAIL_POOL_FD',
} as const;

function fdOf(text: string | undefined): number | undefined {
  return text !== undefined && /^[0-9]{1,4}$/.test(text) && Number(text) >= 3 ? Number(text) : undefined;
}

/** The fd of the rootfs this jailed process was handed, or `undefined` (not jailed, or none handed). */
export function handedRootfsFd(env: NodeJS.ProcessEnv = process.env): number | undefined {
  return fdOf(env[HANDED_FILES_ENV.rootfs]);
}


let poolTaken = false;

/**
 * The handed connection to the pool daemon, once: the first caller owns it (and closes it); later
 * callers (a reconnect) get `undefined` and connect by path, which in a jail finds no socket.
 */
export function takeHandedPoolFd(env: NodeJS.ProcessEnv = process.env): number | undefined {
  if (poolTaken) return undefined;
  const fd = fdOf(env[HANDED_FILES_ENV.pool]);
  if (fd !== undefined) poolTaken = true;
  return fd;
}
