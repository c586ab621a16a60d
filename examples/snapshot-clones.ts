// Prepare a sandbox once, then start clones of it that share its memory: each clone pays the host
// only for the pages it writes.
// Run: node dist/examples/snapshot-clones.js   (on a host with /dev/kvm)
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { SharedSnapshot, Vm } from 'pvisor';

const mib = (bytes: number) => `${(bytes / 2 ** 20).toFixed(1)} MiB`;

async function main(): Promise<void> {
  const dir = join(mkdtempSync('/var/tmp/pvisor-example-'), 'prepared');
  try {
    // The prepared state: a VM with a 64 MiB working set (an agent's tools, loaded once).
    const prepared = await Vm.start({ guest: 'probe', memory: '512MiB' });
    await prepared.probe.fill({ sizeMiB: 64, content: 'random', seed: 7 });
    const expected = (await prepared.probe.digest()).hex;
    await prepared.snapshot(dir);
    await prepared.stop();

    // Four sandboxes from it; one of them goes on to write 16 MiB of its own.
    const clones = await Promise.all([1, 2, 3, 4].map(() => Vm.restore(dir, { strategies: [new SharedSnapshot()] })));
    await clones[0].probe.rewrite({ fraction: 0.25, seed: 1 });
    const digests = await Promise.all(clones.map(async (c) => (await c.probe.digest()).hex)); // each reads its whole working set
    for (const [i, clone] of clones.entries()) {
      const u = clone.memoryUsage();
      console.log(`clone ${i}: ${i === 0 ? 'rewrote 16 MiB' : digests[i] === expected ? 'as prepared' : 'CHANGED'}; ` +
        `shared ${mib(u.guestRamSharedBytes)}, its own ${mib(u.guestRamPrivateBytes)}, charged (PSS) ${mib(u.guestRamPssBytes)}`);
      if (i > 0 && digests[i] !== expected) process.exitCode = 1;
    }
    for (const clone of clones) await clone.stop();
  } finally {
    rmSync(join(dir, '..'), { recursive: true, force: true });
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
