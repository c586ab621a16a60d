/**
 * `pvisor bench linux`: the Linux guest's boot to agent-ready, exec round trip and file transfer,
 * for each way virtio devices can signal (queue notifications through a KVM ioeventfd or an MMIO
 * exit, interrupts through an irqfd or KVM_IRQ_LINE), interleaved run by run so that all see the
 * same machine noise; what the guest's RAM costs the host once booted; and a clone restored from
 * a snapshot of a booted VM to agent-ready, against a fresh boot in the same run.
 */
import { randomBytes } from 'node:crypto';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { parseArgs } from 'node:util';
import { InvalidOptionError } from '../errors';
import { parseSignalling } from '../backends/kvm/signalling';
import { SharedSnapshot } from '../memory/strategies/shared-snapshot';
import { DEFAULT_BACKING_DIR } from '../memory/backing-file';
import { Vm } from '../vm';
import { printTable, progress, sleep, stats } from './bench';
import { parseUsage } from './usage';

const MiB = 2 ** 20;
const MODES = ['ioeventfd+irqfd', 'ioeventfd+irq-line', 'exit+irqfd', 'exit+irq-line'];
type Stats = ReturnType<typeof stats>;

const ms = (x: Stats) => `${x.min.toFixed(1)} / ${x.median.toFixed(1)} / ${x.max.toFixed(1)}`;

interface ModeTimes {
  boot: number[];
  exec: number[];
  write: number[];
  read: number[];
}

/** One VM in `mode`: boot, `execs` round trips of `true`, one file written and read back. */
async function oneRun(mode: string, execs: number, file: Buffer, t: ModeTimes, keep: boolean): Promise<Vm> {
  process.env.PVISOR_VIRTIO_SIGNALLING = mode;
  let t0 = performance.now();
  const vm = await Vm.start({ memory: '512MiB', vcpus: 2, bootTimeoutMs: 300_000 });
  t.boot.push(performance.now() - t0);
  try {
    for (let i = 0; i < execs; i++) {
      t0 = performance.now();
      await vm.exec(['true']);
      t.exec.push(performance.now() - t0);
    }
    t0 = performance.now();
    await vm.files.write('/tmp/bench-file', file);
    t.write.push(performance.now() - t0);
    t0 = performance.now();
    const back = await vm.files.read('/tmp/bench-file');
    t.read.push(performance.now() - t0);
    if (!back.equals(file)) throw new Error(`${mode}: the file read back differs from the one written`);
    await vm.exec(['rm', '/tmp/bench-file']);
  } catch (e) {
    vm.stop();
    throw e;
  }
  if (!keep) vm.stop();
  return vm;
}

/** Restore-to-ready figures of clones of one snapshot of `vm`, ms. */
interface CloneTimes {
  ready: number[];
  ram: number[];
  agent: number[];
  /** The same with SharedSnapshot (guest RAM maps the RAM file; the first clone checks it). */
  sharedReady: number[];
}

/**
 * Snapshots `vm` (a booted VM) and restores `restores` clones of it one after the other, each
 * stopped before the next, timing Vm.restore to the agent's answer (and its parts).
 */
