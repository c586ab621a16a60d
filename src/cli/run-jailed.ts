/**
 * `pvisor run --isolation process`: this process becomes the VM's launcher. It claims the VM's id
 * (its control socket in the runtime directory), starts the VMM in a jail (../jail/launcher.ts)
 * with the same arguments, relays each control request to the jailed VMM's own socket, and ends
 * with the VMM's exit status, or with the typed error of what killed it (its memory limit: a
 * {@link VmLimitError}; its seccomp filter: a {@link JailViolationError}). A snapshot is written
 * by the jailed VMM into its own backing directory and copied out by this process
 * (../jail/snapshot-handoff.ts).
 *
 * What lives in the host's network namespace is this process's: the VM's network (`--net`, made
 * by the launcher and handed to the jail as a TAP fd) and its published ports (`--publish`: this
 * process listens on 127.0.0.1 and forwards each connection through the jailed VM's control
 * socket, as `VmHandle.forward` does; a listener in the jail would be in its own, empty namespace).
 * So are what the jail's uid could not open (../jail/handed-files.ts): a writable rootfs, opened
 * here and handed in as an fd, and the pool daemon (`--vm-pool`), connected here, so that the
 * daemon knows the VM by this process's credentials (the user's) and not by the jail's shared uid.
 *
 * A hibernation (`pvisor suspend --hibernate`) is written by the jailed VMM into its backing
 * directory and taken out by this process once the VMM has ended (../jail/hibernation-handoff.ts),
 * with a record beside this process's socket that carries `--isolation=process`: `pvisor resume`
 * continues it in a new jail ({@link runJailed} with `resume`), moving it into that jail's backing
 * directory, where the jailed restore consumes it. A hibernation to an object store (`--store`)
 * goes the same way out of the jail, then this process sends it (the jail has neither the store's
 * network nor its credentials) and removes its copy; if the sending fails the VM stays hibernated
 * here, and the answer says so.
 */
import { randomBytes } from 'node:crypto';
import { closeSync, constants as fsConstants, existsSync, openSync, rmSync } from 'node:fs';
import { basename, join, resolve } from 'node:path';
import { constants as osConstants } from 'node:os';
import { connect } from 'node:net';
import { CONTROL_PROTOCOL_VERSION, controlRequest, ControlServer, ensureRuntimeDir, errorPayload, idOfSocket, runtimeDir, socketPathFor, type ControlHandler, type ControlResponse, type ControlStreamHandler } from '../control-socket';
import { InvalidOptionError, JailUnavailableError, SnapshotError, StoreError, VmStateError, type JailViolationError, type VmLimitError } from '../errors';
import { checkKvmHost } from '../backends/kvm/host-check';
import { checkJailHost, jailBackingDir, JailedVmm, MAX_RELAYED_ANSWER_BYTES, type JailPlan } from '../jail/launcher';
import { JAIL_ENV } from '../jail/jailed-entry';
import { HANDED_FILES_ENV } from '../jail/handed-files';
import { takeHibernation } from '../jail/hibernation-handoff';
import { checkHibernatedDir, logPathFor, readHibernationRecord, recordPathFor, writeHibernationRecord, type HibernationRecord } from '../snapshot/hibernation-record';
import { connectUnixSocket } from '../sys/unix-socket';
import { isStoreUrl } from '../store/store-url';
import type { StoreTransfer } from '../store/store-options';
import { closeFd } from '../sys/libc';
import { untilJailedReady } from '../jail/jailed-vm';
import { handOffSnapshot } from '../jail/snapshot-handoff';
import { resolveLimits } from '../jail/limits';
import { parseMac } from '../network/addresses';
import { parseNetworkOption, type NetworkPlan } from '../network/options';
import type { PortForward } from '../network/port-forward';
import { formatMiB, MAX_TIMEOUT_MS } from '../units';
import { validateVmName } from '../vm-name';
import type { RunArgs } from './run-args';
import { EXIT_HIBERNATED, RefusedError } from './usage';

