/**
 * `pvisor resume ID` of a hibernated VM: the VM has no process, so the command starts one, a
 * detached `pvisor resume ID --foreground` whose output goes to `ID.log` beside the control
 * socket, waits until it says the VM is ready (or why it is not) on a pipe, and leaves it
 * running. The new process claims the VM's control socket first (so that of two resumes one
 * wins and the other is refused), reads the record again, restores the VM (Vm.restore, lazily),
 * removes the record, and goes on with the run: the probe steps that were left, or, for the Linux
 * guest, until the VM is stopped. `pvisor stop ID` of a hibernated VM discards it.
 */
import { spawn } from 'node:child_process';
import { chmodSync, closeSync, constants, cpSync, fstatSync, openSync, readdirSync, renameSync, rmSync, writeSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { ControlServer, ensureRuntimeDir, errorPayload } from '../control-socket';
import { InvalidOptionError, PvisorError, SnapshotError, StoreClaimedError, TimeoutError, VmStateError } from '../errors';
import type { Vm } from '../vm';
import { checkHibernatedDir, discardHibernated, hibernationDirFor, logPathFor, readHibernationRecord, recordPathFor, type HibernationRecord } from '../snapshot/hibernation-record';
import { PVISOR_NODE_FLAGS, pvisorNodeEnv } from '../node-flags';
import { parseProbeScript, ScriptCursor } from './probe-script';
import { checkCarriedFlags, parseRunArgs } from './run-args';
import { runVm } from './run-command';
import { jailedEntry } from '../jail/jailed-entry';
import type { JailedResume } from './run-jailed';
import { RunControl } from './run-control';
import { EXIT_REFUSED, exitStatusOf, RefusedError } from './usage';

/** What a jailed resume says once its VM answers (./run-jailed.ts). */
type JailedReady = Parameters<JailedResume['ready']>[0];

/** The environment variable that tells a `--foreground` resume which fd to report readiness on. */
const READY_FD_ENV = 'PVISOR_READY_FD';

/** What the resuming process reports once, on its ready pipe. */
export type ResumeReport =
  | { ok: true; pid: number; readyMs: number; ramLoad: string; processPssBytes: number; guestRamResidentBytes: number; log: string }
  | { ok: false; error: { code: string; message: string }; exitStatus: number };

/**
 * `pvisor resume ID --foreground`: continues the hibernated VM in this process; resolves with the
 * run's exit status (as `pvisor run`'s). Refuses with exit 1 if the VM is not hibernated (`live`:
 * a process answers on its socket; or another resume or a stop took it meanwhile). Every outcome
 * is reported to the `pvisor resume` that started this process, if one did.
 */
export async function runHibernated(id: string, socketPath: string, store?: StoreResume, { live = false } = {}): Promise<number> {
  const report = readyReporter();
  try {
    if (live) throw new RefusedError(`${id} is not hibernated: a process runs it (another pvisor resume continued it, or it never hibernated)`);
    if (store) return await runFromStore(id, socketPath, store, report);
    const recordPath = recordPathFor(socketPath);
    const first = readHibernationRecord(recordPath, id);
    if (!first) throw new RefusedError(`${id} is not hibernated (no ${recordPath})`);
    // Everything the record says is checked before the id is claimed, as a command line is.
    const plan = planOf(first, recordPath, (vm) => report.ready(vm, logPathFor(socketPath)));
    // A VM hibernated out of a jail comes back in a new one (./run-jailed.ts claims the id, checks
    // the record again and moves the VM into the jail).
    if (plan.args.isolation === 'process' && !jailedEntry()) {
      const { runJailed } = await import('./run-jailed');
      const args = { ...plan.args, name: id, socketPath };
      return await runJailed(args, plan.argv, first, { record: first, recordPath, ready: (r) => report.readyJailed(r, logPathFor(socketPath)) });
    }
    const carry = { flags: first.flags, backingDir: plan.args.backingDir, command: first.command ?? [], script: plan.cursor };
    let control: RunControl;
    try {
      control = await RunControl.open({ name: id, socketPath, guest: first.guest, memoryBytes: first.memoryBytes, vcpus: first.vcpus, carry, resuming: true });
    } catch (e) {
      if (e instanceof InvalidOptionError && e.option === 'name') throw new RefusedError(`${id} is not hibernated: it is running (another pvisor resume continued it)`);
      throw e;
    }
    try {
      // Now that this process holds the id, the record is stable: it must still be the one read.
      const record = readHibernationRecord(recordPath, id);
      if (!record || record.dir !== first.dir) throw new RefusedError(`${id} is not hibernated any more (resumed or discarded meanwhile)`);
      if (checkHibernatedDir(record.dir) === 'missing') throw new SnapshotError(`${id}'s hibernated state ${record.dir} is gone; pvisor stop ${id} removes its record`);
    } catch (e) {
      control.close();
      throw e;
    }
    return await runVm(control, plan);
  } catch (e) {
    report.failed(e);
    throw e;
  }
}

/** `pvisor resume ID --store s3://...`: where the VM is, and a claim to take over. */
export interface StoreResume {
  url: string;
  takeOver?: string;
}

/**
 * Continues VM `id` hibernated at `store.url` in this process: its run record is read from the
 * store and checked, the id claimed here (a VM of that id running or hibernated on this host is
 * refused), then Vm.restore claims the VM in the store before it runs: a VM another resume
 * claimed is refused (exit 1) naming who and when, with nothing run.
 */
async function runFromStore(id: string, socketPath: string, store: StoreResume, report: ReturnType<typeof readyReporter>): Promise<number> {
  const { getRunRecord } = await import('../store/run-record');
  const record = await getRunRecord(store.url, id);
  const plan = planOf(record, `${store.url}/pvisor-run.json`, (vm) => report.ready(vm, logPathFor(socketPath)));
  if (plan.args.isolation === 'process' && !jailedEntry()) return runJailedFromStore(id, socketPath, store, record, plan, report);
  const carry = { flags: record.flags, backingDir: plan.args.backingDir, command: record.command ?? [], script: plan.cursor };
  let control: RunControl;
  try {
    // Not `resuming`: a record of the same id on this host is another VM, and is refused.
    control = await RunControl.open({ name: id, socketPath, guest: record.guest, memoryBytes: record.memoryBytes, vcpus: record.vcpus, carry });
  } catch (e) {
    if (e instanceof InvalidOptionError && e.option === 'name') throw new RefusedError(`a VM named ${id} runs or is hibernated on this host (${e.message})`);
    throw e;
  }
  try {
    return await runVm(control, { ...plan, restoreStore: store.takeOver ? { takeOverClaim: store.takeOver } : undefined });
  } catch (e) {
    if (e instanceof StoreClaimedError) throw new RefusedError(e.message);
    throw e;
  }
}

/**
 * {@link runFromStore} of a VM hibernated out of a jail: it comes back in a new one. This process
 * has the store's credentials and network (the jail has neither), so it claims the VM and fetches
 * it whole, as a jailed `pvisor run --from s3://...` does, into the run's backing directory, where
 * the new jail takes it in and its restore consumes it, as a local jailed resume does. The claim is
 * marked resumed once the jailed VM answers, and given back if it never does.
 */
async function runJailedFromStore(id: string, socketPath: string, store: StoreResume, record: HibernationRecord, plan: ReturnType<typeof planOf>, report: ReturnType<typeof readyReporter>): Promise<number> {
  const { restoreFromStore } = await import('../store/hibernate-store');
  const { runJailed } = await import('./run-jailed');
  let run: Promise<number> | undefined;
  try {
    await restoreFromStore(store.url, store.takeOver ? { takeOverClaim: store.takeOver } : undefined, async (fetched) => {
      const dir = hibernationDirFor(plan.args.backingDir, id);
      // The run continues from the local copy, as a local jailed resume does from its directory.
      const args = { ...plan.args, name: id, socketPath, source: { ...plan.args.source, dir } };
      moveDir(fetched, dir);
      // As Vm.hibernate leaves a hibernation: the VM's only copy, private.
      for (const name of readdirSync(dir)) chmodSync(join(dir, name), 0o400);
      chmodSync(dir, 0o700);
      try {
        await new Promise<void>((ready, failed) => {
          run = runJailed(args, plan.argv, record, {
            record: { ...record, dir },
            ready: (r) => {
              report.readyJailed(r, logPathFor(socketPath));
              ready();
            },
          });
          run.then(() => failed(new VmStateError(`${id} ended before its jailed restore was ready; its output is in ${logPathFor(socketPath)}`)), failed);
        });
      } catch (e) {
        // Not restored: the store's copy stands (its claim is given back), and this one goes.
        rmSync(dir, { recursive: true, force: true });
        throw e;
      }
    });
  } catch (e) {
    if (e instanceof StoreClaimedError) throw new RefusedError(e.message);
    throw e;
  }
  return run!;
}

/** Moves directory `from` to `to`, across filesystems too (the chunk cache and the backing directory may be on two). */
function moveDir(from: string, to: string): void {
  try {
    renameSync(from, to);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'EXDEV') throw e;
    try {
      cpSync(from, to, { recursive: true, errorOnExist: true, force: false });
    } catch (copy) {
      rmSync(to, { recursive: true, force: true });
      throw copy;
    }
    rmSync(from, { recursive: true, force: true });
  }
}

