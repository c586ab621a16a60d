/**
 * libc bindings through ffi-rs: the one place where pvisor calls into C.
 *
 * Every function is declared here, once. ffi-rs (a native addon) is loaded and libc opened on the
 * first call, not when this module loads: importing pvisor must load no native code, so that an
 * application that only imports it (to type-check, to read its errors, to reach a VM of another
 * process over its control socket) neither pays for nor depends on the addon. The first call is
 * made on the main thread (workers load zstd only, see memory/frame-worker.ts): ffi-rs keeps its
 * symbol cache in an unlocked global, so a lookup from a worker racing another lookup can crash
 * the process. Call descriptors are built once (`define`) and reused, because ffi-rs re-prepares a
 * call from its JS descriptor each time.
 *
 * Addresses travel as JS numbers (ffi-rs U64): user-space addresses are below 2^47, well inside
 * the 2^53 a number holds exactly.
 */
import type * as Ffi from 'ffi-rs';
import { SystemCallError } from '../errors';
import { EINTR } from './constants';

let ffi: typeof Ffi | undefined;

/**
 * ffi-rs, loaded on first use, with libc opened for it under the library name `libc`. Modules
 * that declare more libc functions of their own (./unix-socket.ts) call it before theirs.
 */
export function openLibc(): typeof Ffi {
  if (!ffi) {
    // require, not import: an import is hoisted to when this module loads.
    const loaded = require('ffi-rs') as typeof Ffi;
    loaded.open({ library: 'libc', path: 'libc.so.6' });
    ffi = loaded;
  }
  return ffi;
}

function defineLibc() {
  const { DataType, define } = openLibc();
  const I32 = DataType.I32;
  const I64 = DataType.I64;
  const U64 = DataType.U64;
  const libc = 'libc';
  return define({
    open: { library: libc, retType: I32, paramsType: [DataType.String, I32, I32], errno: true },
    close: { library: libc, retType: I32, paramsType: [I32], errno: true },
    ioctl: { library: libc, retType: I32, paramsType: [I32, U64, U64], errno: true },
    mmap: { library: libc, retType: U64, paramsType: [U64, U64, I32, I32, I32, I64], errno: true },
    munmap: { library: libc, retType: I32, paramsType: [U64, U64], errno: true },
    mprotect: { library: libc, retType: I32, paramsType: [U64, U64, I32], errno: true },
    madvise: { library: libc, retType: I32, paramsType: [U64, U64, I32], errno: true },
    mincore: { library: libc, retType: I32, paramsType: [U64, U64, U64], errno: true },
    eventfd: { library: libc, retType: I32, paramsType: [I32, I32], errno: true },
    memfd_create: { library: libc, retType: I32, paramsType: [DataType.String, I32], errno: true },
    flock: { library: libc, retType: I32, paramsType: [I32, I32], errno: true },
    fcntl: { library: libc, retType: I32, paramsType: [I32, I32, I32], errno: true },
    fallocate: { library: libc, retType: I32, paramsType: [I32, I32, I64, I64], errno: true },
    // Returns the error number itself (not -1 and errno).
    posix_fadvise: { library: libc, retType: I32, paramsType: [I32, I64, I64, I32] },
    // memset(addr, 0, 0) returns `addr` as an ffi-rs External: the only way ffi-rs offers to turn
    // an address into something createExternalBuffer accepts.
    memset: { library: libc, retType: DataType.External, paramsType: [U64, I32, U64] },
    malloc_trim: { library: libc, retType: I32, paramsType: [U64] },
  });
}

type LibcFunctions = ReturnType<typeof defineLibc>;
let defined: LibcFunctions | undefined;

/** The libc functions, defined (and ffi-rs loaded) when one of them is first called. */
const fns = new Proxy({} as LibcFunctions, {
  get: (_, name) => (defined ??= defineLibc())[name as keyof LibcFunctions],
});

/** POSIX_FADV_RANDOM and POSIX_FADV_DONTNEED from <fcntl.h>. */
const POSIX_FADV_RANDOM = 1;
const POSIX_FADV_DONTNEED = 4;

/** mmap's MAP_FAILED, (void *)-1, as ffi-rs hands back a U64 (rounded to a double). */
const MAP_FAILED_MIN = 2 ** 63;

type ErrnoResult<T> = { value: T; errnoCode: number };

function check(call: string, r: ErrnoResult<number>, detail?: string): number {
  if (r.value < 0) throw new SystemCallError(call, r.errnoCode, detail);
  return r.value;
}

/** open(2); throws {@link SystemCallError} naming the path. */
export function openFile(path: string, flags: number, mode = 0): number {
  return check('open', fns.open([path, flags, mode]) as ErrnoResult<number>, path);
}

/** EFD_CLOEXEC and EFD_NONBLOCK from <sys/eventfd.h> (the O_ flags' values). */
const EFD_CLOEXEC = 0o2000000;
const EFD_NONBLOCK = 0o4000;

/** What a write(2) to an eventfd adds to its counter: a little-endian u64 of 1. */
export const EVENTFD_ONE = new Uint8Array([1, 0, 0, 0, 0, 0, 0, 0]);

/**
 * A non-blocking, close-on-exec eventfd(2) (counter 0). Node writes one with fs.writeSync (an
 * 8-byte count); it cannot poll one (see native-prebuilds/helpers/vcpu_runner.c for who reads them).
 */
export function createEventFd(): number {
  return check('eventfd', fns.eventfd([0, EFD_CLOEXEC | EFD_NONBLOCK]) as ErrnoResult<number>);
}

/** memfd_create(2): an anonymous file in memory (`name` shows in /proc/PID/maps), close-on-exec. */
export function createMemfd(name: string, flags: number): number {
  return check('memfd_create', fns.memfd_create([name, flags]) as ErrnoResult<number>, name);
}

