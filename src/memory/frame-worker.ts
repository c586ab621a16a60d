/**
 * A compression worker of {@link FramePool}: encodes and decodes frames in shared buffers that the
 * main thread fills and drains. Loads zstd-napi and the frame format only, never ffi-rs (whose
 * global function cache is not thread-safe). One compression and one decompression context and
 * the buffers are made once and reused for every frame.
 */
import { parentPort, workerData } from 'node:worker_threads';
import { decodeFrame, encodeFrame, type FrameKind } from './frame-file';
import { loadZstd } from './zstd-binding';

const { CCtx, DCtx } = loadZstd();

/** What the pool gives a worker at start. */
export interface FrameWorkerData {
  level: number;
  slots: { input: SharedArrayBuffer; output: SharedArrayBuffer }[];
}

/** A job: the slot's input holds the frame (encode) or its stored bytes (decode). */
export type FrameJob =
  | { slot: number; op: 'encode'; length: number }
  | { slot: number; op: 'decode'; kind: FrameKind; storedLength: number; length: number };

/** A job's answer: the encoded frame, the decoded frame's CRC32, or why it failed. */
export type FrameJobResult =
  | { slot: number; kind: FrameKind; storedLength: number; crc: number }
  | { slot: number; crc: number }
  | { slot: number; error: string };

const data = workerData as FrameWorkerData;
const port = parentPort!;
const cctx = new CCtx();
const dctx = new DCtx();
const slots = data.slots.map((s) => ({ input: new Uint8Array(s.input), output: new Uint8Array(s.output) }));

port.on('message', (job: FrameJob) => {
  const slot = slots[job.slot];
  try {
    if (job.op === 'encode') {
      const frame = encodeFrame(cctx, data.level, slot.input.subarray(0, job.length), slot.output);
      port.postMessage({ slot: job.slot, ...frame } satisfies FrameJobResult);
    } else {
      const crc = decodeFrame(dctx, job.kind, slot.input.subarray(0, job.storedLength), job.length, slot.output);
      port.postMessage({ slot: job.slot, crc } satisfies FrameJobResult);
    }
  } catch (e) {
    port.postMessage({ slot: job.slot, error: e instanceof Error ? e.message : String(e) } satisfies FrameJobResult);
  }
});
port.postMessage('ready');
