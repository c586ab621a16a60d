import { parseProbeScript } from '../../src/cli/probe-script';
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
