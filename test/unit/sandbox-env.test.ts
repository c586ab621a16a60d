// The sandbox-wide environment (Vm.start's env) is checked and bounded before anything starts,
// and goes under each command's own env: pure logic.
import { InvalidOptionError } from '../../src';
import { MAX_SANDBOX_ENV_BYTES, mergeEnvironment, parseEnvironment } from '../../src/guest/environment';

describe('sandbox-wide env', () => {
  it('a good one comes back equal and frozen; none is {}', () => {
    const env = parseEnvironment('env', { LANG: 'C.UTF-8', EMPTY: '' });
    expect(env).toEqual({ LANG: 'C.UTF-8', EMPTY: '' });
    expect(Object.isFrozen(env)).toBe(true);
    expect(parseEnvironment('env', undefined)).toEqual({});
  });

  it.each([
    ['an array', ['A=1'], /env: expected an object/],
    ['an empty name', { '': 'x' }, /env: bad variable name ""/],
    ['a name with =', { 'A=B': 'x' }, /bad variable name "A=B"/],
    ['a number as a value', { A: 1 }, /env\.A: a variable's value is a string, got number/],
    ['a NUL in a value', { A: 'x\0y' }, /env\.A: must not contain NUL/],
    ['more than 64 KiB', { A: 'x'.repeat(MAX_SANDBOX_ENV_BYTES) }, /more than 65536 bytes of variables/],
  ])('%s is refused', (_, value, message) => {
    expect(() => parseEnvironment('env', value)).toThrow(InvalidOptionError);
    expect(() => parseEnvironment('env', value)).toThrow(message);
  });

  it("a command's own env overrides the sandbox's, which fills in the rest", () => {
    const sandbox = parseEnvironment('env', { A: 'sandbox', B: 'sandbox' });
    expect(mergeEnvironment(sandbox, { B: 'own', C: 'own' })).toEqual({ A: 'sandbox', B: 'own', C: 'own' });
    expect(mergeEnvironment(sandbox, undefined)).toEqual({ A: 'sandbox', B: 'sandbox' });
    expect(sandbox).toEqual({ A: 'sandbox', B: 'sandbox' }); // untouched
  });
});
