#!/usr/bin/env node
/**
 * The `pvisor` command.
 */
import { PvisorError, VmNotFoundError } from '../errors';
import { cmdRun } from './run-command';

const HELP = `pvisor: KVM sandboxes that cost the host only the memory they use

Usage:
  pvisor run [--name ID] [--memory 512MiB] [--vcpus 2] [--guest linux|probe] [--console]
             [--vm-ram-dedup] [--vm-idle-release] [--vm-offload [--vm-offload-reload eager|lazy]]
             [--vm-ram-compression] [--vm-backing-dir DIR] [--vm-pool SOCKET [--vm-pool-scope S]]
             [--kernel BZIMAGE] [--initrd CPIO]
             [--rootfs IMAGE [--rootfs-readonly]] [--net none|nat|tap:NAME [--net-allow CIDR[:PORT]]...]
             [--publish HOSTPORT:GUESTPORT]... -- CMD [ARGS...]
      Boots a fresh VM, runs CMD in it, prints its output, exits with its status, tears the VM down.
      The Linux guest (the default) needs hardware virtualisation; CMD is an argv, run without a
      shell. --kernel/--initrd boot your own instead of the shipped ones.
      --rootfs IMAGE: CMD runs in this root filesystem (an ext4 image with the tools CMD needs,
        e.g. made with mke2fs -t ext4 -d DIR IMAGE 256M), attached read-write as /dev/vda and
        shut down cleanly at the end, so what CMD wrote is in the image;
        --rootfs-readonly attaches it read-only (the image needs /dev and /proc and a clean
        journal: e2fsck -p IMAGE).
      --net nat: the guest gets eth0 on a TAP pvisor creates, NAT to the host's uplinks (needs
        CAP_NET_ADMIN, /dev/vhost-net, nft and ip); --net-allow CIDR[:PORT] (repeatable): only
        these destinations, everything else dropped on the host. --net tap:NAME: your own TAP,
        nothing configured on the host. Default none: no network device. docs/networking.md.
      --publish HOSTPORT:GUESTPORT (repeatable): 127.0.0.1:HOSTPORT reaches the guest's TCP
        GUESTPORT through the agent channel (no network needed; the guest runs nc per connection).
      --name ID: the VM's id for suspend/resume/stop/ps (default: 6 random hex digits); the run
        listens on ID.sock in $PVISOR_RUNTIME_DIR, $XDG_RUNTIME_DIR/pvisor, /run/pvisor (root) or
        /tmp/pvisor-$UID (--vm-socket PATH: there instead). SIGINT/SIGTERM stop the VM cleanly.
      --vm-ram-dedup: KSM merges identical guest pages (needs KSM running on the host).
      --vm-idle-release: the host drops pages the guest reports free.
      --vm-pool SOCKET: pages this VM has in common with other VMs of its scope (--vm-pool-scope,
        default "default"; one per tenant) are kept once, in the pool of the pvisor-daemon
        listening on SOCKET (pvisor-daemon serve --memory-pool), and mapped copy-on-write.
      --vm-cold-ram-compression: while the VM runs, blocks unchanged for a while are compressed
        (lz4) into host memory and dropped; the guest's first touch brings them back.
        --vm-cold-after DURATION: how long unchanged (default 10s; 500ms, 30s, 2m).
      --vm-offload: suspend writes the VM's own guest RAM to a backing file and drops it as it
        becomes durable (the default; suspend returns at once, the memory follows).
      --vm-offload-reload: resume brings it all back and checks it first (eager, the default) or
        lets the guest run at once, each piece loaded on first touch and the rest in the
        background (lazy, through userfaultfd).
      --vm-ram-compression: the same with a zstd-compressed backing file (CompressedOffload).
      --vm-backing-dir DIR: where the backing file goes (default /var/tmp); a directory on
        tmpfs or ramfs is refused at suspend, since offloading into RAM frees nothing.
      With --guest probe, CMD is a list of probe steps, e.g.
        pvisor run --guest probe -- fill 64MiB random 42, digest, memory
      Steps: fill SIZE [repetitive|random|compressible] [SEED], rewrite PERCENT% [SEED], touch SIZE [ROUNDS],
             digest, release [OFFSET SIZE], idle, memory, pause, suspend, resume,
             sleep SECONDS (or 500ms, 2m), wait (last step: until pvisor stop ID or a signal)
  pvisor run --from DIR [--shared] [--name ID] [--console] [--vm-... memory strategy flags] -- CMD
      Restores the VM a snapshot holds (written by pvisor snapshot or vm.snapshot()) instead of
      booting one, runs CMD in it as above (probe steps for a probe snapshot) and listens on its
      control socket as above. Its memory, vCPUs, guest and disks are the snapshot's: --memory,
      --vcpus, --guest, --kernel, --initrd and --rootfs are refused beside --from.
      --shared: guest RAM is the snapshot's RAM file mapped copy-on-write (SharedSnapshot), so
        clones of one snapshot share the pages they only read and each pays for what it writes.
  pvisor suspend ID [--vm-offload] [--vm-socket PATH] [--vm-job-id ID] [--vm-attempt-id A] [--json]
      Pauses the VM started by pvisor run --name ID; with --vm-offload its RAM goes to disk too.
  pvisor resume ID [--vm-load] [--vm-socket PATH] [--vm-job-id ID] [--vm-attempt-id A] [--json]
      Lets it run again; RAM that a suspend offloaded is loaded back and verified first.
  pvisor snapshot ID DIR [--leave-paused] [--vm-socket PATH] [--json]
      Writes a snapshot of the VM started by pvisor run --name ID into DIR (new or empty; relative
      to this shell): guest RAM as a sparse file, its machine state and a checksummed manifest,
      all read-only. The VM pauses for it and runs on after; --leave-paused: it stays paused until
      pvisor resume ID. pvisor run --from DIR restores it.
  pvisor stop ID [--vm-socket PATH] [--json]
      Stops the VM; its run ends.
  pvisor ps [--json]
      Live VMs: id, state, guest RAM resident, memory, bytes on disk, pid.
  pvisor bench vmm [--runs N] [--json FILE]
      Start-to-ready time, exits per second against a native C loop, the VMM's memory per VM.
  pvisor bench linux [--runs 3] [--execs 20] [--restores 3] [--json FILE]
      The Linux guest: boot to agent ready, exec round trip, guest RAM once booted, and clones
      of a snapshot of the booted VM: restore to agent ready against a fresh boot.
  pvisor bench memory [--table 1,2,3] [--modes LIST] [--contents repetitive,random] [--backing-dir DIR]
                      [--working-sets LIST] [--schemes LIST] [--ksm-read-after 60s] [--snapshot-dir DIR]
                      [--json FILE]
      The reference study's Tables 1 and 2: each cell a fresh 512 MiB VM in its own process and
      cgroup, resident (group PSS), guest RAM PSS, group memory, offload costs, the study beside.
      Modes cold-compression and cold-compression-mix (16 MiB hot, the rest cold) add a cold
      compression table: time to settle, store size, scanner CPU, faults/s against a native
      userfaultfd loop; --contents compressible is the study's distinct compressible pages.
      --table 3 (or 1,2,3; the default is 1,2): the study's Table 3, four 512 MiB VMs, one process
        each, in one cgroup per cell: schemes private, shared snapshot + COW (four clones of one
        snapshot in --snapshot-dir, on a disk) and KSM (turned on for the cell, read after
        --ksm-read-after, default 60s; settings put back after); working sets same repetitive,
        same random, unique random (--working-sets, --schemes); per VM = group PSS / 4, before
        and after a 100% rewrite; then each VM exits alone and the others' digests are checked.
  pvisor bench floors [--dir DIR] [--size 64MiB] [--runs 5] [--json FILE]
      The host's physical floors for the same bytes (C, no VM): copies into fresh memory and by
      UFFDIO_COPY, write + fdatasync, cold and warm reads back; DIR (default
      /var/tmp/pvisor-bench-floors) must be on a disk.
  pvisor bench soak [--cycles 1000] [--strategy LIST] [--vms 1] [--working-set 16MiB]
                    [--backing-dir DIR] [--json FILE]
      Suspend/resume cycles of 128 MiB probe VMs, each checked against the guest's digest, per
      strategy (none, idle-release, offload-eager, offload-lazy, compressed-offload) in a fresh
      process: cycles, failures, host RSS/PSS before and after, growth of the live JS heap
      (after a full collection), time per cycle (median, p99).
      --vms N runs N VMs in one process at once. Exits 1 if a cycle failed.
  pvisor help | --help
`;

