import { InvalidOptionError } from '../../src/errors';
import { booleanOption, elapsedMs, numberOption, parseSize } from '../../src/units';
import { ColdCompression, CompressedOffload, Offload, PoolClient, SharedSnapshot, Vm } from '../../src';

describe('parseSize', () => {
  it.each([
    ['512MiB', 512 * 2 ** 20],
    ['512M', 512 * 2 ** 20],
    ['2GiB', 2 * 2 ** 30],
    ['1g', 2 ** 30],
    ['4096', 4096],
    ['1.5GiB', 1.5 * 2 ** 30],
    ['100MB', 100 * 10 ** 6],
  ])('parses %s', (text, bytes) => {
    expect(parseSize('memory', text)).toBe(bytes);
  });

  it.each(['', 'lots', '12 parsecs', '-1M', '0x100', '1.0000001K'])('rejects %j with a typed error naming the option', (text) => {
    expect(() => parseSize('memory', text)).toThrow(InvalidOptionError);
    expect(() => parseSize('memory', text)).toThrow(/^memory: /);
  });

  it('rejects negative and fractional byte counts', () => {
    expect(() => parseSize('memory', -4096)).toThrow(InvalidOptionError);
    expect(() => parseSize('memory', 1.5)).toThrow(InvalidOptionError);
  });
});

describe('numberOption (the strategies\' numeric options)', () => {
  const inRange = (v: number) => v >= 1 && v <= 99;
  it('gives the fallback when absent and the value when it is accepted', () => {
    expect(numberOption('x', undefined, 25, inRange, 'from 1 to 99')).toBe(25);
    expect(numberOption('x', 50, 25, inRange, 'from 1 to 99')).toBe(50);
  });
  it.each([[0], [100], [NaN], [Infinity], ['50' as unknown as number]])('refuses %p with an error naming the option and what it must be', (v) => {
    expect(() => numberOption('minSavingPercent', v, 25, inRange, 'from 1 to 99')).toThrow(
      new InvalidOptionError('minSavingPercent', `must be from 1 to 99, got ${String(v)}`),
    );
  });
  it('is what ColdCompression and PoolClient check their options with', () => {
    expect(() => new ColdCompression({ minSavingPercent: 0 })).toThrow(/minSavingPercent.*must be from 1 to 99, got 0/);
    expect(() => new PoolClient({ socket: '/nowhere', intervalMs: 5 })).toThrow(/intervalMs.*must be from 100 to 3600000, got 5/);
  });
});

describe('booleanOption (every boolean option)', () => {
  it('gives the fallback when absent and the value when it is true or false', () => {
    expect(booleanOption('x', undefined, true)).toBe(true);
    expect(booleanOption('x', undefined, false)).toBe(false);
    expect(booleanOption('x', false, true)).toBe(false);
    expect(booleanOption('x', true, false)).toBe(true);
  });
  it.each([
    ['yes', '"yes"'], [1, '1'], [0, '0'], [null, 'null'], [{}, 'an object'], [[true], 'an object'], [() => true, 'a function'],
  ])('refuses %p rather than guess from truthiness, naming the option and what came', (v, got) => {
    expect(() => booleanOption('recursive', v, false)).toThrow(new InvalidOptionError('recursive', `expected true or false, got ${got}`));
  });
  it('is what the strategies and Vm.restore check their boolean options with', async () => {
    expect(() => new Offload({ prefetch: 'no' as never })).toThrow(/^prefetch: expected true or false, got "no"$/);
    expect(() => new CompressedOffload({ keepWorkers: 1 as never })).toThrow(/^keepWorkers: expected true or false, got 1$/);
    expect(() => new SharedSnapshot({ verify: 'yes' as never })).toThrow(/^verify: expected true or false, got "yes"$/);
    await expect(Vm.restore('/nonexistent-snapshot', { verify: null as never })).rejects.toThrow(/^verify: expected true or false, got null$/);
  });
});

describe('elapsedMs', () => {
  it('is fractional milliseconds to the microsecond, not the raw float', () => {
    const t0 = performance.now() - 1.23456789;
    const ms = elapsedMs(t0);
    expect(ms).toBeGreaterThanOrEqual(1.234);
    expect(ms).toBeLessThan(1000);
    expect(Number.isInteger(Math.round(ms * 1000 * 1e6) / 1e6)).toBe(true);
    expect(String(ms).split('.')[1]?.length ?? 0).toBeLessThanOrEqual(3);
  });
});
