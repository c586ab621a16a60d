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

  it('suspend --hibernate --store and resume --store [--take-over] name an object store location, checked', () => {
    const claim = 'ab'.repeat(16);
    expect(parseControlArgs('suspend', ['T1', '--hibernate', '--store', 's3://pvisor/vms/T1'], dir)).toMatchObject({ hibernate: true, offload: true, store: 's3://pvisor/vms/T1' });
    expect(parseControlArgs('resume', ['T1', '--store', 's3://pvisor/vms/T1', '--take-over', claim], dir)).toMatchObject({ store: 's3://pvisor/vms/T1', takeOver: claim });
    expect(parseControlArgs('resume', ['T1'], dir)).not.toHaveProperty('store');
    const refused = (cmd: 'suspend' | 'resume', argv: string[], option: string) => {
      const e = (() => {
        try {
          parseControlArgs(cmd, argv, dir);
        } catch (x) {
          return x;
        }
      })();
      expect(e).toBeInstanceOf(InvalidOptionError);
      expect((e as InvalidOptionError).option).toBe(option);
    };
    // --store without --hibernate would only pause: refused rather than ignored.
    refused('suspend', ['T1', '--store', 's3://pvisor/vms/T1'], 'store');
    refused('suspend', ['T1', '--hibernate', '--store', '/tmp/x'], 'store');
    refused('resume', ['T1', '--store', 's3://pvisor'], 'store');
    refused('resume', ['T1', '--take-over', claim], 'take-over');
    refused('resume', ['T1', '--store', 's3://pvisor/vms/T1', '--take-over', 'nope'], 'take-over');
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
