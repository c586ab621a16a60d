/**
 * What a background process's output keeps (`stdout: { keep: bytes }`): the last bytes it wrote,
 * in a ring of a fixed capacity, so that a process nobody watches costs the host that much and no
 * more, while its stream is drained at once (it never holds the guest's writer), and live
 * listeners that a reattach adds ({@link GuestProcess.output}).
 */
import { InvalidOptionError } from '../errors';

/** The largest `keep`: a background process's output is a tail to look at, not a file. */
export const MAX_KEEP_BYTES = 64 * 1024 * 1024;

/**
 * How one output stream of a spawned process is handled.
 * @category Guest
 */
export type OutputMode = 'pipe' | 'ignore' | { keep: number };

/** The `stdout` / `stderr` option checked. */
export function parseOutputMode(option: string, value: unknown): 'pipe' | 'ignore' | { keep: number } {
  if (value === undefined || value === 'pipe' || value === 'ignore') return value ?? 'pipe';
  if (value !== null && typeof value === 'object' && !Array.isArray(value)) {
    const keys = Object.keys(value);
    const keep = (value as { keep?: unknown }).keep;
    if (keys.length === 1 && keys[0] === 'keep' && typeof keep === 'number' && Number.isSafeInteger(keep) && keep >= 1 && keep <= MAX_KEEP_BYTES) return { keep };
    if (keys.some((k) => k !== 'keep')) throw new InvalidOptionError(option, `unknown key ${JSON.stringify(keys.find((k) => k !== 'keep'))}; expected { keep: bytes }`);
    throw new InvalidOptionError(option, `keep: expected a whole number of bytes from 1 to ${MAX_KEEP_BYTES}, got ${typeof keep === 'number' ? keep : typeof keep}`);
  }
  throw new InvalidOptionError(option, `expected "pipe", "ignore" or { keep: bytes }, got ${typeof value === 'string' ? JSON.stringify(value.slice(0, 40)) : value === null ? 'null' : typeof value}`);
}

/** The last `capacityBytes` of a stream, and the listeners of what comes next. */
export class OutputRing {
  private readonly ring: Buffer;
  /** Where the next byte goes. */
  private at = 0;
  /** Bytes held, up to the capacity. */
  private held = 0;
  /** Every byte the stream carried. */
  private total = 0;
  private readonly listeners = new Set<(chunk: Buffer) => void>();

  constructor(readonly capacityBytes: number) {
    this.ring = Buffer.alloc(capacityBytes);
  }

  /** A chunk of the stream: kept (overwriting the oldest), and given to every listener. */
  push(chunk: Buffer): void {
    this.total += chunk.length;
    const cap = this.capacityBytes;
    const src = chunk.length > cap ? chunk.subarray(chunk.length - cap) : chunk;
    const first = Math.min(src.length, cap - this.at);
    src.copy(this.ring, this.at, 0, first);
    src.copy(this.ring, 0, first);
    this.at = (this.at + src.length) % cap;
    this.held = Math.min(cap, this.held + src.length);
    for (const l of this.listeners) l(chunk);
  }

  /** The bytes kept, oldest first (a copy). */
  kept(): Buffer {
    if (this.held < this.capacityBytes) return Buffer.from(this.ring.subarray(this.at - this.held, this.at));
    return Buffer.concat([this.ring.subarray(this.at), this.ring.subarray(0, this.at)]);
  }

  /** Bytes the stream carried in all; those beyond {@link capacityBytes} before the last are gone. */
  get totalBytes(): number {
    return this.total;
  }

  /** Adds a listener of the chunks to come; returns its removal. */
  listen(listener: (chunk: Buffer) => void): () => void {
    this.listeners.add(listener);
    return () => this.listeners.delete(listener);
  }
}
