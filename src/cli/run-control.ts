/**
 * `pvisor run`'s end of the control socket: claims the VM's id, answers status, suspend, resume,
 * snapshot, hibernate and stop against the running {@link Vm}, and turns SIGINT/SIGTERM into a
 * clean stop. The protocol is in docs/control-protocol.md.
 */
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { jailedRecordPathFor } from '../jail/hibernation-handoff';
import { InvalidOptionError, VmStateError } from '../errors';
import type { ExecResult } from '../guest/guest-types';
import type { Labels } from '../labels';
import { memoryBackedFilesystem } from '../memory/backing-file';
import type { Vm } from '../vm';
import type { GuestKind } from '../vm-types';
import { hibernationDirFor, logPathFor, recordPathFor, writeHibernationRecord, type HibernationRecord } from '../snapshot/hibernation-record';
import { formatProbeScript, parseProbeScript, runProbeScript, type ProbeStep, type ScriptCursor } from './probe-script';
import {
  ControlServer,
  ensureRuntimeDir,
  errorPayload,
  idOfSocket,
  runtimeDir,
  socketPathFor,
  type ControlHandler,
  type ControlHibernation,
  type ControlMemory,
  type ControlRequest,
  type ControlResponse,
  type ControlVmInfo,
} from '../control-socket';
import { validateVmName } from '../vm-name';
import { filesCall, serveRunStream } from './run-streams';

/** What ended a run from outside its steps. */
export type StopCause = 'pvisor stop' | 'SIGINT' | 'SIGTERM';

/** What the run is about to start (for answers while it boots). */
export interface RunDescription {
  /** `--name`; default: a short generated id. */
  name?: string;
  /** `--vm-socket`; default: `<runtime dir>/<id>.sock`. */
  socketPath?: string;
  guest: GuestKind;
  memoryBytes: number;
  vcpus: number;
  /** What goes on with the VM if it hibernates. */
  carry: RunCarry;
  /** `--label`s, for answers while it boots (then the VM's own). */
  labels?: Labels;
  /** The run continues a hibernated VM: its record is expected beside the socket, not refused. */
  resuming?: boolean;
  /**
   * A jailed run: the control socket is this fd, already listening (its launcher bound it and
   * relays `socketPath` to it); nothing is claimed in a runtime directory.
   */
  listenFd?: number;
}

/** What a hibernation record carries of the run besides the VM (see ../snapshot/hibernation-record.ts). */
export interface RunCarry {
  /** The run's flags that go on with the VM (RunArgs.carriedFlags). */
  flags: string[];
  /** Where the hibernated VM goes: the run's backing directory, on a disk. */
  backingDir: string;
  /** Linux guest: CMD. */
  command: string[];
  /** Probe guest: where its steps are. */
  script?: ScriptCursor;
}

const SIGNAL_EXIT: Record<StopCause, number> = {
  // `pvisor stop` is a polite SIGTERM, as `docker stop` is.
  'pvisor stop': 128 + 15,
  SIGINT: 128 + 2,
  SIGTERM: 128 + 15,
};

/** The control socket and signal handling of one `pvisor run`. */
export class RunControl {
  /** @internal The VM once booted (its streams are served against it). */
  vm: Vm | undefined;
  /** Control operations run one at a time: two suspends at once would pause twice. */
  private queue: Promise<unknown> = Promise.resolve();
  private cause: StopCause | undefined;
  private hibernated: ControlHibernation | undefined;
  private answered: (() => void) | undefined;
  private readonly hibernationAnswered = new Promise<void>((resolve) => (this.answered = resolve));
  private readonly onSignal = (signal: NodeJS.Signals) => this.requestStop(signal as StopCause);
  /** When the run claimed its id: the VM's age in `pvisor ps` and Vm.list counts from here. */
  private readonly startedAt = new Date().toISOString();

  private constructor(
    /** The VM's id. */
    readonly id: string,
    private readonly server: ControlServer,
    /** What the run started (or continues). */
    readonly description: RunDescription,
  ) {
    process.on('SIGINT', this.onSignal);
    process.on('SIGTERM', this.onSignal);
  }

