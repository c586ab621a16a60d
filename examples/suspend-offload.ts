// An idle sandbox should cost the host almost nothing: suspend it to a file, resume it later
// with every byte intact.
// Run: node dist/examples/suspend-offload.js   (on a host with /dev/kvm)
import { Offload, Vm } from '../src';

const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`;

async function main(): Promise<void> {
  await using vm = await Vm.start({ guest: 'probe', memory: '512MiB', strategies: [new Offload()] });
  await vm.probe.fill({ sizeMiB: 64, content: 'random', seed: 1 });
  const before = await vm.probe.digest();
  console.log(`working: guest RAM costs ${mib(vm.memoryUsage().guestRamPssBytes)}`);

  await vm.suspend();
  console.log(`suspended: guest RAM costs ${mib(vm.memoryUsage().guestRamPssBytes)}`);

  await vm.resume();
  const after = await vm.probe.digest();
  console.log(`resumed: digest ${after.hex === before.hex ? 'unchanged' : 'CHANGED'}, guest RAM ${mib(vm.memoryUsage().guestRamPssBytes)}`);
  if (after.hex !== before.hex) process.exit(1);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
