/**
 * PoolClient: the VM's side of pvisor-daemon's page pool. The VM starts with private RAM; each
 * merge pass (periodic, or {@link PoolClient.mergeNow}) keys the VM's own pages, offers the keys
 * to the pool, sends the pages the pool asks for (those another VM of the scope has too), and maps
 * the pool's copy over each page whose bytes it has compared equal: reads then share the pool's
 * page, a write makes a private copy again. The pass also finds pages the guest has written since
 * (they are anonymous again) and gives their pool references back.
 *
 * No guest write is lost to a merge: pages are compared and replaced with every vCPU stopped
 * (StrategyContext.withGuestPaused), in slices so that the guest waits little, and a page that
 * changed between the offer and the slice no longer compares equal and stays the VM's.
 *
 * The daemon can go away at any time: pages already mapped stay valid (the memfd lives while
 * mapped), the VM runs on, the figures and a warning say so, and the client reconnects with
 * back-off to the next daemon, whose pool starts afresh.
 */
import { readFileSync } from 'node:fs';
import { InvalidOptionError } from '../../errors';
import { numberOption } from '../../units';
import { rangeMappingCount } from '../../memory-usage';
import { MADV_DONTNEED, MAP_SHARED, PAGE_SIZE, PROT_READ } from '../../sys/constants';
import { closeFd, madvise, mmap, munmap, releaseFreeHeap, viewAt } from '../../sys/libc';
import {
  ANSWER_FULL,
  ANSWER_NONE,
  ANSWER_SEND,
  answerOf,
  answerPage,
  checkScope,
  MAX_OFFER_ENTRIES,
  MAX_PUT_PAGES,
  MAX_SETTLE_PAGES,
  OFFER_ENTRY_BYTES,
  ANSWER_ENTRY_BYTES,
  PoolOp,
  PoolProtocolError,
  putBytes,
  settleBytes,
  writeOfferEntry,
  writePutCount,
  writeSettle,
} from '../../daemon/pool-protocol';
import type { PoolLink } from '../pool-link';
import { PassScratch } from '../pass-scratch';
import { FROM_GONE_POOL, PoolPlaces } from '../pool-places';
import { FRAME_HEADER_BYTES } from '../../protocol/frame';
import { roundMs, type MemoryStrategy, type PeriodicWork, type StrategyContext, type StrategyRam, type StrategyStats } from '../strategy';

/**
 * Options of {@link PoolClient}.
 * @category Strategies
 */
export interface PoolClientOptions {
  /** The daemon's socket (`pvisor-daemon serve --memory-pool --socket PATH`). */
  socket: string;
  /**
   * Pages are shared only among VMs of one scope. Sharing a page across tenants lets one learn,
   * by timing its writes, whether another holds the same content (as with KSM): give each tenant
   * its own scope. A scope is its uid's: VMs of other uids that name the same scope get their
   * own. `gid:GID:NAME` is a scope of group GID, shared by the VMs of every uid in that group
   * (primary or supplementary) and refused to others. Default `default`.
   */
  scope?: string;
  /** Time between merge passes, ms. Default 10000. */
  intervalMs?: number;
  /** Share of one CPU the passes may take. Default 0.1. */
  cpuShare?: number;
  /** How long one request to the daemon may take, ms. Default 10000. */
  requestTimeoutMs?: number;
}

/** When malloc's free pages are given back a second time after a pass (see the end of a pass). */
const HEAP_TRIM_AGAIN_MS = 1000;

/** Pages compared and replaced in one pause of the guest. */
const PAGES_PER_PAUSE = 2048;
/**
 * Pages sent to the pool before they are mapped back (two Puts): while a slice is on its way, the
 * VM's copy and the pool's both exist, so a group of VMs merging at once peaks by up to 0.5 MiB
 * each on top of the passes' own working memory.
 */
