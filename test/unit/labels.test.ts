// Labels are checked and bounded where they are given (Vm.start, --label) and where they are read
// back from another process: pure logic.
import { InvalidOptionError } from '../../src';
import { formatLabels, labelsFromText, matchesLabels, MAX_LABELS, parseLabels } from '../../src/labels';

describe('labels', () => {
  it('a good set comes back equal and frozen; none is {}', () => {
    const l = parseLabels('labels', { team: 'search', 'app.kubernetes.io/name': 'x', n0: '' });
    expect(l).toEqual({ team: 'search', 'app.kubernetes.io/name': 'x', n0: '' });
    expect(Object.isFrozen(l)).toBe(true);
    expect(parseLabels('labels', undefined)).toEqual({});
  });

  it.each([
    ['an array', ['a=b'], /labels: expected an object/],
    ['null', null, /labels: expected an object/],
    ['a string', 'team=a', /labels: expected an object/],
    ['an empty key', { '': 'x' }, /labels\.: a label key is 1-63/],
    ['a key with a space', { 'a b': 'x' }, /a label key/],
    ['a key beginning with a dot', { '.a': 'x' }, /a label key/],
    ['__proto__ as a key', JSON.parse('{"__proto__": "x"}'), /a label key/],
    ['a key of 64 characters', { ['k'.repeat(64)]: 'x' }, /a label key/],
    ['a number as a value', { a: 1 }, /labels\.a: a label's value is a string, got number/],
    ['a value of 257 characters', { a: 'v'.repeat(257) }, /labels\.a: 257 characters; a label's value has at most 256/],
    ['a newline in a value', { a: 'x\ny' }, /no control characters/],
    ['65 labels', Object.fromEntries(Array.from({ length: MAX_LABELS + 1 }, (_, i) => [`k${i}`, 'v'])), /65 labels; at most 64/],
  ])('%s is refused, naming the label', (_, value, message) => {
    expect(() => parseLabels('labels', value)).toThrow(InvalidOptionError);
    expect(() => parseLabels('labels', value)).toThrow(message);
  });

  it('64 labels of 63-character keys and 256-character values are the most, and allowed', () => {
    const most = Object.fromEntries(Array.from({ length: MAX_LABELS }, (_, i) => [`${String(i).padStart(2, '0')}${'k'.repeat(61)}`, 'v'.repeat(256)]));
    expect(Object.keys(parseLabels('labels', most))).toHaveLength(64);
  });

  it('KEY=VALUE words (--label): the value may hold "="; a missing key, no "=" or a key given twice is refused', () => {
    expect(labelsFromText('--label', ['a=1', 'b=x=y', 'c='])).toEqual({ a: '1', b: 'x=y', c: '' });
    expect(() => labelsFromText('--label', ['a'])).toThrow(/--label: expected KEY=VALUE, got "a"/);
    expect(() => labelsFromText('--label', ['=v'])).toThrow(/expected KEY=VALUE/);
    expect(() => labelsFromText('--label', ['a=1', 'a=2'])).toThrow(/--label: a is given twice/);
    expect(() => labelsFromText('--label', ['a b=1'])).toThrow(/a label key/);
  });

  it('matching needs every wanted label with the same value; the table prints k=v,k2=v2 or -', () => {
    const l = parseLabels('labels', { team: 'a', env: 'prod' });
    expect(matchesLabels(l, {})).toBe(true);
    expect(matchesLabels(l, { team: 'a' })).toBe(true);
    expect(matchesLabels(l, { team: 'a', env: 'dev' })).toBe(false);
    expect(matchesLabels(l, { owner: 'a' })).toBe(false);
    // An inherited property is not a label.
    expect(matchesLabels(l, { constructor: Object.prototype.constructor as unknown as string })).toBe(false);
    expect(formatLabels(l)).toBe('team=a,env=prod');
    expect(formatLabels({})).toBe('-');
  });
});
