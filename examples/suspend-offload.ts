// An idle sandbox should cost the host almost nothing: suspend it to a file, resume it later
// with every byte intact.
// Run: node dist/examples/suspend-offload.js   (on a host with /dev/kvm)
import { Offload, Vm } from 'pvisor';

const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`;

async function main(): Promise<void> {
  await using vm = await Vm.start({ guest: 'probe', memory: '512MiB', strategies: [new Offload()] });
  await vm.probe.fill({ sizeMiB: 64, content: 'random', seed: 1 });
  const before = await vm.probe.digest();
  console.log(`working: guest RAM costs ${mib(vm.memoryUsage().guestRamPssBytes)}`);

  // suspend() returns as soon as the VM is stopped and the write-out is under way; the memory
  // follows as each batch is safely on disk.
  let t0 = performance.now();
  await vm.suspend();
  console.log(`suspended in ${(performance.now() - t0).toFixed(1)} ms`);
  await vm.memoryReleased();
  console.log(`memory released after ${(performance.now() - t0).toFixed(1)} ms: guest RAM costs ${mib(vm.memoryUsage().guestRamPssBytes)}`);

  t0 = performance.now();
  await vm.resume();
  console.log(`resumed in ${(performance.now() - t0).toFixed(1)} ms`);
  const after = await vm.probe.digest();
  console.log(`resumed: digest ${after.hex === before.hex ? 'unchanged' : 'CHANGED'}, guest RAM ${mib(vm.memoryUsage().guestRamPssBytes)}`);
  if (after.hex !== before.hex) process.exit(1);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
