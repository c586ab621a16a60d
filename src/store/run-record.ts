/**
 * The CLI's hibernation record (../snapshot/hibernation-record.ts) of a VM hibernated to an object
 * store, kept beside it as `<prefix>/pvisor-run.json`: `pvisor resume ID --store s3://...` on
 * any host reads its run from there (flags, probe steps left, command), as a local resume reads
 * `ID.hibernated`. Written create-only before the hibernation's VM ends; read bounded and checked
 * as the local record is (its `dir` must be the very location it was read from).
 */
import { SnapshotError, StoreError } from '../errors';
import { MAX_RECORD_BYTES, parseHibernationRecord, type HibernationRecord } from '../snapshot/hibernation-record';
import { ObjectStore } from './object-io';
import { resolveStoreOptions, type StoreOptions } from './store-options';
import { parseStoreUrl, type StoreUrl } from './store-url';

/** The record's name under the hibernated VM's prefix. */
export const RUN_RECORD_NAME = 'pvisor-run.json';

function keyOf(url: StoreUrl): string {
  return `${url.prefix}/${RUN_RECORD_NAME}`;
}

/** Writes `record` (whose `dir` is its location) beside the hibernated VM, create-only. */
export async function putRunRecord(record: HibernationRecord, options?: StoreOptions): Promise<void> {
  const url = parseStoreUrl(record.dir);
  const bytes = Buffer.from(`${JSON.stringify(record, null, 1)}\n`);
  if (bytes.length > MAX_RECORD_BYTES) throw new SnapshotError(`the hibernation record of ${record.id} would be ${bytes.length} bytes, more than ${MAX_RECORD_BYTES}: its command or steps are too long to carry`);
  const store = ObjectStore.open(url, resolveStoreOptions(options));
  try {
    await store.put(keyOf(url), bytes, true);
  } finally {
    store.close();
  }
}

/**
 * Reads the record of VM `id` hibernated at `location`. None there is a {@link StoreError}
 * `not-found` (nothing hibernated there by the CLI); one of another id or location, or malformed,
 * a {@link SnapshotError}.
 */
export async function getRunRecord(location: string, id: string, options?: StoreOptions): Promise<HibernationRecord> {
  const url = parseStoreUrl(location);
  const store = ObjectStore.open(url, resolveStoreOptions(options));
  let bytes: Buffer;
  try {
    bytes = await store.get(keyOf(url), MAX_RECORD_BYTES);
  } catch (e) {
    if (e instanceof StoreError && e.reason === 'not-found') throw new StoreError('not-found', `${url.url}: no VM hibernated there by pvisor suspend --hibernate --store (no ${RUN_RECORD_NAME})`, { cause: e });
    throw e;
  } finally {
    store.close();
  }
  const where = `${url.url}/${RUN_RECORD_NAME}`;
  const record = parseHibernationRecord(bytes.toString('utf8'), where, id);
  const named = parseStoreUrl(record.dir);
  if (named.bucket !== url.bucket || named.prefix !== url.prefix) throw new SnapshotError(`${where}: dir: ${JSON.stringify(record.dir.slice(0, 200))} is not where the record was read from`);
  return record;
}
