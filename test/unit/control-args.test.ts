// Arguments of pvisor suspend/resume/stop, as the reference CLI spells them.
import { formatBytes, parseControlArgs } from '../../src/cli/control-commands';
import { InvalidOptionError } from '../../src/errors';

describe('pvisor suspend/resume/stop: argument parsing', () => {
  const dir = '/run/pvisor';

  it('takes the reference CLI form: JOB --vm-socket SOCKET --vm-job-id JOB --vm-attempt-id ATTEMPT --vm-offload', () => {
    expect(parseControlArgs('suspend', ['J1', '--vm-socket', '/tmp/s/J1.sock', '--vm-job-id', 'J1', '--vm-attempt-id', '3', '--vm-offload'], dir)).toEqual({
      id: 'J1', socketPath: '/tmp/s/J1.sock', offload: true, hibernate: false, foreground: false, load: false, json: false, attemptId: '3',
    });
    expect(parseControlArgs('resume', ['J1', '--vm-socket', '/tmp/s/J1.sock', '--vm-job-id', 'J1', '--vm-attempt-id', '3', '--vm-load'], dir)).toMatchObject({ id: 'J1', load: true, offload: false });
  });

  it('the socket defaults to <runtime dir>/<ID>.sock; without --vm-offload suspend only pauses', () => {
    expect(parseControlArgs('suspend', ['T1'], dir)).toEqual({ id: 'T1', socketPath: '/run/pvisor/T1.sock', offload: false, hibernate: false, foreground: false, load: false, json: false, attemptId: undefined });
    expect(parseControlArgs('stop', ['T1', '--json'], dir)).toMatchObject({ id: 'T1', json: true });
  });

  it('suspend --hibernate implies --vm-offload; resume --foreground is its own', () => {
    expect(parseControlArgs('suspend', ['T1', '--vm-offload', '--hibernate'], dir)).toMatchObject({ id: 'T1', offload: true, hibernate: true });
    expect(parseControlArgs('suspend', ['T1', '--hibernate'], dir)).toMatchObject({ offload: true, hibernate: true });
    expect(parseControlArgs('suspend', ['T1', '--vm-offload'], dir)).toMatchObject({ offload: true, hibernate: false });
    expect(parseControlArgs('resume', ['T1', '--foreground', '--vm-socket', '/x/T1.sock'], dir)).toMatchObject({ id: 'T1', foreground: true, socketPath: '/x/T1.sock' });
    expect(parseControlArgs('resume', ['T1', '--vm-load'], dir)).toMatchObject({ foreground: false, hibernate: false });
  });

  it('the id may come from --vm-job-id or the socket name alone', () => {
    expect(parseControlArgs('resume', ['--vm-job-id', 'J2'], dir)).toMatchObject({ id: 'J2', socketPath: '/run/pvisor/J2.sock' });
    expect(parseControlArgs('stop', ['--vm-socket', '/x/J3.sock'], dir)).toMatchObject({ id: 'J3', socketPath: '/x/J3.sock' });
  });

  it.each([
    ['suspend', []],
    ['suspend', ['A', 'B']],
    ['suspend', ['A', '--vm-job-id', 'B']],
    ['suspend', ['../etc']],
  ] as const)('%s %j is refused with a typed error', (cmd, argv) => {
    expect(() => parseControlArgs(cmd, [...argv], dir)).toThrow(InvalidOptionError);
  });

  it.each([
    ['resume', ['T1', '--vm-offload']],
    ['suspend', ['T1', '--vm-load']],
    ['stop', ['T1', '--vm-offload']],
    ['resume', ['T1', '--hibernate']],
    ['stop', ['T1', '--hibernate']],
    ['suspend', ['T1', '--foreground']],
    ['stop', ['T1', '--foreground']],
  ] as const)('%s does not take %j', (cmd, argv) => {
    expect(() => parseControlArgs(cmd, [...argv], dir)).toThrow(/Unknown option/);
  });

  it('prints small figures in KiB, so that "almost nothing" is visible', () => {
    expect(formatBytes(0)).toBe('0 KiB');
    expect(formatBytes(163840)).toBe('160 KiB');
    expect(formatBytes(16.5 * 2 ** 20)).toBe('16.5 MiB');
  });
});
