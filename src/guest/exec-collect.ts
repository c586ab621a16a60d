/**
 * How `exec` turns a started command into its result: output collected up to `maxBuffer` per
 * stream (beyond it the command is killed with an {@link OutputLimitError}), each piece given to
 * `onStdout`/`onStderr` as it comes (text never split inside a UTF-8 character), stdin written and
 * closed, then the exit status with the output. One place for both kinds of command: the guest's
 * own ({@link GuestProcess}) and one of a VM in another process (`RemoteProcess`, over its
 * control socket), so that `Vm.exec` and `VmHandle.exec` behave alike.
 */
import type { Readable } from 'node:stream';
import { StringDecoder } from 'node:string_decoder';
import { OutputLimitError } from '../errors';
import type { ExecBufferResult, ExecResult, ExitStatus } from './guest-types';
// For {@link} in the documentation only.
import type { GuestProcess } from './guest-process';

/** What collecting needs of a started command. */
export interface CollectedProcess {
  readonly stdout: Readable;
  readonly stderr: Readable;
  /** True once the host killed it for a reason of its own: later output is not kept. */
  readonly stopped: boolean;
  /** Kills it for `reason`, which `exited` then rejects with. */
  stop(reason: Error): void;
  write(data: string | Uint8Array): Promise<void>;
  end(): Promise<void>;
  readonly exited: Promise<ExitStatus>;
}

/** The checked output options of one exec. */
export interface CollectOptions {
  maxBuffer: number;
  encoding: 'utf8' | 'buffer';
  /** Given each piece: a string with `encoding: 'utf8'`, else a Buffer. */
  onStdout?: ((piece: never) => void) | undefined;
  onStderr?: ((piece: never) => void) | undefined;
  /** Written to the command's stdin, which is then closed. */
  stdin?: string | Uint8Array | undefined;
}

/** Collects `p`'s output and status as {@link CollectOptions} say. */
export async function collectOutput(p: CollectedProcess, options: CollectOptions): Promise<ExecResult | ExecBufferResult> {
  const { maxBuffer, encoding } = options;
  const collected = { stdout: [] as Buffer[], stderr: [] as Buffer[] };
  const sizes = { stdout: 0, stderr: 0 };
  // Chunks come as the guest sent them: a decoder keeps a split UTF-8 character for the next,
  // and what it holds at the end is given once the output is complete.
  const flushes: (() => void)[] = [];
  const listenerOf = (given: ((piece: never) => void) | undefined): ((b: Buffer) => void) | undefined => {
    if (!given) return undefined;
    const deliver = given as (piece: Buffer | string) => void;
    if (encoding === 'buffer') return deliver;
    const decoder = new StringDecoder('utf8');
    flushes.push(() => {
      const rest = decoder.end();
      if (rest) deliver(rest);
    });
    return (b) => {
      const text = decoder.write(b);
      if (text) deliver(text);
    };
  };
  const listeners = { stdout: listenerOf(options.onStdout), stderr: listenerOf(options.onStderr) };
  for (const name of ['stdout', 'stderr'] as const) {
    p[name].on('data', (b: Buffer) => {
      if (p.stopped) return; // killed already: nothing more is kept
      sizes[name] += b.length;
      if (sizes[name] > maxBuffer) {
        p.stop(new OutputLimitError(maxBuffer, `command wrote more than ${maxBuffer} bytes to ${name} (maxBuffer); it was killed`));
        return;
      }
      collected[name].push(b);
      try {
        listeners[name]?.(b);
      } catch (e) {
        // The caller's callback threw: that ends the command, never the receive path it runs on.
        p.stop(e instanceof Error ? e : new Error(String(e)));
      }
    });
  }
  if (options.stdin !== undefined) {
    p.write(options.stdin).then(() => p.end()).catch(() => {
      // The command may exit without reading its stdin (EPIPE): its exit status says enough.
    });
  }
  const status = await p.exited;
  for (const flush of flushes) flush();
  const stdout = Buffer.concat(collected.stdout);
  const stderr = Buffer.concat(collected.stderr);
  return encoding === 'buffer' ? { ...status, stdout, stderr } : { ...status, stdout: stdout.toString('utf8'), stderr: stderr.toString('utf8') };
}