/**
 * A hibernated VM that `pvisor resume` continues jailed: its record (read and checked by
 * ./resume-hibernated.ts), where it is, and whom to tell when it is ready or why not.
 */
export interface JailedResume {
  record: HibernationRecord;
  /** The record beside the socket; none for a VM fetched from a store (its claim there is its lock). */
  recordPath?: string;
  ready(report: { readyMs: number; ramLoad: string; processPssBytes: number; guestRamResidentBytes: number }): void;
}

/**
 * Runs `args` jailed (`argv`: the run's own arguments, passed on); resolves with the run's exit
 * status. With `resume`, continues that hibernated VM (`args.source` is its directory) in a new jail.
 */
export async function runJailed(args: RunArgs, argv: readonly string[], machine: { memoryBytes: number; vcpus: number }, resume?: JailedResume, fetchedDir?: string): Promise<number> {
  // The options' own checks were made first (checkRootfsFile, in ./run-command.ts), before the host is needed.
  requireJailHost(args);
  const limits = resolveLimits(args.limits, machine);
  // --vm-socket: this process listens there (the jailed run's own socket is the one it was handed).
  const explicit = args.socketPath;
  const id = args.name !== undefined ? validateVmName(args.name) : explicit !== undefined ? validateVmName(idOfSocket(explicit), 'vm-socket') : randomBytes(3).toString('hex');
  const { readOnly, readWrite } = resume ? { readOnly: [], readWrite: [] } : pathsOf(args);
  const path = explicit ?? socketPathFor(id);
  if (explicit === undefined) ensureRuntimeDir(runtimeDir());
  let vmm: JailedVmm | undefined;
  /** Once the VM has hibernated: where it went, and a promise that resolves when the answer has left. */
  let hibernated: { sent: Promise<void>; dir: string; bytesOnDisk: number; stored?: StoreTransfer | true } | undefined;
  /** While a hibernation is asked of the jailed VMM: settles once {@link hibernated} is said, or will not be. */
  let hibernating: Promise<void> | undefined;
  const relay: ControlHandler = async (request) => {
    if (!vmm) return { response: { ok: false, error: errorPayload(new VmStateError(`${id} is starting`)) } };
    const jailed = vmm;
    const ask = (r: typeof request) => controlRequest(jailed.innerSocketPath, id, r, MAX_TIMEOUT_MS, MAX_RELAYED_ANSWER_BYTES);
    let r: ControlResponse;
    try {
      if (request.op === 'hibernate') {
        // To a store: the jail has neither the store's network nor its credentials, so the jailed
        // VMM hibernates into its backing directory as always and this process sends what it
        // takes out. The prefix is checked first, before the VM is paused, as in-process.
        const toStore = request.store?.replace(/\/$/, '');
        const storeLib = toStore === undefined ? undefined : await import('../store/hibernate-store');
        if (toStore !== undefined) await storeLib!.checkHibernationPrefix(toStore, undefined);
        let settled!: () => void;
        hibernating = new Promise<void>((s) => (settled = s));
        const asked = ask({ ...request, store: undefined });
        // Settled once `hibernated` is said or will not be: the run's end waits for it (the VMM may end first).
        void asked.then((a) => (a.ok && a.hibernation ? taken : undefined), () => undefined).finally(() => setImmediate(settled));
        // The VMM ends once it has answered; what it left in its backing directory is taken before the jail comes down.
        const taken = new Promise<{ dir: string; record: HibernationRecord } | { error: unknown }>((done) =>
          jailed.beforeTeardown(async () => {
            const a = await asked.catch(() => undefined);
            if (!a?.ok || !a.hibernation) return;
            done(await takeHibernation(jailed, id, machine.memoryBytes, a.hibernation.dir, args.backingDir).catch((error: unknown) => ({ error })));
          }),
        );
        const answer = await asked;
        if (!answer.ok || !answer.hibernation) r = answer;
        else {
          const got = await taken;
          if ('error' in got) throw got.error;
          const record: HibernationRecord = { ...got.record, dir: got.dir, flags: jailedFlags(args.carriedFlags) };
          let sent!: () => void;
          // Said at once: the VMM has ended, and this process must not exit before the answer has left (below).
          const h: NonNullable<typeof hibernated> = { sent: new Promise<void>((s) => (sent = s)), dir: got.dir, bytesOnDisk: answer.hibernation.bytesOnDisk };
          hibernated = h;
          const { v: _v, ...rest } = answer as ControlResponse & { v?: unknown };
          const vm = rest.vm && { ...rest.vm, pid: process.pid };
          const log = logPathFor(path);
          try {
            if (toStore !== undefined) {
              const { putRunRecord, RUN_RECORD_NAME } = await import('../store/run-record');
              let failure: StoreError;
              try {
                const { transfer } = await storeLib!.sendHibernation(got.dir, toStore, undefined, () => putRunRecord({ ...record, dir: toStore }));
                // Sent: nothing of the VM stays on this host.
                rmSync(got.dir, { recursive: true, force: true });
                h.dir = toStore;
                h.stored = transfer ?? true;
                const hibernation = { ...answer.hibernation, dir: toStore, record: `${toStore}/${RUN_RECORD_NAME}`, log, ...(transfer && { store: transfer }) };
                return { response: { ...rest, ...(vm && { vm }), hibernation } as ControlResponse, afterSent: sent };
              } catch (e) {
                failure = new StoreError(e instanceof StoreError ? e.reason : 'unreachable', `${(e as Error).message}; ${id} is hibernated on this host instead, in ${got.dir}: pvisor resume ${id} continues it here`, { cause: e });
              }
              // The VM has ended, and its one copy is here: it stays hibernated on this host, and the answer says where.
              try {
                writeHibernationRecord(recordPathFor(path), record);
              } catch (e) {
                failure = new StoreError(failure.reason, `${failure.message} (but its record could not be written: ${(e as Error).message}; ${got.dir} holds the VM)`, { cause: failure });
              }
              return { response: { ok: false, error: errorPayload(failure), ...(vm && { vm }) }, afterSent: sent };
            }
            const recordPath = recordPathFor(path);
            writeHibernationRecord(recordPath, record);
            const hibernation = { ...answer.hibernation, dir: got.dir, record: recordPath, log };
            return { response: { ...rest, ...(vm && { vm }), hibernation } as ControlResponse, afterSent: sent };
          } catch (e) {
            sent();
            throw e;
          }
        }
      } else if (request.op === 'snapshot') {
        // The jailed VMM writes where it can (its backing directory); this process copies it out.
        const into = (target: string) =>
          handOffSnapshot(jailed, machine.memoryBytes, target, async (staging) => {
            const answer = await ask({ ...request, dir: staging });
            return { written: answer.ok, value: answer.ok && answer.snapshot ? { ...answer, snapshot: { ...answer.snapshot, dir: target } } : answer };
          });
        if (isStoreUrl(request.dir)) {
          // To a store: this process has its credentials and network (the jail has neither), so
          // it takes the copy into a work directory and sends it, as Vm.snapshot does in-process.
          const { snapshotToStore } = await import('../store/snapshot-store');
          const url = request.dir;
          const { written, transfer } = await snapshotToStore(url, undefined, into);
          r = written.ok && written.snapshot ? { ...written, snapshot: { ...written.snapshot, dir: url, store: transfer } } : written;
        } else r = await into(resolve(request.dir));
      } else r = await ask(request);
    } catch (e) {
      return { response: { ok: false, error: errorPayload(e) } };
    }
    const { v: _v, ...answer } = r as ControlResponse & { v?: unknown };
    // The process a user would signal is this one: the VMM's own pid is its pid namespace's.
    if (answer.vm) answer.vm = { ...answer.vm, pid: process.pid };
    return { response: answer as ControlResponse };
  };
  // A stream (spawn, a file stream, watch) is the rest of its connection: once its request is
  // passed on, the two sockets are piped to each other, each side's backpressure the other's,
  // so the jailed VMM's own credit and bounds hold end to end.
  const relayStream: ControlStreamHandler = (request, conn, leftover) => {
    if (!vmm) {
      conn.end(`${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, ok: false, error: errorPayload(new VmStateError(`${id} is starting`)) })}\n`);
      return;
    }
    const inner = connect(vmm.innerSocketPath);
    const end = () => {
      inner.destroy();
      conn.destroy();
    };
    inner.on('error', end);
    conn.on('error', end);
    // The VMM's side closing lets what it sent reach the client first (the pipe ends conn); a
    // client that goes takes its stream in the VMM with it.
    inner.on('close', () => conn.end());
    conn.on('close', () => inner.destroy());
    inner.once('connect', () => {
      inner.write(`${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, ...request })}\n`);
      if (leftover.length) inner.write(leftover);
      conn.pipe(inner);
      inner.pipe(conn);
    });
  };
  const server = await ControlServer.listen(path, id, relay, relayStream).catch((e: unknown) => {
    if (e instanceof InvalidOptionError && e.option === 'name') throw resume ? new RefusedError(`${id} is not hibernated: it is running (another pvisor resume continued it)`) : new RefusedError(e.message);
    throw e;
  });
  // Holding the socket, the id is this process's to check, as an unjailed run checks it (./run-control.ts).
  try {
    if (!resume?.recordPath && existsSync(recordPathFor(path))) {
      throw new RefusedError(new InvalidOptionError('name', `${id} is hibernated (${recordPathFor(path)}): pvisor resume ${id} continues it, pvisor stop ${id} discards it; or choose another --name`).message);
    }
    if (resume?.recordPath) {
      const record = readHibernationRecord(resume.recordPath, id);
      if (!record || record.dir !== resume.record.dir) throw new RefusedError(`${id} is not hibernated any more (resumed or discarded meanwhile)`);
      if (checkHibernatedDir(record.dir) === 'missing') throw new SnapshotError(`${id}'s hibernated state ${record.dir} is gone; pvisor stop ${id} removes its record`);
    }
  } catch (e) {
    server.close();
    throw e;
  }
  const stopOnSignal = (signal: NodeJS.Signals) => {
    if (!vmm) return;
    // The jailed run stops its VM cleanly, as on a signal of its own; if it cannot be reached, it is killed.
    const jailed = vmm;
    controlRequest(jailed.innerSocketPath, id, { op: 'stop', signal: signal === 'SIGINT' ? 'SIGINT' : 'SIGTERM' }, 30_000).catch(() => jailed.kill());
    process.stderr.write(`pvisor: ${id}: ${signal}, stopping the jailed VM\n`);
  };
  process.on('SIGINT', stopOnSignal);
  process.on('SIGTERM', stopOnSignal);
  const forwards: PortForward[] = [];
  const handed: NonNullable<JailPlan['handedFds']>[number][] = [];
  try {
    const { network, mac } = await networkOf(args);
    handed.push(...handedFiles(args));
    const plan: JailPlan = { id, limits, runArgv: withoutPublish(withAbsolutePaths(argv, process.cwd())), socketPath: path, readOnly, readWrite, backingParent: args.backingDir, handedFds: handed, ...(network.kind !== 'none' && { network, networkMac: mac }) };
    if (fetchedDir !== undefined) {
      plan.giveToJail = [fetchedDir];
      plan.runArgv = withoutPublish(withFrom(fetchedDir, withAbsolutePaths(argv, process.cwd())));
    }
    if (resume) {
      // The hibernated VM goes into the new jail's backing directory, which the jailed restore may consume.
      const name = basename(resume.record.dir);
      plan.moveIn = [{ from: resume.record.dir, name }];
      plan.runArgv = withoutPublish(withFrom(join(jailBackingDir(args.backingDir, id), name), argv));
      plan.env = { [JAIL_ENV.resumed]: '1' };
    }
    const t0 = performance.now();
    vmm = await JailedVmm.start(plan);
    if (vmm.reclaimed) process.stderr.write(`pvisor: ${vmm.reclaimed}\n`);
    if (!args.quiet) process.stderr.write(`pvisor: ${id} jailed (pid ${vmm.pid}): memory at most ${formatMiB(limits.memoryBytes)}, ${limits.cpus} CPU(s), ${limits.pids} tasks\n`);
    const ended = vmm.exited();
    if (args.publish.length) void publish(vmm, id, args, forwards, ended);
    if (resume) void resumeReady(vmm, id, resume, t0, ended);
    const outcome = await ended;
    if ('exitCode' in outcome && outcome.exitCode === EXIT_HIBERNATED) await hibernating;
    if ('exitCode' in outcome && outcome.exitCode === EXIT_HIBERNATED && hibernated) {
      await hibernated.sent;
      // As an unjailed run says it (./run-command.ts): the VM is out of its jail, and comes back in a new one.
      const stored = hibernated.stored;
      if (stored)
        process.stderr.write(
          `pvisor: ${id} hibernated to ${hibernated.dir}${stored === true ? '' : ` (${formatMiB(stored.bytesTransferred)} sent)`}, out of its jail; this process ends (exit ${EXIT_HIBERNATED}). ` +
            `pvisor resume ${id} --store ${hibernated.dir} continues it in a new jail, here or on another host\n`,
        );
      else
        process.stderr.write(
          `pvisor: ${id} hibernated into ${hibernated.dir} (${formatMiB(hibernated.bytesOnDisk)} on disk), out of its jail, to come back in a new one; this process ends (exit ${EXIT_HIBERNATED}). ` +
            `pvisor resume ${id} continues it in a new process, whose output goes to ${logPathFor(path)}\n`,
        );
    }
    if ('exitCode' in outcome) return outcome.exitCode;
    if ('error' in outcome) throw outcome.error as VmLimitError | JailViolationError;
    process.stderr.write(`pvisor: ${id}: the jailed VM process was killed by ${outcome.signal}\n`);
    return 128 + (osConstants.signals[outcome.signal] ?? 0);
  } finally {
    // The jail has its copies.
    for (const h of handed) closeFd(h.fd);
    for (const f of forwards) f.close();
    process.off('SIGINT', stopOnSignal);
    process.off('SIGTERM', stopOnSignal);
    server.close();
  }
}

