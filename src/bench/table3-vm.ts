/**
 * A VM of a Table 3 cell in a process of its own, as a `pvisor run` would be: `pvisor bench
 * memory-vm` (the child, {@link vmProcess}) runs one VM and answers the parent's requests one line
 * of JSON each; {@link VmProcess} is the parent's handle on it.
 */
import { LinuxWorkingSet } from '../guest/linux-workset';
import type { FillOptions, RewriteOptions } from '../guest/probe-client';
import { expectedDigestHex, type ProbeContent, type ProbeWorkingSet } from '../guest/probe-content';
import { KsmAdvice } from '../memory/strategies/ksm-advice';
import { PoolClient } from '../memory/strategies/pool-client';
import { SharedSnapshot } from '../memory/strategies/shared-snapshot';
import { Vm } from '../vm';
import type { CellCgroup } from './cell-cgroup';
import { CellProcess, parentLink } from './cell-process';
import type { Table3Guest } from './table3-setup';

/** What the parent asks a VM process. */
export type VmRequest =
  | { op: 'start'; guest: Table3Guest; ksm: boolean; pool?: string }
  | { op: 'merge' }
  | { op: 'restore'; guest: Table3Guest; dir: string }
  | { op: 'fill'; sizeMiB: number; content: ProbeContent; seed: number }
  | { op: 'rewrite'; seed: number }
  | { op: 'digest' }
  | { op: 'snapshot'; dir: string }
  | { op: 'stats' }
  | { op: 'stop' };

/** What a cell does to a VM's working set: the probe's own ops, or pvisor-workset's in the Linux guest. */
interface Table3Set {
  fill(options: FillOptions): Promise<unknown>;
  rewrite(options: RewriteOptions): Promise<unknown>;
  digest(): Promise<{ hex: string }>;
}

/** A boot or a restore of the Linux guest takes seconds natively and minutes in the nested harness. */
const LINUX_TIMEOUT_MS = 600_000;

/** `pvisor bench memory-vm`: one VM per process, one request per line, one answer each. */
export async function vmProcess(): Promise<void> {
  const link = parentLink();
  let vm: Vm | undefined;
  let set: Table3Set | undefined;
  let pool: PoolClient | undefined;
  const ram = () => Vm.liveGuestRam()[0];
  try {
    for (;;) {
      const line = await link.next();
      if (line === undefined) return; // the parent is gone: stop the VM
      const req = JSON.parse(line) as VmRequest;
      const t0 = performance.now();
      try {
        let reply: Record<string, unknown> = {};
        switch (req.op) {
          case 'start': {
            // Merges only when the parent asks, so that the cell times and watches them.
            pool = req.pool === undefined ? undefined : new PoolClient({ socket: req.pool, intervalMs: 3_600_000 });
            const strategies = [...(req.ksm ? [new KsmAdvice()] : []), ...(pool ? [pool] : [])];
            if (req.guest === 'linux') {
              vm = await Vm.start({ memory: '512MiB', vcpus: 2, strategies, bootTimeoutMs: LINUX_TIMEOUT_MS });
              set = await LinuxWorkingSet.start(vm);
            } else {
              vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, strategies });
              set = vm.probe;
            }
            reply = { guestRam: ram() };
            break;
          }
          case 'merge': {
            if (!pool?.connected) throw new Error('not connected to the pool');
            await pool.mergeNow();
            reply = { pool: vm!.memoryUsage().strategies.find((x) => x.strategy === 'pool-client')!.figures };
            break;
          }
          case 'restore':
            vm = await Vm.restore(req.dir, { strategies: [new SharedSnapshot()], ...(req.guest === 'linux' ? { readyTimeoutMs: LINUX_TIMEOUT_MS } : {}) });
            // The source's holder runs on in the clone: the parent checks its digests with its own model.
            set = req.guest === 'linux' ? LinuxWorkingSet.attach(vm, undefined) : vm.probe;
            reply = { guestRam: ram() };
            break;
          case 'fill':
            await set!.fill({ sizeMiB: req.sizeMiB, content: req.content, seed: req.seed });
            break;
          case 'rewrite':
            await set!.rewrite({ fraction: 1, seed: req.seed });
            break;
          case 'digest':
            reply = { hex: (await set!.digest()).hex };
            break;
          case 'snapshot': {
            const info = await vm!.snapshot(req.dir);
            reply = { ramDataPageCount: info.ramDataPageCount };
            break;
          }
          case 'stats':
            reply = { strategies: vm!.memoryUsage().strategies };
            break;
          case 'stop':
            await vm?.stop();
            vm = undefined;
            break;
        }
        link.say({ ok: true, ms: performance.now() - t0, ...reply });
        if (req.op === 'stop') return;
      } catch (e) {
        link.say({ ok: false, error: (e as Error).message });
      }
    }
  } finally {
    await vm?.stop();
  }
}

/** The parent's handle on one VM process. */
export class VmProcess {
  guestRam: { start: number; length: number } | undefined;
  constructor(readonly proc: CellProcess) {}

  static spawn(cgroup: CellCgroup | string, label: string): VmProcess {
    return new VmProcess(CellProcess.spawn(cgroup, ['memory-vm'], label));
  }

  /** Sends one request and waits for its answer; a refused request is an error naming the VM. */
  async call(req: VmRequest): Promise<Record<string, unknown> & { ms: number }> {
    this.proc.send(req);
    const reply = await this.proc.next();
    if (reply.ok !== true) throw new Error(`${this.proc.label}: ${req.op} failed: ${String(reply.error)}`);
    if (reply.guestRam) this.guestRam = reply.guestRam as { start: number; length: number };
    return reply as Record<string, unknown> & { ms: number };
  }

  /** Checks the guest's digest against the host's model of its working set. */
  async expectDigest(ws: ProbeWorkingSet, when: string): Promise<void> {
    const { hex } = (await this.call({ op: 'digest' })) as unknown as { hex: string };
    const want = expectedDigestHex(ws);
    if (hex !== want) throw new Error(`${this.proc.label}: digest ${when} is ${hex}, the host's model says ${want}`);
  }

  /** Asks it to stop its VM and exit; resolves with its exit status. */
  async stop(): Promise<number> {
    await this.call({ op: 'stop' });
    return this.proc.exited;
  }
}
