/**
 * The probe guest's operations as typed calls over the agent protocol.
 */
import { GuestRequestError, InvalidOptionError } from '../errors';
import { checkVersion, integerAt, objectAt } from '../persist/state-fields';
import type { AgentClient } from '../protocol/agent-client';
import { PROBE_CONTENTS, PROBE_CONTENT_CODES, isProbeContent, type ProbeContent } from './probe-content';
import { pageMiBOption, u32Option } from '../units';

const enum ProbeOp {
  Fill = 0x0101,
  Rewrite = 0x0102,
  Touch = 0x0103,
  Digest = 0x0104,
  Release = 0x0105,
  Idle = 0x0106,
  ExitStorm = 0x0107,
  Zero = 0x0108,
  Fault = 0x01f0,
  Hostile = 0x01f1,
}

/**
 * The attacks {@link ProbeGuest.hostile} replays from inside the guest, each a malicious driver's
 * or agent's (docs/probe-guest.md, "HOSTILE", says what each does and what `counts` are).
 * @internal
 */
export const HOSTILE_KINDS = {
  'tx-alias': 1,
  'tx-malformed': 2,
  'avail-jump': 3,
  'notify-flood': 4,
  'chain-flood': 5,
  'frame-garbage': 6,
  'frame-bytewise': 7,
  'frame-foreign-ids': 8,
  'frame-unknown-type': 9,
  'balloon-ranges': 10,
  'balloon-self': 11,
  'virtio-state': 12,
  'live-requeue': 13,
  'balloon-alias': 14,
} as const;

/** @internal */
export type HostileKind = keyof typeof HOSTILE_KINDS;

/**
 * Options of {@link ProbeGuest.hostile}; which ones a kind reads is in docs/probe-guest.md.
 * @internal
 */
export interface HostileOptions {
  /** Chains, rounds, notifications or payload bytes (per kind); the avail index jump; a frame type. Default 1. */
  count?: number;
  /** `tx-alias`, `balloon-alias`: descriptors in the chain (at most 256). Default 256. */
  descriptors?: number;
  /** `tx-alias`, `balloon-alias`: bytes each descriptor claims (the same bytes of guest RAM). Default 4096. */
  descriptorBytes?: number;
  /** `avail-jump`: the queue whose available index jumps. Default `console-transmit`. */
  queue?: 'console-transmit' | 'balloon-reporting';
  /** Reject with a TimeoutError after this long. Default: no timeout. */
  timeoutMs?: number;
}

/**
 * What the guest saw of an attack: three counts whose meaning is the kind's, and its duration.
 * @internal
 */
export interface HostileResult extends ProbeTiming {
  counts: [number, number, number];
  /** The answer's payload (`frame-bytewise`: the bytes sent one per chain). */
  payload: Buffer;
}

/**
 * Options of {@link ProbeGuest.fill}.
 * @category Guest
 */
export interface FillOptions {
  /** Working set size in MiB. */
  sizeMiB: number;
  /** What to write; see {@link ProbeContent}. */
  content: ProbeContent;
  /** Seed of the content (32-bit); the same seed gives the same bytes in every VM. Default 1. */
  seed?: number;
}

/**
 * Options of {@link ProbeGuest.rewrite}.
 * @category Guest
 */
export interface RewriteOptions {
  /** Fraction of working-set pages to rewrite, 0..1, spread evenly. */
  fraction: number;
  /** Seed of the new content. Default: the fill's seed + 1. */
  seed?: number;
}

/**
 * Options of {@link ProbeGuest.touch}.
 * @category Guest
 */
export interface TouchOptions {
  /** How much of the working set, from its start, is hot, in MiB. */
  hotMiB: number;
  /** How many times to read every hot page. Default 1. */
  rounds?: number;
}

/**
 * Options of {@link ProbeGuest.release}.
 * @category Guest
 */
export interface ReleaseOptions {
  /** Start of the range inside the working set, in MiB. Default 0. */
  offsetMiB?: number;
  /** Length of the range, in MiB. Default: the whole working set. */
  sizeMiB?: number;
}

/**
 * Options of {@link ProbeGuest.zero}.
 * @category Guest
 */
export interface ZeroOptions {
  /** Start of the range inside the working set, in MiB. */
  offsetMiB: number;
  /** Length of the range, in MiB. */
  sizeMiB: number;
}

/**
 * A guest-side timing in TSC cycles.
 * @category Guest
 */
export interface ProbeTiming {
  tscCycles: number;
}

