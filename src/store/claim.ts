/**
 * The claim that lets a hibernated VM in an object store resume at most once: before the VM
 * runs, the restoring process writes `<prefix>/claim.json` create-only (`If-None-Match: *`), so of
 * any number of restores racing on other hosts exactly one succeeds and the others get a
 * {@link StoreClaimedError} naming the winner. Every later change of the claim (the VM runs:
 * `resumed`; the restore failed before the VM ran: `released`; a user takes a dead claimant's
 * VM over) is a compare-and-swap (`If-Match` on the ETag read), never a delete, which this
 * store cannot make conditional (docs/object-store.md, "Conditional operations").
 *
 * A write whose answer is lost (a timeout after the store applied it, an SDK retry that then
 * gets 412) is decided by reading the claim back: each claim carries a random id, so the writer
 * knows its own. The claim object is hostile input as the manifest is: bounded, checked.
 */
import { randomBytes } from 'node:crypto';
import { hostname } from 'node:os';
import { GetObjectCommand, PutObjectCommand } from '@aws-sdk/client-s3';
import { StoreClaimedError, StoreError, type StoreClaimInfo } from '../errors';
import type { ObjectStore } from './object-io';
import type { StoreUrl } from './store-url';

/** The claim's name under the hibernated VM's prefix. */
export const CLAIM_NAME = 'claim.json';
/** A claim is about 300 bytes; a larger object there is not one. */
const MAX_CLAIM_BYTES = 4096;
const FORMAT = 'pvisor-store-claim';
const VERSION = 1;
const CLAIM_ID = /^[0-9a-f]{32}$/;

/**
 * What `claim.json` holds. `released`: free to claim again (its restore failed before the VM
 * ran). `withdrawn`: written by the hibernating process itself when its hibernation failed after
 * the upload began, so that the VM, going on at its origin, is never resumed from the store too.
 */
export interface ClaimBody {
  format: typeof FORMAT;
  version: typeof VERSION;
  claimId: string;
  state: 'claimed' | 'resumed' | 'released' | 'withdrawn';
  host: string;
  pid: number;
  claimedAt: string;
  resumedAt?: string;
  releasedAt?: string;
}

/** The claim's key for the hibernated VM at `url`. */
export function claimKey(url: StoreUrl): string {
  return `${url.prefix}/${CLAIM_NAME}`;
}

/** A claim this process holds: it says when the VM runs, or gives the VM back if it never did. */
export interface HeldClaim {
  readonly claimId: string;
  /**
   * Records that the VM runs. False if the claim is no longer this process's (a user took it
   * over meanwhile): the caller says so, since the VM may now run twice.
   */
  markResumed(): Promise<boolean>;
  /** Gives the VM back (the restore failed before it ran); best effort: false if it could not. */
  release(): Promise<boolean>;
}

/**
 * Marks `claim` resumed (the VM at `url` runs): undefined once it is, else the warning to give,
 * since another restore may then take the VM over and run it too.
 */
export async function markClaimResumed(claim: HeldClaim, url: StoreUrl): Promise<string | undefined> {
  let why = 'it was taken over meanwhile';
  try {
    if (await claim.markResumed()) return undefined;
  } catch (e) {
    why = (e as Error).message;
  }
  return `${url.url}: the VM runs, but its claim ${claim.claimId} could not be marked resumed (${why}): another restore may take it over`;
}

/**
 * Claims the hibernated VM at `url` for this process. Another claim there is a
 * {@link StoreClaimedError}, unless it is `released` or its id is `takeOver` (the user's choice:
 * that claimant is known to be dead before the VM ran), in which case it is replaced by a
 * compare-and-swap that only one of several racing takers wins.
 */
export async function takeClaim(store: ObjectStore, url: StoreUrl, options: { takeOver?: string } = {}): Promise<HeldClaim> {
  if (options.takeOver !== undefined && !CLAIM_ID.test(options.takeOver)) throw new StoreError('malformed', `takeOverClaim ${JSON.stringify(String(options.takeOver).slice(0, 80))} is not a claim id (32 hex digits, as a StoreClaimedError's claim.claimId)`);
  const key = claimKey(url);
  const mine: ClaimBody = { format: FORMAT, version: VERSION, claimId: randomBytes(16).toString('hex'), state: 'claimed', host: hostname().slice(0, 255), pid: process.pid, claimedAt: new Date().toISOString() };
  const won = (etag: string): HeldClaim => heldClaim(store, url, mine, etag);
  let created = await tryPut(store, key, mine, { IfNoneMatch: '*' });
  if (created !== undefined) return won(created);
  // Lost the create, or its answer: what is there now decides. Twice at most, since a claim
  // replaced under our read (a released one taken by another) is read once more.
  for (let round = 0; round < 3; round++) {
    const now = await readClaim(store, url);
    if (!now) {
      created = await tryPut(store, key, mine, { IfNoneMatch: '*' });
      if (created !== undefined) return won(created);
      continue;
    }
    if (now.body.claimId === mine.claimId) return won(now.etag);
    const free = now.body.state === 'released' || now.body.claimId === options.takeOver;
    if (!free) throw claimedError(url, now.body, options.takeOver);
    const swapped = await compareAndSwap(store, url, now.etag, mine);
    if (swapped !== undefined) return won(swapped);
  }
  throw new StoreError('unreachable', `${url.url}: the claim ${key} kept changing while this restore tried to take it; nothing was restored`);
}

