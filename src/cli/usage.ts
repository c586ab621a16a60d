/**
 * How `pvisor` and `pvisor-daemon` are used and how they end: each command's usage text (printed
 * on stdout by `--help`, exit 0), `--version`, and the exit statuses, as conventional CLIs have
 * them: 2 for a usage error (an unknown option, a bad value, a missing argument; reported before
 * anything is started or printed about a VM), 1 for a request refused as it stands (no VM of that
 * id, a VM in a state the request cannot apply to, a taken --name, a snapshot directory that is
 * not empty), 125 when pvisor itself fails (docker's convention, so that it cannot be mistaken for
 * the status of the command run in the guest), otherwise the command's own status.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { InvalidOptionError, PvisorError, VmNotFoundError } from '../errors';
import { StrategyConflictError } from '../memory/strategy';
import { PACKAGE_ROOT } from '../native';
import { reportJailedExit } from '../jail/jailed-entry';

/** Exit status of a usage error. */
export const EXIT_USAGE = 2;
/**
 * Exit status of a request refused as it stands ({@link RefusedError}, a VmNotFoundError): the
 * caller's to change, unlike {@link EXIT_PVISOR_FAILURE}.
 */
export const EXIT_REFUSED = 1;
/** Exit status when pvisor itself fails (host unsupported, guest crash, I/O error...). */
export const EXIT_PVISOR_FAILURE = 125;
/**
 * Exit status of a `pvisor run` whose VM hibernated (`pvisor suspend ID --hibernate`): its CMD
 * or steps did not finish here, and go on in the process that `pvisor resume ID` starts. 128 +
 * SIGTSTP, the signal that suspends a job, so that it reads as neither CMD's status nor a stop.
 */
export const EXIT_HIBERNATED = 128 + 20;

/**
 * A request that cannot apply as things stand, refused before anything changed: `pvisor resume`
 * of a VM that runs (nothing to resume), `pvisor suspend` of a suspended or hibernated one, a
 * `--name` that a running VM has, a snapshot into a directory that is not empty. Exits 1
 * ({@link EXIT_REFUSED}), with its message alone.
 */
export class RefusedError extends Error {}

/** A command line that does not say what the command accepts; `command` is e.g. `run` or `bench soak`. */
export class UsageError extends Error {
  constructor(
    readonly program: string,
    readonly command: string,
    message: string,
  ) {
    super(message);
  }
}

/**
 * Runs `parse` (a command's argument parsing and checking, which starts nothing) and turns what it
 * refuses (an {@link InvalidOptionError}, memory strategies that cannot be composed, or Node's
 * parseArgs errors) into a {@link UsageError}.
 */
export function parseUsage<T>(command: string, parse: () => T, program = 'pvisor'): T {
  try {
    return parse();
  } catch (e) {
    if (e instanceof InvalidOptionError || e instanceof StrategyConflictError || isParseArgsError(e)) throw new UsageError(program, command, (e as Error).message);
    throw e;
  }
}

function isParseArgsError(e: unknown): boolean {
  return e instanceof Error && 'code' in e && String(e.code).startsWith('ERR_PARSE_ARGS');
}

/** Whether `--help` or `-h` is among a command's own arguments (not in CMD after `--`). */
export function wantsHelp(argv: readonly string[]): boolean {
  const dash = argv.indexOf('--');
  const own = dash >= 0 ? argv.slice(0, dash) : argv;
  return own.includes('--help') || own.includes('-h');
}

/** The package's version, from its package.json. */
export function packageVersion(): string {
  return (JSON.parse(readFileSync(join(PACKAGE_ROOT, 'package.json'), 'utf8')) as { version: string }).version;
}

/**
 * Runs a program's `main` and exits with its status, mapping what it throws to the statuses in
 * this module's comment: a usage error prints its message and where to read the usage.
 */
export function runProgram(program: string, main: (argv: string[]) => Promise<number>): void {
  main(process.argv.slice(2)).then(
    (code) => {
      reportJailedExit(code);
      process.exit(code);
    },
    (e: unknown) => {
      if (e instanceof UsageError) {
        const help = e.command ? `${e.program} ${e.command} --help` : `${e.program} --help`;
        process.stderr.write(`${e.program}: ${e.message}\n(${help} says what it accepts)\n`);
      } else if (e instanceof VmNotFoundError || e instanceof RefusedError || e instanceof PvisorError) process.stderr.write(`${program}: ${e.message}\n`);
      else process.stderr.write(`${program}: unexpected error: ${e instanceof Error ? e.stack : String(e)}\n`);
      reportJailedExit(exitStatusOf(e));
      process.exit(exitStatusOf(e));
    },
  );
}

