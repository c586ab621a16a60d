/**
 * Sends a local snapshot directory (snapshot-dir.ts) to an object store: each non-zero 2 MiB RAM
 * chunk as an object named by its SHA-256 (sent only when the bucket does not have it already,
 * so a child of a template sends only what changed), the two small files likewise, and the
 * manifest last, create-only. Each chunk is checked against the directory's CRC32C as it is
 * read, so what is sent is what the snapshot sealed.
 */
import { readSync } from 'node:fs';
import { join } from 'node:path';
import { StoreError } from '../errors';
import { fileDataRuns } from '../guest-ram/file-runs';
import { crc32c } from '../native/crc32c';
import { hex32, RAM_CHUNK_BYTES } from '../snapshot/ram-file';
import { manifestBytesLimit, MAX_STATE_BYTES, readRamChecksums } from '../snapshot/snapshot-dir';
import { closeSnapshotFiles, openSnapshotFile, readSnapshotFile } from '../snapshot/snapshot-file';
import { sha256Hex } from './chunk-cache';
import { eachBounded, type ObjectStore } from './object-io';
import type { ResolvedStoreOptions, StoreTransfer } from './store-options';
import { chunkSizeBytes, STORE_MANIFEST_VERSION, type StoreManifest } from './store-manifest';
import { chunkKey, type StoreUrl } from './store-url';

/**
 * Uploads the snapshot in `dir` to `url`. A snapshot already at `url` is a {@link StoreError}
 * `exists`. `touchedOffsets`: guest RAM offsets in the order the VM's faults first loaded them (a
 * lazily restored VM), recorded as the manifest's touch order.
 */
export async function uploadSnapshotDir(dir: string, url: StoreUrl, store: ObjectStore, options: Pick<ResolvedStoreOptions, 'concurrency' | 'onProgress'>, touchedOffsets?: readonly number[]): Promise<StoreTransfer> {
  const t0 = performance.now();
  // Refused before any chunk is sent; the create-only write at the end settles a race.
  if ((await store.sizeOf(url.manifestKey)) !== undefined) throw new StoreError('exists', `${url.url}: a snapshot is there already; a snapshot goes to a new prefix`);
  const { ramBytes, chunkCrc32c } = readRamChecksums(dir);
  const small = (name: string, maxBytes: number): Buffer => {
    const f = openSnapshotFile(join(dir, name));
    try {
      return readSnapshotFile(f, maxBytes, 'a snapshot needs');
    } finally {
      closeSnapshotFiles(f);
    }
  };
  const manifestBytes = small('manifest.json', manifestBytesLimit(ramBytes));
  const stateBytes = small('state.json', MAX_STATE_BYTES);
  const ram = openSnapshotFile(join(dir, 'ram'));
  const out: StoreTransfer = { url: url.url, chunksTotal: chunkCrc32c.length, zeroChunks: 0, chunksTransferred: 0, chunksPresent: 0, bytesTransferred: 0, ms: 0 };
  let chunksDone = 0;
  const progress = (): void => options.onProgress?.({ direction: 'upload', url: url.url, chunksDone, chunksTotal: out.chunksTotal, bytesTransferred: out.bytesTransferred });
  // One send per distinct chunk, however many places of RAM hold it.
  const sent = new Map<string, Promise<void>>();
  const ensure = (sha: string, bytes: Buffer): Promise<void> => {
    let p = sent.get(sha);
    if (!p) {
      p = (async () => {
        const key = chunkKey(sha);
        // A chunk of another size under its name was damaged: sent again, over it.
        if ((await store.sizeOf(key)) === bytes.length) {
          out.chunksPresent++;
          return;
        }
        await store.put(key, bytes);
        out.chunksTransferred++;
        out.bytesTransferred += bytes.length;
      })();
      sent.set(sha, p);
    }
    return p;
  };
  try {
    if (ram.sizeBytes !== ramBytes) throw new StoreError('malformed', `${ram.path}: ${ram.sizeBytes} bytes, the manifest says ${ramBytes}`);
    const data = fileDataRuns(ram.fd, ramBytes);
    const ramChunks: (string | null)[] = new Array<string | null>(chunkCrc32c.length).fill(null);
    const indexes = chunkCrc32c.map((_, i) => i);
    await eachBounded(indexes, options.concurrency, async (i) => {
      const chunk = readChunk(ram.fd, ram.path, data, ramBytes, i);
      const crc = crc32c(chunk);
      if (crc !== chunkCrc32c[i]) throw new StoreError('corrupt', `${ram.path}: RAM chunk ${i} has CRC32C ${hex32(crc)}, the manifest says ${hex32(chunkCrc32c[i])}: the file changed before it was sent`);
      if (isZero(chunk)) out.zeroChunks++;
      else {
        const sha = sha256Hex(chunk);
        ramChunks[i] = sha;
        await ensure(sha, chunk);
      }
      chunksDone++;
      progress();
    });
    const files = { manifest: { sha256: sha256Hex(manifestBytes), sizeBytes: manifestBytes.length }, state: { sha256: sha256Hex(stateBytes), sizeBytes: stateBytes.length } };
    await ensure(files.manifest.sha256, manifestBytes);
    await ensure(files.state.sha256, stateBytes);
    const touchOrder = touchOrderOf(touchedOffsets, ramChunks);
    const manifest: StoreManifest = { format: 'pvisor-store-snapshot', version: STORE_MANIFEST_VERSION, ramBytes, chunkBytes: RAM_CHUNK_BYTES, ramChunks, files, ...(touchOrder.length && { touchOrder }) };
    const body = Buffer.from(JSON.stringify(manifest));
    await store.put(url.manifestKey, body, true);
    out.bytesTransferred += body.length;
    out.ms = performance.now() - t0;
    progress();
    return out;
  } finally {
    closeSnapshotFiles(ram);
  }
}

