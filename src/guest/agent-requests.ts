/**
 * What the Linux guest's calls (its processes, its files, its memory figures) share in their
 * requests to the agent: a request's default timeout, data cut to frame size, and the flags of
 * an answer's chunks (docs/agent-protocol.md).
 * @module
 */
import { parseTimeoutMs } from '../units';
import type { RequestTimeout } from './guest-types';

export const CHUNK_STDOUT = 1;
export const CHUNK_STDERR = 2;
export const CHUNK_STARTED = 4;
/** Data per STDIN_WRITE / FILE_WRITE frame, well inside the 1 MiB payload limit. */
const DATA_PER_FRAME = 512 * 1024;
/**
 * How long a request the agent answers at once may take by default (a file frame, a kill, the
 * memory figures): the agent answers these in milliseconds, so a silent one is a broken one.
 */
export const DEFAULT_REQUEST_TIMEOUT_MS = 30_000;

export function requestTimeout(options: RequestTimeout | undefined): number {
  return options?.timeoutMs === undefined ? DEFAULT_REQUEST_TIMEOUT_MS : parseTimeoutMs('timeoutMs', options.timeoutMs);
}

/** `bytes` cut into frame-sized chunks; at least one, so that empty data is still sent once. */
export function frameChunks(bytes: Buffer): Buffer[] {
  const chunks = [bytes.subarray(0, DATA_PER_FRAME)];
  for (let off = DATA_PER_FRAME; off < bytes.length; off += DATA_PER_FRAME) chunks.push(bytes.subarray(off, off + DATA_PER_FRAME));
  return chunks;
}
