// A sandbox whose guest crashes ends with an event; the host process and other VMs go on.
// Run: node dist/examples/crash-isolation.js   (on a host with /dev/kvm)
import { Vm } from 'pvisor';

async function main(): Promise<void> {
  await using healthy = await Vm.start({ guest: 'probe', memory: '128MiB', vcpus: 1 });
  const doomed = await Vm.start({ guest: 'probe', memory: '128MiB', vcpus: 1 });

  const crashed = new Promise<Error>((resolve) => doomed.once('crash', resolve));
  doomed.probe.fault('triple-fault');
  console.log(`doomed VM: ${(await crashed).message} (state ${doomed.state})`);

  await healthy.probe.fill({ sizeMiB: 8, content: 'repetitive' });
  console.log(`healthy VM still answers: digest ${(await healthy.probe.digest()).hex}`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
