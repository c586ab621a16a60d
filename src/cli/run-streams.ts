/**
 * `pvisor run`'s streams and files calls over its control socket (docs/control-protocol.md,
 * "Streams" and "Files"): a spawned process, a file read or written as it goes, the VM's events,
 * and the files calls that are one answer. Each acts on the running {@link Vm} as a call in this
 * process would, with the client's values checked by the same code.
 */
import type { Socket } from 'node:net';
import { Readable } from 'node:stream';
import { finished } from 'node:stream/promises';
import { VmStateError } from '../errors';
import { CONTROL_PROTOCOL_VERSION, errorPayload, type ControlFilesRequest, type ControlResponse, type ControlStreamRequest, type ControlVmInfo } from '../control-socket';
import { MAX_UNSENT_STREAM_BYTES, serveStream, StreamChannel, type StreamSession } from '../control-stream';
import type { Vm } from '../vm';
import type { VmEvents } from '../vm-types';

/** Writes one answer line on a stream connection; an error answer closes it. */
function answerLine(conn: Socket, response: ControlResponse): void {
  const line = `${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, ...response })}\n`;
  if (response.ok) conn.write(line);
  else conn.end(line);
}

/** Serves a stream request on its own connection against `vm` (undefined while it boots). */
export function serveRunStream(vm: Vm | undefined, info: () => ControlVmInfo, request: ControlStreamRequest, conn: Socket, leftover: Buffer): void {
  conn.on('error', () => {});
  void (async () => {
    try {
      if (!vm) throw new VmStateError(`${info().id} is starting`);
      if (request.op === 'watch') return watch(vm, info, conn);
      const { session, pid } = await openSession(vm, request);
      answerLine(conn, { ok: true, vm: info(), ...(pid !== undefined && { pid }) });
      serveStream(conn, leftover, session, errorPayload);
    } catch (e) {
      answerLine(conn, { ok: false, error: errorPayload(e), vm: info() });
    }
  })();
}

/** The stream a request asks for; throws (nothing started) for values the VM refuses. */
async function openSession(vm: Vm, request: Exclude<ControlStreamRequest, { op: 'watch' }>): Promise<{ session: StreamSession; pid?: number }> {
  switch (request.op) {
    case 'spawn': {
      const p = vm.spawn(request.command, { env: request.env, cwd: request.cwd, stdin: request.stdin, timeoutMs: request.timeoutMs, user: request.user, stdout: request.stdout, stderr: request.stderr });
      // Answered with the pid once the program runs; one that never starts is the answer's error.
      const pid = await p.pid;
      return {
        pid,
        session: {
          outputs: { [StreamChannel.Stdout]: p.stdout, [StreamChannel.Stderr]: p.stderr },
          ...(request.stdin && { input: { write: (b: Buffer) => p.write(b), end: () => p.end() } }),
          signal: (signal) => p.kill(signal),
          result: p.exited,
          abort: () => {
            // Nobody reads it any more: what comes is dropped, the process goes.
            p.stdout.destroy();
            p.stderr.destroy();
            p.kill('SIGKILL').catch(() => {});
          },
        },
      };
    }
    case 'files.readStream': {
      const s = vm.files.readStream(request.path, { timeoutMs: request.timeoutMs, user: request.user });
      // The stream's own errors (no such file) come before any data: they are the answer's.
      await firstReadable(s);
      return { session: { outputs: { [StreamChannel.Stdout]: s }, result: finished(s).then(() => ({})), abort: () => s.destroy() } };
    }
    case 'files.writeStream': {
      const w = vm.files.writeStream(request.path, { mode: request.mode, timeoutMs: request.timeoutMs, user: request.user });
      let bytes = 0;
      const done = finished(w).then(() => ({ bytes }));
      done.catch(() => {});
      return {
        session: {
          outputs: {},
          input: {
            write: (b) =>
              new Promise<void>((resolve, reject) => {
                bytes += b.length;
                w.write(b, (e) => (e ? reject(e) : resolve()));
              }),
            end: () => new Promise<void>((resolve, reject) => {
              w.end();
              done.then(() => resolve(), reject);
            }),
          },
          result: done,
          abort: () => w.destroy(),
        },
      };
    }
  }
}

/**
 * Resolves once `s` has data or has ended; rejects with its error if it fails first (the guest
 * refused to open the file).
 */
function firstReadable(s: Readable): Promise<void> {
  return new Promise((resolve, reject) => {
    const done = () => {
      s.off('readable', done);
      s.off('error', failed);
      resolve();
    };
    const failed = (e: Error) => {
      s.off('readable', done);
      reject(e);
    };
    s.once('readable', done);
    s.once('error', failed);
  });
}

/**
 * The VM's state changes and its end as JSON lines, until it ends. A client that does not read
 * them is cut off once more than {@link MAX_UNSENT_STREAM_BYTES} wait (events are a few a
 * minute: only a client that never reads gets there).
 */
function watch(vm: Vm, info: () => ControlVmInfo, conn: Socket): void {
  answerLine(conn, { ok: true, vm: info() });
  const line = (event: Record<string, unknown>) => {
    if (conn.destroyed) return;
    conn.write(`${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, ...event })}\n`);
    if (conn.writableLength > MAX_UNSENT_STREAM_BYTES) conn.destroy();
  };
  const onState: VmEvents['state'] = (state, previous) => line({ event: 'state', state, previous });
  const onExit: VmEvents['exit'] = (e) => {
    line({ event: 'exit', state: e.state, ...(e.error && { error: errorPayload(e.error) }), ...(e.hibernatedTo && { hibernatedTo: e.hibernatedTo }) });
    conn.end();
  };
  vm.on('state', onState);
  vm.on('exit', onExit);
  // Nothing is read from a watch: what a client sends is dropped.
  conn.on('data', () => {});
  conn.resume();
  conn.once('close', () => {
    vm.off('state', onState);
    vm.off('exit', onExit);
  });
  if (vm.state === 'stopped' || vm.state === 'crashed') onExit({ state: vm.state, ...(vm.error && { error: vm.error }) });
}

/** A files call that is one request and one answer. */
export async function filesCall(vm: Vm, r: ControlFilesRequest): Promise<Partial<ControlResponse & { ok: true }>> {
  const t = { timeoutMs: r.timeoutMs, user: r.user };
  switch (r.call) {
    case 'stat':
      return { stat: await vm.files.stat(r.path, { ...t, followSymlinks: r.followSymlinks }) };
    case 'list':
      return { entries: await vm.files.list(r.path, { ...t, maxEntries: r.maxEntries }) };
    case 'mkdir':
      await vm.files.mkdir(r.path, { ...t, recursive: r.recursive, mode: r.mode });
      return {};
    case 'remove':
      await vm.files.remove(r.path, { ...t, recursive: r.recursive });
      return {};
    case 'rename':
      await vm.files.rename(r.path, r.to, t);
      return {};
  }
}
