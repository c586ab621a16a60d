// What a VM costs the host, and how free page reporting gives memory back: boot the probe guest,
// give it a 64 MiB working set, then let it free that memory.
// Run: node dist/examples/probe-memory.js   (on a host with /dev/kvm)
import { IdleRelease, Vm } from 'pvisor';

const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`;

async function main(): Promise<void> {
  // IdleRelease: the host drops the pages the guest reports free.
  await using vm = await Vm.start({ guest: 'probe', memory: '512MiB', vcpus: 2, strategies: [new IdleRelease()] });
  console.log(`booted: guest RAM costs ${mib(vm.memoryUsage().guestRamPssBytes)} of ${mib(vm.memoryBytes)}`);

  await vm.probe.fill({ sizeMiB: 64, content: 'random', seed: 7 });
  console.log(`after a 64 MiB working set: ${mib(vm.memoryUsage().guestRamPssBytes)}`);

  await vm.probe.release();
  console.log(`after the guest freed it: ${mib(vm.memoryUsage().guestRamPssBytes)}`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