const PAGES_SENT_PER_SLICE = 128;
/**
 * Pages in one Put (the protocol allows {@link MAX_PUT_PAGES}): the frame it is built in, and the
 * daemon's buffer it lands in, are resident for the largest one sent. Table 3's same random cell,
 * two runs each way (kvm_pvm): with 480-page slices of 240-page Puts the group rose 14.5 and 16.5
 * MiB above its size before the merge, with 128 of 64 by 11.0 and 8.6 (with 64 of 32, 10.4 and
 * 9.9); the saving and the passes' time stayed the same.
 */
const PAGES_PER_PUT = 64;
const RECONNECT_FIRST_MS = 500;
const RECONNECT_MAX_MS = 30_000;
const VIEW_CHUNK_BYTES = 2 ** 30;

/** Mappings left free for everything else in the process (Node, other VMs' own needs). */
const MAP_COUNT_RESERVE = 8192;

/**
 * How many more mappings this process may make before it nears vm.max_map_count (65530 by
 * default, per process, shared by every VM in it), keeping {@link MAP_COUNT_RESERVE} spare.
 */
function mappingBudget(): number {
  let max = 65530;
  try {
    max = Number(readFileSync('/proc/sys/vm/max_map_count', 'utf8').trim()) || max;
  } catch {
    // the default, then
  }
  // Read line by line, as memory-usage.ts reads maps: this process may hold tens of thousands.
  const used = rangeMappingCount(0, Number.MAX_SAFE_INTEGER);
  return Math.max(0, max - used - MAP_COUNT_RESERVE);
}

/** One daemon's pool as this client maps it. */
interface PoolGeneration {
  id: number;
  link: PoolLink;
  fd: number;
  bytes: number;
  /** The pool mapped read-only, to compare pages against. */
  addr: number;
  views: Buffer[];
}

/**
 * Shares the VM's pages with other VMs through pvisor-daemon's page pool.
 * @category Strategies
 */
export class PoolClient implements MemoryStrategy {
  readonly name = 'pool-client';
  readonly needs = [] as const;
  /** It maps pool pages over running guest RAM: ColdCompression must not drop them behind it. */
  readonly exclusive = ['resident-pages'] as const;
  readonly periodic: PeriodicWork;
  private readonly socketPath: string;
  private readonly scope: string;
  private readonly requestTimeoutMs: number;
  private ctx: StrategyContext | undefined;
  private pool: PoolGeneration | undefined;
  private generations = 0;
  private connecting = false;
  private reconnectTimer: NodeJS.Timeout | undefined;
  private reconnectMs = RECONNECT_FIRST_MS;
  private closed = false;
  private lastError: string | undefined;
  /** The guest pages mapped from a pool, and from which pool page (made at the first pass). */
  private mapped: PoolPlaces | undefined;
  private zeroKey: bigint | undefined;
  /** A pass's arrays and request frame, resident only while a pass runs. */
  private scratch: PassScratch | undefined;
  /** References of pages the guest freed, given back at the next pass. */
  private freedPoolPages: number[] = [];
  private passing: Promise<void> | undefined;
  private readonly figures = { merges: 0, lastMergeMs: 0, pagesMapped: 0, pagesSent: 0, pagesUnshared: 0, pagesChangedBeforeMap: 0, reconnects: 0, poolFull: 0, pagesNotMappedForMapCount: 0 };
  /** New mappings this pass may still make (see {@link mappingBudget}). */
  private mappingBudget = 0;

  constructor(options: PoolClientOptions) {
    if (typeof options?.socket !== 'string' || options.socket.length === 0) throw new InvalidOptionError('socket', 'the pool daemon\'s socket path is required');
    this.socketPath = options.socket;
    try {
      this.scope = checkScope(options.scope ?? 'default', 'scope');
    } catch (e) {
      throw new InvalidOptionError('scope', (e as Error).message);
    }
    const num = (name: string, v: number | undefined, fallback: number, min: number, max: number) =>
      numberOption(name, v, fallback, (x) => x >= min && x <= max, `from ${min} to ${max}`);
    this.periodic = { intervalMs: num('intervalMs', options.intervalMs, 10_000, 100, 3_600_000), cpuShare: num('cpuShare', options.cpuShare, 0.1, 0.001, 1) };
    this.requestTimeoutMs = num('requestTimeoutMs', options.requestTimeoutMs, 10_000, 100, 600_000);
  }