/**
 * Marks the hibernation at `url` withdrawn (create-only): its VM goes on at its origin. `taken`
 * if a restore claimed it first (the VM has moved: the origin must not go on), `unknown` if the
 * store could not be reached (see docs/object-store.md for that window).
 */
export async function withdrawHibernation(store: ObjectStore, url: StoreUrl): Promise<'withdrawn' | 'taken' | 'unknown'> {
  const mine: ClaimBody = { format: FORMAT, version: VERSION, claimId: randomBytes(16).toString('hex'), state: 'withdrawn', host: hostname().slice(0, 255), pid: process.pid, claimedAt: new Date().toISOString() };
  try {
    if ((await tryPut(store, claimKey(url), mine, { IfNoneMatch: '*' })) !== undefined) return 'withdrawn';
    const now = await readClaim(store, url);
    if (!now) return 'unknown';
    return now.body.claimId === mine.claimId ? 'withdrawn' : 'taken';
  } catch {
    return 'unknown';
  }
}

/** The claim at `url`, checked, with its ETag; undefined if there is none. */
export async function readClaim(store: ObjectStore, url: StoreUrl): Promise<{ body: ClaimBody; etag: string } | undefined> {
  const key = claimKey(url);
  const got = await store.bounded(`GET ${key}`, async (abortSignal) => {
    let r;
    try {
      r = await store.client.send(new GetObjectCommand({ Bucket: store.bucket, Key: key }), { abortSignal });
    } catch (e) {
      if ((e as { $metadata?: { httpStatusCode?: number } }).$metadata?.httpStatusCode === 404) return undefined;
      throw e;
    }
    if (r.ContentLength !== undefined && r.ContentLength > MAX_CLAIM_BYTES) {
      (r.Body as { destroy?: () => void } | undefined)?.destroy?.();
      throw new StoreError('malformed', `${url.url}/${CLAIM_NAME}: ${r.ContentLength} bytes, more than a claim's ${MAX_CLAIM_BYTES}`);
    }
    const text = await (r.Body as { transformToString(): Promise<string> }).transformToString();
    if (Buffer.byteLength(text) > MAX_CLAIM_BYTES) throw new StoreError('malformed', `${url.url}/${CLAIM_NAME}: more than a claim's ${MAX_CLAIM_BYTES} bytes`);
    return { text, etag: r.ETag ?? '' };
  });
  if (!got) return undefined;
  return { body: parseClaim(got.text, `${url.url}/${CLAIM_NAME}`), etag: got.etag };
}

/** Checks a claim object's text; anything else than a claim is a {@link StoreError} `malformed`. */
export function parseClaim(text: string, where: string): ClaimBody {
  const bad = (what: string) => new StoreError('malformed', `${where}: not a pvisor claim (${what}); nothing was restored`);
  let o: Record<string, unknown>;
  try {
    o = JSON.parse(text) as Record<string, unknown>;
  } catch {
    throw bad('not JSON');
  }
  if (typeof o !== 'object' || o === null || Array.isArray(o)) throw bad('not an object');
  if (o.format !== FORMAT || o.version !== VERSION) throw bad(`format ${JSON.stringify(o.format)} version ${JSON.stringify(o.version)}`);
  if (typeof o.claimId !== 'string' || !CLAIM_ID.test(o.claimId)) throw bad('claimId');
  if (o.state !== 'claimed' && o.state !== 'resumed' && o.state !== 'released' && o.state !== 'withdrawn') throw bad('state');
  if (typeof o.host !== 'string' || o.host.length > 255 || /[\u0000-\u001f]/.test(o.host)) throw bad('host');
  if (!Number.isSafeInteger(o.pid) || (o.pid as number) < 0) throw bad('pid');
  const date = (k: string, required: boolean): string | undefined => {
    const v = o[k];
    if (v === undefined && !required) return undefined;
    if (typeof v !== 'string' || v.length > 64 || Number.isNaN(Date.parse(v))) throw bad(k);
    return v;
  };
  const body: ClaimBody = { format: FORMAT, version: VERSION, claimId: o.claimId, state: o.state, host: o.host, pid: o.pid as number, claimedAt: date('claimedAt', true)! };
  const resumedAt = date('resumedAt', false);
  const releasedAt = date('releasedAt', false);
  if (resumedAt) body.resumedAt = resumedAt;
  if (releasedAt) body.releasedAt = releasedAt;
  return body;
}

