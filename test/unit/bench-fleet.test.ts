// The pure parts of `pvisor bench fleet`: its arguments checked, and its figures judged against
// issue 27's goals in the table it prints (nothing here is timed or needs a store).
import { parseFleetArgs } from '../../src/cli/bench-args';
import { parseExportLines } from '../../src/bench/fleet-store';
import { changedChunkIndexes, fleetGoals, fleetLinuxGoals, fleetLinuxRows, fleetTableRows, type FleetFigures } from '../../src/bench/fleet-table';
import { InvalidOptionError } from '../../src/errors';

const MiB = 2 ** 20;

describe('pvisor bench fleet arguments', () => {
  it('has defaults, and takes each option', () => {
    expect(parseFleetArgs([])).toMatchObject({ runs: 3, clones: 16, workingSetMiB: 32, bucket: 'pvisor', json: undefined });
    const o = parseFleetArgs(['--runs', '5', '--clones', '0', '--working-set', '16MiB', '--dir', 'rel', '--bucket', 'my-bucket.1', '--json', 'x.json']);
    expect(o).toMatchObject({ runs: 5, clones: 0, workingSetMiB: 16, bucket: 'my-bucket.1', json: `${process.cwd()}/x.json` });
    expect(o.dir).toBe(`${process.cwd()}/rel`);
  });

  it.each([
    [['--runs', '0'], /--runs: expected 1 to 100/],
    [['--runs', '2.5'], /--runs/],
    [['--clones', '17'], /--clones: expected 0 to 16/],
    [['--working-set', '65MiB'], /--working-set/],
    [['--working-set', '1536KiB'], /--working-set: expected whole MiB/],
    [['--bucket', 'Bad_Bucket'], /--bucket: not a bucket name/],
    [['--bucket', 'a'], /--bucket/],
    // Checked before the bench runs, not when its minutes are spent.
    [['--json', '/nonexistent-dir/x.json'], /--json: cannot write \/nonexistent-dir\/x\.json: \/nonexistent-dir does not exist/],
    [['--json', '/tmp'], /--json: cannot write \/tmp: it is a directory/],
  ])('refuses %j', (argv, message) => {
    expect(() => parseFleetArgs(argv)).toThrow(InvalidOptionError);
    expect(() => parseFleetArgs(argv)).toThrow(message);
  });

  it('refuses an unknown option', () => {
    expect(() => parseFleetArgs(['--guests', 'linux'])).toThrow(/Unknown option '--guests'/);
  });

  it('takes --guest probe (the default) or linux, nothing else', () => {
    expect(parseFleetArgs([]).guest).toBe('probe');
    expect(parseFleetArgs(['--guest', 'linux']).guest).toBe('linux');
    expect(() => parseFleetArgs(['--guest', 'windows'])).toThrow(/--guest: expected probe or linux/);
  });
});

describe('the store exports the bench reads', () => {
  it('takes export lines and nothing else', () => {
    expect(parseExportLines('export AWS_ENDPOINT_URL=http://127.0.0.1:9000\nexport AWS_REGION=us-east-1\necho hi\nexport bad=x\n')).toEqual({ AWS_ENDPOINT_URL: 'http://127.0.0.1:9000', AWS_REGION: 'us-east-1' });
  });
});

describe('the chunks a child changed', () => {
  it('are the places whose hash differs, zero chunks included, and those past the shorter manifest', () => {
    expect(changedChunkIndexes(['a', null, 'b', 'c'], ['a', 'x', 'b', null])).toEqual([1, 3]);
    expect(changedChunkIndexes(['a', 'b'], ['a', 'b'])).toEqual([]);
    expect(changedChunkIndexes(['a'], ['a', null, 'z'])).toEqual([1, 2]);
  });
});