  map(ctx: StrategyContext): void {
    this.ctx = ctx;
    this.connect();
  }

  /** Whether the client holds a live connection to the daemon. */
  get connected(): boolean {
    return this.pool !== undefined && !this.pool.link.closed;
  }

  /** Connects (again), without waiting; a failure is retried with back-off. */
  private connect(): void {
    if (this.closed || this.connecting || this.connected) return;
    this.connecting = true;
    import('../pool-link')
      .then(({ PoolLink }) => PoolLink.connect(this.socketPath, { scope: this.scope, name: this.ctx!.vmName }, this.requestTimeoutMs))
      .then(
        (link) => {
          this.connecting = false;
          if (this.closed) {
            link.close();
            closeFd(link.poolFd);
            return;
          }
          this.adopt(link);
        },
        (e: Error) => {
          this.connecting = false;
          this.lost(e.message);
        },
      );
  }

  private adopt(link: PoolLink): void {
    this.dropGeneration();
    const addr = mmap(0, link.poolBytes, PROT_READ, MAP_SHARED, link.poolFd, 0, 'the page pool (read-only)');
    const views: Buffer[] = [];
    for (let off = 0; off < link.poolBytes; off += VIEW_CHUNK_BYTES) views.push(viewAt(addr + off, Math.min(VIEW_CHUNK_BYTES, link.poolBytes - off)));
    const gen = ++this.generations;
    this.freedPoolPages = [];
    // References into the pool before this one went with its daemon.
    this.mapped?.forgetPool();
    this.pool = { id: gen, link, fd: link.poolFd, bytes: link.poolBytes, addr, views };
    if (gen > 1) this.figures.reconnects++;
    this.reconnectMs = RECONNECT_FIRST_MS;
    this.lastError = undefined;
    link.onClose((e) => {
      if (this.pool?.id === gen) this.lost(e.message);
    });
  }

  /** The daemon is gone or unreachable: pages mapped from it stay; try again later. */
  private lost(why: string): void {
    if (this.closed) return;
    const first = this.lastError === undefined;
    this.lastError = why;
    if (first) this.ctx?.warn(`pool-client: ${why}; the VM runs on with what it maps, reconnecting`);
    clearTimeout(this.reconnectTimer);
    this.reconnectTimer = setTimeout(() => this.connect(), this.reconnectMs);
    this.reconnectTimer.unref();
    this.reconnectMs = Math.min(RECONNECT_MAX_MS, this.reconnectMs * 2);
  }

  /** Unmaps the comparison view of the current pool and closes its fd (mapped guest pages keep the memfd alive). */
  private dropGeneration(): void {
    const p = this.pool;
    if (!p) return;
    this.pool = undefined;
    p.link.close();
    p.views.length = 0;
    munmap(p.addr, p.bytes);
    closeFd(p.fd);
  }

  /**
   * The guest freed a range: its pages mapped from the pool go back to reading zero as anonymous
   * memory (costing nothing until written), and their references go back at the next pass.
   */
  freePagesReported(ctx: StrategyContext, gpa: number, length: number): void {
    const offset = ctx.ram.hostOffset(gpa, length);
    if (offset < 0) return;
    let dropped = false;
    for (let page = offset / PAGE_SIZE; this.mapped && page < (offset + length) / PAGE_SIZE; page++) {
      const m = this.mapped.take(page);
      if (m === undefined) continue;
      if (m !== FROM_GONE_POOL) this.freedPoolPages.push(m);
      dropped = true;
    }
    if (dropped) ctx.ram.discardHost(offset, length, 'zero');
  }

