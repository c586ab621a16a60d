// A suspended sandbox whose working set compresses well costs almost nothing, on disk too:
// suspend it to a zstd frame file, resume it later with every byte checked.
// Run: node dist/examples/compressed-offload.js   (on a host with /dev/kvm)
import { CompressedOffload, Vm } from 'pvisor';

const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(2)} MiB`;

async function main(): Promise<void> {
  const offload = new CompressedOffload();
  await using vm = await Vm.start({ guest: 'probe', memory: '512MiB', strategies: [offload] });
  await vm.probe.fill({ sizeMiB: 64, content: 'repetitive', seed: 1 });
  const before = await vm.probe.digest();
  console.log(`working: guest RAM costs ${mib(vm.memoryUsage().guestRamPssBytes)}`);

  await vm.suspend();
  await vm.memoryReleased(); // the frames are compressed and written after suspend() returns
  const { figures } = vm.memoryUsage().strategies[0];
  console.log(`suspended: guest RAM costs ${mib(vm.memoryUsage().guestRamPssBytes)}; ${mib(figures.bytesOnDisk)} on disk for ${mib(figures.bytesUncompressed)} of RAM (${figures.framesZstd} zstd, ${figures.framesRaw} raw, ${figures.framesZero} zero frames)`);

  await vm.resume();
  const after = await vm.probe.digest();
  console.log(`resumed: digest ${after.hex === before.hex ? 'unchanged' : 'CHANGED'}, guest RAM ${mib(vm.memoryUsage().guestRamPssBytes)}`);
  if (after.hex !== before.hex) process.exit(1);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
