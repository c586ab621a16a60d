import { InvalidOptionError } from '../../src/errors';
import { parseSize } from '../../src/units';

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
