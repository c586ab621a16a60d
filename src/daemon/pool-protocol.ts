/**
 * The page pool's protocol between a VM process (PoolClient) and pvisor-daemon, in the agent
 * protocol's frames (../protocol/frame.ts: bounded, linear to decode): a Request with an op and an
 * id, answered by a Response or an Error with the same id. The daemon's first answer, to Hello,
 * comes with the pool's memfd (SCM_RIGHTS), which the client maps privately over guest pages.
 *
 * Payloads are little-endian arrays of fixed-size entries, each bounded so that no message makes
 * either side hold more than a batch: the daemon never stages more than one Put of pages.
 */

/** Operations. */
export const enum PoolOp {
  /**
   * JSON {version, scope, name} -> JSON {version, poolBytes, clientId}, with the memfd. The scope
   * is the peer's: see {@link checkScope}.
   */
  Hello = 1,
  /** Offer entries -> Answer entries: for each page, a pool page, Send, or None. */
  Offer = 2,
  /** Put entries (page + its 4096 bytes) -> Answer entries: the pool page holding it, or Full. */
  Put = 3,
  /** Settle: pool pages mapped (keep), pool pages not mapped or no longer mapped (drop) -> empty. */
  Settle = 4,
  /** Empty -> JSON {@link PoolStatus}. */
  Status = 5,
}

/**
 * The pool protocol's version: the client says it in Hello, the daemon in its answer, each
 * refusing another. It is not the frame header's version byte, which is the frame layout's
 * (FRAME_VERSION of ../protocol/frame.ts).
 */
export const POOL_PROTOCOL_VERSION = 1;
export const PAGE_BYTES = 4096;
/** Most entries in one Offer (12 bytes each: under the frame's 1 MiB). */
export const MAX_OFFER_ENTRIES = 65536;
/** Most pages in one Put (under the frame's 1 MiB): what the daemon holds of a client at once. */
export const MAX_PUT_PAGES = 240;
/** Most pool pages in one Settle. */
export const MAX_SETTLE_PAGES = 131072;
/** A longest scope or VM name. */
export const MAX_NAME_BYTES = 256;

/** Answers: a pool page number, or one of these. */
export const ANSWER_SEND = 0xffffffff;
export const ANSWER_NONE = 0xfffffffe;
export const ANSWER_FULL = 0xfffffffd;

/** A page's content key (see pageHashes): two 32-bit words. */
export interface PageKey {
  lo: number;
  hi: number;
}

/**
 * What `pvisor-daemon status` prints: of the scopes the asker may see (its uid's and its groups';
 * root sees all), and of those scopes' clients. `poolBytes`, `pid` and `pssBytes` are the daemon's.
 */
export interface PoolStatus {
  pid: number;
  poolBytes: number;
  /** Pool pages holding a page some client references. */
  pagesUsed: number;
  /** Processes whose clients disconnected while they run on, per scope: their references are kept. */
  orphanedClients: number;
  references: number;
  /** Each client as it named its scope, with the uid the kernel gave for it. */
  clients: { id: number; scope: string; name: string; pid: number; uid: number; references: number }[];
  scopes: number;
  candidates: number;
  pssBytes: number;
}

/** A payload that breaks the protocol: the connection ends. */
export class PoolProtocolError extends Error {}

// Each layout below is written in one place, as the writers and readers the client uses: it builds
// its requests straight into one reusable frame (../memory/pass-scratch.ts). The daemon's side is
// native (native-prebuilds/helpers/pool_daemon.c); test/pool-wire.ts encodes requests for tests
// with these same writers.

/** Bytes of one Offer entry: u32 guest page, u32 key.lo, u32 key.hi. */
export const OFFER_ENTRY_BYTES = 12;
/** Bytes of one Answer entry: u32 guest page, u32 answer. */
export const ANSWER_ENTRY_BYTES = 8;

/** Writes Offer entry `i` into `b`. */
export function writeOfferEntry(b: Buffer, i: number, page: number, key: PageKey): void {
  b.writeUInt32LE(page, i * OFFER_ENTRY_BYTES);
  b.writeUInt32LE(key.lo >>> 0, i * OFFER_ENTRY_BYTES + 4);
  b.writeUInt32LE(key.hi >>> 0, i * OFFER_ENTRY_BYTES + 8);
}

/** The guest page of Answer entry `i`. */
export function answerPage(p: Buffer, i: number): number {
  return p.readUInt32LE(i * ANSWER_ENTRY_BYTES);
}

