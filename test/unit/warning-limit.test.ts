// The warning limiter's bucket over a clock the test moves: pure logic.
import { InvalidOptionError } from '../../src';
import { parseWarningLimit, WarningLimiter } from '../../src/warning-limit';

describe('warning limit', () => {
  it('lets 20 through at once, then 2 a second, and says how many it dropped', () => {
    let now = 0;
    const out: string[] = [];
    const w = new WarningLimiter((m) => out.push(m), parseWarningLimit(undefined), () => now);
    for (let i = 0; i < 1000; i++) w.warn(`w${i}`);
    expect(out).toEqual(Array.from({ length: 20 }, (_, i) => `w${i}`));
    now += 500; // one token back
    w.warn('late');
    expect(out.slice(20)).toEqual(['980 more warnings dropped over 0.5 s (at most 20 at once, then 2 a second: see the warningLimit option)', 'late']);
    // A steady 10 a second for 10 s gets 2 a second through.
    let through = 0;
    for (let i = 0; i < 100; i++) {
      now += 100;
      const before = out.length;
      w.warn('steady');
      through += out.length - before;
    }
    expect(out.filter((m) => m === 'steady').length).toBeGreaterThanOrEqual(19);
    expect(out.filter((m) => m === 'steady').length).toBeLessThanOrEqual(21);
    expect(through).toBeLessThanOrEqual(42); // the counts of what was dropped included
    // Quiet for a while: the burst is back, and no more than it.
    now += 60_000;
    const before = out.length;
    for (let i = 0; i < 30; i++) w.warn('again');
    expect(out.slice(before).filter((m) => m === 'again')).toHaveLength(20);
  });

  it('the count of what was dropped comes even when no warning follows', async () => {
    const out: string[] = [];
    const w = new WarningLimiter((m) => out.push(m), { burst: 1, perSecond: 20 });
    w.warn('a');
    w.warn('b');
    w.warn('c');
    expect(out).toEqual(['a']);
    await new Promise((r) => setTimeout(r, 120));
    expect(out[1]).toMatch(/^2 more warnings dropped over/);
  });

  it('the count comes even when the token it waited for went to a warning that was then dropped too', async () => {
    let now = 0;
    const out: string[] = [];
    const w = new WarningLimiter((m) => out.push(m), { burst: 1, perSecond: 20 }, () => now);
    w.warn('a');
    w.warn('b'); // dropped; the count is due in 50 ms
    await new Promise((r) => setTimeout(r, 70)); // the timer fires, but the fake clock gave no token
    expect(out).toEqual(['a']);
    now += 50;
    await new Promise((r) => setTimeout(r, 70));
    expect(out).toEqual(['a', expect.stringMatching(/^1 more warning dropped over/)]);
  });

  it('Infinity lets every one through; a bad option is an InvalidOptionError', () => {
    const out: string[] = [];
    const w = new WarningLimiter((m) => out.push(m), parseWarningLimit({ burst: Infinity, perSecond: Infinity }));
    for (let i = 0; i < 10_000; i++) w.warn('x');
    expect(out).toHaveLength(10_000);
    for (const bad of [null, 5, 'fast', { burst: 0 }, { burst: 1.5 }, { burst: NaN }, { burst: '20' }, { perSecond: 0 }, { perSecond: -1 }, { perSecond: NaN }, { perSecond: '2' }]) {
      expect(() => parseWarningLimit(bad)).toThrow(InvalidOptionError);
    }
    expect(parseWarningLimit({ perSecond: 0.5 })).toEqual({ burst: 20, perSecond: 0.5 });
  });
});