  /**
   * Claims the id's socket before the VM boots, so that a taken id fails without starting anything.
   */
  static async open(description: RunDescription): Promise<RunControl> {
    const explicit = description.socketPath;
    if (description.listenFd !== undefined) {
      const id = validateVmName(description.name ?? '', 'name');
      const self: { control?: RunControl } = {};
      const server = await ControlServer.listenOnFd(
        description.listenFd,
        explicit ?? `${id}.sock`,
        (r) => self.control!.handle(r),
        (r, conn, leftover) => serveRunStream(self.control!.vm, () => self.control!.info(), r, conn, leftover),
      );
      self.control = new RunControl(id, server, description);
      return self.control;
    }
    let id = description.name !== undefined ? validateVmName(description.name) : explicit ? validateVmName(idOfSocket(explicit), 'vm-socket') : generateId();
    for (let attempt = 0; ; attempt++) {
      // A socket path given by the user is used as it is; the default directory is made private.
      const path = explicit ?? socketPathFor(id);
      if (!explicit) ensureRuntimeDir(runtimeDir());
      try {
        const self: { control?: RunControl } = {};
        const server = await ControlServer.listen(
          path,
          id,
          (r) => self.control!.handle(r),
          (r, conn, leftover) => serveRunStream(self.control!.vm, () => self.control!.info(), r, conn, leftover),
        );
        // Holding the socket, the id is ours to check: a hibernated VM of this id has no process
        // listening, and a new VM must not take its id from under it.
        if (!description.resuming && existsSync(recordPathFor(path))) {
          server.close();
          throw new InvalidOptionError('name', `${id} is hibernated (${recordPathFor(path)}): pvisor resume ${id} continues it, pvisor stop ${id} discards it; or choose another --name`);
        }
        self.control = new RunControl(id, server, description);
        return self.control;
      } catch (e) {
        // A generated id that happens to be taken: draw another.
        const generated = description.name === undefined && !explicit;
        if (!(generated && e instanceof InvalidOptionError && attempt < 3)) throw e;
        id = generateId();
      }
    }
  }

  /** The socket's path. */
  get socketPath(): string {
    return this.server.path;
  }

  /** The VM has booted: requests now act on it. */
  attach(vm: Vm): void {
    this.vm = vm;
  }

  /** Why the VM was stopped from outside, if it was. */
  get stopCause(): StopCause | undefined {
    return this.cause;
  }

  /** The run's exit status after a stop from outside its steps. */
  get stopExitCode(): number {
    return this.cause ? SIGNAL_EXIT[this.cause] : 0;
  }

  /** Where the VM went if it hibernated (its process then ends). */
  get hibernation(): ControlHibernation | undefined {
    return this.hibernated;
  }

  /**
   * Once the VM has hibernated: resolves when the answer has left (the run must not exit before
   * the client has it).
   */
  hibernationSent(): Promise<void> {
    return this.hibernationAnswered;
  }

  /** Stops listening, removes the socket and gives signals back their default meaning. */
  close(): void {
    process.off('SIGINT', this.onSignal);
    process.off('SIGTERM', this.onSignal);
    this.server.close();
  }

  private requestStop(cause: StopCause): void {
    this.cause ??= cause;
    if (!this.vm) {
      // Still booting: nothing of the guest's is worth keeping, and a boot cannot be cut short.
      process.stderr.write(`pvisor: ${this.id}: ${cause} while booting; exiting\n`);
      this.close();
      process.exit(SIGNAL_EXIT[cause]);
    }
    const vm = this.vm;
    // After any suspend or resume in progress: stopping unmaps guest RAM under a strategy's feet.
    void this.enqueue(() => vm.stop());
  }

  private enqueue<T>(op: () => Promise<T>): Promise<T> {
    const run = this.queue.then(op);
    this.queue = run.catch(() => {});
    return run;
  }

