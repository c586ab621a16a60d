/**
 * What Node's `net` cannot do on a Unix socket: receive a file descriptor (SCM_RIGHTS). The page
 * pool's daemon (native-prebuilds/helpers/pool_daemon.c) hands its memfd to each VM process this
 * way; pidfd_getfd would need ptrace rights over the daemon (root, or yama's ptrace_scope 0),
 * SCM_RIGHTS needs only the socket. Structs are built in the scratch buffer (x86-64 layouts, <sys/socket.h>, <sys/un.h>).
 */
import { SystemCallError } from '../errors';
import { scratchStruct } from './scratch';
import { closeFd, openLibc } from './libc';

// This module is loaded only when a VM joins a page pool; its functions are libc's.
const { define, DataType } = openLibc();

const I32 = DataType.I32;
const I64 = DataType.I64;
const U64 = DataType.U64;
const libc = 'libc';

const fns = define({
  socket: { library: libc, retType: I32, paramsType: [I32, I32, I32], errno: true },
  connect: { library: libc, retType: I32, paramsType: [I32, U64, I32], errno: true },
  recvmsg: { library: libc, retType: I64, paramsType: [I32, U64, I32], errno: true },
});

type ErrnoResult = { value: number; errnoCode: number };

const AF_UNIX = 1;
const SOCK_STREAM = 1;
const SOCK_NONBLOCK = 0o4000;
const SOCK_CLOEXEC = 0o2000000;
const SOL_SOCKET = 1;
const SCM_RIGHTS = 1;
const MSG_DONTWAIT = 0x40;
const MSG_CMSG_CLOEXEC = 0x40000000;
const MSG_CTRUNC = 0x8;
/** EAGAIN: nothing to read yet on a non-blocking socket. */
export const EAGAIN = 11;

const SUN_PATH_MAX = 108;
// Offsets in the scratch buffer: msghdr, iovec, cmsghdr with one int, then the data.
const MSGHDR = 0;
const IOVEC = 64;
const CMSG = 96;
const CMSG_SPACE_ONE_FD = 24; // CMSG_SPACE(sizeof(int))
const CMSG_LEN_ONE_FD = 20; // CMSG_LEN(sizeof(int))
const DATA = 128;
/** The most bytes one {@link receiveWithFd} carries. */
export const MAX_FD_MESSAGE_BYTES = 8192;

function check(call: string, r: ErrnoResult, detail?: string): number {
  if (r.value < 0) throw new SystemCallError(call, r.errnoCode, detail);
  return r.value;
}

/**
 * A non-blocking, close-on-exec Unix stream socket connected to `path`. A connect that the
 * listener's backlog defers fails with EAGAIN, like any other failure, as a SystemCallError.
 */
export function connectUnixSocket(path: string): number {
  const bytes = Buffer.from(path);
  if (bytes.length >= SUN_PATH_MAX) throw new SystemCallError('connect', 36 /* ENAMETOOLONG */, path);
  const fd = check('socket', fns.socket([AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0]) as ErrnoResult);
  const { addr, view } = scratchStruct(2 + SUN_PATH_MAX);
  view.writeUInt16LE(AF_UNIX, 0);
  bytes.copy(view, 2);
  const r = fns.connect([fd, addr, 2 + bytes.length + 1]) as ErrnoResult;
  if (r.value < 0) {
    closeFd(fd);
    throw new SystemCallError('connect', r.errnoCode, path);
  }
  return fd;
}

/**
 * Reads what has arrived on socket `fd` (at most {@link MAX_FD_MESSAGE_BYTES}) and the descriptor
 * sent with it, if any (close-on-exec, now the caller's), without blocking: `undefined` when
 * nothing has arrived yet; `{ data: empty }` when the peer closed.
 */
export function receiveWithFd(fd: number): { data: Buffer; fd?: number } | undefined {
  const { addr, view } = scratchStruct(DATA + MAX_FD_MESSAGE_BYTES);
  writeMsghdr(view, addr, MAX_FD_MESSAGE_BYTES);
  const r = fns.recvmsg([fd, addr + MSGHDR, MSG_DONTWAIT | MSG_CMSG_CLOEXEC]) as ErrnoResult;
  if (r.value < 0 && r.errnoCode === EAGAIN) return undefined;
  const n = check('recvmsg', r);
  const data = Buffer.from(view.subarray(DATA, DATA + n));
  const controlLen = Number(view.readBigUInt64LE(MSGHDR + 40));
  const flags = view.readInt32LE(MSGHDR + 48);
  if (flags & MSG_CTRUNC) throw new SystemCallError('recvmsg', 90 /* EMSGSIZE */, 'more descriptors than expected');
  if (controlLen >= CMSG_LEN_ONE_FD && view.readInt32LE(CMSG + 8) === SOL_SOCKET && view.readInt32LE(CMSG + 12) === SCM_RIGHTS) {
    return { data, fd: view.readInt32LE(CMSG + 16) };
  }
  return { data };
}

function writeMsghdr(view: Buffer, addr: number, dataBytes: number): void {
  // msghdr: name, namelen, iov, iovlen, control, controllen, flags.
  view.writeBigUInt64LE(0n, MSGHDR);
  view.writeUInt32LE(0, MSGHDR + 8);
  view.writeBigUInt64LE(BigInt(addr + IOVEC), MSGHDR + 16);
  view.writeBigUInt64LE(1n, MSGHDR + 24);
  view.writeBigUInt64LE(BigInt(addr + CMSG), MSGHDR + 32);
  view.writeBigUInt64LE(BigInt(CMSG_SPACE_ONE_FD), MSGHDR + 40);
  view.writeInt32LE(0, MSGHDR + 48);
  view.writeBigUInt64LE(BigInt(addr + DATA), IOVEC);
  view.writeBigUInt64LE(BigInt(dataBytes), IOVEC + 8);
}
