/**
 * `s3://bucket/prefix` URLs: where a snapshot lives in an object store. Checked before anything is
 * sent, so a typo fails at once with the part that is wrong, not as an S3 error from afar.
 */
import { StoreError } from '../errors';

/** A checked `s3://bucket/prefix`. */
export interface StoreUrl {
  /** The URL as given, for messages. */
  url: string;
  bucket: string;
  /** The key prefix, without a leading or trailing `/`. */
  prefix: string;
  /** The key of the snapshot's manifest, written last: a snapshot without it is not one. */
  manifestKey: string;
}

/** Whether `location` names an object store rather than a local directory. */
export function isStoreUrl(location: string): boolean {
  return location.startsWith('s3://');
}

/** The manifest's name under the prefix. */
export const MANIFEST_NAME = 'snapshot.json';

/**
 * Where the content-addressed chunks of every snapshot in a bucket live, shared by all of them so
 * that a template's children and other snapshots of the same guest store each chunk once. A
 * prefix inside it is refused: a manifest there could be taken for a chunk.
 */
export const CHUNKS_PREFIX = 'pvisor-chunks/sha256/';

// S3's bucket naming rules (lower case, digits, dots, hyphens, 3-63 long, starting and ending
// with a letter or digit), without dotted-quad names, which S3 refuses too.
const BUCKET = /^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$/;
// S3 keys are up to 1024 bytes; the manifest's name follows the prefix.
const MAX_PREFIX_BYTES = 1024 - MANIFEST_NAME.length - 1;

/**
 * Parses `s3://bucket/prefix` (one trailing `/` allowed). The prefix must be non-empty, without
 * empty, `.` or `..` segments, control characters, `?` or `#`, and short enough for an S3 key.
 * Anything else is a {@link StoreError} with reason `url`.
 */
export function parseStoreUrl(url: string): StoreUrl {
  const bad = (why: string): StoreError => new StoreError('url', `${JSON.stringify(url.slice(0, 200))}: ${why}; an object store location is s3://bucket/prefix`);
  if (typeof url !== 'string') throw new StoreError('url', 'an object store location is a string, s3://bucket/prefix');
  if (!url.startsWith('s3://')) throw bad('not an s3:// URL');
  const rest = url.slice('s3://'.length);
  const slash = rest.indexOf('/');
  const bucket = slash < 0 ? rest : rest.slice(0, slash);
  if (!BUCKET.test(bucket) || bucket.includes('..') || /^\d+\.\d+\.\d+\.\d+$/.test(bucket)) throw bad(`"${bucket.slice(0, 70)}" is not an S3 bucket name (3-63 lower-case letters, digits, dots or hyphens)`);
  let prefix = slash < 0 ? '' : rest.slice(slash + 1);
  if (prefix.endsWith('/')) prefix = prefix.slice(0, -1);
  if (prefix === '') throw bad('no prefix: a snapshot needs a prefix of its own in the bucket');
  if (/[\u0000-\u001f\u007f?#\\]/.test(prefix)) throw bad('the prefix holds a control character, ?, # or \\');
  const segments = prefix.split('/');
  if (segments.some((s) => s === '' || s === '.' || s === '..')) throw bad('the prefix has an empty, . or .. segment');
  if (Buffer.byteLength(prefix) > MAX_PREFIX_BYTES) throw bad(`the prefix is longer than ${MAX_PREFIX_BYTES} bytes`);
  if (`${prefix}/`.startsWith(CHUNKS_PREFIX.split('/')[0] + '/')) throw bad(`the prefix is inside ${CHUNKS_PREFIX.split('/')[0]}/, where pvisor keeps chunks`);
  return { url, bucket, prefix, manifestKey: `${prefix}/${MANIFEST_NAME}` };
}

/** The key of the chunk whose SHA-256 is `sha256` (hex). */
export function chunkKey(sha256: string): string {
  return CHUNKS_PREFIX + sha256;
}

/**
 * The key of the page delta (chunk-delta.ts) that makes chunk `sha256` from `base` (`null`:
 * zeros). Its bytes follow from the two chunks, so it is content-addressed as a chunk is: a child
 * that changed a chunk the way another did finds the delta there.
 */
export function deltaKey(sha256: string, base: string | null): string {
  return `${DELTAS_PREFIX}${sha256}.${base ?? 'zero'}`;
}

/** Where page deltas live, beside the chunks. */
export const DELTAS_PREFIX = 'pvisor-chunks/delta/';