/** The exit status for what a command threw, as this module's comment says. */
export function exitStatusOf(e: unknown): number {
  if (e instanceof UsageError) return EXIT_USAGE;
  if (e instanceof VmNotFoundError || e instanceof RefusedError) return EXIT_REFUSED;
  return EXIT_PVISOR_FAILURE;
}

const RUN = `  pvisor run [--executor vm] [--name ID] [--memory 512MiB] [--vcpus 2] [--guest linux|probe] [--console]
             [--vm-ram-dedup] [--vm-idle-release] [--vm-offload [--vm-offload-reload eager|lazy]]
             [--vm-ram-compression] [--vm-cold-ram-compression [--vm-cold-after 10s]]
             [--vm-backing-dir DIR] [--vm-pool SOCKET [--vm-pool-scope S]] [--vm-socket PATH]
             [--kernel BZIMAGE] [--initrd CPIO] [--isolation process|none] [--limit-{memory,cpus,pids} V]...
             [--rootfs IMAGE [--rootfs-readonly]] [--net none|nat|tap:NAME [--net-allow RULE]... [--net-deny RULE]...]
             [--publish HOSTPORT:GUESTPORT]... [--label KEY=VALUE]... [--quiet] -- CMD [ARGS...]
      Boots a fresh VM, runs CMD in it, prints its output, exits with its status, tears the VM down.
      The Linux guest (the default) needs hardware virtualisation; CMD is an argv, run without a
      shell. --kernel/--initrd boot your own instead of the shipped ones.
      --executor vm: the only executor; --memory: guest RAM, a multiple of 4 KiB (512MiB, 1GiB); --vcpus: 1 to 8.
      --console: the guest's serial console on stderr as [console] lines; past 1 MiB that stderr
        has not taken yet, lines are dropped, and a line says how many once it catches up.
      --rootfs IMAGE: CMD runs in this root filesystem (an ext4 image with the tools CMD needs,
        e.g. made with mke2fs -t ext4 -d DIR IMAGE 256M), attached read-write as /dev/vda and
        shut down cleanly at the end, so what CMD wrote is in the image;
        --rootfs-readonly attaches it read-only (the image needs /dev and /proc and a clean
        journal: e2fsck -p IMAGE).
      --net nat: the guest gets eth0 on a TAP pvisor creates, NAT to the host's uplinks (needs
        CAP_NET_ADMIN, /dev/vhost-net, nft and ip); --net-allow / --net-deny RULE (repeatable):
        only / never these (deny wins), RULE a hostname, *.DOMAIN or CIDR[:PORT]; the guest's
        DNS is then pvisor's, answering allowed names only. --net tap:NAME: your own TAP,
        nothing configured on the host. Default none: no network device. docs/networking.md.
      --publish HOSTPORT:GUESTPORT (repeatable): 127.0.0.1:HOSTPORT reaches the guest's TCP
        GUESTPORT through the agent channel (no network needed; the guest runs nc per connection).
      --name ID: the VM's id for suspend/resume/stop/ps (default: 6 random hex digits); the run
        listens on ID.sock in $PVISOR_RUNTIME_DIR, $XDG_RUNTIME_DIR/pvisor, /run/pvisor (root) or
        /tmp/pvisor-$UID (--vm-socket PATH: there instead). SIGINT/SIGTERM stop the VM cleanly.
        The SDK reaches it too: VmHandle.connect(ID). It runs jailed (needs root, bwrap, cgroups;
        else exit 125) unless --isolation none; --limit-{memory,cpus,pids} bound it: docs/security.md.
      --label KEY=VALUE (repeatable, at most 64): labels shown by pvisor ps and Vm.list().
      -q, --quiet: no progress lines on stderr, only CMD's output, warnings and errors.
      --vm-ram-dedup: KSM merges identical guest pages (needs KSM running on the host).
      --vm-idle-release: the host drops pages the guest reports free.
      --vm-pool SOCKET: pages this VM has in common with other VMs of its scope (--vm-pool-scope,
        default "default"; one per tenant) are kept once, in the pool of the pvisor-daemon
        listening on SOCKET (pvisor-daemon serve --memory-pool), and mapped copy-on-write.
        A scope is its uid's; gid:GID:NAME is shared by the members of group GID.
      --vm-cold-ram-compression: while the VM runs, blocks unchanged for a while are compressed
        (lz4) into host memory and dropped; the guest's first touch brings them back.
        --vm-cold-after DURATION: how long unchanged (default 10s; 500ms, 30s, 2m).
      --vm-offload: suspend writes the VM's own guest RAM to a backing file and drops it as it
        becomes durable (the default; suspend returns at once, the memory follows).
      --vm-offload-reload: resume brings it all back and checks it first (eager, the default) or
        lets the guest run at once, each piece loaded on first touch and the rest in the
        background (lazy, through userfaultfd).
      --vm-ram-compression: the same with a zstd-compressed backing file (CompressedOffload;
        needs the optional dependency zstd-napi).
      --vm-backing-dir DIR: where the backing file goes (default /var/tmp); a directory on
        tmpfs or ramfs is refused at suspend, since offloading into RAM frees nothing.
      With --guest probe, CMD is a list of probe steps, e.g.
        pvisor run --guest probe -- fill 64MiB random 42, digest, memory
      Steps: fill SIZE [repetitive|random|compressible] [SEED], rewrite PERCENT% [SEED], touch SIZE [ROUNDS],
             digest, release [OFFSET SIZE], idle, memory, pause, suspend, resume,
             sleep SECONDS (or 500ms, 2m), wait (last step: until pvisor stop ID or a signal)
  pvisor run --from DIR|s3://BUCKET/PREFIX [--shared] [--name ID] [--console] [--label KEY=VALUE]... [--quiet] [--vm-... memory strategy flags] -- CMD
      Restores the VM a snapshot holds (written by pvisor snapshot or vm.snapshot()) instead of
      booting one, runs CMD in it as above (probe steps for a probe snapshot) and listens on its
      control socket as above. Its memory, vCPUs, guest and disks are the snapshot's: --memory,
      --vcpus, --guest, --kernel, --initrd and --rootfs are refused beside --from.
      --shared: guest RAM is the snapshot's RAM file mapped copy-on-write (SharedSnapshot), so
        clones of one snapshot share the pages they only read and each pays for what it writes.
      Exit status: CMD's (128+N if a signal N killed it); 2 for a usage error; 1 if --name is
      taken; 125 if pvisor failed;
      ${EXIT_HIBERNATED} if the VM hibernated (pvisor suspend ID --hibernate): CMD goes on after pvisor resume ID.
`;

