// Offload's options are checked when it is made, before any VM exists. No KVM needed.
import { InvalidOptionError, Offload, StrategyConflictError, type MemoryStrategy } from '../../src';
import { validateComposition } from '../../src/memory/strategy';

// A strategy that serves userfaultfd faults itself, as cold compression will.
const uffdUser: MemoryStrategy = { name: 'cold-compression', ramBacking: 'any', exclusive: ['userfaultfd'], stats: () => ({ strategy: 'cold-compression', figures: {}, notes: [] }) };

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

  it('lazy reload drives userfaultfd, so it cannot share guest RAM with another userfaultfd user', () => {
    expect(() => validateComposition([new Offload(), uffdUser])).not.toThrow();
    expect(() => validateComposition([new Offload({ reload: 'lazy' }), uffdUser])).toThrow(StrategyConflictError);
    expect(() => validateComposition([new Offload({ reload: 'lazy' }), uffdUser])).toThrow(/both drive userfaultfd/);
  });
});