/** The run of a hibernated VM, from its record (its flags and steps checked as a command line's). */
function planOf(record: HibernationRecord, recordPath: string, onReady: (vm: Vm) => void): Parameters<typeof runVm>[1] & { argv: string[] } {
  const flags = checkCarriedFlags(record.flags);
  // The Linux guest's CMD is not run again (it runs on, detached): it is there for the parser.
  const command = record.guest === 'probe' ? [record.steps!] : record.command!.length ? record.command! : ['true'];
  const argv = ['--from', record.dir, ...flags, '--', ...command];
  let args;
  try {
    args = parseRunArgs(argv, '/');
  } catch (e) {
    throw new SnapshotError(`${recordPath}: ${(e as Error).message}`);
  }
  let steps;
  try {
    steps = record.guest === 'probe' ? parseProbeScript(args.command) : undefined;
  } catch (e) {
    throw new SnapshotError(`${recordPath}: steps: ${(e as Error).message}`);
  }
  return { args, argv, steps, cursor: steps && new ScriptCursor(steps), resumed: { recordPath, onReady } };
}

/** The `--foreground` side of the ready pipe: says once, ready or failed, then closes it. */
function readyReporter(): { ready(vm: Vm, log: string): void; readyJailed(r: JailedReady, log: string): void; failed(e: unknown): void } {
  const text = process.env[READY_FD_ENV];
  delete process.env[READY_FD_ENV];
  let fd = text !== undefined && /^\d+$/.test(text) ? Number(text) : undefined;
  const say = (r: ResumeReport) => {
    if (fd === undefined) return;
    try {
      writeSync(fd, `${JSON.stringify(r)}\n`);
      closeSync(fd);
    } catch {
      // The resume that started this process is gone: nobody to tell.
    }
    fd = undefined;
  };
  return {
    ready(vm, log) {
      const u = vm.memoryUsage();
      const info = vm.restoreInfo!;
      say({ ok: true, pid: process.pid, readyMs: Math.round(info.readyMs * 10) / 10, ramLoad: info.ramLoad, processPssBytes: u.processPssBytes, guestRamResidentBytes: u.guestRamPssBytes, log });
    },
    readyJailed(r, log) {
      // The VM's figures are its jailed process's; the pid to signal is this one, its launcher.
      say({ ok: true, pid: process.pid, readyMs: r.readyMs, ramLoad: r.ramLoad, processPssBytes: r.processPssBytes, guestRamResidentBytes: r.guestRamResidentBytes, log });
    },
    failed(e) {
      say({ ok: false, error: errorPayload(e), exitStatus: exitStatusOf(e) });
    },
  };
}