const SUSPEND = `  pvisor suspend ID [--vm-offload] [--hibernate [--store s3://B/P]] [--vm-socket PATH] [--vm-job-id ID] [--vm-attempt-id A] [--json]
      Pauses the VM started by pvisor run --name ID; with --vm-offload its RAM goes to disk too.
      --hibernate (implies --vm-offload): the VM's whole state goes to --vm-backing-dir (default
        /var/tmp), or --store to a new object store prefix (any host resumes it), and its process
        ends. A probe step under way finishes first, the rest after the resume; a Linux guest's
        processes run on, detached (output dropped, stdin closed). Refused for a suspended VM, a
        writable rootfs or --net tap:NAME (--net nat gets a new TAP).
`;
const RESUME = `  pvisor resume ID [--vm-load] [--foreground] [--store s3://B/P [--take-over CLAIM]] [--vm-socket PATH] [--vm-job-id ID] [--vm-attempt-id A] [--json]
      Lets it run again; RAM that a suspend offloaded is loaded back and verified first.
      A hibernated VM goes on in a new, detached process with the same id and control socket,
        its guest RAM loaded lazily; its output (the probe steps left, pvisor's messages) goes to
        ID.log beside the socket. --foreground: in this process instead, its output here.
      --store: one hibernated there goes on here, at most once (--take-over: docs/object-store.md).
      Refused (exit 1) if there is nothing to resume: the VM runs.
`;
const SNAPSHOT = `  pvisor snapshot ID DIR|s3://BUCKET/PREFIX [--leave-paused] [--vm-socket PATH] [--json]
      Writes a snapshot of the VM started by pvisor run --name ID into DIR (new or empty; relative
      to this shell): guest RAM as a sparse file, its machine state and a checksummed manifest,
      all read-only. The VM pauses for it and runs on after; --leave-paused: it stays paused until
      pvisor resume ID. pvisor run --from DIR restores it. s3://BUCKET/PREFIX: docs/object-store.md.
`;
const STOP = `  pvisor stop ID [--vm-socket PATH] [--vm-job-id ID] [--vm-attempt-id A] [--json]
      Stops the VM; its run ends. A hibernated VM is discarded: its state is removed from disk.
`;
const PS = `  pvisor ps [--json]
      Live and hibernated VMs: id, state, guest RAM resident, memory, bytes on disk, pid, labels.
`;
const CONTROL_EXIT = `      Exit status: 0; 2 for a usage error; 1 if no VM of that id is running or hibernated, or if
      the request cannot apply to it as it stands (resume of a running VM, suspend of a suspended
      or hibernated one, a snapshot into a directory that is not empty); 125 if it failed.
`;

