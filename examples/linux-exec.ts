// An agent framework's everyday loop: boot a Linux sandbox, hand it a file, run a command on it,
// read the result back. Needs hardware virtualisation (or the nested harness: scripts/with-kvm.js).
// Run: node dist/examples/linux-exec.js
import { Vm } from 'pvisor';

async function main(): Promise<void> {
  await using vm = await Vm.start({ memory: '512MiB', vcpus: 2, bootTimeoutMs: 180_000 });
  await vm.files.write('/work/input.txt', 'banana\napple\ncherry\n');
  const sorted = await vm.exec('sort /work/input.txt > /work/sorted.txt && wc -l < /work/sorted.txt', { timeoutMs: 30_000 });
  console.log(`sort exited ${sorted.exitCode}, ${sorted.stdout.trim()} lines`);
  console.log((await vm.files.read('/work/sorted.txt')).toString());
  if (sorted.exitCode !== 0) process.exit(1);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