/** How long the client waits for the resumed VM to be ready: a restore reads no more than a suspend writes. */
const READY_TIMEOUT_MS = 10 * 60 * 1000;

/**
 * Starts the process that continues hibernated VM `id`, detached, its output appended to the log
 * beside the socket; resolves with its report once the VM is ready, or rejects with why not
 * (a {@link RefusedError} if it was not hibernated after all).
 */
export async function startResume(id: string, socketPath: string, store?: StoreResume): Promise<ResumeReport & { ok: true }> {
  const log = logPathFor(socketPath);
  // From a store, this host may never have run a VM: its runtime directory is made as a run makes it.
  if (store) ensureRuntimeDir(dirname(socketPath));
  const logFd = openLog(log);
  let child;
  try {
    writeSync(logFd, `pvisor: ${new Date().toISOString()} pvisor resume ${id}${store ? ` --store ${store.url}` : ''}: a new process continues the hibernated VM\n`);
    const storeArgs = store ? ['--store', store.url, ...(store.takeOver ? ['--take-over', store.takeOver] : [])] : [];
    child = spawn(process.execPath, [...PVISOR_NODE_FLAGS, join(__dirname, 'main.js'), 'resume', id, '--foreground', '--vm-socket', socketPath, ...storeArgs], {
      // Its own session: it outlives this command and the terminal it ran in.
      detached: true,
      cwd: '/',
      stdio: ['ignore', logFd, logFd, 'pipe'],
      env: { ...pvisorNodeEnv(), [READY_FD_ENV]: '3' },
    });
  } finally {
    closeSync(logFd);
  }
  const pipe = child.stdio[3] as NodeJS.ReadableStream & { destroy(): void };
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
  try {
    const line = await new Promise<string | undefined>((resolve, reject) => {
      let text = '';
      const timer = setTimeout(() => reject(new TimeoutError(`the process resuming ${id} (pid ${child.pid}) was not ready within ${READY_TIMEOUT_MS} ms; its output is in ${log}`)), READY_TIMEOUT_MS);
      pipe.setEncoding('utf8');
      pipe.on('data', (d: string) => {
        text += d;
        // One short line is all it says; a longer one is not a report.
        if (text.includes('\n') || text.length > 64 * 1024) {
          clearTimeout(timer);
          resolve(text.split('\n')[0]);
        }
      });
      pipe.on('end', () => {
        clearTimeout(timer);
        resolve(text.includes('\n') ? text.split('\n')[0] : undefined);
      });
      pipe.on('error', () => {});
    });
    if (line === undefined) {
      const code = await exited;
      throw new PvisorError('PVISOR_RESUME', `the process resuming ${id} ended (exit ${code}) before the VM was ready; its output is in ${log}`);
    }
    let report: ResumeReport;
    try {
      report = JSON.parse(line) as ResumeReport;
    } catch {
      throw new PvisorError('PVISOR_RESUME', `the process resuming ${id} said something that is not a report; its output is in ${log}`);
    }
    if (!report.ok) {
      if (report.exitStatus === EXIT_REFUSED) throw new RefusedError(`resume ${id} refused: ${report.error.message}`);
      throw new PvisorError(report.error.code, `resume ${id} failed: ${report.error.message} (its output is in ${log})`);
    }
    return report;
  } finally {
    pipe.destroy();
    child.unref();
  }
}