/**
 * The result of {@link ProbeGuest.digest}.
 * @category Guest
 */
export interface ProbeDigest extends ProbeTiming {
  bytes: number;
  /** The digest as 16 hex digits (h2 then h1). */
  hex: string;
  h1: number;
  h2: number;
}

/**
 * What the probe guest exposes; `vm.probe` on a VM started with `guest: 'probe'`.
 * @category Guest
 */
export class ProbeGuest {
  private fillSeed = 1;
  private fillBytes = 0;

  /** @internal */
  constructor(private readonly agent: AgentClient) {}

  /**
   * What the host remembers of the guest's working set (its seed and size, the defaults of
   * rewrite and release), for a snapshot.
   * @internal
   */
  saveState(): { version: 1; fillSeed: number; fillBytes: number } {
    return { version: 1, fillSeed: this.fillSeed, fillBytes: this.fillBytes };
  }

  /**
   * Takes a {@link saveState} value (unchecked) back; a malformed one is a SnapshotError naming the field.
   * @internal
   */
  restoreState(value: unknown, path = 'guestClient'): void {
    const o = objectAt(value, path);
    checkVersion(o, path, 1);
    const fillSeed = integerAt(o, 'fillSeed', path, 0, 0xffffffff);
    this.fillBytes = integerAt(o, 'fillBytes', path, 0, Number.MAX_SAFE_INTEGER);
    this.fillSeed = fillSeed;
  }

  /** Fills the working set with `sizeMiB` MiB of content (replacing the previous one). */
  async fill(options: FillOptions): Promise<{ bytes: number } & ProbeTiming> {
    const bytes = pageMiBOption('sizeMiB', options.sizeMiB);
    const seed = u32Option('seed', options.seed ?? 1);
    if (!isProbeContent(options.content)) throw new InvalidOptionError('content', `expected one of ${PROBE_CONTENTS.map((c) => JSON.stringify(c)).join(', ')}`);
    const p = Buffer.alloc(16);
    p.writeBigUInt64LE(BigInt(bytes), 0);
    p.writeUInt32LE(PROBE_CONTENT_CODES[options.content], 8);
    p.writeUInt32LE(seed, 12);
    const r = await this.agent.request(ProbeOp.Fill, p);
    this.fillSeed = seed;
    this.fillBytes = bytes;
    return { bytes: readU64(r, 0), tscCycles: readU64(r, 8) };
  }

  /** Rewrites a fraction of the working set's pages with new content. */
  async rewrite(options: RewriteOptions): Promise<{ pagesRewritten: number } & ProbeTiming> {
    if (!(options.fraction >= 0 && options.fraction <= 1)) throw new InvalidOptionError('fraction', 'expected a number from 0 to 1');
    const p = Buffer.alloc(8);
    p.writeUInt32LE(Math.round(options.fraction * 1000), 0);
    p.writeUInt32LE(u32Option('seed', options.seed ?? (this.fillSeed + 1) >>> 0), 4);
    const r = await this.agent.request(ProbeOp.Rewrite, p);
    return { pagesRewritten: readU64(r, 0), tscCycles: readU64(r, 8) };
  }

  /**
   * Writes zeros over a range of the working set, as a program that clears its buffers does: the
   * pages stay the guest's (they are not reported free), and must read back as zero whatever the
   * host did with them meanwhile.
   */
  async zero(options: ZeroOptions): Promise<{ bytes: number } & ProbeTiming> {
    const p = Buffer.alloc(16);
    p.writeBigUInt64LE(BigInt(pageMiBOption('offsetMiB', options.offsetMiB)), 0);
    p.writeBigUInt64LE(BigInt(pageMiBOption('sizeMiB', options.sizeMiB)), 8);
    const r = await this.agent.request(ProbeOp.Zero, p);
    return { bytes: readU64(r, 0), tscCycles: readU64(r, 8) };
  }

  /** Reads every page of the hot part of the working set `rounds` times. */
  async touch(options: TouchOptions): Promise<{ pagesTouched: number } & ProbeTiming> {
    const p = Buffer.alloc(16);
    p.writeBigUInt64LE(BigInt(pageMiBOption('hotMiB', options.hotMiB)), 0);
    p.writeUInt32LE(u32Option('rounds', options.rounds ?? 1), 8);
    const r = await this.agent.request(ProbeOp.Touch, p);
    return { pagesTouched: readU64(r, 0), tscCycles: readU64(r, 8) };
  }

