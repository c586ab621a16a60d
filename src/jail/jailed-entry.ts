/**
 * The jailed side of `pvisor run --isolation process`: what the VMM process reads when its
 * launcher (./launcher.ts) started it inside the jail. It is told so by the environment its
 * launcher set (bubblewrap clears everything else): the fd of its control socket, already
 * listening, and the fd it reports its exit status on. A death without a report is a kill, which
 * the launcher then explains (the memory limit, seccomp).
 * @module
 */
import { writeSync } from 'node:fs';

/** The environment variables the launcher sets in the jail. */
export const JAIL_ENV = {
  controlFd: 'PVISOR_JAIL_CONTROL_FD',
  statusFd: 'PVISOR_JAIL_STATUS_FD',
  /**
   * Test-only: set by test/kvm/jail.test.ts, the jailed VMM makes a call its filter does not
   * allow once its VM is running, so that the test sees seccomp kill it: `1`, a system call
   * (acct); `ioctl`, a KVM ioctl request outside the allowed ones (KVM_SET_USER_MEMORY_REGION2).
   * Read only in the jail, where only the launcher sets the environment.
   */
  testForbiddenSyscall: 'PVISOR_JAIL_TEST_FORBIDDEN_SYSCALL',
  /** Set (to 1) when the `--from` directory is a hibernated VM that `pvisor resume` continues in this jail. */
  resumed: 'PVISOR_JAIL_RESUMED',
} as const;

/** What the jailed VMM was handed, or `undefined` outside a jail. */
export interface JailedEntry {
  /** A Unix socket already listening: the control socket, reached through the launcher. */
  controlFd: number;
  /** Where the exit status goes before the process exits. */
  statusFd: number;
  /** The test hook ({@link JAIL_ENV}.testForbiddenSyscall): which forbidden call it makes, or `false` when off. */
  forbiddenSyscallHook: false | 'syscall' | 'ioctl';
  /** The run continues a hibernated VM ({@link JAIL_ENV}.resumed). */
  resumed: boolean;
}

function fdOf(text: string | undefined): number | undefined {
  return text !== undefined && /^[0-9]{1,4}$/.test(text) ? Number(text) : undefined;
}

/** This process's jail, from its environment. */
export function jailedEntry(env: NodeJS.ProcessEnv = process.env): JailedEntry | undefined {
  const controlFd = fdOf(env[JAIL_ENV.controlFd]);
  const statusFd = fdOf(env[JAIL_ENV.statusFd]);
  if (controlFd === undefined || statusFd === undefined) return undefined;
  const hook = env[JAIL_ENV.testForbiddenSyscall];
  return { controlFd, statusFd, forbiddenSyscallHook: hook === '1' ? 'syscall' : hook === 'ioctl' ? 'ioctl' : false, resumed: env[JAIL_ENV.resumed] === '1' };
}

/** Tells the launcher the exit status this process is about to exit with (jailed processes only). */
export function reportJailedExit(code: number): void {
  const entry = jailedEntry();
  if (!entry) return;
  try {
    writeSync(entry.statusFd, `exit ${code}\n`);
  } catch {
    // The launcher is gone: nobody to tell.
  }
}

/** Parses what the jailed process reported: its exit status, or `undefined` if it said nothing (it was killed). */
export function parseJailedReport(text: string): number | undefined {
  const m = /^exit (\d{1,3})$/m.exec(text);
  return m ? Number(m[1]) : undefined;
}

/** acct(2): never made by the VMM (and harmless if it were allowed: EPERM without CAP_SYS_PACCT). */
const SYS_ACCT = 163;
/** ioctl(2). */
const SYS_IOCTL = 16;

/**
 * The test hook: one call outside the filter, the one the environment asks for (acct, or a KVM
 * ioctl request the filter does not list, on fd -1: harmless if it were let through, EBADF).
 * Returns only if the filter let it through.
 */
export function makeForbiddenSyscall(kind: 'syscall' | 'ioctl' = jailedEntry()?.forbiddenSyscallHook || 'syscall'): number {
  // Loaded here, not imported: this module is read by every pvisor command, and libc's binding loads ffi-rs.
  const { openLibc } = require('../sys/libc') as typeof import('../sys/libc');
  const { KVM_SET_USER_MEMORY_REGION2 } = require('../sys/constants') as typeof import('../sys/constants');
  const { define, DataType } = openLibc();
  const f = define({ syscall: { library: 'libc', retType: DataType.I64, paramsType: [DataType.I64, DataType.I64, DataType.I64, DataType.I64] } });
  return (kind === 'ioctl' ? f.syscall([SYS_IOCTL, -1, KVM_SET_USER_MEMORY_REGION2, 0]) : f.syscall([SYS_ACCT, 0, 0, 0])) as number;
}