/**
 * `--publish` for a jailed VM: once its VM is ready, this process listens on each host port and
 * forwards through the jailed VMM's socket. A port that cannot be had stops the VM, as it ends an
 * in-process run.
 */
async function publish(vmm: JailedVmm, id: string, args: RunArgs, forwards: PortForward[], ended: Promise<unknown>): Promise<void> {
  let gone = false;
  void ended.then(() => (gone = true));
  try {
    const handle = await Promise.race([untilJailedReady(id, vmm.innerSocketPath, MAX_TIMEOUT_MS), ended.then(() => undefined)]);
    for (const p of args.publish) {
      if (!handle || gone) return;
      const f = await handle.forward(p.guestPort, { hostPort: p.hostPort });
      forwards.push(f);
      if (gone) f.close();
      else if (!args.quiet) process.stderr.write(`pvisor: ${f.host}:${f.port} reaches the guest's port ${p.guestPort}\n`);
    }
  } catch (e) {
    if (gone) return;
    process.stderr.write(`pvisor: ${id}: --publish: ${(e as Error).message}; stopping the jailed VM\n`);
    controlRequest(vmm.innerSocketPath, id, { op: 'stop' }, 30_000).catch(() => vmm.kill());
  }
}

/**
 * The run's arguments without `--publish` (before `--`): the launcher publishes, not the jailed
 * run. Pure.
 */
