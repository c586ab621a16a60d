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
 */
import { randomBytes } from 'node:crypto';
import { resolve } from 'node:path';
import { constants as osConstants } from 'node:os';
import { connect } from 'node:net';
import { CONTROL_PROTOCOL_VERSION, controlRequest, ControlServer, ensureRuntimeDir, errorPayload, idOfSocket, runtimeDir, socketPathFor, type ControlHandler, type ControlResponse, type ControlStreamHandler } from '../control-socket';
import { InvalidOptionError, VmStateError, type JailViolationError, type VmLimitError } from '../errors';
import { JailedVmm, MAX_RELAYED_ANSWER_BYTES } from '../jail/launcher';
import { untilJailedReady } from '../jail/jailed-vm';
import { handOffSnapshot } from '../jail/snapshot-handoff';
import { resolveLimits } from '../jail/limits';
import { parseMac } from '../network/addresses';
import { parseNetworkOption, type NetworkPlan } from '../network/options';
import type { PortForward } from '../network/port-forward';
import { formatMiB, MAX_TIMEOUT_MS } from '../units';
import { validateVmName } from '../vm-name';
import type { RunArgs } from './run-args';
import { RefusedError } from './usage';

/** Runs `args` jailed (`argv`: the run's own arguments, passed on); resolves with the run's exit status. */
export async function runJailed(args: RunArgs, argv: readonly string[], machine: { memoryBytes: number; vcpus: number }): Promise<number> {
  const limits = resolveLimits(args.limits, machine);
  // --vm-socket: this process listens there (the jailed run's own socket is the one it was handed).
  const explicit = args.socketPath;
  const id = args.name !== undefined ? validateVmName(args.name) : explicit !== undefined ? validateVmName(idOfSocket(explicit), 'vm-socket') : randomBytes(3).toString('hex');
  const { readOnly, readWrite } = pathsOf(args);
  const path = explicit ?? socketPathFor(id);
  if (explicit === undefined) ensureRuntimeDir(runtimeDir());
  let vmm: JailedVmm | undefined;
  const relay: ControlHandler = async (request) => {
    if (request.op === 'hibernate') {
      return { response: { ok: false, error: errorPayload(new InvalidOptionError(request.op, `not available for a jailed VM yet (its process would have to be started again in a jail by pvisor resume); run it with --isolation none`)) } };
    }
    if (!vmm) return { response: { ok: false, error: errorPayload(new VmStateError(`${id} is starting`)) } };
    const jailed = vmm;
    const ask = (r: typeof request) => controlRequest(jailed.innerSocketPath, id, r, MAX_TIMEOUT_MS, MAX_RELAYED_ANSWER_BYTES);
    let r: ControlResponse;
    try {
      if (request.op === 'snapshot') {
        // The jailed VMM writes where it can (its backing directory); this process copies it out.
        const target = resolve(request.dir);
        r = await handOffSnapshot(jailed, machine.memoryBytes, target, async (staging) => {
          const answer = await ask({ ...request, dir: staging });
          return { written: answer.ok, value: answer.ok && answer.snapshot ? { ...answer, snapshot: { ...answer.snapshot, dir: target } } : answer };
        });
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
    throw e instanceof InvalidOptionError && e.option === 'name' ? new RefusedError(e.message) : e;
  });
  const stopOnSignal = (signal: NodeJS.Signals) => {
    if (!vmm) return;
    // The jailed run stops its VM cleanly, as on a signal of its own; if it cannot be reached, it is killed.
    const jailed = vmm;
    controlRequest(jailed.innerSocketPath, id, { op: 'stop' }, 30_000).catch(() => jailed.kill());
    process.stderr.write(`pvisor: ${id}: ${signal}, stopping the jailed VM\n`);
  };
  process.on('SIGINT', stopOnSignal);
  process.on('SIGTERM', stopOnSignal);
  const forwards: PortForward[] = [];
  try {
    const { network, mac } = await networkOf(args);
    vmm = await JailedVmm.start({ id, limits, runArgv: withoutPublish(argv), readOnly, readWrite, backingParent: args.backingDir, ...(network.kind !== 'none' && { network, networkMac: mac }) });
    if (!args.quiet) process.stderr.write(`pvisor: ${id} jailed (pid ${vmm.pid}): memory at most ${formatMiB(limits.memoryBytes)}, ${limits.cpus} CPU(s), ${limits.pids} tasks\n`);
    const ended = vmm.exited();
    if (args.publish.length) void publish(vmm, id, args, forwards, ended);
    const outcome = await ended;
    if ('exitCode' in outcome) return outcome.exitCode;
    if ('error' in outcome) throw outcome.error as VmLimitError | JailViolationError;
    process.stderr.write(`pvisor: ${id}: the jailed VM process was killed by ${outcome.signal}\n`);
    return 128 + (osConstants.signals[outcome.signal] ?? 0);
  } finally {
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
    if (source.rootfs) (source.rootfs.readOnly ? readOnly : readWrite).push(resolve(source.rootfs.path));
  }
  return { readOnly, readWrite };
}
