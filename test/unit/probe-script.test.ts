import { formatProbeScript, parseProbeScript, ScriptCursor } from '../../src/cli/probe-script';
import type { Vm } from '../../src/vm';
import { InvalidOptionError } from '../../src/errors';

describe('pvisor run --guest probe: step parsing', () => {
  it('parses steps separated by commas or semicolons, sizes with or without units', () => {
    expect(parseProbeScript(['fill', '64MiB', 'random', '42,', 'digest;', 'rewrite', '25%', '7,', 'touch', '16', '3,', 'release', '0', '8MiB'])).toEqual([
      { op: 'fill', sizeMiB: 64, content: 'random', seed: 42 },
      { op: 'digest' },
      { op: 'rewrite', fraction: 0.25, seed: 7 },
      { op: 'touch', hotMiB: 16, rounds: 3 },
      { op: 'release', offsetMiB: 0, sizeMiB: 8 },
    ]);
  });

  it('suspend and resume are steps', () => {
    expect(parseProbeScript(['suspend, resume'])).toEqual([{ op: 'suspend' }, { op: 'resume' }]);
  });

  it('sleep counts seconds as the shell does, or says its unit; wait ends the script', () => {
    expect(parseProbeScript(['sleep 30, sleep 1.5s, sleep 500ms, sleep 2m, wait'])).toEqual([
      { op: 'sleep', ms: 30000 },
      { op: 'sleep', ms: 1500 },
      { op: 'sleep', ms: 500 },
      { op: 'sleep', ms: 120000 },
      { op: 'wait' },
    ]);
    expect(() => parseProbeScript(['wait, digest'])).toThrow(/wait: must be the last step/);
    expect(() => parseProbeScript(['sleep 3h'])).toThrow(InvalidOptionError);
  });

  it('fill takes each content kind by name', () => {
    expect(parseProbeScript(['fill 16MiB compressible 9, fill 8 random, fill 4 repetitive 0'])).toEqual([
      { op: 'fill', sizeMiB: 16, content: 'compressible', seed: 9 },
      { op: 'fill', sizeMiB: 8, content: 'random', seed: 1 },
      { op: 'fill', sizeMiB: 4, content: 'repetitive', seed: 0 },
    ]);
    expect(() => parseProbeScript(['fill 8MiB compressed'])).toThrow(/content must be repetitive, random, compressible, got compressed/);
  });

  it('defaults: repetitive content, seed 1, whole-working-set release', () => {
    expect(parseProbeScript(['fill 1GiB, release'])).toEqual([{ op: 'fill', sizeMiB: 1024, content: 'repetitive', seed: 1 }, { op: 'release' }]);
  });

  it.each([[['explode']], [['fill']], [['fill', '8MiB', 'zeros']], [['rewrite', '150%']], [[]], [['touch', '4', 'x']]])('rejects %j with a typed error', (words) => {
    expect(() => parseProbeScript(words)).toThrow(InvalidOptionError);
  });
});

describe('probe steps carried by a hibernation', () => {
  it('formatProbeScript gives text that parses back to the same steps', () => {
    const steps = parseProbeScript(['fill 64MiB random 42, fill 4KiB compressible 7, rewrite 7%, rewrite 25% 3, touch 16 3, release, release 0 8MiB, digest, idle, memory, pause, resume, suspend, sleep 1.5s, wait']);
    const text = formatProbeScript(steps);
    expect(parseProbeScript([text])).toEqual(steps);
  });

  it('the cursor says which steps are left: a sleep under way counts what remains, a guest step under way is done, wait stays', async () => {
    const steps = parseProbeScript(['fill 16MiB, sleep 10s, digest, wait']);
    const cursor = new ScriptCursor(steps);
    const vm = { name: 'T', state: 'running', once() {}, off() {} } as unknown as Vm;
    expect(cursor.remaining()).toEqual(steps);
    await cursor.begin(0, vm);
    // The fill talks to the guest: a hibernation waits for it, and it does not come back.
    let out = false;
    void cursor.outOfGuest().then(() => (out = true));
    await Promise.resolve();
    expect(out).toBe(false);
    expect(cursor.remaining()).toEqual(steps.slice(1));
    cursor.end();
    await Promise.resolve();
    expect(out).toBe(true);
    expect(cursor.remaining()).toEqual(steps.slice(1));
    await cursor.begin(1, vm);
    const t = performance.now();
    expect(cursor.remaining(t + 4000)[0]).toEqual({ op: 'sleep', ms: expect.any(Number) });
    expect((cursor.remaining(t + 4000)[0] as { ms: number }).ms).toBeLessThanOrEqual(6000);
    expect((cursor.remaining(t + 4000)[0] as { ms: number }).ms).toBeGreaterThan(5900);
    expect(cursor.remaining(t + 60000)[0]).toEqual({ op: 'sleep', ms: 0 });
    expect(cursor.remaining().slice(1)).toEqual(steps.slice(2));
    await expect(cursor.outOfGuest()).resolves.toBeUndefined();
    cursor.end();
    await cursor.begin(3, vm);
    expect(cursor.remaining()).toEqual([{ op: 'wait' }]);
  });

  it('halted steps wait until go(), and end when the VM ends meanwhile', async () => {
    const cursor = new ScriptCursor(parseProbeScript(['digest, digest']));
    const listeners: (() => void)[] = [];
    const vm = { name: 'T', state: 'running', once: (_: string, f: () => void) => listeners.push(f), off() {} } as unknown as Vm;
    cursor.halt();
    let begun = false;
    const first = cursor.begin(0, vm).then(() => (begun = true));
    await new Promise((r) => setTimeout(r, 10));
    expect(begun).toBe(false);
    cursor.go();
    await first;
    expect(begun).toBe(true);
    cursor.end();
    cursor.halt();
    const second = cursor.begin(1, vm);
    listeners.forEach((f) => f());
    await expect(second).rejects.toThrow(/T ended before its steps were done/);
  });
});