export function withoutPublish(argv: readonly string[]): string[] {
  const dash = argv.indexOf('--');
  const own = dash >= 0 ? argv.slice(0, dash) : [...argv];
  const out: string[] = [];
  for (let i = 0; i < own.length; i++) {
    if (own[i] === '--publish') i++;
    else if (!own[i].startsWith('--publish=')) out.push(own[i]);
  }
  return [...out, ...(dash >= 0 ? argv.slice(dash) : [])];
}

/**
 * The network the launcher makes for the VM: `--net`'s, or for `--from` the snapshot's policy
 * with its guest's MAC, as Vm.restore makes it in-process (each restored VM a TAP of its own).
 */
async function networkOf(args: RunArgs): Promise<{ network: NetworkPlan; mac?: Buffer }> {
  const { source } = args;
  if (source.kind === 'boot') return { network: parseNetworkOption(source.network) };
  const { SnapshotReader } = await import('../snapshot/snapshot-dir');
  const snapshot = SnapshotReader.open(source.dir);
  snapshot.close();
  const saved = snapshot.state.network;
  if (!saved) return { network: { kind: 'none' } };
  // Checked when the snapshot was read: a 'nat' option and a unicast MAC.
  return { network: parseNetworkOption(saved.option), mac: parseMac(saved.mac) };
}