  private readonly handle: ControlHandler = (request: ControlRequest) =>
    // A command may run for long: it is not queued behind, nor holds up, pause, resume or stop.
    request.op === 'exec' ? this.exec(request) : request.op === 'files' ? this.files(request) : this.enqueue(async () => {
      const vm = this.vm;
      if (!vm) return { response: { ok: false, error: errorPayload(new VmStateError(`${this.id} is starting`)), vm: this.info() } };
      try {
        switch (request.op) {
          case 'status':
            return { response: { ok: true, vm: this.info(), memory: this.memory() } };
          case 'suspend':
          case 'resume': {
            const before = this.memory();
            const t0 = performance.now();
            if (request.op === 'resume') await vm.resume();
            else if (request.offload) await vm.suspend();
            else await vm.pause();
            const tookMs = Math.round((performance.now() - t0) * 10) / 10;
            if (request.op !== 'suspend' || !request.offload) return { response: { ok: true, vm: this.info(), before, memory: this.memory(), tookMs } };
            // Suspended at once; the answer waits until the memory is given back, so it can say so.
            let releaseError: unknown;
            await vm.memoryReleased().catch((e: unknown) => (releaseError = e));
            const releasedMs = Math.round((performance.now() - t0) * 10) / 10;
            if (releaseError) return { response: { ok: false, error: errorPayload(releaseError), vm: this.info(), memory: this.memory() } };
            return { response: { ok: true, vm: this.info(), before, memory: this.memory(), tookMs, releasedMs } };
          }
          case 'snapshot': {
            const written = await vm.snapshot(request.dir, { leavePaused: request.leavePaused });
            const snapshot = { ...written, ms: Math.round(written.ms * 10) / 10 };
            return { response: { ok: true, vm: this.info(), memory: this.memory(), snapshot } };
          }
          case 'hibernate': {
            const before = this.memory();
            const t0 = performance.now();
            const hibernation = await this.hibernate(vm, request.store);
            const tookMs = Math.round((performance.now() - t0) * 10) / 10;
            return { response: { ok: true, vm: { ...this.info(), state: 'hibernated' }, before, tookMs, hibernation }, afterSent: () => this.answered?.() };
          }
          case 'stop':
            return { response: { ok: true, vm: this.info(), memory: this.memory() }, afterSent: () => this.requestStop(request.signal ?? 'pvisor stop') };
          default:
            // Streams are served on their own connections (ControlServer), files calls above.
            throw new VmStateError(`${request.op} is not a queued request`);
        }
      } catch (e) {
        return { response: { ok: false, error: errorPayload(e), vm: this.info(), memory: this.memory() } };
      }
    });

  /**
   * Moves the VM to its backing directory and writes the record beside the socket that says how
   * its run goes on; the VM ends (its process follows once the answer is sent). Probe steps that
   * have not begun are held, and one that talks to the guest is let finish first (when the VM
   * runs: a paused guest would not answer it, and then carries it out after the resume, its
   * answer lost). If anything fails, the VM and its steps go on as they were.
   */
  private async hibernate(vm: Vm, store?: string): Promise<ControlHibernation> {
    const carry = this.description.carry;
    if (vm.state !== 'running' && vm.state !== 'paused') {
      const hint = vm.state === 'suspended' ? `; its RAM is offloaded: pvisor resume ${this.id} first` : '';
      throw new VmStateError(`${this.id} is ${vm.state}; hibernation needs it running or paused${hint}`);
    }
    if (store !== undefined) return this.hibernateToStore(vm, store);
    const fs = memoryBackedFilesystem(carry.backingDir);
    if (fs) throw new InvalidOptionError('--vm-backing-dir', `${carry.backingDir} is on ${fs}: a hibernated VM there would stay in RAM; run the VM with --vm-backing-dir on a disk`);
    const script = carry.script;
    script?.halt();
    try {
      if (vm.state === 'running') await script?.outOfGuest();
      const left = script?.remaining();
      const dir = hibernationDirFor(carry.backingDir, this.id);
      // A jailed VMM writes its record where it can, in its backing directory: its launcher takes
      // it from there with the VM (src/cli/run-jailed.ts) and writes its own beside its socket.
      const record = this.description.listenFd !== undefined ? jailedRecordPathFor(carry.backingDir, this.id) : recordPathFor(this.socketPath);
      const log = logPathFor(this.socketPath);
      await vm.hibernate(dir, {
        beforeStop: (info) => {
          writeHibernationRecord(record, this.hibernationRecord(vm, dir, info.bytesOnDisk, left));
          // Committed: the VM ends next, and whoever sees it end must know why.
          this.hibernated = { dir, record, log, ramDataPageCount: info.ramDataPageCount, bytesOnDisk: info.bytesOnDisk };
        },
      });
      return this.hibernated!;
    } catch (e) {
      script?.go();
      throw e;
    }
  }

  /**
   * The record of this run's VM hibernated at `dir` (a directory, or an `s3://` location): the
   * run's flags, and what is left of its steps or its command.
   */
  private hibernationRecord(vm: Vm, dir: string, bytesOnDisk: number, left: ProbeStep[] | undefined): HibernationRecord {
    const carry = this.description.carry;
    return {
      format: 'pvisor-hibernated',
      version: 1,
      id: this.id,
      dir,
      hibernatedAt: new Date().toISOString(),
      guest: vm.guest,
      memoryBytes: vm.memoryBytes,
      vcpus: vm.vcpus,
      bytesOnDisk,
      flags: carry.flags,
      // Nothing left: the resumed run keeps the VM until it is stopped, as this one would not have.
      ...(vm.guest === 'probe' ? { steps: left?.length ? formatProbeScript(left) : 'wait' } : { command: carry.command }),
    };
  }