/** Opens the log for appending: a regular file of this user's, 0600, never through a link. */
function openLog(path: string): number {
  let fd: number;
  try {
    fd = openSync(path, constants.O_WRONLY | constants.O_APPEND | constants.O_CREAT | constants.O_NOFOLLOW | constants.O_NONBLOCK, 0o600);
  } catch (e) {
    throw new PvisorError('PVISOR_RESUME', `cannot open the log ${path} for the resumed VM's output: ${(e as Error).message}`, { cause: e });
  }
  const st = fstatSync(fd);
  const uid = process.getuid?.() ?? 0;
  if (!st.isFile() || st.uid !== uid || st.mode & 0o077) {
    closeSync(fd);
    throw new PvisorError('PVISOR_RESUME', `${path} is not a regular file of this user's with mode 0600: refused as the resumed VM's log`);
  }
  return fd;
}

/**
 * `pvisor stop ID` of a hibernated VM: removes its state and its record. It holds the VM's control
 * socket meanwhile, so that a resume at the same moment either finds it discarded or, having won,
 * gets the stop itself (then resolves with `'running'`: the caller stops the running VM).
 */
export async function discardHibernatedVm(id: string, socketPath: string): Promise<{ record: HibernationRecord } | 'running' | undefined> {
  let server: ControlServer;
  try {
    server = await ControlServer.listen(socketPath, id, async () => ({ response: { ok: false, error: { code: 'PVISOR_VM_STATE', message: `${id} is being discarded` } } }));
  } catch (e) {
    if (e instanceof InvalidOptionError && e.option === 'name') return 'running';
    throw e;
  }
  try {
    const recordPath = recordPathFor(socketPath);
    const record = readHibernationRecord(recordPath, id);
    if (!record) return undefined;
    discardHibernated(recordPath, record);
    return { record };
  } finally {
    server.close();
  }
}
