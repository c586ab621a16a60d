/**
 * A listening Unix socket as a bare file descriptor, made with libc: the jail's launcher binds it
 * where only it can reach (a root-owned directory the jail does not see) and hands the fd to the
 * jailed VMM, which accepts on it. Node's `net` cannot do this: a server it made accepts in this
 * process too, and removes its file when closed.
 * @module
 */
import { SystemCallError } from '../errors';
import { closeFd, openLibc } from '../sys/libc';
import { scratchStruct } from '../sys/scratch';

const AF_UNIX = 1;
const SOCK_STREAM = 1;
const SOCK_CLOEXEC = 0o2000000;
const SUN_PATH_MAX = 108;
const BACKLOG = 64;

let fns: ReturnType<typeof defineFns> | undefined;
function defineFns() {
  const { define, DataType } = openLibc();
  const I32 = DataType.I32;
  const U64 = DataType.U64;
  return define({
    socket: { library: 'libc', retType: I32, paramsType: [I32, I32, I32], errno: true },
    bind: { library: 'libc', retType: I32, paramsType: [I32, U64, I32], errno: true },
    listen: { library: 'libc', retType: I32, paramsType: [I32, I32], errno: true },
  });
}

type ErrnoResult = { value: number; errnoCode: number };

/**
 * A close-on-exec Unix stream socket listening at `path` (which must not exist). The caller owns
 * the fd (hand it to a child through spawn's stdio, then close it) and removes the file.
 */
export function listenUnixSocket(path: string): number {
  fns ??= defineFns();
  const bytes = Buffer.from(path);
  if (bytes.length >= SUN_PATH_MAX) throw new SystemCallError('bind', 36 /* ENAMETOOLONG */, path);
  const s = fns.socket([AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0]) as ErrnoResult;
  if (s.value < 0) throw new SystemCallError('socket', s.errnoCode);
  const fd = s.value;
  const { addr, view } = scratchStruct(2 + SUN_PATH_MAX);
  view.fill(0);
  view.writeUInt16LE(AF_UNIX, 0);
  bytes.copy(view, 2);
  for (const [call, r] of [['bind', () => fns!.bind([fd, addr, 2 + bytes.length + 1])], ['listen', () => fns!.listen([fd, BACKLOG])]] as const) {
    const out = r() as ErrnoResult;
    if (out.value < 0) {
      closeFd(fd);
      throw new SystemCallError(call, out.errnoCode, path);
    }
  }
  return fd;
}
