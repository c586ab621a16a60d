// The memory layer checks a composition before anything is allocated: pure logic, no KVM.
import { ColdCompression, CompressedOffload, IdleRelease, KsmAdvice, Offload, StrategyConflictError, type MemoryStrategy } from '../../src';
import type { RamBackingRequest } from '../../src/strategy';
import { MemoryComposition, nextTickDelayMs, planComposition } from '../../src/memory/composition';

// Strategies as a snapshot or pool strategy declares itself: pure data here.
const providing = (name: string, ramBacking: RamBackingRequest): MemoryStrategy => ({ name, needs: [], exclusive: [], ramBacking, stats: () => ({ strategy: name, figures: {}, notes: [] }) });
const privateFile = providing('shared-snapshot', { kind: 'private-file', path: '/snapshots/ram' });
const memfd = providing('memfd-ram', { kind: 'memfd' });

function conflict(list: MemoryStrategy[]): StrategyConflictError {
  try {
    planComposition(list);
  } catch (e) {
    return e as StrategyConflictError;
  }
  throw new Error('no conflict found');
}

describe('memory strategy composition', () => {
  it('accepts strategies that can work together, on the backing one of them provides', () => {
    expect(planComposition([new KsmAdvice(), new IdleRelease()])).toEqual({ kind: 'anonymous' });
    expect(planComposition([new KsmAdvice(), new IdleRelease(), new Offload({ reload: 'lazy' })])).toEqual({ kind: 'anonymous' });
    expect(planComposition([privateFile, new IdleRelease(), new KsmAdvice(), new Offload()])).toEqual({ kind: 'private-file', path: '/snapshots/ram' });
    expect(planComposition([memfd, new Offload({ reload: 'lazy' }), new IdleRelease()])).toEqual({ kind: 'memfd' });
  });

  it('names both strategies when they cannot', () => {
    const twice = conflict([new IdleRelease(), new IdleRelease()]);
    expect(twice).toBeInstanceOf(StrategyConflictError);
    expect(twice.message).toMatch(/idle-release and idle-release .* given twice/);
    expect(conflict([new Offload(), new CompressedOffload()]).message).toMatch(/both drive suspend-image/);
    expect(conflict([privateFile, memfd]).message).toMatch(/both provide guest RAM's backing/);
  });

  it('refuses a strategy whose needs the chosen backing does not offer, naming the provider', () => {
    const lazy = conflict([privateFile, new Offload({ reload: 'lazy' })]);
    expect(lazy.strategies).toEqual(['shared-snapshot', 'offload']);
    expect(lazy.message).toMatch(/offload needs userfaultfd-missing, which guest RAM mapped privately from \/snapshots\/ram \(from shared-snapshot\) does not offer/);
    const ksm = conflict([new KsmAdvice(), memfd]);
    expect(ksm.strategies).toEqual(['memfd-ram', 'ksm-advice']);
    expect(ksm.message).toMatch(/ksm-advice needs ksm-mergeable/);
    // A memfd's dropped page stays in its file; a private file mapping has no userfaultfd.
    expect(conflict([memfd, new ColdCompression()]).message).toMatch(/cold-compression needs userfaultfd-write-protect, which memfd-backed guest RAM \(from memfd-ram\) does not offer/);
    expect(conflict([new ColdCompression(), privateFile]).strategies).toEqual(['shared-snapshot', 'cold-compression']);
  });

  it('sends free-page reports to the strategy that drives them first, then to those that listen', () => {
    const heard: string[] = [];
    const listener = (name: string, exclusive: MemoryStrategy['exclusive']): MemoryStrategy => ({ name, needs: [], exclusive, freePagesReported: () => heard.push(name), stats: () => ({ strategy: name, figures: {}, notes: [] }) });
    const composition = new MemoryComposition([listener('listens', []), listener('drives', ['free-page-reporting'])], 'vm', { fail: () => {}, warn: () => {}, withGuestPaused: async (work) => work() });
    composition.attach({ hostAddr: 0, sizeBytes: 0, backing: { kind: 'anonymous' }, hostView: () => Buffer.alloc(0), advise: () => {}, discard: () => {}, discardHost: () => {}, discardHostRuns: () => {}, hostOffset: () => -1, mapFileRuns: () => ({ mapped: 0 }) });
    composition.freePageSink!(0, 4096);
    expect(heard).toEqual(['drives', 'listens']);
    // Without a strategy that drives reporting, the balloon offers none.
    expect(new MemoryComposition([listener('listens', [])], 'vm', { fail: () => {}, warn: () => {}, withGuestPaused: async (work) => work() }).freePageSink).toBeUndefined();
  });

  it('spaces periodic work so that it stays within its CPU share', () => {
    expect(nextTickDelayMs({ intervalMs: 1000, cpuShare: 0.1 }, 5)).toBe(1000); // cheap ticks: the interval
    expect(nextTickDelayMs({ intervalMs: 1000, cpuShare: 0.1 }, 200)).toBe(1800); // 200 of 2000 ms = 10%
    expect(nextTickDelayMs({ intervalMs: 0, cpuShare: 1 }, 50)).toBe(0);
  });
});