const BENCH_VMM = `  pvisor bench vmm [--runs 5] [--exits 100000] [--json FILE]
      Start-to-ready time, exits per second against a native C loop, the VMM's memory per VM.
`;
const BENCH_LINUX = `  pvisor bench linux [--runs 3] [--execs 20] [--file-mib 10] [--signalling LIST] [--restores 3]
                     [--json FILE]
      The Linux guest: boot to agent ready, exec round trip, a file written and read back, for
      each way virtio devices signal (--signalling, default all four), guest RAM once booted, and
      clones of a snapshot of the booted VM: restore to agent ready against a fresh boot.
`;
const BENCH_MEMORY = `  pvisor bench memory [--table 1,2,3] [--guest probe|linux] [--modes LIST] [--contents repetitive,random]
                      [--placements 1,8] [--backing-dir DIR] [--working-set 64MiB] [--shared-vms 4] [--floor-runs 5]
                      [--cold-cpu-share 0.05] [--working-sets LIST] [--schemes LIST] [--ksm-read-after 60s]
                      [--snapshot-dir DIR] [--json FILE]
      The reference study's Tables 1 and 2: each cell a fresh 512 MiB VM in its own process and
      cgroup, resident (group PSS), guest RAM PSS, group memory, offload costs, the study beside.
      --shared-vms N: also N offloaded VMs in one process (0 skips it); --floor-runs N: runs of
      each physical floor measured first (0 skips them).
      --guest linux: the shipped Linux guest, whose data a process holds (pvisor-workset in its
      initramfs); its default modes are the study's (default, idle-release, cold-compression,
      offload, compressed-offload) and its default --placements 1,8: each cell once with one VM
      in the process and once with 8 (figures per VM, the process shared among them).
      --contents agent (with --guest linux): the agent workload's rows, each VM booting the agent
      rootfs read-only (scripts/agent-rootfs.sh builds it) and its program holding a compiled
      TypeScript project; idle-release drops the guest's caches, Table 2's task is its work.
      Modes cold-compression and cold-compression-mix (16 MiB hot, the rest cold) add a cold
      compression table: time to settle, store size, scanner CPU, faults/s against a native
      userfaultfd loop; --contents compressible is the study's distinct compressible pages.
      --cold-cpu-share: ColdCompression's share of a CPU in those cells (default 0.05, the
        product's); in the nested harness, 20-50x slower than hardware, 1 lets it finish within
        the study's reading time as it does on hardware at 0.05.
      --table 3 (or 1,2,3; the default is 1,2): the study's Table 3, four 512 MiB VMs, one process
        each, in one cgroup per cell: schemes private, shared snapshot + COW (four clones of one
        snapshot in --snapshot-dir, on a disk), KSM (turned on for the cell, read after
        --ksm-read-after, default 60s; settings put back after), daemon-pool (a pvisor-daemon in
        the cell; two merge passes after all four fill) and daemon-pool-arriving (each VM fills
        after the passes that followed the one before); working sets same repetitive,
        same random, unique random (--working-sets, --schemes); per VM = group PSS / 4, before
        and after a 100% rewrite; then each VM exits alone and the others' digests are checked.
        With --guest linux, on the shipped Linux guest (pvisor-workset holds each working set).
`;
const BENCH_SNAPSHOT = `  pvisor bench snapshot [--runs 5] [--dir DIR] [--json FILE]
      Snapshots of a probe VM with a 64 MiB working set, and restores of them (private and
      shared) against fresh starts; the snapshots go under DIR (default /var/tmp).
`;
const BENCH_FLOORS = `  pvisor bench floors [--dir DIR] [--size 64MiB] [--runs 5] [--json FILE]
      The host's physical floors for the same bytes (C, no VM): copies into fresh memory and by
      UFFDIO_COPY, write + fdatasync, cold and warm reads back; DIR (default
      /var/tmp/pvisor-bench-floors) must be on a disk.
`;
const BENCH_SOAK = `  pvisor bench soak [--cycles 1000] [--strategy LIST] [--vms 1] [--working-set 16MiB]
                    [--backing-dir DIR] [--json FILE]
      Suspend/resume cycles of 128 MiB probe VMs, each checked against the guest's digest, per
      strategy (none, idle-release, offload-eager, offload-lazy, compressed-offload) in a fresh
      process: cycles, failures, host RSS/PSS before and after, growth of the live JS heap
      (after a full collection), time per cycle (median, p99).
      --vms N runs N VMs in one process at once. Exits 1 if a cycle failed.
`;
const BENCH_FLEET = `  pvisor bench fleet [--guest probe|linux] [--runs 3] [--clones 16] [--working-set 32MiB] [--dir DIR]
                     [--bucket pvisor] [--json FILE]
      Snapshots in an object store (probe guest): restore to ready locally, from the store with
      a cold and a warm chunk cache; bytes read before ready; the upload of a child that changed
      8 MiB; N SharedSnapshot clones on one host: chunks fetched, guest RAM PSS per clone beside
      N clones of the local snapshot (--clones 0 skips them). --guest linux: a 256 MiB Linux
      VM's restore to agent ready, local lazy and from the store, instead. The store is the one
      AWS_ENDPOINT_URL names, else one it starts (scripts/object-store.sh, root) and stops.
`;