  tick(ctx: StrategyContext): Promise<void> {
    return this.mergeNow(ctx);
  }

  /**
   * One merge pass now (also what each periodic tick does); resolves when it is done. Does
   * nothing while the daemon is unreachable.
   */
  mergeNow(ctx: StrategyContext | undefined = this.ctx): Promise<void> {
    if (!ctx) return Promise.resolve();
    this.passing ??= this.pass(ctx).finally(() => (this.passing = undefined));
    return this.passing;
  }

  private async pass(ctx: StrategyContext): Promise<void> {
    const pool = this.pool;
    if (!pool || pool.link.closed) return;
    const t0 = performance.now();
    const ram = ctx.ram;
    const pages = ram.sizeBytes / PAGE_SIZE;
    // The arrays live with the client: a pass allocates as little as it can.
    const scratch = (this.scratch ??= new PassScratch(pages));
    const mapped = (this.mapped ??= new PoolPlaces(pages));
    const payload = (bytes: number) => scratch.frame.subarray(FRAME_HEADER_BYTES, FRAME_HEADER_BYTES + bytes);
    const runs = ram.ownPageRuns();
    const drop = this.freedPoolPages;
    this.freedPoolPages = [];
    // A page mapped from a pool that is the VM's own (anonymous) again was written since.
    for (const r of runs) {
      for (let page = r.offset / PAGE_SIZE; page < (r.offset + r.length) / PAGE_SIZE; page++) {
        const m = mapped.take(page);
        if (m === undefined) continue;
        this.figures.pagesUnshared++;
        if (m !== FROM_GONE_POOL) drop.push(m);
      }
    }
    // Key every own page not yet shared, except zero pages (the guest's free memory: IdleRelease's).
    const { pageHashes, pageHashesOf } = await import('../../native/crc32c');
    const keys = scratch.keys;
    if (this.zeroKey === undefined) {
      const one = new BigUint64Array(1);
      pageHashesOf(Buffer.alloc(PAGE_SIZE), one);
      this.zeroKey = one[0];
    }
    const zero = this.zeroKey;
    for (const r of runs) pageHashes(ram.hostAddr + r.offset, r.length / PAGE_SIZE, keys.subarray(r.offset / PAGE_SIZE));
    const candidates: number[] = []; // guest page, pool page, ...: each a reference held
    const send: number[] = [];
    try {
      // Offers, built straight into the pass's request frame.
      const batch = payload(MAX_OFFER_ENTRIES * OFFER_ENTRY_BYTES);
      let n = 0;
      const flushOffer = async () => {
        const answers = await pool.link.requestBuilt(PoolOp.Offer, scratch.frame, n * OFFER_ENTRY_BYTES, this.requestTimeoutMs);
        this.checkAnswers(answers, n, pool);
        for (let i = 0; i < n; i++) {
          const answer = answerOf(answers, i);
          if (answer === ANSWER_SEND) send.push(answerPage(answers, i));
          else if (answer !== ANSWER_NONE) candidates.push(answerPage(answers, i), answer);
        }
        n = 0;
      };
      for (const r of runs) {
        for (let p = r.offset / PAGE_SIZE; p < (r.offset + r.length) / PAGE_SIZE; p++) {
          if (keys[p] === zero) continue;
          writeOfferEntry(batch, n, p, { lo: Number(keys[p] & 0xffffffffn), hi: Number(keys[p] >> 32n) });
          if (++n === MAX_OFFER_ENTRIES) await flushOffer();
        }
      }
      if (n > 0) await flushOffer();
      this.mappingBudget = mappingBudget();
      // Maps (guest page, pool page) pairs, in guest page order, a slice at a time with the guest stopped.
      const mapPairs = async (flat: number[]) => {
        const pairs: [number, number][] = [];
        for (let k = 0; k < flat.length; k += 2) pairs.push([flat[k], flat[k + 1]]);
        pairs.sort((a, b) => a[0] - b[0]);
        for (let i = 0; i < pairs.length; i += PAGES_PER_PAUSE) {
          const slice = pairs.slice(i, i + PAGES_PER_PAUSE);
          const refused = await ctx.withGuestPaused(() => this.mapSlice(ram, pool, mapped, slice));
          // The VM changed state or ended meanwhile: nothing of the slice was mapped.
          drop.push(...(refused ?? slice.map(([, poolPage]) => poolPage)));
        }
      };
      // What the pool held already.
      await mapPairs(candidates);
      // Then the pages it asked for, straight from guest RAM into the frame, a slice at a time,
      // each slice mapped as soon as the pool holds it: the VM's copy and the pool's coexist for
      // one slice, not for the whole pass (they did, and made the group's peak during a merge a
      // whole working set higher).
      let full = false;
      for (let i = 0; i < send.length && !full; i += PAGES_SENT_PER_SLICE) {
        const sliceEnd = Math.min(send.length, i + PAGES_SENT_PER_SLICE);
        const pooled: number[] = [];
        for (let j = i; j < sliceEnd && !full; j += PAGES_PER_PUT) {
          const count = Math.min(PAGES_PER_PUT, sliceEnd - j);
          const put = payload(putBytes(count));
          const slot = writePutCount(put, count);
          for (let k = 0; k < count; k++) ram.view(send[j + k] * PAGE_SIZE, PAGE_SIZE).copy(slot(k, send[j + k]));
          const answers = await pool.link.requestBuilt(PoolOp.Put, scratch.frame, put.length, this.requestTimeoutMs);
          this.checkAnswers(answers, count, pool);
          this.figures.pagesSent += count;
          for (let k = 0; k < count; k++) {
            const answer = answerOf(answers, k);
            if (answer === ANSWER_FULL) full = true;
            else pooled.push(answerPage(answers, k), answer);
          }
        }
        if (full) this.figures.poolFull++;
        await mapPairs(pooled);
      }
      for (let i = 0; i < drop.length; i += MAX_SETTLE_PAGES) {
        const part = drop.slice(i, i + MAX_SETTLE_PAGES);
        const settle = payload(settleBytes(part.length));
        writeSettle(settle, [], part); // nothing kept: every page named is dropped
        await pool.link.requestBuilt(PoolOp.Settle, scratch.frame, settle.length, this.requestTimeoutMs);
      }
    } catch (e) {
      // The link ended (its close listener reconnects); the daemon keeps this process's references.
      if (!pool.link.closed) throw e;
    } finally {
      // Every request sent has been answered (or its link is gone): nothing reads the frame now.
      scratch.release();
      // What the pass allocated and freed (reads of /proc, answers, sockets' chunks) stays
      // resident in malloc's heap unless given back: now, and again a second later, once the
      // collector has freed the pass's last garbage: the second trim is most of the gain
      // (docs/design-figures.md, "The page pool client's heap trim").
      releaseFreeHeap();
      setTimeout(releaseFreeHeap, HEAP_TRIM_AGAIN_MS).unref();
    }
    // The comparisons mapped pool pages into the read-only view too: unmap them there, so that
    // each page's PSS is split among the VMs that map it, not among them and their views.
    if (this.pool === pool) madvise(pool.addr, pool.bytes, MADV_DONTNEED, 'MADV_DONTNEED');
    this.figures.merges++;
    this.figures.lastMergeMs = roundMs(performance.now() - t0);
  }