async function cloneRuns(vm: Vm, restores: number): Promise<CloneTimes> {
  // On a disk, as snapshots are kept: a RAM file on tmpfs would be memory already.
  const dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-bench-linux-'));
  const t: CloneTimes = { ready: [], ram: [], agent: [], sharedReady: [] };
  try {
    const snap = join(dir, 'snapshot');
    const info = await vm.snapshot(snap);
    progress(`snapshot of the booted VM: ${info.ms.toFixed(0)} ms, ${info.ramDataPageCount} pages in its RAM file`);
    for (let i = 0; i < restores; i++) {
      const clone = await Vm.restore(snap, { readyTimeoutMs: 300_000 });
      const r = clone.restoreInfo!;
      t.ready.push(r.readyMs);
      t.ram.push(r.ramMs);
      t.agent.push(r.agentMs);
      try {
        await clone.exec(['true']);
      } finally {
        clone.stop();
      }
      progress(`clone ${i + 1}/${restores}: agent ready in ${r.readyMs.toFixed(0)} ms (reading RAM ${r.ramMs.toFixed(0)} ms, resume to the agent's answer ${r.agentMs.toFixed(0)} ms)`);
    }
    for (let i = 0; i < restores; i++) {
      const clone = await Vm.restore(snap, { readyTimeoutMs: 300_000, strategies: [new SharedSnapshot()] });
      t.sharedReady.push(clone.restoreInfo!.readyMs);
      try {
        await clone.exec(['true']);
      } finally {
        clone.stop();
      }
      const r = clone.restoreInfo!;
      progress(`SharedSnapshot clone ${i + 1}/${restores}: agent ready in ${r.readyMs.toFixed(0)} ms (mapping RAM ${r.ramMs.toFixed(0)} ms${i === 0 ? ', the file checked' : ''}, resume to the agent's answer ${r.agentMs.toFixed(0)} ms)`);
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
  return t;
}

/** `pvisor bench linux`'s options (its usage in ./usage.ts names each). */
export const BENCH_LINUX_OPTIONS = {
  runs: { type: 'string', default: '3' },
  execs: { type: 'string', default: '20' },
  'file-mib': { type: 'string', default: '10' },
  signalling: { type: 'string', default: MODES.join(',') },
  restores: { type: 'string', default: '3' },
  json: { type: 'string' },
} as const;

/** Entry of `pvisor bench linux`. */
export async function benchLinux(argv: string[]): Promise<number> {
  const { values, runs, execs, fileMib, restores, modes } = parseUsage('bench linux', () => {
    const { values } = parseArgs({ args: argv, options: BENCH_LINUX_OPTIONS, strict: true });
    const runs = Number(values.runs);
    const execs = Number(values.execs);
    const fileMib = Number(values['file-mib']);
    const restores = Number(values.restores);
    for (const [name, v] of [['--runs', runs], ['--execs', execs], ['--file-mib', fileMib]] as const) {
      if (!Number.isInteger(v) || v < 1) throw new InvalidOptionError(name, `wants a whole number >= 1, got ${v}`);
    }
    if (!Number.isInteger(restores) || restores < 0) throw new InvalidOptionError('--restores', `wants a whole number >= 0, got ${restores}`);
    const modes = values.signalling.split(',');
    for (const m of modes) if (!parseSignalling(m)) throw new InvalidOptionError('--signalling', `"${m}" is not one of ${MODES.join(', ')}`);
    return { values, runs, execs, fileMib, restores, modes };
  });

  const file = randomBytes(fileMib * MiB);
  const times = new Map(modes.map((m) => [m, { boot: [], exec: [], write: [], read: [] } as ModeTimes]));
  const before = process.env.PVISOR_VIRTIO_SIGNALLING;
  let last: Vm | undefined;
  try {
    for (let r = 0; r < runs; r++) {
      for (const m of modes) {
        const t = times.get(m)!;
        const keep = r === runs - 1 && m === modes[0];
        const vm = await oneRun(m, execs, file, t, keep);
        if (keep) last = vm;
        progress(`run ${r + 1}/${runs} ${m}: ready in ${t.boot[r].toFixed(0)} ms, exec median ${stats(t.exec.slice(-execs)).median.toFixed(1)} ms, ${fileMib} MiB written in ${t.write[r].toFixed(0)} ms, read in ${t.read[r].toFixed(0)} ms`);
      }
    }
    progress('guest RAM of the last VM, 5 s after its work');
    await sleep(5000);
    const guestRamPssBytes = last!.memoryUsage().guestRamPssBytes;
    const clones = restores > 0 ? await cloneRuns(last!, restores) : undefined;

    const result = Object.fromEntries(modes.map((m) => {
      const t = times.get(m)!;
      const mibps = (xs: number[]) => stats(xs.map((x) => fileMib / (x / 1000)));
      return [m, { bootMs: stats(t.boot), execMs: stats(t.exec), writeMiBps: mibps(t.write), readMiBps: mibps(t.read) }];
    }));
    const rows: string[][] = [['figure (min / median / max)', ...modes]];
    rows.push([`boot to agent ready, ms (${runs} runs)`, ...modes.map((m) => ms(result[m].bootMs))]);
    rows.push([`exec round trip of true, ms (${runs * execs})`, ...modes.map((m) => ms(result[m].execMs))]);
    rows.push([`host to guest file, ${fileMib} MiB, MiB/s`, ...modes.map((m) => ms(result[m].writeMiBps))]);
    rows.push([`guest to host file, ${fileMib} MiB, MiB/s`, ...modes.map((m) => ms(result[m].readMiBps))]);
    printTable(rows);
    process.stdout.write(`guest RAM PSS once booted (${modes[0]}), MiB | ${(guestRamPssBytes / MiB).toFixed(1)}\n`);
    // The same VM size and signalling as the fresh boots of modes[0], so the ratio compares like with like.
    const clone = clones && {
      restores,
      readyMs: stats(clones.ready),
      ramMs: stats(clones.ram),
      agentMs: stats(clones.agent),
      bootMedianMs: result[modes[0]].bootMs.median,
      ratio: stats(clones.ready).median / result[modes[0]].bootMs.median,
      // What a restore costs beyond copying RAM in (which a shared RAM file avoids).
      ratioWithoutRam: stats(clones.ready.map((r, i) => r - clones.ram[i])).median / result[modes[0]].bootMs.median,
      sharedReadyMs: stats(clones.sharedReady),
      sharedRatio: stats(clones.sharedReady).median / result[modes[0]].bootMs.median,
    };
    if (clone) {
      printTable([
        [`clone of a booted VM (${modes[0]}), ms (min / median / max)`, `${restores} restores`],
        ['Vm.restore to agent ready', ms(clone.readyMs)],
        ['  of which reading guest RAM', ms(clone.ramMs)],
        ['  of which resume to the agent\'s RESTORED answer', ms(clone.agentMs)],
        ['fresh boot to agent ready, median', clone.bootMedianMs.toFixed(1)],
        ['restore / fresh boot (medians)', clone.ratio.toFixed(3)],
        ['restore less reading RAM / fresh boot (medians)', clone.ratioWithoutRam.toFixed(3)],
        ['SharedSnapshot clone to agent ready (the first checks the RAM file)', ms(clone.sharedReadyMs)],
        ['SharedSnapshot clone / fresh boot (medians; issue 11 goal <= 0.1)', clone.sharedRatio.toFixed(3)],
      ]);
    }
    const json = { runs, execs, fileMib, modes: result, guestRamPssBytes, ...(clone && { clone }) };
    if (values.json) writeFileSync(values.json, JSON.stringify(json, null, 2));
    else process.stdout.write(`${JSON.stringify(json)}\n`);
  } finally {
    last?.stop();
    if (before === undefined) delete process.env.PVISOR_VIRTIO_SIGNALLING;
    else process.env.PVISOR_VIRTIO_SIGNALLING = before;
  }
  return 0;
}
