// A hostile guest on real KVM: the probe's HOSTILE op (docs/probe-guest.md) replays, from inside a
// guest, the queue, frame, balloon and virtio state-machine attacks of a compromised guest kernel,
// while a second VM in the same process keeps answering. For every attack: each of the bystander's
// round trips stays under a bound and its digest is right every time, a 10 ms host timer keeps
// firing, the process's memory stays within a bound, and the hostile VM either answers (keeping
// on with warnings) or ends with a typed error, never the process. Needs /dev/kvm.
import { mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GuestCrashError, GuestRequestError, IdleRelease, Vm } from '../../src';
import { hostileBytewiseByte, type HostileKind, type HostileOptions, type HostileResult } from '../../src/guest/probe-client';
import { hexOf } from '../probe-digest';
import { processThreads } from '../process-threads';

const MiB = 2 ** 20;
// Inside the nested harness (scripts/nested-kvm.sh) every exit and every instruction of the host
// is emulated: deadlines and bounds on time stretch tenfold and the floods are a tenth as long
// (with a quarter, the file took 213 s there, 25 s on kvm_pvm); what is asserted stays the same.
const NESTED = process.env.PVISOR_NESTED === '1';
const SLOW = NESTED ? 10 : 1;
const scaled = (n: number) => (NESTED ? Math.max(1, Math.round(n / 10)) : n);

// Bounds, from the figures this file prints (kvm_pvm, 2 cores, 12 runs of the attacks): the
// bystander's slowest round trip mostly 5-100 ms, at worst 445 ms; the timer mostly under 60 ms
// late, once or twice a run 100-420 ms at some attack (any: this machine is itself a VM whose host
// takes the CPU now and then, and a hostile vCPU spinning on one of the two cores is its right),
// but never more than 2 gaps over 110 ms in one attack; the process at most 64 MiB and its
// arrayBuffers 58 MiB over their size before the attack. What the bounds catch, measured with the
// virtqueue budget counting chains instead of descriptors: tx-alias (2048 chains) held the loop
// 220-305 ms per notification, 7-8 gaps over 110 ms; balloon-alias 1.4-2.9 s in one.
const ROUND_TRIP_MS = 1000 * SLOW;
const TIMER_LATE_MS = 1000 * SLOW;
/** Gaps between the timer's firings longer than this... */
const LONG_GAP_MS = 110 * SLOW;
/** ...at most this many per attack. */
const LONG_GAPS = 3;
const HOST_GROWTH_MIB = 192;
const ARRAY_BUFFERS_GROWTH_MIB = 160;

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** What went on in the process while an attack ran. */
interface Health {
  roundTrips: number;
  maxRoundTripMs: number;
  wrongDigests: number;
  maxTimerLateMs: number;
  /** Gaps between the timer's firings longer than {@link LONG_GAP_MS}. */
  longGaps: number;
  peakRssGrowthMiB: number;
  peakArrayBuffersGrowthMiB: number;
}

/**
 * Keeps the bystander answering digests back to back and a 10 ms timer sampling the process's
 * memory until `stop`, which resolves with what was seen.
 */
function watch(bystander: Vm, expectedHex: string): { stop(): Promise<Health> } {
  const base = process.memoryUsage();
  const h: Health = { roundTrips: 0, maxRoundTripMs: 0, wrongDigests: 0, maxTimerLateMs: 0, longGaps: 0, peakRssGrowthMiB: 0, peakArrayBuffersGrowthMiB: 0 };
  let last = performance.now();
  const timer = setInterval(() => {
    const now = performance.now();
    h.maxTimerLateMs = Math.max(h.maxTimerLateMs, now - last - 10);
    if (now - last > LONG_GAP_MS) h.longGaps++;
    last = now;
    const m = process.memoryUsage();
    h.peakRssGrowthMiB = Math.max(h.peakRssGrowthMiB, (m.rss - base.rss) / MiB);
    h.peakArrayBuffersGrowthMiB = Math.max(h.peakArrayBuffersGrowthMiB, (m.arrayBuffers - base.arrayBuffers) / MiB);
  }, 10);
  let stopped = false;
  const loop = (async () => {
    while (!stopped) {
      const t0 = performance.now();
      const d = await bystander.probe.digest();
      h.maxRoundTripMs = Math.max(h.maxRoundTripMs, performance.now() - t0);
      h.roundTrips++;
      if (d.hex !== expectedHex) h.wrongDigests++;
    }
  })();
  return {
    async stop() {
      stopped = true;
      await loop;
      clearInterval(timer);
      return h;
    },
  };
}