  /** An answer of the wrong size, or naming a page the pool cannot have, ends the link. */
  private checkAnswers(payload: Buffer, expected: number, pool: PoolGeneration): void {
    const poolPages = pool.bytes / PAGE_SIZE;
    let bad = payload.length !== expected * ANSWER_ENTRY_BYTES;
    for (let i = 0; !bad && i < expected; i++) {
      const answer = answerOf(payload, i);
      bad = answer < ANSWER_FULL && answer >= poolPages;
    }
    if (bad) {
      pool.link.close();
      throw new PoolProtocolError('the pool answered with pages it does not have');
    }
  }

  /**
   * With the guest stopped: maps each candidate's pool page over its guest page if their bytes
   * are equal, consecutive pages as one mapping. Returns the pool pages not mapped.
   */
  private mapSlice(ram: StrategyRam, pool: PoolGeneration, mapped: PoolPlaces, slice: [number, number][]): number[] {
    // A newer daemon's pool was adopted since the pass began: this one's view and fd are gone.
    if (this.pool !== pool) return slice.map(([, poolPage]) => poolPage);
    const refused: number[] = [];
    const runs: { guest: number; pool: number; pages: number }[] = [];
    let run: { guest: number; pool: number; pages: number } | undefined;
    const flush = () => {
      if (!run) return;
      // Each run may split a mapping in three: past the process's budget, the pages stay the VM's.
      if (this.mappingBudget < 2) {
        for (let k = 0; k < run.pages; k++) refused.push(run.pool + k);
        this.figures.pagesNotMappedForMapCount += run.pages;
      } else {
        this.mappingBudget -= 2;
        runs.push(run);
      }
      run = undefined;
    };
    for (const [guest, poolPage] of slice) {
      const poolOffset = poolPage * PAGE_SIZE;
      const chunk = pool.views[Math.floor(poolOffset / VIEW_CHUNK_BYTES)];
      const inChunk = poolOffset % VIEW_CHUNK_BYTES;
      const same = !mapped.has(guest) && ram.view(guest * PAGE_SIZE, PAGE_SIZE).equals(chunk.subarray(inChunk, inChunk + PAGE_SIZE));
      if (!same) {
        this.figures.pagesChangedBeforeMap++;
        refused.push(poolPage);
        continue;
      }
      if (run && run.guest + run.pages === guest && run.pool + run.pages === poolPage) run.pages++;
      else {
        flush();
        run = { guest, pool: poolPage, pages: 1 };
      }
    }
    flush();
    // All of the slice's runs in one native call: one call per run (a page each, for a
    // repetitive working set) grew this process by tens of MiB (see ../../guest-ram/file-runs.ts).
    const done = ram.mapFileRuns(pool.fd, runs.map((r) => ({ offset: r.guest * PAGE_SIZE, length: r.pages * PAGE_SIZE, fileOffset: r.pool * PAGE_SIZE })));
    for (const r of runs.slice(0, done.mapped)) {
      for (let k = 0; k < r.pages; k++) mapped.set(r.guest + k, r.pool + k);
      this.figures.pagesMapped += r.pages;
    }
    if (done.error) throw done.error;
    return refused;
  }

  stats(ctx: StrategyContext): StrategyStats {
    const notes: string[] = [];
    if (!this.connected) notes.push(`not connected to the pool at ${this.socketPath}${this.lastError ? `: ${this.lastError}` : ''}; the VM runs on with the pages it maps`);
    const vmas = rangeMappingCount(ctx.ram.hostAddr, ctx.ram.sizeBytes);
    return {
      strategy: this.name,
      figures: { connected: this.connected ? 1 : 0, pagesShared: this.mapped?.size ?? 0, guestRamMappings: vmas, ...this.figures },
      notes,
    };
  }

  close(): void {
    this.closed = true;
    clearTimeout(this.reconnectTimer);
    this.dropGeneration();
    // A pass still running writes into the arrays until it sees its link closed.
    const { scratch, mapped } = this;
    this.scratch = undefined;
    this.mapped = undefined;
    const free = () => {
      scratch?.free();
      mapped?.close();
    };
    if (this.passing) void this.passing.finally(free).catch(() => {});
    else free();
  }
}