/**
 * RAM chunk `index` of the RAM file `fd`, reading only its data runs (`data`, sorted): a hole
 * reads as zeros without being read, which would put zero pages in the page cache.
 */
function readChunk(fd: number, path: string, data: readonly [number, number][], ramBytes: number, index: number): Buffer {
  const off = index * RAM_CHUNK_BYTES;
  const len = chunkSizeBytes(ramBytes, index);
  const chunk = Buffer.alloc(len);
  // The first run that ends past the chunk's start, by bisection: a fragmented file has many.
  let lo = 0;
  for (let hi = data.length; lo < hi;) {
    const mid = (lo + hi) >>> 1;
    if (data[mid][1] <= off) lo = mid + 1;
    else hi = mid;
  }
  for (let r = lo; r < data.length && data[r][0] < off + len; r++) {
    const [start, end] = data[r];
    const from = Math.max(off, start);
    const to = Math.min(off + len, end);
    for (let done = 0; done < to - from;) {
      const n = readSync(fd, chunk, from - off + done, to - from - done, from + done);
      if (n === 0) throw new StoreError('malformed', `${path}: ends at byte ${from + done}, before guest RAM does`);
      done += n;
    }
  }
  return chunk;
}

const ZERO = Buffer.alloc(RAM_CHUNK_BYTES);

function isZero(chunk: Buffer): boolean {
  return chunk.equals(ZERO.subarray(0, chunk.length));
}

/**
 * Chunk indices of `touchedOffsets` (guest RAM offsets), in order, each once, leaving out chunks
 * that are zero now: what {@link StoreManifest.touchOrder} holds.
 */
export function touchOrderOf(touchedOffsets: readonly number[] | undefined, ramChunks: readonly (string | null)[]): number[] {
  const seen = new Set<number>();
  for (const off of touchedOffsets ?? []) {
    const i = Math.floor(off / RAM_CHUNK_BYTES);
    if (i >= 0 && i < ramChunks.length && ramChunks[i] !== null) seen.add(i);
  }
  return [...seen];
}