  /** Digest of the working set, computed in the guest. */
  async digest(): Promise<ProbeDigest> {
    const r = await this.agent.request(ProbeOp.Digest);
    // A digest cannot be made up of zeros the way a short count can (readU64): too short is an error.
    if (r.length < 24) throw new GuestRequestError(0, `the guest answered DIGEST with ${r.length} bytes, 24 expected`);
    const h1 = r.readUInt32LE(8);
    const h2 = r.readUInt32LE(12);
    return { bytes: readU64(r, 0), h1, h2, hex: hex32(h2) + hex32(h1), tscCycles: readU64(r, 16) };
  }

  /** Frees a range of the working set in the guest, which reports it to the host as free. */
  async release(options: ReleaseOptions = {}): Promise<{ bytesReported: number }> {
    const offset = pageMiBOption('offsetMiB', options.offsetMiB ?? 0);
    const size = options.sizeMiB === undefined ? this.fillBytes - offset : pageMiBOption('sizeMiB', options.sizeMiB);
    const p = Buffer.alloc(16);
    p.writeBigUInt64LE(BigInt(offset), 0);
    p.writeBigUInt64LE(BigInt(Math.max(0, size)), 8);
    const r = await this.agent.request(ProbeOp.Release, p);
    return { bytesReported: readU64(r, 0) };
  }

  /** Asks the guest to park until the next request (it answers first). */
  async idle(): Promise<void> {
    await this.agent.request(ProbeOp.Idle);
  }

  /**
   * Makes the guest write `count` times to a doorbell register the VMM ignores: every write is a VM exit, so
   * this measures the vCPU loop (`pvisor bench vmm`).
   * @internal
   */
  async exitStorm(count: number): Promise<{ exits: number } & ProbeTiming> {
    const p = Buffer.alloc(4);
    p.writeUInt32LE(u32Option('count', count), 0);
    const r = await this.agent.request(ProbeOp.ExitStorm, p);
    return { exits: readU64(r, 0), tscCycles: readU64(r, 8) };
  }

  /**
   * Makes the guest misbehave on purpose, to test isolation: `triple-fault`, `stray-mmio` (an
   * address no device owns) or `abort`. The VM ends with a `crash` event; the promise never settles.
   * @internal
   */
  fault(kind: 'triple-fault' | 'stray-mmio' | 'abort'): void {
    const p = Buffer.alloc(4);
    p.writeUInt32LE({ 'triple-fault': 1, 'stray-mmio': 2, abort: 3 }[kind], 0);
    this.agent.request(ProbeOp.Fault, p).catch(() => {});
  }

  /**
   * Makes the guest attack the VMM as a malicious driver or agent would (docs/probe-guest.md,
   * "HOSTILE"), to test that the host stays healthy. Resolves with what the guest saw; a kind that
   * breaks the guest's own channel may instead reject (a typed error) or end the VM.
   * @internal
   */
  async hostile(kind: HostileKind, options: HostileOptions = {}): Promise<HostileResult> {
    const code = HOSTILE_KINDS[kind];
    if (code === undefined) throw new InvalidOptionError('kind', `expected one of ${Object.keys(HOSTILE_KINDS).join(', ')}`);
    const p = Buffer.alloc(24);
    p.writeUInt32LE(code, 0);
    p.writeUInt32LE(u32Option('count', options.count ?? 1), 4);
    const arg1 = kind === 'tx-alias' || kind === 'balloon-alias' ? u32Option('descriptors', options.descriptors ?? 256) : options.queue === 'balloon-reporting' ? 1 : 0;
    p.writeBigUInt64LE(BigInt(arg1), 8);
    p.writeBigUInt64LE(BigInt(u32Option('descriptorBytes', options.descriptorBytes ?? 4096)), 16);
    const r = await this.agent.request(ProbeOp.Hostile, p, options.timeoutMs === undefined ? {} : { timeoutMs: options.timeoutMs });
    return { counts: [readU64(r, 0), readU64(r, 8), readU64(r, 16)], tscCycles: readU64(r, 24), payload: r };
  }
}

/**
 * The byte at `i` of `frame-bytewise`'s payload (docs/probe-guest.md).
 * @internal
 */
export function hostileBytewiseByte(i: number): number {
  return (i + (i >>> 8)) & 0xff;
}



function readU64(b: Buffer, off: number): number {
  return b.length >= off + 8 ? Number(b.readBigUInt64LE(off)) : 0;
}

function hex32(v: number): string {
  return v.toString(16).padStart(8, '0');
}