interface Attack {
  kind: HostileKind;
  options?: HostileOptions;
  /** The hostile VM answers the op, its request fails with a typed error, or the VM ends. */
  outcome: 'answers' | 'refused' | 'ends';
  /** Before the attack, on the hostile VM. */
  prepare?: (vm: Vm) => Promise<void>;
  /** What the guest saw, the warnings the host gave (at most a few thousand kept), the VM after. */
  check?: (r: HostileResult | Error, warnings: string[], vm: Vm) => Promise<void> | void;
}

const ALL_SET_UP = 15; // ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK
const NEEDS_RESET = 64;
const count = (warnings: string[], re: RegExp) => warnings.filter((w) => re.test(w)).length;
const result = (r: HostileResult | Error) => {
  if (r instanceof Error) throw r;
  return r;
};

const ATTACKS: Attack[] = [
  {
    // One chain of 256 descriptors over the same 32 MiB, 2048 times: 8 GiB claimed per chain.
    kind: 'tx-alias',
    options: { count: scaled(2048), descriptors: 256, descriptorBytes: 32 * MiB },
    outcome: 'answers',
    check: (r, w) => {
      expect(result(r).counts).toEqual([scaled(2048), scaled(2048), ALL_SET_UP]);
      expect(count(w, /^virtio-console: transmit chain 0 carries 8589934592 bytes, more than \d+: refused$/)).toBe(scaled(2048));
    },
  },
  {
    // 256 x 4 KiB over the same page: exactly the 1 MiB + 4 KiB a chain may carry, 256 times.
    kind: 'tx-alias',
    options: { count: scaled(256), descriptors: 256, descriptorBytes: 4096 },
    outcome: 'answers',
    check: (r, w) => {
      expect(result(r).counts).toEqual([scaled(256), scaled(256), ALL_SET_UP]);
      expect(count(w, /refused/)).toBe(0);
      expect(count(w, /^agent protocol: bad frame magic$/)).toBe(scaled(256)); // the page is zeros
    },
  },
  {
    // 256 reports of 256 descriptors, each the same 32 MiB: 65,536 madvise calls.
    kind: 'balloon-alias',
    options: { count: scaled(256), descriptors: 256, descriptorBytes: 32 * MiB },
    outcome: 'answers',
    check: (r, _w, vm) => {
      expect(result(r).counts).toEqual([scaled(256), scaled(256), ALL_SET_UP]);
      const figures = vm.memoryUsage().strategies.find((s) => s.strategy === 'idle-release')!.figures;
      expect(figures.reports).toBe(scaled(256) * 256); // every report was taken, none dropped
    },
  },
  {
    kind: 'tx-malformed',
    options: { count: scaled(100) },
    outcome: 'answers',
    check: (r, w) => {
      const n = scaled(100);
      expect(result(r).counts).toEqual([7 * n, 6 * n, ALL_SET_UP]);
      expect(count(w, /chain (0|2): descriptor chain loops/)).toBe(2 * n);
      expect(count(w, /chain 3: next 65535 out of range/)).toBe(n);
      expect(count(w, /chain 4: indirect descriptors were not negotiated/)).toBe(n);
      expect(count(w, /chain (5|6): buffer 0x(c0000000\+4096|10000000000\+1) outside guest RAM/)).toBe(2 * n);
      expect(count(w, /descriptor head 65535 out of range/)).toBe(n);
    },
  },
  {
    kind: 'avail-jump',
    options: { count: 1000, queue: 'console-transmit' },
    outcome: 'answers',
    check: (r, w) => {
      expect(result(r).counts).toEqual([1000, 0, ALL_SET_UP | NEEDS_RESET]);
      expect(count(w, /^virtio device 3 needs a reset: queue 1: available index \d+ is 1000 ahead/)).toBe(1);
    },
  },
  {
    kind: 'avail-jump',
    options: { count: 1000, queue: 'balloon-reporting' },
    outcome: 'answers',
    check: async (r, w, vm) => {
      expect(result(r).counts).toEqual([1000, 0, ALL_SET_UP | NEEDS_RESET]);
      expect(count(w, /^virtio device 5 needs a reset: queue 2: available index 1000 is 1000 ahead/)).toBe(1);
      // The balloon, reset and set up again by the guest, reports again.
      await vm.probe.fill({ sizeMiB: 4, content: 'random' });
      expect((await vm.probe.release({ sizeMiB: 4 })).bytesReported).toBe(4 * MiB);
    },
  },
  {
    kind: 'notify-flood',
    options: { count: scaled(20000) },
    outcome: 'answers',
    check: (r) => expect(result(r).counts).toEqual([scaled(20000), 0, 0]),
  },
  {
    kind: 'chain-flood',
    options: { count: scaled(20000) },
    outcome: 'answers',
    check: (r, w) => {
      expect(result(r).counts).toEqual([scaled(20000), 0, 0]);
      expect(w).toEqual([]); // events of an unknown op are not an error
    },
  },
  {
    kind: 'frame-garbage',
    options: { count: scaled(300) },
    outcome: 'answers',
    check: (r, w) => {
      const n = scaled(300);
      expect(result(r).counts).toEqual([7 * n, 0, 0]);
      // Each bad piece costs one warning and the decoder is in step again at the next chain: the
      // event split over two chains after them costs none.
      expect(count(w, /^agent protocol: bad frame magic$/)).toBe(2 * n);
      expect(count(w, /^agent protocol: unsupported protocol version 2$/)).toBe(n);
      expect(count(w, /^agent protocol: payload length (4294967295|1048577) exceeds 1048576$/)).toBe(2 * n);
      expect(w).toHaveLength(5 * n);
    },
  },
  {
    kind: 'frame-bytewise',
    options: { count: scaled(256 * 1024) },
    outcome: 'answers',
    check: (r) => {
      const { payload } = result(r);
      const expected = Buffer.alloc(scaled(256 * 1024));
      for (let i = 0; i < expected.length; i++) expected[i] = hostileBytewiseByte(i);
      expect(payload.equals(expected)).toBe(true);
    },
  },
  {
    kind: 'frame-foreign-ids',
    outcome: 'answers',
    check: async (r, w, vm) => {
      expect(result(r).counts).toEqual([14, 0, 0]);
      for (const id of [0, 4294967295, 2147483647]) expect(count(w, new RegExp(`^agent protocol: guest error for request ${id}: `))).toBe(1);
      // The forged text arrives cut, its terminal escapes and line breaks made harmless.
      const forged = w.find((m) => m.startsWith('agent protocol: guest error for request 2147483646: '))!;
      expect(forged).toMatch(/\?\[2J\?\]0;pvisor\?\?host: all VMs healthy\?A+\.\.\. \(4076 bytes\)$/);
      expect(forged.length).toBeLessThan(1100);
      expect(w.join('\n')).not.toMatch(/[\x00-\x09\x0b-\x1f\x7f]/);
      // The answer for the next id, sent before it was asked, was dropped: the next request gets its own.
      await vm.probe.fill({ sizeMiB: 1, content: 'random', seed: 8 });
      expect((await vm.probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 8, sizeBytes: MiB, rewrites: [] }));
    },
  },
  {
    kind: 'frame-unknown-type',
    options: { count: 9 },
    outcome: 'refused',
    check: (e, w) => {
      expect(e).toBeInstanceOf(GuestRequestError);
      expect((e as Error).message).toMatch(/frame of type 9, which is not an answer/);
      expect(count(w, /^agent protocol: frame of type 9 for request \d+$/)).toBe(1);
    },
  },
  {
    kind: 'balloon-ranges',
    outcome: 'answers',
    prepare: (vm) => vm.probe.fill({ sizeMiB: 2, content: 'random', seed: 5 }).then(() => {}),
    check: async (r, w, vm) => {
      expect(result(r).counts).toEqual([13, 13, ALL_SET_UP]);
      expect(count(w, /^virtio-balloon: chain \d+: buffer 0x[0-9a-f]+\+\d+ outside guest RAM$/)).toBe(7);
      expect(count(w, /^virtio-balloon: chain \d+: indirect descriptors were not negotiated$/)).toBe(1);
      expect(count(w, /^virtio-balloon: report 0x(400001|400800)\+\d+: .*not page-aligned/)).toBe(2);
      // The unaligned reports inside the working set's first pages dropped nothing of it.
      expect((await vm.probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 5, sizeBytes: 2 * MiB, rewrites: [] }));
    },
  },
  {
    kind: 'balloon-self',
    outcome: 'ends',
    check: (e) => {
      expect(e).toBeInstanceOf(GuestCrashError);
    },
  },
  {
    kind: 'virtio-state',
    outcome: 'answers',
    check: (r, w) => {
      expect(result(r).counts).toEqual([11, 0x7ff, ALL_SET_UP]);
      expect(count(w, /^virtio device 5: DRIVER_OK without FEATURES_OK/)).toBe(1);
      expect(count(w, /^virtio device 5: the driver cleared status bits 0x8 without a reset; ignored$/)).toBe(1);
      expect(count(w, /^virtio device 5: queue 0 (rings are not aligned|size 3 is not|size 65536 is not)/)).toBe(3);
      expect(count(w, /^virtio device 5: virtqueue rings lie outside guest RAM$/)).toBe(1);
    },
  },
  {
    kind: 'live-requeue',
    outcome: 'answers',
    prepare: (vm) => vm.probe.fill({ sizeMiB: 1, content: 'random', seed: 6 }).then(() => {}),
    check: async (r, w, vm) => {
      // The device kept its rings and its status; the answer came through them.
      expect(result(r).counts).toEqual([23, 0, ALL_SET_UP]);
      expect(count(w, /^virtio device 3: the driver cleared status bits 0xe without a reset; ignored$/)).toBe(1);
      // And the VM can still be snapshotted and restored (a live device without DRIVER_OK could not).
      const dir = mkdtempSync(join(tmpdir(), 'pvisor-hostile-'));
      try {
        await vm.snapshot(join(dir, 'snap'));
        const clone = await Vm.restore(join(dir, 'snap'));
        try {
          expect((await clone.probe.digest()).hex).toBe(hexOf({ content: 'random', seed: 6, sizeBytes: MiB, rewrites: [] }));
        } finally {
          await clone.stop();
        }
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    },
  },
];