/** The answer of Answer entry `i`: a pool page, {@link ANSWER_SEND}, {@link ANSWER_NONE} or {@link ANSWER_FULL}. */
export function answerOf(p: Buffer, i: number): number {
  return p.readUInt32LE(i * ANSWER_ENTRY_BYTES + 4);
}

/** Bytes of a Put of `count` pages: u32 count, the guest pages, then their bytes, page after page (so they can be keyed in one call). */
export function putBytes(count: number): number {
  return 4 + count * (4 + PAGE_BYTES);
}

/** Writes a Put's count into `b` (sized by {@link putBytes}) and returns where page `k`'s number and bytes go. */
export function writePutCount(b: Buffer, count: number): (k: number, page: number) => Buffer {
  b.writeUInt32LE(count, 0);
  const data = 4 + 4 * count;
  return (k, page) => {
    b.writeUInt32LE(page, 4 + 4 * k);
    return b.subarray(data + k * PAGE_BYTES, data + (k + 1) * PAGE_BYTES);
  };
}

/** Bytes of a Settle naming `pages` pool pages. */
export function settleBytes(pages: number): number {
  return 4 + 4 * pages;
}

/** Settle: u32 count of kept pages, the kept pool pages, then the dropped ones; written into `b` (sized by {@link settleBytes}). */
export function writeSettle(b: Buffer, keep: readonly number[], drop: readonly number[]): void {
  b.writeUInt32LE(keep.length, 0);
  keep.forEach((page, i) => b.writeUInt32LE(page, 4 + 4 * i));
  drop.forEach((page, i) => b.writeUInt32LE(page, 4 + 4 * (keep.length + i)));
}

/** A JSON payload of at most `maxBytes`, as an object. */
export function decodeJson(p: Buffer, maxBytes: number, what: string): Record<string, unknown> {
  if (p.length > maxBytes) throw new PoolProtocolError(`${what}: ${p.length} bytes, at most ${maxBytes}`);
  let v: unknown;
  try {
    v = JSON.parse(p.toString('utf8'));
  } catch {
    throw new PoolProtocolError(`${what}: not JSON`);
  }
  if (typeof v !== 'object' || v === null || Array.isArray(v)) throw new PoolProtocolError(`${what}: not an object`);
  return v as Record<string, unknown>;
}

/** What the daemon's answer to Hello says, checked. */
export interface Welcome {
  poolBytes: number;
  clientId: number;
}

/** The daemon's answer to Hello: a {@link POOL_PROTOCOL_VERSION} daemon's, or a {@link PoolProtocolError}. */
export function decodeWelcome(p: Buffer): Welcome {
  const w = decodeJson(p, 4096, 'Welcome');
  if (w.version !== POOL_PROTOCOL_VERSION) throw new PoolProtocolError(`Welcome: the daemon speaks pool protocol version ${JSON.stringify(w.version)}; this pvisor speaks ${POOL_PROTOCOL_VERSION}`);
  if (typeof w.poolBytes !== 'number' || typeof w.clientId !== 'number') throw new PoolProtocolError('Welcome: poolBytes and clientId are not numbers');
  return { poolBytes: w.poolBytes, clientId: w.clientId };
}

/**
 * A scope, as {@link checkName}; one that starts with `gid:` must be `gid:GID:NAME`, a scope of
 * group GID. The daemon keys every other scope by the uid of the process that names it, so a
 * scope `NAME` is the uid's own and no other uid's client can reach it; `gid:GID:NAME` is shared
 * by the members of group GID (primary or supplementary), and refused to anyone else.
 */
export function checkScope(v: unknown, what: string): string {
  const scope = checkName(v, what);
  if (scope.startsWith('gid:')) {
    const m = /^gid:(0|[1-9][0-9]{0,9}):(.+)$/s.exec(scope);
    if (!m || Number(m[1]) >= 0xffffffff) throw new PoolProtocolError(`${what}: a group's scope is gid:GID:NAME (GID a number below 4294967295, NAME not empty), got ${JSON.stringify(scope)}`);
  }
  return scope;
}

/** A scope or name: 1 to {@link MAX_NAME_BYTES} bytes of printable text. */
export function checkName(v: unknown, what: string): string {
  if (typeof v !== 'string' || v.length === 0 || Buffer.byteLength(v) > MAX_NAME_BYTES || /[\u0000-\u001f]/.test(v)) {
    throw new PoolProtocolError(`${what}: expected 1 to ${MAX_NAME_BYTES} bytes of printable text`);
  }
  return v;
}
