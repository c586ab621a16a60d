// Offload's options are checked when it is made, before any VM exists. No KVM needed.
import { InvalidOptionError, Offload, type MemoryStrategy } from '../../src';
import { planComposition } from '../../src/memory/composition';

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
});