describe('a hostile guest, from inside, against the host and a second VM', () => {
  const bystanderWs = { content: 'random' as const, seed: 77, sizeBytes: 2 * MiB, rewrites: [] };
  let bystander: Vm;
  let bystanderHex: string;
  let threadsBefore: number;
  let fdsBefore: number;
  const figures: string[] = [];

  beforeAll(async () => {
    bystander = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1, name: 'bystander' });
    await bystander.probe.fill({ sizeMiB: 2, content: 'random', seed: 77 });
    bystanderHex = hexOf(bystanderWs);
    expect((await bystander.probe.digest()).hex).toBe(bystanderHex);
    threadsBefore = processThreads();
    fdsBefore = readdirSync('/proc/self/fd').length;
  });
  afterAll(async () => {
    await bystander?.stop();
    if (figures.length) console.log(`hostile guest figures (attack, bystander's round trips and slowest, timer's latest and long gaps, RSS and arrayBuffers growth):\n${figures.join('\n')}`);
  });

  it.each(ATTACKS.map((a) => [`${a.kind}${a.options ? ` ${JSON.stringify(a.options)}` : ''}`, a] as const))('%s', async (_name, attack) => {
    // Every warning, to count what each attack caused (the default limit is tested below).
    const hostile = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1, strategies: [new IdleRelease()], name: `hostile-${attack.kind}`, warningLimit: { burst: Infinity, perSecond: Infinity } });
    const warnings: string[] = [];
    hostile.on('warning', (m) => {
      if (warnings.length < 10_000) warnings.push(m);
    });
    let crash: Error | undefined;
    hostile.on('crash', (e) => (crash = e));
    try {
      await attack.prepare?.(hostile);
      const health = watch(bystander, bystanderHex);
      const t0 = performance.now();
      const r = await hostile.probe.hostile(attack.kind, { ...attack.options, timeoutMs: 60_000 * SLOW }).catch((e: Error) => e);
      const ms = performance.now() - t0;
      await sleep(50); // work the device continues in later turns of the event loop
      const h = await health.stop();
      figures.push(`${attack.kind.padEnd(18)} ${ms.toFixed(0).padStart(5)} ms  ${String(h.roundTrips).padStart(5)} trips  ${h.maxRoundTripMs.toFixed(1).padStart(6)} ms  ${h.maxTimerLateMs.toFixed(1).padStart(6)} ms  ${String(h.longGaps).padStart(2)} gaps  ${h.peakRssGrowthMiB.toFixed(1).padStart(5)} MiB  ${h.peakArrayBuffersGrowthMiB.toFixed(1).padStart(5)} MiB  ${warnings.length} warnings`);

      // The host: the bystander answered, right, every time, in time; the loop and memory held.
      expect(h.roundTrips).toBeGreaterThan(0);
      expect(h.wrongDigests).toBe(0);
      expect(h.maxRoundTripMs).toBeLessThan(ROUND_TRIP_MS);
      expect(h.maxTimerLateMs).toBeLessThan(TIMER_LATE_MS);
      expect(h.longGaps).toBeLessThanOrEqual(LONG_GAPS);
      expect(h.peakRssGrowthMiB).toBeLessThan(HOST_GROWTH_MIB);
      expect(h.peakArrayBuffersGrowthMiB).toBeLessThan(ARRAY_BUFFERS_GROWTH_MIB);

      // The hostile VM: as expected for the attack, and typed.
      if (attack.outcome === 'answers') expect(r).not.toBeInstanceOf(Error);
      if (attack.outcome === 'refused') expect(r).toBeInstanceOf(GuestRequestError);
      if (attack.outcome === 'ends') {
        expect(r).toBeInstanceOf(GuestCrashError);
        expect(crash).toBe(r);
        expect(hostile.state).toBe('crashed');
      } else {
        expect(crash).toBeUndefined();
        expect(hostile.state).toBe('running');
      }
      await attack.check?.(r, warnings, hostile);
      if (attack.outcome !== 'ends') {
        // It keeps running, with warnings: it still works.
        await hostile.probe.fill({ sizeMiB: 1, content: 'repetitive', seed: 9 });
        expect((await hostile.probe.digest()).hex).toBe(hexOf({ content: 'repetitive', seed: 9, sizeBytes: MiB, rewrites: [] }));
      }
    } finally {
      await hostile.stop();
    }
  }, 120_000 * SLOW);

  it('by default the warnings a guest causes reach listeners 20 at once, then 2 a second, and what was dropped is counted', async () => {
    const hostile = await Vm.start({ guest: 'probe', memory: '64MiB', vcpus: 1, name: 'hostile-warnings' });
    const got: string[] = [];
    hostile.on('warning', (m) => got.push(m));
    try {
      const n = scaled(100);
      const t0 = performance.now();
      const r = await hostile.probe.hostile('tx-malformed', { count: n, timeoutMs: 60_000 * SLOW });
      expect(r.counts[0]).toBe(7 * n);
      const isCount = (m: string) => /^\d+ more warnings? dropped over [\d.]+ s \(at most 20 at once, then 2 a second/.test(m);
      const accounted = () => got.filter((m) => !isCount(m)).length + got.filter(isCount).reduce((sum, m) => sum + Number(m.split(' ')[0]), 0);
      // The count of what was dropped comes once the limit allows again (within a second or two).
      for (let i = 0; i < 60 && accounted() < 7 * n; i++) await sleep(50);
      const seconds = (performance.now() - t0) / 1000;
      const summaries = got.filter(isCount);
      const dropped = summaries.reduce((sum, m) => sum + Number(m.split(' ')[0]), 0);
      // The attack causes 7 warnings a round (see tx-malformed above): each one emitted or counted.
      expect(got.length - summaries.length + dropped).toBe(7 * n);
      expect(summaries.length).toBeGreaterThan(0);
      expect(got.length).toBeLessThanOrEqual(20 + Math.ceil(2 * seconds) + 1);
      figures.push(`default warning limit: ${7 * n} warnings caused in ${seconds.toFixed(1)} s, ${got.length} emitted (${summaries.length} of them counts of the dropped)`);
    } finally {
      await hostile.stop();
    }
  });

  it("the bystander's working set is intact, and the hostile VMs left no thread or fd behind", async () => {
    expect((await bystander.probe.digest()).hex).toBe(bystanderHex);
    await sleep(50); // a stopped VM's socket handle closes on the next tick
    expect(processThreads()).toBe(threadsBefore);
    expect(readdirSync('/proc/self/fd').length).toBeLessThanOrEqual(fdsBefore + 1); // Node may open its own once
  });
});
