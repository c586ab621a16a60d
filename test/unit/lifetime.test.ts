// A VM's lifetime timer and its options: pure scheduling logic, under Jest's fake timers.
import { InvalidOptionError } from '../../src';
import { Lifetime, MAX_TIMEOUT_WARNING_LEAD_MS, parseLifetimeOptions, timeoutWarningLeadMs } from '../../src/lifetime';

describe('Lifetime', () => {
  let events: string[];
  let lifetime: Lifetime;
  let onWarn: (remainingMs: number) => void;
  beforeEach(() => {
    jest.useFakeTimers({ now: 1_000_000 });
    events = [];
    onWarn = () => {};
    lifetime = new Lifetime({
      warn: (remainingMs) => (events.push(`warn ${remainingMs} at ${Date.now() - 1_000_000}`), onWarn(remainingMs)),
      expire: () => events.push(`expire at ${Date.now() - 1_000_000}`),
    });
  });
  afterEach(() => jest.useRealTimers());

  it('the warning lead is 10 s, or half a lifetime shorter than 20 s', () => {
    expect(timeoutWarningLeadMs(60_000)).toBe(MAX_TIMEOUT_WARNING_LEAD_MS);
    expect(timeoutWarningLeadMs(20_000)).toBe(10_000);
    expect(timeoutWarningLeadMs(3_000)).toBe(1_500);
    expect(timeoutWarningLeadMs(1)).toBe(0);
  });

  it('warns 10 s before a 60 s deadline, then expires at it, once; the deadline is then unset', () => {
    lifetime.set(60_000);
    expect(lifetime.expiresAtMs).toBe(1_060_000);
    jest.advanceTimersByTime(49_999);
    expect(events).toEqual([]);
    jest.advanceTimersByTime(1);
    expect(events).toEqual(['warn 10000 at 50000']);
    jest.advanceTimersByTime(9_999);
    expect(events).toHaveLength(1);
    jest.advanceTimersByTime(1);
    expect(events).toEqual(['warn 10000 at 50000', 'expire at 60000']);
    expect(lifetime.expiresAtMs).toBeUndefined();
    expect(lifetime.lastLifetimeMs).toBe(60_000);
    jest.advanceTimersByTime(120_000);
    expect(events).toHaveLength(2);
  });

  it('a 1 ms lifetime warns with 0 left, then expires', () => {
    lifetime.set(1);
    jest.advanceTimersByTime(1);
    expect(events).toEqual(['warn 0 at 1', 'expire at 1']);
  });

  it('extending from the warning: no expiry at the old deadline, a new warning before the new one', () => {
    let extended = false;
    onWarn = () => {
      if (!extended) lifetime.set(30_000);
      extended = true;
    };
    lifetime.set(30_000);
    jest.advanceTimersByTime(30_000);
    expect(events).toEqual(['warn 10000 at 20000']);
    expect(lifetime.expiresAtMs).toBe(1_050_000);
    jest.advanceTimersByTime(20_000);
    expect(events).toEqual(['warn 10000 at 20000', 'warn 10000 at 40000', 'expire at 50000']);
  });

  it('clearing from the warning: nothing expires', () => {
    onWarn = () => lifetime.clear();
    lifetime.set(4_000);
    jest.advanceTimersByTime(100_000);
    expect(events).toEqual(['warn 2000 at 2000']);
    expect(lifetime.expiresAtMs).toBeUndefined();
  });

  it('shortening after the warning: expires at the new deadline, warned again before it', () => {
    lifetime.set(60_000);
    jest.advanceTimersByTime(55_000);
    lifetime.set(2_000);
    jest.advanceTimersByTime(2_000);
    expect(events).toEqual(['warn 10000 at 50000', 'warn 1000 at 56000', 'expire at 57000']);
  });

  it('set replaces the deadline; clear unsets it', () => {
    lifetime.set(10_000);
    lifetime.set(100_000);
    jest.advanceTimersByTime(20_000);
    expect(events).toEqual([]);
    lifetime.clear();
    jest.advanceTimersByTime(200_000);
    expect(events).toEqual([]);
    expect(lifetime.expiresAtMs).toBeUndefined();
  });

  it.each([0, -1, 1.5, 2 ** 31, NaN])('a lifetime of %p ms is refused', (ms) => {
    expect(() => lifetime.set(ms)).toThrow(InvalidOptionError);
    expect(() => lifetime.set(ms)).toThrow(/timeoutMs: expected a whole number of milliseconds from 1 to 2147483647/);
  });
});

describe('the timer keeps no process alive', () => {
  it('is unref\'d', () => {
    const lifetime = new Lifetime({ warn: () => {}, expire: () => {} });
    lifetime.set(60_000);
    const timer = (lifetime as unknown as { timer: NodeJS.Timeout }).timer;
    expect(timer.hasRef()).toBe(false);
    lifetime.clear();
  });
});

describe('lifetime options', () => {
  it('onTimeout defaults to stop; timeoutMs is optional', () => {
    expect(parseLifetimeOptions({})).toEqual({ onTimeout: 'stop', timeoutMs: undefined });
    expect(parseLifetimeOptions({ timeoutMs: 5000, onTimeout: 'suspend' })).toEqual({ timeoutMs: 5000, onTimeout: 'suspend' });
  });

  it("hibernate needs hibernateDir, made absolute; hibernateDir goes with nothing else", () => {
    expect(parseLifetimeOptions({ onTimeout: 'hibernate', hibernateDir: 'away' }, '/srv')).toEqual({ onTimeout: 'hibernate', hibernateDir: '/srv/away', timeoutMs: undefined });
    expect(() => parseLifetimeOptions({ onTimeout: 'hibernate' })).toThrow(/hibernateDir: onTimeout: 'hibernate' needs hibernateDir/);
    expect(() => parseLifetimeOptions({ onTimeout: 'stop', hibernateDir: '/x' })).toThrow(/hibernateDir: only goes with onTimeout: 'hibernate'/);
  });

  it.each([
    [{ onTimeout: 'pause' }, /onTimeout: expected "suspend", "hibernate" or "stop", got "pause"/],
    [{ onTimeout: 1 }, /onTimeout: expected/],
    [{ timeoutMs: '10s' }, /timeoutMs: expected a whole number/],
    [{ timeoutMs: 0 }, /timeoutMs/],
  ])('%j is refused', (options, message) => {
    expect(() => parseLifetimeOptions(options)).toThrow(InvalidOptionError);
    expect(() => parseLifetimeOptions(options)).toThrow(message);
  });
});