/** The host files the VM reads and writes, which its jail mounts at the same paths. */
function pathsOf(args: RunArgs): { readOnly: string[]; readWrite: string[] } {
  const readOnly: string[] = [];
  const readWrite: string[] = [];
  const { source } = args;
  if (source.kind === 'snapshot') readOnly.push(source.dir);
  else {
    if (source.kernel) readOnly.push(resolve(source.kernel));
    if (source.initrd) readOnly.push(resolve(source.initrd));
    // A writable one is handed in as an open file (handedFiles): the jail's uid could not open it.
    if (source.rootfs?.readOnly) readOnly.push(resolve(source.rootfs.path));
  }
  return { readOnly, readWrite };
}

/**
 * `pvisor resume` of a jailed VM: once the jailed VM answers, its record goes (the VM is back in a
 * process) and the resume that started this process is told.
 */
async function resumeReady(vmm: JailedVmm, id: string, resume: JailedResume, t0: number, ended: Promise<unknown>): Promise<void> {
  try {
    const handle = await Promise.race([untilJailedReady(id, vmm.innerSocketPath, MAX_TIMEOUT_MS), ended.then(() => undefined)]);
    if (!handle) return;
    const readyMs = Math.round((performance.now() - t0) * 10) / 10;
    const status = await controlRequest(vmm.innerSocketPath, id, { op: 'status' }, MAX_TIMEOUT_MS);
    if (!status.ok || !status.memory) throw new VmStateError(`${id} is ${status.vm?.state ?? 'not answering'}`);
    if (resume.recordPath) rmSync(resume.recordPath, { force: true });
    resume.ready({ readyMs, ramLoad: status.vm?.ramLoad ?? 'read', processPssBytes: status.memory.processPssBytes, guestRamResidentBytes: status.memory.guestRamResidentBytes });
  } catch (e) {
    process.stderr.write(`pvisor: ${id}: the resumed jailed VM did not answer: ${(e as Error).message}; stopping it\n`);
    vmm.kill();
  }
}