/** LOCK_SH, LOCK_EX and LOCK_NB from <sys/file.h>; EWOULDBLOCK from <errno.h>. */
const LOCK_SH = 1;
const LOCK_EX = 2;
const LOCK_NB = 4;
const EWOULDBLOCK = 11;

/**
 * flock(2) without waiting: an exclusive lock (a writer) or a shared one (readers). Returns false
 * if another open file holds a conflicting lock; the lock goes with the fd's close.
 */
export function tryLockFile(fd: number, exclusive: boolean): boolean {
  const r = fns.flock([fd, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB]) as ErrnoResult<number>;
  if (r.value === 0) return true;
  if (r.errnoCode === EWOULDBLOCK) return false;
  return check('flock', r) === 0;
}

/** fallocate(2) modes from <linux/falloc.h>. */
const FALLOC_FL_KEEP_SIZE = 1;
const FALLOC_FL_PUNCH_HOLE = 2;

/** Frees [offset, offset+length) of file `fd` (a hole reads zero), keeping its size: fallocate(PUNCH_HOLE). */
export function punchHole(fd: number, offset: number, length: number): void {
  check('fallocate(PUNCH_HOLE)', fns.fallocate([fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length]) as ErrnoResult<number>);
}

/** F_DUPFD_CLOEXEC from <linux/fcntl.h>. */
const F_DUPFD_CLOEXEC = 1030;

/**
 * A close-on-exec duplicate of `fd` (fcntl F_DUPFD_CLOEXEC): the same open file, for an owner
 * that closes its own, without opening the path again (which may by then be another file).
 */
export function dupFd(fd: number): number {
  return check('fcntl(F_DUPFD_CLOEXEC)', fns.fcntl([fd, F_DUPFD_CLOEXEC, 0]) as ErrnoResult<number>);
}

/** close(2). */
export function closeFd(fd: number): void {
  check('close', fns.close([fd]) as ErrnoResult<number>);
}

/**
 * ioctl(2) whose third argument is a number or an address. `name` is the request's symbolic
 * name, used in the error.
 */
export function ioctl(fd: number, request: number, arg: number, name: string): number {
  // A signal to this thread (a profiler's SIGPROF under node --cpu-prof, found so) can end a KVM
  // ioctl with EINTR before it did anything (KVM_CREATE_VM did); such an ioctl is simply asked
  // again. KVM_RUN, whose EINTR means something, runs on the vCPU threads, not through here.
  for (let attempt = 1; ; attempt++) {
    const r = fns.ioctl([fd, request, arg]) as ErrnoResult<number>;
    if (r.value >= 0 || r.errnoCode !== EINTR || attempt === 100) return check(`ioctl(${name})`, r);
  }
}

/** mmap(2); returns the address. */
export function mmap(addr: number, length: number, prot: number, flags: number, fd: number, offset: number, what: string): number {
  const r = fns.mmap([addr, length, prot, flags, fd, offset]) as ErrnoResult<number>;
  if (r.value >= MAP_FAILED_MIN) throw new SystemCallError('mmap', r.errnoCode, what);
  return r.value;
}

/** munmap(2). */
export function munmap(addr: number, length: number): void {
  check('munmap', fns.munmap([addr, length]) as ErrnoResult<number>);
}

/** mprotect(2). */
export function mprotect(addr: number, length: number, prot: number): void {
  check('mprotect', fns.mprotect([addr, length, prot]) as ErrnoResult<number>);
}

/** madvise(2). */
export function madvise(addr: number, length: number, advice: number, name: string): void {
  check(`madvise(${name})`, fns.madvise([addr, length, advice]) as ErrnoResult<number>);
}

/** madvise(2) that reports failure instead of throwing: for advice whose failure costs nothing. */
export function tryMadvise(addr: number, length: number, advice: number): boolean {
  return (fns.madvise([addr, length, advice]) as ErrnoResult<number>).value === 0;
}

/**
 * mincore(2): which pages of [addr, addr+length) are resident. `vecAddr` is native memory of at
 * least length/4096 bytes; bit 0 of each byte is set for a resident page.
 */
export function mincore(addr: number, length: number, vecAddr: number): void {
  check('mincore', fns.mincore([addr, length, vecAddr]) as ErrnoResult<number>);
}

/**
 * A zero-copy Buffer over native memory at `addr`. The caller keeps the memory mapped for as long
 * as the view is used: a view over an unmapped address crashes the process on access.
 */
export function viewAt(addr: number, length: number): Buffer {
  return openLibc().createExternalBuffer(fns.memset([addr, 0, 0]), length);
}

/**
 * Gives the free pages inside malloc's heap back to the kernel (glibc's malloc_trim(0)). Free
 * memory in the middle of the heap otherwise stays resident: a page pool's merge pass left a VM
 * process's heap 5-6 MiB larger, almost all of it free, and this gave it back.
 */
export function releaseFreeHeap(): void {
  fns.malloc_trim([0]);
}

/**
 * Asks the kernel to drop a file's clean pages from the page cache (posix_fadvise DONTNEED).
 * Advice only: pages still dirty stay, and a failure is not an error worth surfacing.
 */
export function dropFileCache(fd: number): void {
  fns.posix_fadvise([fd, 0, 0, POSIX_FADV_DONTNEED]);
}

/**
 * Tells the kernel that reads through this open file (and faults through its mappings) are
 * random: no readahead beyond what is asked. For a sparse file whose holes must not be read into
 * the page cache as zero pages. Advice only.
 */
export function adviseRandomAccess(fd: number): void {
  fns.posix_fadvise([fd, 0, 0, POSIX_FADV_RANDOM]);
}
