import { IdleRelease, KsmAdvice, StrategyConflictError, type MemoryStrategy } from '../../src';
import { validateComposition } from '../../src/memory/strategy';

// A strategy as a future file-backed one (offload, snapshot) declares itself: pure data here.
const fileBacked = (name: string): MemoryStrategy => ({ name, ramBacking: 'file', exclusive: ['ram-backing'], stats: () => ({ strategy: name, figures: {}, notes: [] }) });

describe('memory strategy composition', () => {
  it('accepts strategies that can work together', () => {
    expect(() => validateComposition([new KsmAdvice(), new IdleRelease()])).not.toThrow();
    expect(() => validateComposition([fileBacked('offload'), new IdleRelease()])).not.toThrow();
  });

  it('names both strategies when they cannot', () => {
    const conflict = (list: MemoryStrategy[]) => {
      try {
        validateComposition(list);
      } catch (e) {
        return e as StrategyConflictError;
      }
      throw new Error('no conflict found');
    };
    const twice = conflict([new IdleRelease(), new IdleRelease()]);
    expect(twice).toBeInstanceOf(StrategyConflictError);
    expect(twice.message).toMatch(/idle-release and idle-release .* given twice/);
    const backing = conflict([new KsmAdvice(), fileBacked('offload')]);
    expect(backing.strategies).toEqual(['ksm-advice', 'offload']);
    expect(backing.message).toMatch(/ksm-advice needs private-anonymous guest RAM, offload needs file/);
    expect(conflict([fileBacked('offload'), fileBacked('shared-snapshot')]).message).toMatch(/both drive ram-backing/);
  });
});