function heldClaim(store: ObjectStore, url: StoreUrl, mine: ClaimBody, etag: string): HeldClaim {
  let current = etag;
  let settled = false;
  const move = async (next: ClaimBody): Promise<boolean> => {
    if (settled) return false;
    settled = true;
    const swapped = await compareAndSwap(store, url, current, next);
    if (swapped === undefined) return false;
    current = swapped;
    return true;
  };
  return {
    claimId: mine.claimId,
    markResumed: () => move({ ...mine, state: 'resumed', resumedAt: new Date().toISOString() }),
    release: () => move({ ...mine, state: 'released', releasedAt: new Date().toISOString() }).catch(() => false),
  };
}

/**
 * Replaces the claim whose ETag is `etag` by `next`; resolves with the new ETag, or undefined if
 * the claim was no longer that one. radosgw 16 compares `If-Match` byte for byte with its stored
 * ETag, unquoted, where S3 returns it quoted (and AWS expects that form): the form S3 gave is sent
 * first, and the other only when a read shows the claim unchanged.
 */
async function compareAndSwap(store: ObjectStore, url: StoreUrl, etag: string, next: ClaimBody): Promise<string | undefined> {
  const key = claimKey(url);
  const unquoted = etag.replace(/^"(.*)"$/, '$1');
  const forms = unquoted === etag ? [etag, `"${etag}"`] : [etag, unquoted];
  for (const form of forms) {
    const put = await tryPut(store, key, next, { IfMatch: form });
    if (put !== undefined) return put;
    const now = await readClaim(store, url);
    if (now && now.body.claimId === next.claimId && now.body.state === next.state) return now.etag;
    if (!now || now.etag !== etag) return undefined;
  }
  return undefined;
}

/**
 * PUTs `body` under a condition; its ETag, or undefined when the store refused the condition
 * (412) or failed in a way that may hide a win (a 500 of a lost internal race, an answer lost):
 * the caller reads the claim back to know.
 */
async function tryPut(store: ObjectStore, key: string, body: ClaimBody, condition: { IfNoneMatch: string } | { IfMatch: string }): Promise<string | undefined> {
  const bytes = Buffer.from(JSON.stringify(body));
  try {
    const r = await store.bounded(`PUT ${key}`, (abortSignal) =>
      store.client.send(new PutObjectCommand({ Bucket: store.bucket, Key: key, Body: bytes, ContentLength: bytes.length, ContentType: 'application/json', ...condition }), { abortSignal }),
    );
    return r.ETag ?? '';
  } catch (e) {
    if (e instanceof StoreError && (e.reason === 'exists' || e.reason === 'unreachable' || e.reason === 'timeout')) return undefined;
    throw e;
  }
}

function claimedError(url: StoreUrl, c: ClaimBody, takeOver: string | undefined): StoreClaimedError {
  const info: StoreClaimInfo = { claimId: c.claimId, state: c.state === 'released' ? 'claimed' : c.state, host: c.host, pid: c.pid, claimedAt: c.claimedAt, ...(c.resumedAt && { resumedAt: c.resumedAt }) };
  const what =
    c.state === 'resumed' ? `was resumed by ${c.host} pid ${c.pid} at ${c.resumedAt ?? c.claimedAt}`
    : c.state === 'withdrawn' ? `was withdrawn by ${c.host} pid ${c.pid} at ${c.claimedAt}: its hibernation failed after the upload and the VM went on there`
    : `was claimed by ${c.host} pid ${c.pid} at ${c.claimedAt}, not known to have run yet`;
  const other = takeOver !== undefined ? ` (takeOverClaim ${takeOver} names another claim)` : '';
  const hint = c.state !== 'claimed'
    ? ''
    : `; if that process ended before the VM ran, take the VM over with the store option takeOverClaim: '${c.claimId}' (pvisor resume --take-over ${c.claimId})`;
  return new StoreClaimedError(info, `${url.url}: refused: the hibernated VM ${what} (claim ${c.claimId})${other}. A hibernated VM is resumed at most once${hint}`);
}