/** A hibernated jailed VM's flags: the run's, with `--isolation=process` said, so that it comes back jailed whatever the default. Pure. */
export function jailedFlags(carried: readonly string[]): string[] {
  return [...carried.filter((f) => !f.startsWith('--isolation=')), '--isolation=process'];
}

/**
 * The jailed run's arguments with `--from` what the jail sees (a hibernated VM's place in its
 * backing directory, a fetched snapshot's local copy), then the others as given. Pure.
 */
export function withFrom(from: string, argv: readonly string[]): string[] {
  const dash = argv.indexOf('--');
  const own = (dash >= 0 ? argv.slice(0, dash) : [...argv]).filter((f) => !f.startsWith('--from='));
  const i = own.indexOf('--from');
  if (i >= 0) own.splice(i, 2);
  return ['--from', from, ...own, ...(dash >= 0 ? argv.slice(dash) : [])];
}

/**
 * What the jail's uid could not open itself, opened here and handed in as fds
 * (../jail/handed-files.ts): a writable rootfs, and a connection to the pool daemon. The caller
 * closes them once the jail has its copies. A pool that cannot be reached is not handed: the
 * jailed client says so and runs on, as an unjailed one does.
 */
function handedFiles(args: RunArgs): NonNullable<JailPlan['handedFds']>[number][] {
  const out: NonNullable<JailPlan['handedFds']>[number][] = [];
  const { source } = args;
  try {
    if (source.kind === 'boot' && source.rootfs && !source.rootfs.readOnly) {
      const image = resolve(source.rootfs.path);
      let fd: number;
      try {
        fd = openSync(image, fsConstants.O_RDWR);
      } catch (e) {
        throw new InvalidOptionError('rootfs', `cannot open ${image} for reading and writing: ${(e as Error).message}`);
      }
      out.push({ fd, env: HANDED_FILES_ENV.rootfs, value: String });
    }
    const pool = args.carriedFlags.find((f) => f.startsWith('--vm-pool='))?.slice('--vm-pool='.length);
    if (pool !== undefined) {
      try {
        out.push({ fd: connectUnixSocket(pool), env: HANDED_FILES_ENV.pool, value: String });
      } catch {
        // Unreachable now: the jailed client reports it.
      }
    }
  } catch (e) {
    for (const h of out) closeSync(h.fd);
    throw e;
  }
  return out;
}

