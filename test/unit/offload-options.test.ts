// Offload's options are checked when it is made, before any VM exists. No KVM needed.
import { CompressedOffload, InvalidOptionError, Offload, type MemoryStrategy } from '../../src';
import { planComposition } from '../../src/memory/composition';
import { hotFirst } from '../../src/memory/strategies/offload';

// A strategy that serves missing pages itself, as cold compression will.
const uffdUser: MemoryStrategy = { name: 'cold-compression', needs: ['userfaultfd-missing'], exclusive: [], stats: () => ({ strategy: 'cold-compression', figures: {}, notes: [] }) };

describe('Offload options', () => {
  it('reloads eagerly unless told otherwise, and says so in its figures', () => {
    expect(new Offload().reload).toBe('eager');
    expect(new Offload({ reload: 'lazy' }).reload).toBe('lazy');
    const st = new Offload({ reload: 'lazy' }).stats();
    expect(st.figures.reloadLazy).toBe(1);
    expect(st.notes).toContain('reload: lazy');
    expect(st.figures.lastFullLoadMs).toBeUndefined();
  });

  it('refuses an unknown reload mode with a typed error', () => {
    expect(() => new Offload({ reload: 'later' as never })).toThrow(InvalidOptionError);
    expect(() => new Offload({ reload: 'later' as never })).toThrow(/reload: expected "eager" or "lazy", got "later"/);
  });

  it('lazy reload shares the VM\'s userfaultfd server with other strategies that serve missing pages', () => {
    expect(new Offload({ reload: 'lazy' }).needs).toContain('userfaultfd-missing');
    expect(() => planComposition([new Offload({ reload: 'lazy' }), uffdUser])).not.toThrow();
  });

  it('prefetches the pieces the guest touched first last time first, each once, then the rest in address order', () => {
    const M = 2 ** 20;
    const pieces = [0, 2, 4, 6, 8].map((m) => ({ offset: m * M, length: 2 * M }));
    expect(hotFirst(pieces, [])).toEqual([0, 1, 2, 3, 4]);
    // 5 MiB is in piece 2, 9 MiB in piece 4, 5.5 MiB again in piece 2, 100 MiB in none.
    expect(hotFirst(pieces, [5 * M, 9 * M, 5.5 * M, 100 * M])).toEqual([2, 4, 0, 1, 3]);
  });

  it('refuses a prefetch or page cache setting that is not one', () => {
    expect(() => new Offload({ prefetch: 'yes' as never })).toThrow(/prefetch: expected true or false/);
    expect(() => new Offload({ pageCache: 'sometimes' as never })).toThrow(/pageCache: expected "bypass" or "keep"/);
  });

  it('refuses a backing directory or a memory-backed opt-in that is not one, as CompressedOffload does', () => {
    for (const make of [(o: object) => new Offload(o), (o: object) => new CompressedOffload(o)]) {
      expect(() => make({ dir: '' })).toThrow(/dir: expected a directory path/);
      expect(() => make({ allowMemoryBackedDir: 1 })).toThrow(/allowMemoryBackedDir: expected true or false, got 1/);
    }
  });
});
