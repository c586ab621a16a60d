/**
 * Sends a local snapshot directory (snapshot-dir.ts) to an object store: each non-zero 2 MiB RAM
 * chunk as an object named by its SHA-256 (sent only when the bucket does not have it already,
 * so a child of a template sends only what changed), the two small files likewise, and the
 * manifest last, create-only. Each chunk is checked against the directory's CRC32C as it is
 * read, so what is sent is what the snapshot sealed.
 *
 * A chunk the bucket lacks is sent as a page delta (chunk-delta.ts) when that is smaller: against
 * the chunk this VM's RAM there was last stored or restored as (its {@link ChunkBases}), if the
 * bucket holds that whole and this host's chunk cache knows its page hashes, else against zeros.
 * So a child that changed 8 MiB sends about 8 MiB, not every 2 MiB chunk its pages fall in.
 */
import { readSync } from 'node:fs';
import { join } from 'node:path';
import { StoreError } from '../errors';
import { fileDataRuns } from '../guest-ram/file-runs';
import { crc32c } from '../native/crc32c';
import { hex32, RAM_CHUNK_BYTES } from '../snapshot/ram-file';
import { manifestBytesLimit, MAX_STATE_BYTES, readRamChecksums } from '../snapshot/snapshot-dir';
import { closeSnapshotFiles, openSnapshotFile, readSnapshotFile } from '../snapshot/snapshot-file';
import { sha256Hex, type ChunkCache } from './chunk-cache';
import { changedPages, deltaSizeBytes, encodeDelta, pageHashesOf } from './chunk-delta';
import { eachBounded, type ObjectStore } from './object-io';
import type { ResolvedStoreOptions, StoreTransfer } from './store-options';
import { chunkSizeBytes, type ChunkBases, type RamDelta, type StoreManifest } from './store-manifest';
import { chunkKey, deltaKey, type StoreUrl } from './store-url';

/**
 * A delta against a chunk stored whole is sent only if it is at most this part of the chunk: a
 * restore that lacks the base reads it too. One against zeros costs a restore nothing more, so
 * it is sent whenever it is smaller than the chunk.
 */
const DELTA_AGAINST_BASE_MAX = 0.5;

/**
 * Uploads the snapshot in `dir` to `url`. A snapshot already at `url` is a {@link StoreError}
 * `exists`. `touchedOffsets`: guest RAM offsets in the order the VM's faults first loaded them (a
 * lazily restored VM), recorded as the manifest's touch order. `bases`: what the VM's RAM was
 * last stored or restored as, for deltas; `cache`: this host's chunk cache, which keeps the page
 * hashes of what is stored whole. Resolves with what was sent and the bases for the next upload.
 */
export async function uploadSnapshotDir(
  dir: string,
  url: StoreUrl,
  store: ObjectStore,
  cache: ChunkCache,
  options: Pick<ResolvedStoreOptions, 'concurrency' | 'onProgress'>,
  previous: { touchedOffsets?: readonly number[]; bases?: ChunkBases } = {},
): Promise<{ transfer: StoreTransfer; bases: ChunkBases }> {
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
  const put = async (key: string, bytes: Buffer): Promise<void> => {
    await store.put(key, bytes);
    out.chunksTransferred++;
    out.bytesTransferred += bytes.length;
  };
  /** Sends `bytes` as `key` unless the bucket has an object of that size there. */
  const putMissing = async (key: string, bytes: Buffer): Promise<void> => {
    // An object of another size under its name was damaged: sent again, over it.
    if ((await store.sizeOf(key)) === bytes.length) out.chunksPresent++;
    else await put(key, bytes);
  };
  const ramDeltas: Record<string, RamDelta> = {};
  const oldBases = previous.bases?.length === chunkCrc32c.length ? previous.bases : undefined;
  const bases: ChunkBases = new Array<string | null>(chunkCrc32c.length).fill(null);
  /** Whether the bucket holds `sha` whole, at `sizeBytes`: asked once per upload. */
  const wholeInBucket = new Map<string, Promise<boolean>>();
  const isWhole = (sha: string, sizeBytes: number): Promise<boolean> => {
    let p = wholeInBucket.get(sha);
    if (!p) wholeInBucket.set(sha, (p = store.sizeOf(chunkKey(sha)).then((n) => n === sizeBytes)));
    return p;
  };
  /** Keeps the page hashes of `sha`, stored whole, for the deltas of the next snapshot. */
  const keepPageHashes = (sha: string, chunk: Buffer): void => {
    if (!cache.hasPageHashes(sha)) cache.writePageHashes(sha, pageHashesOf(chunk));
  };
  /**
   * Stores RAM chunk `sha` (at index `i`) whole, or as a delta when smaller; resolves with its
   * base for next time. One store per distinct chunk: the first place that holds it decides.
   */
  const storing = new Map<string, Promise<string | null>>();
  const storeRamChunk = (i: number, sha: string, chunk: Buffer): Promise<string | null> => {
    let p = storing.get(sha);
    if (!p) {
      p = (async () => {
        if (await isWhole(sha, chunk.length)) {
          out.chunksPresent++;
          keepPageHashes(sha, chunk);
          return sha;
        }
        // Against what this place was last stored as, if the bucket has it whole and its page hashes are here; else zeros.
        const old = oldBases?.[i] ?? null;
        const oldHashes = old !== null && (await isWhole(old, chunk.length)) ? cache.pageHashes(old, chunk.length) : undefined;
        const base = oldHashes ? old : null;
        const pages = changedPages(chunk, oldHashes ?? null);
        const sizeBytes = deltaSizeBytes(chunk.length, pages);
        if (base === null ? sizeBytes < chunk.length : sizeBytes <= chunk.length * DELTA_AGAINST_BASE_MAX) {
          await putMissing(deltaKey(sha, base), encodeDelta(chunk, pages));
          ramDeltas[sha] = { base, sizeBytes };
          return base;
        }
        await put(chunkKey(sha), chunk);
        keepPageHashes(sha, chunk);
        return sha;
      })();
      storing.set(sha, p);
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
        bases[i] = await storeRamChunk(i, sha, chunk);
      }
      chunksDone++;
      progress();
    });
    const files = { manifest: { sha256: sha256Hex(manifestBytes), sizeBytes: manifestBytes.length }, state: { sha256: sha256Hex(stateBytes), sizeBytes: stateBytes.length } };
    await putMissing(chunkKey(files.manifest.sha256), manifestBytes);
    if (files.state.sha256 !== files.manifest.sha256) await putMissing(chunkKey(files.state.sha256), stateBytes);
    const touchOrder = touchOrderOf(previous.touchedOffsets, ramChunks);
    const withDeltas = Object.keys(ramDeltas).length > 0;
    const manifest: StoreManifest = {
      format: 'pvisor-store-snapshot',
      // Version 2 only when it has deltas: a version 1 reader can restore the rest.
      version: withDeltas ? 2 : 1,
      ramBytes,
      chunkBytes: RAM_CHUNK_BYTES,
      ramChunks,
      files,
      ...(touchOrder.length && { touchOrder }),
      ...(withDeltas && { ramDeltas }),
    };
    const body = Buffer.from(JSON.stringify(manifest));
    await store.put(url.manifestKey, body, true);
    out.bytesTransferred += body.length;
    out.ms = performance.now() - t0;
    progress();
    return { transfer: out, bases };
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
