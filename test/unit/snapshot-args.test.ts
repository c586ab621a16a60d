// Arguments and answer of pvisor snapshot ID DIR. No KVM needed.
import { formatSnapshotAnswer, parseSnapshotArgs } from '../../src/cli/snapshot-command';
import { InvalidOptionError } from '../../src/errors';

describe('pvisor snapshot: argument parsing', () => {
  const cwd = '/home/u/work';
  const dir = '/run/pvisor';

  it('takes ID DIR, DIR made absolute against the client\'s cwd (the VM\'s process has another)', () => {
    expect(parseSnapshotArgs(['T1', 'snaps/s1'], cwd, dir)).toEqual({ id: 'T1', socketPath: '/run/pvisor/T1.sock', dir: '/home/u/work/snaps/s1', leavePaused: false, json: false });
    expect(parseSnapshotArgs(['T1', '/abs/s1', '--leave-paused', '--json', '--vm-socket', '/x/T1.sock'], cwd, dir)).toEqual({ id: 'T1', socketPath: '/x/T1.sock', dir: '/abs/s1', leavePaused: true, json: true });
  });

  it.each([
    [[], /^id: which VM\?/],
    [['T1'], /^dir: where to\? e.g. pvisor snapshot T1 DIR/],
    [['T1', ''], /^dir: where to\?/],
    [['T1', 'a', 'b'], /^dir: one snapshot directory, got a b/],
    [['../x', 'a'], /^id: "..\/x" is not a VM id/],
  ])('%j is refused with a typed error', (argv, message) => {
    expect(() => parseSnapshotArgs(argv, cwd, dir)).toThrow(InvalidOptionError);
    expect(() => parseSnapshotArgs(argv, cwd, dir)).toThrow(message);
  });

  it('takes an s3://bucket/prefix location as it is, and refuses a malformed one before asking the VM', () => {
    expect(parseSnapshotArgs(['T1', 's3://pvisor/templates/t1'], cwd, dir).dir).toBe('s3://pvisor/templates/t1');
    expect(() => parseSnapshotArgs(['T1', 's3://pvisor'], cwd, dir)).toThrow(/^dir: "s3:\/\/pvisor": no prefix/);
    expect(() => parseSnapshotArgs(['T1', 's3://Bad_Bucket/x'], cwd, dir)).toThrow(InvalidOptionError);
  });

  it('does not take options of other commands', () => {
    expect(() => parseSnapshotArgs(['T1', 'd', '--vm-offload'], cwd, dir)).toThrow(/Unknown option/);
  });

  it('says in one sentence where, how many RAM pages, how long, and how the VM is left', () => {
    const vm = { id: 'T1', pid: 1, guest: 'probe' as const, memoryBytes: 2 ** 28, vcpus: 2, labels: {} };
    const snapshot = { dir: '/s/1', ramDataPageCount: 16404, ms: 278.8 };
    expect(formatSnapshotAnswer({ id: 'T1' }, { ok: true, vm: { ...vm, state: 'running' }, snapshot })).toBe('T1 snapshot: 16404 RAM pages (64.1 MiB) written to /s/1 in 278.8 ms; T1 is running');
    expect(formatSnapshotAnswer({ id: 'T1' }, { ok: true, vm: { ...vm, state: 'paused' }, snapshot })).toMatch(/; T1 is paused \(pvisor resume T1 lets it run\)$/);
  });
});
