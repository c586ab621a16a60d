// Vm.list's reading of the runtime directory (what other processes answer is checked and
// bounded) and its merge with this process's VMs: real Unix sockets, no KVM.
import { mkdtempSync, rmSync } from 'node:fs';
import { createServer, type Server } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { InvalidOptionError, Vm } from '../../src';
import { parseLabels } from '../../src/labels';
import { entryOfHibernated, entryOfLive, listVms, mergeVmLists, scanRuntimeDir, type VmListRow } from '../../src/vm-list';

const vmInfo = { id: 'A', pid: 4242, state: 'running', guest: 'probe', memoryBytes: 2 ** 26, vcpus: 1, labels: { team: 'x' }, startedAt: '2026-12-03T05:00:00.000Z' };

/** A process listening on `path` that answers every line with `answer` (which may be anything). */
function fakeRun(path: string, answer: string): Promise<Server> {
  const server = createServer((c) => {
    c.on('error', () => {});
    c.once('data', () => c.end(answer));
  });
  return new Promise((resolve) => server.listen(path, () => resolve(server)));
}

describe('entries from a control socket are checked', () => {
  const now = Date.parse('2026-12-03T05:00:10.000Z');
  const row = (vm: unknown, extra: Record<string, unknown> = {}) => ({ id: 'A', socketPath: '/r/A.sock', response: { ok: true, vm, ...extra } as never });

  it('a good answer: name, pid, state, labels, memory, start and age', () => {
    const e = entryOfLive(row(vmInfo, { memory: { guestRamResidentBytes: 12345 } }), now);
    expect(e).toEqual({
      name: 'A', where: 'control-socket', socketPath: '/r/A.sock', state: 'running', pid: 4242, guest: 'probe',
      labels: { team: 'x' }, memoryBytes: 2 ** 26, residentBytes: 12345, startedAt: new Date('2026-12-03T05:00:00.000Z'), ageMs: 10_000,
    });
  });

  it('an older pvisor (no labels, no start): {} and no age', () => {
    const { labels, startedAt, ...old } = vmInfo;
    void labels;
    void startedAt;
    const e = entryOfLive(row(old), now);
    expect(e.labels).toEqual({});
    expect(e.ageMs).toBeUndefined();
    expect(e.error).toBeUndefined();
  });

  it.each([
    ['no vm', undefined, /no "vm"/],
    ['a state that is not one', { ...vmInfo, state: 'exploded' }, /no valid "state"/],
    ['a negative pid', { ...vmInfo, pid: -1 }, /no valid "pid"/],
    ['a pid that is a string', { ...vmInfo, pid: '1' }, /no valid "pid"/],
  ])('%s: unresponsive, saying why', (_, vm, why) => {
    const e = entryOfLive(row(vm), now);
    expect(e.state).toBe('unresponsive');
    expect(e.pid).toBeNull();
    expect(e.error).toMatch(why);
  });

  it('labels that break the rules are dropped and said; a bad memory figure or start is left out', () => {
    const e = entryOfLive(row({ ...vmInfo, labels: { 'bad key': 'x' }, memoryBytes: -5, startedAt: 'yesterday' }, { memory: { guestRamResidentBytes: 'lots' } }), now);
    expect(e).toMatchObject({ state: 'running', pid: 4242, labels: {} });
    expect(e.error).toMatch(/its labels were refused: .*a label key/);
    expect(e.memoryBytes).toBeUndefined();
    expect(e.residentBytes).toBeUndefined();
    expect(e.startedAt).toBeUndefined();
  });

  it("a hibernated VM's labels are the --label flags its record carries", () => {
    const record = { format: 'pvisor-hibernated', version: 1, id: 'H', dir: '/d', hibernatedAt: '', guest: 'probe', memoryBytes: 2 ** 26, vcpus: 1, bytesOnDisk: 5, flags: ['--console', '--label=team=x', '--label=a=b=c'] } as const;
    expect(entryOfHibernated({ id: 'H', record: { ...record, flags: [...record.flags] } })).toEqual({
      name: 'H', where: 'hibernated', state: 'hibernated', pid: null, guest: 'probe', labels: { team: 'x', a: 'b=c' }, memoryBytes: 2 ** 26, residentBytes: 0,
    });
    expect(entryOfHibernated({ id: 'H', error: 'refused' })).toMatchObject({ state: 'hibernated', error: 'refused', labels: {} });
  });
});