/** Exit status when pvisor itself fails (bad options, host unsupported, guest crash). */
const EXIT_PVISOR_ERROR = 125;
/** Exit status of suspend/resume/stop when no VM of that id is running. */
const EXIT_NO_SUCH_VM = 2;

async function main(argv: string[]): Promise<number> {
  const [cmd, ...rest] = argv;
  switch (cmd) {
    case 'run':
      return cmdRun(rest);
    case 'suspend':
    case 'resume':
    case 'stop': {
      const { cmdControl } = await import('./control-commands');
      return cmdControl(cmd, rest);
    }
    case 'snapshot': {
      const { cmdSnapshot } = await import('./snapshot-command');
      return cmdSnapshot(rest);
    }
    case 'ps': {
      const { cmdPs } = await import('./control-commands');
      return cmdPs(rest);
    }
    case 'bench': {
      const { cmdBench } = await import('./bench');
      return cmdBench(rest);
    }
    case undefined:
    case 'help':
    case '--help':
    case '-h':
      process.stdout.write(HELP);
      return cmd === undefined ? 2 : 0;
    default:
      process.stderr.write(`pvisor: unknown command ${JSON.stringify(cmd)}\n\n${HELP}`);
      return 2;
  }
}

main(process.argv.slice(2)).then(
  (code) => process.exit(code),
  (e: unknown) => {
    if (e instanceof VmNotFoundError) {
      process.stderr.write(`pvisor: ${e.message}\n`);
      process.exit(EXIT_NO_SUCH_VM);
    }
    if (e instanceof PvisorError) process.stderr.write(`pvisor: ${e.message}\n`);
    else if (e instanceof Error && 'code' in e && String(e.code).startsWith('ERR_PARSE_ARGS')) process.stderr.write(`pvisor: ${e.message}\n\n${HELP}`);
    else process.stderr.write(`pvisor: unexpected error: ${e instanceof Error ? e.stack : String(e)}\n`);
    process.exit(EXIT_PVISOR_ERROR);
  },
);