  /**
   * {@link hibernate} to an object store: the VM goes to `store` (its work files in the chunk
   * cache, not the backing directory), with its record beside it in the store instead of beside
   * the socket, so that `pvisor resume ID --store` continues it on any host; nothing of it stays
   * on this one.
   */
  private async hibernateToStore(vm: Vm, store: string): Promise<ControlHibernation> {
    const carry = this.description.carry;
    const script = carry.script;
    script?.halt();
    try {
      if (vm.state === 'running') await script?.outOfGuest();
      const left = script?.remaining();
      const { putRunRecord, RUN_RECORD_NAME } = await import('../store/run-record');
      const url = store.replace(/\/$/, '');
      const log = logPathFor(this.socketPath);
      await vm.hibernate(url, {
        beforeStop: async (info) => {
          // Before the VM ends: a failure here withdraws the hibernation and the VM goes on.
          await putRunRecord(this.hibernationRecord(vm, url, info.bytesOnDisk, left));
          this.hibernated = { dir: url, record: `${url}/${RUN_RECORD_NAME}`, log, ramDataPageCount: info.ramDataPageCount, bytesOnDisk: info.bytesOnDisk, ...(info.store && { store: info.store }) };
        },
      });
      return this.hibernated!;
    } catch (e) {
      script?.go();
      throw e;
    }
  }

  /**
   * Runs a command in the guest: an argv or a shell command for the Linux guest (Vm.exec), probe
   * steps for the probe guest (their lines are the output), as `pvisor run` runs its own CMD.
   */
  private async exec(request: ControlRequest & { op: 'exec' }): Promise<{ response: ControlResponse }> {
    const vm = this.vm;
    try {
      if (!vm) throw new VmStateError(`${this.id} is starting`);
      let exec: ExecResult;
      if (vm.guest === 'linux') exec = await vm.exec(request.command, { timeoutMs: request.timeoutMs });
      else {
        const lines: string[] = [];
        const words = typeof request.command === 'string' ? request.command.split(/\s+/).filter(Boolean) : request.command;
        await runProbeScript(vm, parseProbeScript(words), (line) => lines.push(line));
        exec = { exitCode: 0, signal: null, stdout: lines.map((l) => `${l}\n`).join(''), stderr: '' };
      }
      return { response: { ok: true, vm: this.info(), exec } };
    } catch (e) {
      return { response: { ok: false, error: errorPayload(e), vm: this.info() } };
    }
  }

  /** A files call: as exec, not queued behind lifecycle operations. */
  private async files(request: ControlRequest & { op: 'files' }): Promise<{ response: ControlResponse }> {
    try {
      if (!this.vm) throw new VmStateError(`${this.id} is starting`);
      return { response: { ok: true, vm: this.info(), ...(await filesCall(this.vm, request)) } };
    } catch (e) {
      return { response: { ok: false, error: errorPayload(e), vm: this.info() } };
    }
  }

  /** @internal Who the VM is, for answers. */
  info(): ControlVmInfo {
    const d = this.description;
    const labels = this.vm?.labels ?? d.labels ?? {};
    const ramLoad = this.vm?.restoreInfo?.ramLoad;
    return { id: this.id, pid: process.pid, state: this.vm?.state ?? 'starting', guest: d.guest, memoryBytes: d.memoryBytes, vcpus: d.vcpus, labels, startedAt: this.startedAt, ...(ramLoad && { ramLoad }) };
  }

  private memory(): ControlMemory | undefined {
    const vm = this.vm;
    if (!vm || vm.state === 'stopped' || vm.state === 'crashed' || vm.state === 'starting') return undefined;
    const u = vm.memoryUsage();
    let bytesOnDisk = 0;
    for (const s of u.strategies) bytesOnDisk += s.figures.bytesOnDisk ?? 0;
    return {
      ...u,
      guestRamResidentBytes: u.guestRamPssBytes,
      guestRamRssBytes: u.guestRamRssBytes,
      processPssBytes: u.processPssBytes,
      bytesOnDisk,
      strategies: u.strategies,
    };
  }
}

/** Six hex digits: short to type, and a clash (checked) is rare among the VMs of one user. */
function generateId(): string {
  return randomBytes(3).toString('hex');
}

