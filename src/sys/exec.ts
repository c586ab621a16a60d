/**
 * execv(3) from Node: what `pvisor-daemon serve` does once its options are checked, to become the
 * native page pool daemon with the same pid (so no Node process stays behind it). Declared here
 * rather than in ./libc.ts because it needs the scratch buffer, which needs ./libc.ts.
 */
import { SystemCallError } from '../errors';
import { openLibc } from './libc';
import { scratchStruct } from './scratch';

type ErrnoResult = { value: number; errnoCode: number };

let fns: { execv: (args: [number, number]) => unknown; fcntl: (args: [number, number, number]) => unknown } | undefined;
const F_SETFD = 2;

/**
 * Replaces this process with the program at `path`, given `argv` (argv[0] included) and this
 * process's environment; the pid stays, Node's threads end, stdin, stdout and stderr stay open
 * in the program (other descriptors Node opened are close-on-exec). Returns only by throwing
 * {@link SystemCallError}. Call it on the main thread (see ./libc.ts).
 */
export function execProgram(path: string, argv: readonly string[]): never {
  const { define, DataType } = openLibc();
  fns ??= define({
    execv: { library: 'libc', retType: DataType.I32, paramsType: [DataType.U64, DataType.U64], errno: true },
    fcntl: { library: 'libc', retType: DataType.I32, paramsType: [DataType.I32, DataType.I32, DataType.I32], errno: true },
  });
  // In the scratch buffer: argv's pointers ending with NULL, then the strings, each NUL-terminated.
  const strings = [path, ...argv].map((s) => Buffer.from(`${s}\0`));
  for (const b of strings) {
    if (b.indexOf(0) !== b.length - 1) throw new SystemCallError('execv', 22 /* EINVAL */, `an argument holds a NUL byte: ${JSON.stringify(b.toString())}`);
  }
  const pointerBytes = 8 * (argv.length + 1);
  const { addr, view } = scratchStruct(pointerBytes + strings.reduce((n, b) => n + b.length, 0));
  const where: number[] = [];
  let at = pointerBytes;
  for (const b of strings) {
    b.copy(view, at);
    where.push(addr + at);
    at += b.length;
  }
  where.slice(1).forEach((p, i) => view.writeBigUInt64LE(BigInt(p), 8 * i));
  view.writeBigUInt64LE(0n, 8 * argv.length);
  // Node marks stdin, stdout and stderr close-on-exec when it starts: the program gets them back.
  for (const fd of [0, 1, 2]) fns.fcntl([fd, F_SETFD, 0]);
  const r = fns.execv([where[0], addr]) as ErrnoResult;
  throw new SystemCallError('execv', r.errnoCode, path);
}
