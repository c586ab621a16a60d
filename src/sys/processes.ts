/**
 * Whether process `pid` no longer exists: what every sweep of a dead pvisor process's leftovers
 * (backing files, TAP devices and nftables tables named after their owner's pid) asks. Signal 0
 * checks without sending; EPERM means it lives under another uid, so only ESRCH is gone.
 */
export function processGone(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return false;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'ESRCH';
  }
}