describe('pvisor bench fleet table', () => {
  const figures: FleetFigures = {
    runs: 3,
    workingSetMiB: 32,
    localMs: { min: 90, median: 100, max: 130 },
    storeColdMs: { min: 250, median: 300, max: 400 },
    storeWarmMs: { min: 120, median: 150, max: 160 },
    bytesBeforeReady: 36 * MiB,
    childSentBytes: 10 * MiB + 1,
    childChunksSent: 6,
    childChunksPresent: 13,
    childChangedChunks: [0, 20, 21],
    cloneChunksFetched: [20, 0, 0, 0],
  };

  it('judges each goal: ratios to local, the share of the working set, bytes sent, clones', () => {
    const goals = fleetGoals(figures);
    expect(goals.map((g) => [g.value, g.met])).toEqual([
      [3, false],
      [1.5, true],
      [36 / 32, false],
      [10 * MiB + 1, false],
      [0, true],
    ]);
    const better = fleetGoals({ ...figures, storeColdMs: { min: 1, median: 200, max: 300 }, bytesBeforeReady: 3.2 * MiB, childSentBytes: 10 * MiB, cloneChunksFetched: [20, 1, 0] });
    expect(better.map((g) => g.met)).toEqual([true, true, true, true, false]);
    expect(better[4].value).toBe(1);
  });

  it('prints min / median / max, the goal and whether it was met beside each figure', () => {
    const rows = fleetTableRows(figures);
    expect(rows[0]).toEqual(['figure', 'pvisor', 'goal (issue 27)', 'met']);
    expect(rows[1]).toEqual(['local lazy restore to ready, ms', '90 / 100 / 130', '-', '-']);
    expect(rows[2]).toEqual(['store lazy restore to ready, cold cache, ms', '250 / 300 / 400 (3.00x local)', '<= 2x local', 'NO']);
    expect(rows[3][1]).toBe('120 / 150 / 160 (1.50x local)');
    expect(rows[3][3]).toBe('yes');
    expect(rows[4][1]).toBe('36.0 MiB = 113% of the 32 MiB working set');
    expect(rows[4][3]).toBe('NO');
    expect(rows[5][1]).toBe('10.0 MiB sent (6 objects sent, 13 present; RAM chunks changed: 0, 20, 21)');
    expect(rows[5][3]).toBe('NO');
    expect(rows[6]).toEqual(['4 clones on one host, chunks fetched', '1st 20, then 0, 0, 0', '0 after the 1st', 'yes']);
    for (const r of rows) expect(r).toHaveLength(4);
  });

  it('leaves the clones row out when fewer than two clones were restored', () => {
    expect(fleetTableRows({ ...figures, cloneChunksFetched: [] })).toHaveLength(6);
    expect(fleetTableRows({ ...figures, cloneChunksFetched: [20] })).toHaveLength(6);
    expect(fleetGoals({ ...figures, cloneChunksFetched: [20] })).toHaveLength(4);
  });

  it('judges and prints the clones\' guest RAM PSS against local SharedSnapshot clones\'', () => {
    const withPss = { ...figures, clonePssBytes: { store: 11 * MiB, local: 10 * MiB } };
    const goals = fleetGoals(withPss);
    expect(goals).toHaveLength(6);
    expect(goals[5].value).toBeCloseTo(1.1);
    expect(goals[5].met).toBe(true);
    expect(fleetGoals({ ...withPss, clonePssBytes: { store: 11.2 * MiB, local: 10 * MiB } })[5].met).toBe(false);
    const rows = fleetTableRows(withPss);
    expect(rows[7]).toEqual(['4 SharedSnapshot clones, guest RAM PSS per clone', '11.0 MiB from the store, 10.0 MiB local (1.10x)', 'as local SharedSnapshot clones', 'yes']);
  });
});

describe('pvisor bench fleet --guest linux table', () => {
  const figures = { runs: 2, memory: '256MiB', localMs: { min: 900, median: 1000, max: 1100 }, storeColdMs: { min: 2000, median: 2500, max: 3000 }, storeWarmMs: { min: 1500, median: 1800, max: 1900 }, bytesBeforeReady: 40 * MiB };

  it('judges the store restores against the local lazy one, and prints them', () => {
    expect(fleetLinuxGoals(figures).map((g) => [g.value, g.met])).toEqual([
      [2.5, false],
      [1.8, true],
    ]);
    const rows = fleetLinuxRows(figures);
    expect(rows[1]).toEqual(['Linux: local lazy restore to agent ready, ms', '900 / 1000 / 1100', '-', '-']);
    expect(rows[2]).toEqual(['Linux: store restore to agent ready, cold cache, ms', '2000 / 2500 / 3000 (2.50x local; 40.0 MiB read)', '<= 2x local', 'NO']);
    expect(rows[3][3]).toBe('yes');
  });
});