/**
 * Refuses, before anything is claimed or started, a run this host cannot jail, saying why and the
 * way out. Never a silent (or loud) fallback to an unjailed VMM: whoever relies on the jail, by
 * default or by asking, gets it or an error, and running unjailed is said on the command line.
 * A host without KVM is refused as an unjailed run would refuse it.
 */
function requireJailHost(args: RunArgs): void {
  checkKvmHost();
  try {
    checkJailHost();
  } catch (e) {
    if (!(e instanceof JailUnavailableError)) throw e;
    const how = args.isolationGiven ? 'pvisor run --isolation process runs' : 'pvisor run runs';
    throw new JailUnavailableError(
      `${how} each VM in a jail of its own (docs/security.md), and this host cannot make one: ${e.message}. ` +
        'Fix that, or run the VM unjailed with --isolation none (its VMM then runs in this process, as this user, without the jail\'s namespaces, seccomp filter and limits)',
      { cause: e },
    );
  }
}

/** The run options that name a host path: bound into the jail at the same absolute path. */
const PATH_FLAGS = ['kernel', 'initrd', 'rootfs', 'from', 'vm-pool', 'vm-backing-dir'];

/**
 * The run's arguments with every path option (before `--`) made absolute against `cwd`: the
 * jailed VMM's working directory is not this one (nothing of the host's is in its root), and its
 * files are bound at their absolute paths. A store URL stays as it is. Pure.
 */
export function withAbsolutePaths(argv: readonly string[], cwd: string): string[] {
  const dash = argv.indexOf('--');
  const own = dash >= 0 ? argv.slice(0, dash) : [...argv];
  const abs = (v: string) => (isStoreUrl(v) ? v : resolve(cwd, v));
  const out: string[] = [];
  for (let i = 0; i < own.length; i++) {
    const m = /^--([a-z-]+)(=(.*))?$/s.exec(own[i]);
    if (m && PATH_FLAGS.includes(m[1])) {
      if (m[2] !== undefined) out.push(`--${m[1]}=${abs(m[3])}`);
      else if (i + 1 < own.length) out.push(own[i], abs(own[++i]));
      else out.push(own[i]);
    } else out.push(own[i]);
  }
  return [...out, ...(dash >= 0 ? argv.slice(dash) : [])];
}
