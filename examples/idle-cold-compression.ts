// A sandbox that sits idle between an agent's tool calls keeps running, yet costs the host only
// the compressed size of what it does not touch; the next touch brings it back, checked.
// Run: node dist/examples/idle-cold-compression.js   (on a host with /dev/kvm)
import { ColdCompression, Vm } from 'pvisor';

const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(2)} MiB`;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function main(): Promise<void> {
  // Blocks unchanged for 2 s count as cold (the default, 10 s, suits a real agent's pauses).
  const cold = new ColdCompression({ coldAfterMs: 2000 });
  await using vm = await Vm.start({ guest: 'probe', memory: '512MiB', strategies: [cold] });
  await vm.probe.fill({ sizeMiB: 64, content: 'compressible', seed: 1 });
  const before = await vm.probe.digest();
  console.log(`working: guest RAM costs ${mib(vm.memoryUsage().guestRamPssBytes)}`);

  // The agent thinks; the VM idles. Wait until the store stops growing (a minute at most).
  let stored = -1;
  for (let i = 0; i < 60 && vm.memoryUsage().strategies[0].figures.blocksStored !== stored; i++) {
    stored = vm.memoryUsage().strategies[0].figures.blocksStored;
    await sleep(3000);
  }
  const { figures } = vm.memoryUsage().strategies[0];
  console.log(`idle: guest RAM costs ${mib(vm.memoryUsage().guestRamPssBytes)}, the compressed store ${mib(figures.storeBytes)} for ${mib(figures.bytesCompressedFrom)} of RAM`);

  const after = await vm.probe.digest(); // every block comes back on first touch
  console.log(`back at work: digest ${after.hex === before.hex ? 'unchanged' : 'CHANGED'}, ${vm.memoryUsage().strategies[0].figures.faultsServed} blocks brought back`);
  if (after.hex !== before.hex) process.exit(1);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
