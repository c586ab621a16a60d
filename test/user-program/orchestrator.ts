// A user's program, type-checked against the shipped .d.ts under the strictest settings a user
// may have (test/unit/dts-strict.test.ts). It is compiled, never run: each line is a use the
// README and the API docs show, written as a strict user writes it.
import {
  ColdCompression,
  CompressedOffload,
  IdleRelease,
  InvalidOptionError,
  KsmAdvice,
  Offload,
  SharedSnapshot,
  Vm,
  VmHandle,
  type ExecResult,
  type VmOptions,
} from 'pvisor';
import type { MemoryStrategy, StrategyContext, StrategyStats } from 'pvisor/strategy';

/** A strategy of the user's own, written against 'pvisor/strategy'. */
class CountSuspends implements MemoryStrategy {
  readonly name = 'count-suspends';
  readonly needs = [] as const;
  readonly exclusive = [] as const;
  private suspends = 0;
  async suspend(ctx: StrategyContext): Promise<void> {
    this.suspends++;
    ctx.warn(`${ctx.vmName} suspended ${this.suspends} times`);
  }
  stats(): StrategyStats {
    return { strategy: this.name, figures: { suspends: this.suspends }, notes: [] };
  }
}

async function orchestrate(): Promise<void> {
  const options: VmOptions = {
    memory: '512MiB',
    vcpus: 1,
    strategies: [new IdleRelease(), new Offload({ dir: '/var/tmp' }), new KsmAdvice(), new CountSuspends()],
    labels: { team: 'agents' },
    env: { LANG: 'C.UTF-8' },
    timeoutMs: 60_000,
    onTimeout: 'suspend',
    network: { mode: 'nat', allow: ['10.1.0.0/16:443'] },
    logger: console,
  };
  await using vm = await Vm.start(options);
  vm.on('state', (state) => console.log(state));
  const r: ExecResult = await vm.exec('echo hi', { env: { A: '1' }, cwd: '/tmp', timeoutMs: 5000, onStdout: (s) => console.log(s) });
  const first: string | undefined = r.stdout.split('\n')[0];
  console.log(first, r.exitCode);
  const bytes = await vm.exec(['cat', '/etc/hostname'], { encoding: 'buffer' });
  console.log(bytes.stdout.byteLength);
  await vm.files.write('/tmp/x', 'data');
  console.log((await vm.files.stat('/tmp/x')).size, await vm.files.read('/tmp/x'));
  const p = vm.spawn('cat', { stdin: true });
  p.stdin?.end('x');
  console.log((await p.exited).exitCode);
  const fwd = await vm.forward(8080);
  console.log(fwd.port);
  await fwd.close();
  const snap = await vm.snapshot('/var/tmp/snap');
  console.log(snap.ms);
  const clone = await Vm.restore('/var/tmp/snap', { strategies: [new SharedSnapshot(), new ColdCompression()] });
  await clone.stop();
  await vm.suspend();
  await vm.resume();
  vm.setTimeout(120_000);
  console.log(vm.memoryUsage().guestRamPssBytes, vm.labels.team);
  const other = await Vm.start({ guest: 'probe', memory: '64MiB', strategies: [new CompressedOffload()] });
  await other.stop();
  for (const entry of await Vm.list({ labels: { team: 'agents' } })) console.log(entry.name, entry.state);
  const handle = await VmHandle.connect('agent-1');
  console.log((await handle.exec('true')).exitCode);
}

orchestrate().catch((e: unknown) => {
  if (e instanceof InvalidOptionError) console.error(e.message);
});
