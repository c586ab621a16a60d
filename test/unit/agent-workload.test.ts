// The agent workload's program (scripts/agent-workload/agent.js) against the parsers the tests and
// the bench read it with: run here by this host's node, with the TypeScript of node_modules (the
// image has Debian's). No KVM needed.
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { AgentWorkloadError, parseAgentReady, parseAgentStatus } from '../../src/bench/agent-workload';

const program = join(__dirname, '..', '..', '..', 'scripts', 'agent-workload', 'agent.js');

describe('the agent program', () => {
  it('says ready after compiling its project, answers status, work and exit with JSON lines, and refuses the rest', () => {
    const long = 'x'.repeat(2000);
    const r = spawnSync(process.execPath, [program], { input: `status\nwork\nfly\n${long}\nstatus\nexit\nstatus\n`, encoding: 'utf8', timeout: 120_000 });
    expect({ status: r.status, stderr: r.stderr }).toEqual({ status: 0, stderr: '' });
    const [readyLine, ...answers] = r.stdout.trimEnd().split('\n');
    const ready = parseAgentReady(readyLine);
    expect(ready.files).toBe(6);
    expect(ready.heapMiB).toBeGreaterThan(10);
    const json = answers.map((a) => JSON.parse(a) as Record<string, unknown>);
    expect(json).toHaveLength(6); // the status after exit is never answered
    const first = parseAgentStatus(json[0]);
    expect(first.heapUsedBytes).toBeGreaterThan(10 * 2 ** 20);
    expect(first.rssBytes).toBeGreaterThan(first.heapUsedBytes);
    expect(json[1]).toMatchObject({ work: 'compiled', files: 6 });
    expect(json[2]).toEqual({ error: 'unknown request "fly"; expected status, work or exit' });
    expect(json[3]).toEqual({ error: 'a request is at most 1024 bytes' });
    expect(parseAgentStatus(json[4]).ticks).toBe(0);
    expect(json[5]).toEqual({ exit: 0 });
  }, 150_000);

  it('keeps idling when its stdin ends, as under pvisor run (stdin /dev/null)', () => {
    const r = spawnSync(process.execPath, [program], { stdio: ['ignore', 'pipe', 'pipe'], encoding: 'utf8', timeout: 20_000, killSignal: 'SIGKILL' });
    expect(r.signal).toBe('SIGKILL'); // still running when the timeout killed it
    expect(r.stdout).toMatch(/^ready compiled 6 files in \d+ ms/);
    expect(r.stderr).toBe('agent: stdin ended; idling until killed\n');
  }, 60_000);
});

describe('parsing what the agent program says', () => {
  it('a ready line', () => {
    const line = 'ready compiled 6 files in 2274 ms, heap 52.8 MiB, rss 137.7 MiB (typescript 4.8.4 loaded in 686 ms, 45 files with the libs, 18 outputs, node v18.20.4)';
    expect(parseAgentReady(line)).toEqual({ files: 6, compileMs: 2274, heapMiB: 52.8, rssMiB: 137.7, line });
    for (const bad of ['', 'ready', 'agent: cannot compile', `${line.slice(0, 40)}`, 'ready compiled 99999999 files in 1 ms, heap 1.0 MiB, rss 1.0 MiB (']) {
      expect(() => parseAgentReady(bad)).toThrow(AgentWorkloadError);
    }
  });

  it('a status answer: every figure a whole number >= 0', () => {
    const good = { status: 'idle', heapUsedBytes: 1, heapTotalBytes: 2, rssBytes: 3, externalBytes: 4, ticks: 0, uptimeMs: 5, files: 6 };
    expect(parseAgentStatus(good)).toEqual({ heapUsedBytes: 1, heapTotalBytes: 2, rssBytes: 3, externalBytes: 4, ticks: 0, uptimeMs: 5 });
    expect(() => parseAgentStatus({ ...good, status: 'busy' })).toThrow(/not an answer to status/);
    for (const bad of [-1, 1.5, '7', null, 2 ** 60]) {
      expect(() => parseAgentStatus({ ...good, rssBytes: bad })).toThrow(/status: rssBytes is .*, not a whole number >= 0/);
    }
    const { uptimeMs: _, ...missing } = good;
    expect(() => parseAgentStatus(missing)).toThrow(/uptimeMs is undefined/);
  });
});