describe('merging', () => {
  const entry = (name: string, pid: number, labels: Record<string, string> = {}, where: VmListRow['where'] = 'control-socket'): VmListRow => ({ name, where, state: 'running', pid, labels: parseLabels('labels', labels) });

  it("a VM of this process that also has a control socket is listed once, as this process's", () => {
    const own = [entry('a', 100, {}, 'this-process')];
    const merged = mergeVmLists(own, [entry('a', 100), entry('a', 200), entry('b', 100)], 100, {});
    expect(merged.map((e) => `${e.name}@${e.pid} ${e.where}`)).toEqual(['a@100 this-process', 'a@200 control-socket', 'b@100 control-socket']);
  });

  it('selects by labels', () => {
    const merged = mergeVmLists([entry('a', 1, { team: 'x' }, 'this-process')], [entry('b', 2, { team: 'y' }), entry('c', 3, { team: 'x', env: 'p' })], 1, parseLabels('labels', { team: 'x' }));
    expect(merged.map((e) => e.name)).toEqual(['a', 'c']);
  });
});

describe('the runtime directory', () => {
  let dir: string;
  const servers: Server[] = [];
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-list-'));
  });
  afterEach(async () => {
    for (const s of servers.splice(0)) await new Promise((r) => s.close(r));
    rmSync(dir, { recursive: true, force: true });
  });

  it('lists what answers, says what answers wrongly, and bounds what another process may send', async () => {
    servers.push(await fakeRun(join(dir, 'good.sock'), `${JSON.stringify({ v: 1, ok: true, vm: { ...vmInfo, id: 'good' } })}\n`));
    servers.push(await fakeRun(join(dir, 'garbage.sock'), 'not json\n'));
    // Far more than a status answer is, and no end of line: not kept whole.
    servers.push(await fakeRun(join(dir, 'huge.sock'), 'x'.repeat(2 * 1024 * 1024)));
    // A socket nobody listens on is left from a killed run: not a VM.
    const gone = await fakeRun(join(dir, 'gone.sock'), '');
    await new Promise((r) => gone.close(r));
    const { live } = await scanRuntimeDir(dir);
    expect(live.map((r) => r.id)).toEqual(['garbage', 'good', 'huge']);
    const list = await listVms([], {}, dir);
    const byName = Object.fromEntries(list.map((e) => [e.name, e]));
    expect(byName.good).toMatchObject({ state: 'running', pid: 4242, labels: { team: 'x' } });
    expect(byName.garbage).toMatchObject({ state: 'unresponsive', pid: null });
    expect(byName.garbage.error).toMatch(/malformed answer/);
    expect(byName.huge).toMatchObject({ state: 'unresponsive' });
    expect(byName.huge.error).toMatch(/answered status with more than 262144 bytes/);
    expect((await listVms([], { labels: { team: 'x' } }, dir)).map((e) => e.name)).toEqual(['good']);
  });

  it('a directory that does not exist holds no VMs', async () => {
    expect(await listVms([], {}, join(dir, 'none'))).toEqual([]);
  });

  it('Vm.list refuses an unknown option and bad labels, typed', async () => {
    await expect(Vm.list({ label: { a: 'b' } } as never)).rejects.toThrow(/label: not an option of Vm.list; did you mean labels\?/);
    await expect(Vm.list({ labels: { 'a b': 'c' } })).rejects.toThrow(InvalidOptionError);
  });
});