/** The bench subcommands a user runs, and their usage. */
export const BENCH_USAGE = {
  vmm: BENCH_VMM,
  linux: BENCH_LINUX,
  memory: BENCH_MEMORY,
  snapshot: BENCH_SNAPSHOT,
  floors: BENCH_FLOORS,
  soak: BENCH_SOAK,
  fleet: BENCH_FLEET,
} as const;

/** A bench subcommand a user runs. */
export type BenchName = keyof typeof BENCH_USAGE;

const BENCH = Object.values(BENCH_USAGE).join('');

/** Usage of each `pvisor` command (`bench X` for a bench). */
export const PVISOR_USAGE: Record<string, string> = {
  run: RUN,
  suspend: SUSPEND + CONTROL_EXIT,
  resume: RESUME + CONTROL_EXIT,
  snapshot: SNAPSHOT + CONTROL_EXIT,
  stop: STOP + CONTROL_EXIT,
  ps: PS,
  bench: BENCH,
  ...Object.fromEntries(Object.entries(BENCH_USAGE).map(([name, text]) => [`bench ${name}`, text])),
};

/** `pvisor --help`: the commands a user runs; the benches are `pvisor bench --help`'s. */
export const PVISOR_HELP = `pvisor: KVM sandboxes that cost the host only the memory they use

Usage:
${RUN}${SUSPEND}${RESUME}${SNAPSHOT}${STOP}${PS}  pvisor bench NAME ...
      Benchmarks against the reference study (vmm, linux, memory, snapshot, floors, soak, fleet):
      pvisor bench --help lists them.
  pvisor --help | COMMAND --help | --version (-v, -V)

Exit status: 2 for a usage error, 1 for a refused request, 125 if pvisor itself failed,
otherwise the command's own.
`;

const DAEMON_SERVE = `  pvisor-daemon serve --memory-pool [--socket PATH] [--max-pool 1GiB] [--group GROUP]
                      [--max-clients 1024] [--max-clients-per-uid 256]
      Holds one copy of each page that VMs started with --vm-pool (SDK: new PoolClient()) have in
      common, in a memfd they map copy-on-write. The socket is 0600 (0660 and of GROUP with
      --group); every peer's credentials are checked. A scope is its uid's; gid:GID:NAME is
      group GID's. It serves at most --max-clients connections, --max-clients-per-uid of one
      uid. SIGTERM or SIGINT ends it; VMs keep the pages they map and carry on without the pool.
`;
const DAEMON_STATUS = `  pvisor-daemon status [--socket PATH] [--json]
      Prints the pool's size, and the pages, references and clients of the scopes this uid may
      see (its own and its groups'; root sees all).
`;

/** Usage of each `pvisor-daemon` command. */
export const DAEMON_USAGE: Record<string, string> = { serve: DAEMON_SERVE, status: DAEMON_STATUS };

/** `pvisor-daemon --help`. */
export const DAEMON_HELP = `pvisor-daemon: the page pool that pvisor VMs share

Usage:
${DAEMON_SERVE}${DAEMON_STATUS}  pvisor-daemon --help | COMMAND --help | --version

The socket defaults to pool.sock in $PVISOR_RUNTIME_DIR, else $XDG_RUNTIME_DIR/pvisor, else
/run/pvisor (root) or /tmp/pvisor-$UID.
Exit status: 2 for a usage error, 125 if the daemon failed, 0 otherwise.
`;

/** Prints a command's usage on stdout (its `--help`); resolves with the status 0. */
export function printUsage(text: string): number {
  process.stdout.write(`Usage:\n${text}`);
  return 0;
}
