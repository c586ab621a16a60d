/**
 * The addresses the VM's resolver opened: the elements of its nftables set (`hosts`, type
 * ipv4_addr, `flags timeout`), which the VM's egress chain accepts new connections to. Each
 * element lives for the TTL of the answer that opened it, bounded below (so that an answer with
 * TTL 0 still leaves the guest the time to connect) and above; the kernel removes it when that
 * runs out. Established connections outlive their element (conntrack lets them on).
 *
 * One owner of the set: every change goes through one queue, one `nft -f -` transaction at a time,
 * so a refresh and a removal never interleave. The number of elements is capped (the set's
 * `size` too): a guest that resolves many names fills it, and is refused more until some expire.
 */
import { formatIpv4 } from './addresses';

/** The name of the set in the VM's inet table. */
export const HOSTS_SET = 'hosts';
/** At most this many addresses open at once per VM. */
export const HOSTS_SET_CAPACITY = 4096;
/** An element lives at least this long, whatever the answer's TTL (0 included). */
export const MIN_ELEMENT_TTL_S = 30;
/** And at most this long: a longer TTL is cut to it, in the set and in the guest's answer. */
export const MAX_ELEMENT_TTL_S = 3600;

/** Answers remembered per address (several names may share an address, e.g. behind one CDN). */
const MAX_REASONS = 8;

/** The element timeout for an answer whose records' smallest TTL is `ttlS`. */
export function elementTtlS(ttlS: number): number {
  return Math.min(MAX_ELEMENT_TTL_S, Math.max(MIN_ELEMENT_TTL_S, Math.floor(ttlS)));
}

/** The set's declaration, inside `table inet NAME { ... }`. */
export function hostsSetDeclaration(): string {
  return `  set ${HOSTS_SET} {\n    type ipv4_addr; flags timeout; size ${HOSTS_SET_CAPACITY};\n  }`;
}

/**
 * The `nft -f -` script that (re)opens `open` for their timeouts and removes `close`. `add` of an
 * element already there leaves its timeout as it was (nft 1.0), so a refresh is add (so that it
 * exists, which `delete` needs), delete, add with the new timeout: one transaction, never absent.
 */
export function setElementsScript(table: string, open: readonly { address: number; timeoutS: number }[], close: readonly number[]): string {
  const el = `element inet ${table} ${HOSTS_SET}`;
  const lines: string[] = [];
  for (const { address, timeoutS } of open) {
    const a = formatIpv4(address);
    lines.push(`add ${el} { ${a} timeout ${timeoutS}s }`, `delete ${el} { ${a} }`, `add ${el} { ${a} timeout ${timeoutS}s }`);
  }
  for (const address of close) {
    const a = formatIpv4(address);
    lines.push(`add ${el} { ${a} timeout 1s }`, `delete ${el} { ${a} }`);
  }
  return lines.length ? `${lines.join('\n')}\n` : '';
}

/** The set holds as many addresses as it may: the resolver answers SERVFAIL until some expire. */
export class EgressSetFullError extends Error {
  constructor(readonly capacity: number) {
    super(`the VM's set of opened addresses is full (${capacity})`);
    this.name = 'EgressSetFullError';
  }
}

/** The VM's set of opened addresses. */
export class EgressSet {
  /** Address → when its element expires (ms, Date.now()), as this process last set it. */
  private readonly expiresAtMs = new Map<number, number>();
  /**
   * Address → the answers that opened it (each the chain of names, question first), so that a
   * change of rules closes exactly the addresses no allowed answer stands behind. At most
   * {@link MAX_REASONS} per address: the latest are kept.
   */
  private readonly reasons = new Map<number, string[][]>();
  private queue: Promise<unknown> = Promise.resolve();

  constructor(
    private readonly table: string,
    /** Runs an `nft -f -` script; rejects with nft's complaint. */
    private readonly nft: (script: string) => Promise<void>,
    private readonly capacity = HOSTS_SET_CAPACITY,
  ) {}

  /** How many addresses are open now. */
  get size(): number {
    this.forgetExpired(Date.now());
    return this.expiresAtMs.size;
  }

  /** Whether `address` is open now (as far as this process set it). */
  has(address: number): boolean {
    return (this.expiresAtMs.get(address) ?? 0) > Date.now();
  }

  /**
   * Opens `addresses` for `timeoutS` (an element already open for longer keeps its time). Resolves
   * once the kernel has them; rejects with {@link EgressSetFullError} when they would not fit, and
   * with nft's error if it failed (then nothing of this call was opened).
   */
  open(addresses: readonly number[], timeoutS: number, chain: readonly string[]): Promise<void> {
    return this.serialize(async () => {
      const now = Date.now();
      this.forgetExpired(now);
      // Taken before nft runs: the kernel's timer starts later, so this process never believes an
      // element lives longer than it does.
      const until = now + timeoutS * 1000;
      const unique = [...new Set(addresses)];
      // An element with more than half of the new lifetime left is not refreshed: a guest asking
      // the same name again and again costs no nft run each time.
      const todo = unique.filter((a) => (this.expiresAtMs.get(a) ?? 0) < until - (timeoutS * 1000) / 2);
      const added = todo.filter((a) => !this.expiresAtMs.has(a)).length;
      if (this.expiresAtMs.size + added > this.capacity) throw new EgressSetFullError(this.capacity);
      if (todo.length) await this.nft(setElementsScript(this.table, todo.map((address) => ({ address, timeoutS })), []));
      for (const a of todo) this.expiresAtMs.set(a, until);
      for (const a of unique) {
        const known = (this.reasons.get(a) ?? []).filter((c) => c.join(' ') !== chain.join(' '));
        this.reasons.set(a, [...known, [...chain]].slice(-MAX_REASONS));
      }
    });
  }

  /**
   * Removes every open address for which `keep` refuses all the answers that opened it (each
   * answer's chain of names, question first). Resolves with the addresses removed.
   */
  retain(keep: (address: number, chain: readonly string[]) => boolean): Promise<number[]> {
    return this.serialize(async () => {
      this.forgetExpired(Date.now());
      const gone = [...this.expiresAtMs.keys()].filter((a) => !(this.reasons.get(a) ?? []).some((c) => keep(a, c)));
      if (gone.length) await this.nft(setElementsScript(this.table, [], gone));
      for (const a of gone) {
        this.expiresAtMs.delete(a);
        this.reasons.delete(a);
      }
      return gone;
    });
  }

  private forgetExpired(now: number): void {
    for (const [a, t] of this.expiresAtMs) {
      if (t > now) continue;
      this.expiresAtMs.delete(a);
      this.reasons.delete(a);
    }
  }

  private serialize<T>(work: () => Promise<T>): Promise<T> {
    const next = this.queue.then(work, work);
    this.queue = next.catch(() => undefined);
    return next;
  }
}
