/**
 * The control socket of a VM started by `pvisor run`: how `pvisor suspend`, `resume`, `snapshot`,
 * `stop` and `ps` in another shell reach it. The CLI runs one VM per process, so each run listens
 * on its own socket.
 *
 * **Where.** `<dir>/<ID>.sock`, where `<dir>` is `$PVISOR_RUNTIME_DIR`, else
 * `$XDG_RUNTIME_DIR/pvisor`, else `/run/pvisor` for root, else `/tmp/pvisor-$UID`. The run creates
 * the directory with mode 0700 and refuses one that another user owns or others may write to:
 * whoever can connect can suspend, resume or stop the VM. The run removes its socket when it ends;
 * a socket file left by a killed run (nobody listening) is replaced by the next run of that ID.
 *
 * **Protocol.** Newline-delimited JSON over a Unix stream socket: the client writes one request per
 * line, the server answers each with one line, in order. Requests:
 * ```
 * {"op":"status"}
 * {"op":"suspend","offload":false}   pause: vCPUs stop, guest RAM stays as it is
 * {"op":"suspend","offload":true}    Vm.suspend(): vCPUs stop, then every memory strategy's suspend
 *                                    hook runs (the CLI composes Offload by default: RAM goes to a
 *                                    file and is dropped)
 * {"op":"resume"}                    strategies bring back and verify what they took, vCPUs run
 * {"op":"snapshot","dir":"/abs/dir","leavePaused":false}
 *                                    Vm.snapshot(dir): pauses if running, writes a sealed snapshot
 *                                    into dir (new or empty; absolute, since the run's cwd is not
 *                                    the client's), resumes unless leavePaused
 * {"op":"stop"}                      answered first, then the VM stops and the run ends
 * ```
 * Every answer carries the VM (`vm`: id, pid, state, guest, memoryBytes, vcpus) and its memory
 * figures after the operation (`memory`: guestRamResidentBytes (PSS), guestRamRssBytes,
 * processPssBytes, bytesOnDisk, and each strategy's own figures); suspend and resume add the figures
 * before (`before`) and the time taken (`tookMs`); a snapshot adds what it wrote (`snapshot`: dir,
 * ramDataPageCount, ms). A suspend with offload is answered once the
 * memory is released, and adds the time that took from the request (`releasedMs`); a release that
 * fails (e.g. a full disk) is an error answer, with the VM suspended and its unwritten pages kept:
 * ```
 * {"ok":true,"vm":{...,"state":"suspended"},"before":{...},"memory":{...},"tookMs":3.1,"releasedMs":152.4}
 * {"ok":false,"error":{"code":"PVISOR_VM_STATE","message":"T1 is running; this needs it paused or suspended"},"vm":{...},"memory":{...}}
 * ```
 * Error codes are those of pvisor's typed errors (`PVISOR_VM_STATE`, `PVISOR_BACKING_FILE`,
 * `PVISOR_INVALID_OPTION` for a malformed request, ...). A failed operation leaves the VM as it was.
 * @module
 */
import { lstatSync, mkdirSync, rmSync, chmodSync } from 'node:fs';
import { createConnection, createServer, type Server, type Socket } from 'node:net';
import { basename, isAbsolute, join } from 'node:path';
import { ControlSocketError, InvalidOptionError, PvisorError, TimeoutError, VmNotFoundError } from '../errors';
import type { StrategyStats } from '../memory/strategy';
import type { GuestKind, SnapshotInfo, VmState } from '../vm';

/** A request to a VM's control socket. */
export type ControlRequest =
  | { op: 'status' }
  | { op: 'suspend'; offload: boolean }
  | { op: 'resume' }
  | { op: 'snapshot'; dir: string; leavePaused: boolean }
  | { op: 'stop' };

/** Who the VM is and what state it is in. */
export interface ControlVmInfo {
  id: string;
  /** The `pvisor run` process. */
  pid: number;
  state: VmState | 'starting';
  guest: GuestKind;
  memoryBytes: number;
  vcpus: number;
}

/** A VM's memory figures, in bytes. */
export interface ControlMemory {
  /** PSS of guest RAM: what its pages cost the host. */
  guestRamResidentBytes: number;
  guestRamRssBytes: number;
  /** PSS of the whole `pvisor run` process (Node, pvisor and the VM). */
  processPssBytes: number;
  /** Sum of the strategies' `bytesOnDisk` figures (a suspend image, for instance). */
  bytesOnDisk: number;
  strategies: StrategyStats[];
}

/** An answer from a VM's control socket. */
export type ControlResponse =
  | { ok: true; vm: ControlVmInfo; memory?: ControlMemory; before?: ControlMemory; tookMs?: number; releasedMs?: number; snapshot?: SnapshotInfo }
  | { ok: false; error: { code: string; message: string }; vm?: ControlVmInfo; memory?: ControlMemory };

/** What the server does with a request: the answer, and what to do once it has been sent. */
export type ControlHandler = (request: ControlRequest) => Promise<{ response: ControlResponse; afterSent?: () => void }>;

/** A longer line is not a request: the connection is closed. */
const MAX_LINE_BYTES = 64 * 1024;
/** sun_path holds 108 bytes including the terminating NUL. */
const MAX_SOCKET_PATH_BYTES = 107;

/** The directory of control sockets, by the rule in this module's documentation. */
export function runtimeDir(env: NodeJS.ProcessEnv = process.env, uid: number = process.getuid?.() ?? 0): string {
  if (env.PVISOR_RUNTIME_DIR) return env.PVISOR_RUNTIME_DIR;
  if (env.XDG_RUNTIME_DIR) return join(env.XDG_RUNTIME_DIR, 'pvisor');
  return uid === 0 ? '/run/pvisor' : `/tmp/pvisor-${uid}`;
}

/**
 * Creates the runtime directory 0700, or checks that an existing one is a directory of this user
 * that nobody else may write to (so nobody else can plant or replace a socket in it).
 */
export function ensureRuntimeDir(dir: string): void {
  const created = mkdirSync(dir, { recursive: true, mode: 0o700 }) !== undefined;
  // mkdir's mode is filtered by the umask: set it exactly on a directory made here.
  if (created) chmodSync(dir, 0o700);
  const st = lstatSync(dir);
  const uid = process.getuid?.() ?? 0;
  const refuse = (why: string) => new InvalidOptionError('runtime directory', `${dir} ${why}; set PVISOR_RUNTIME_DIR to a directory of yours that only you may write to`);
  if (!st.isDirectory()) throw refuse('is not a directory');
  if (st.uid !== uid) throw refuse(`belongs to uid ${st.uid}, not to this user (${uid})`);
  if (st.mode & 0o022) throw refuse(`may be written by others (mode ${(st.mode & 0o777).toString(8)})`);
}

/** The control socket of VM `id`. */
export function socketPathFor(id: string, dir: string = runtimeDir()): string {
  return join(dir, `${id}.sock`);
}

/** The VM id a socket path stands for (`/run/pvisor/T1.sock` is `T1`). */
export function idOfSocket(path: string): string {
  return basename(path).replace(/\.sock$/, '');
}

/** Parses one request line; a malformed one is an {@link InvalidOptionError}. */
export function parseRequest(line: string): ControlRequest {
  let value: unknown;
  try {
    value = JSON.parse(line);
  } catch {
    throw new InvalidOptionError('control request', `not JSON: ${JSON.stringify(line.slice(0, 80))}`);
  }
  const r = value as Record<string, unknown> | null;
  switch (r && typeof r === 'object' ? r.op : undefined) {
    case 'status':
      return { op: 'status' };
    case 'resume':
      return { op: 'resume' };
    case 'stop':
      return { op: 'stop' };
    case 'suspend':
      if (r!.offload !== undefined && typeof r!.offload !== 'boolean') throw new InvalidOptionError('control request', 'suspend: offload must be true or false');
      return { op: 'suspend', offload: r!.offload === true };
    case 'snapshot': {
      // The run's cwd is not the client's: a relative directory would land somewhere unexpected.
      if (typeof r!.dir !== 'string' || !isAbsolute(r!.dir) || r!.dir.includes('\0')) throw new InvalidOptionError('control request', 'snapshot: dir must be an absolute path');
      if (r!.leavePaused !== undefined && typeof r!.leavePaused !== 'boolean') throw new InvalidOptionError('control request', 'snapshot: leavePaused must be true or false');
      return { op: 'snapshot', dir: r!.dir, leavePaused: r!.leavePaused === true };
    }
    default:
      throw new InvalidOptionError('control request', `expected {"op": "status" | "suspend" | "resume" | "snapshot" | "stop"}, got ${JSON.stringify(line.slice(0, 80))}`);
  }
}

/** An error as it travels in a response. */
export function errorPayload(e: unknown): { code: string; message: string } {
  if (e instanceof PvisorError) return { code: e.code, message: e.message };
  return { code: 'PVISOR_INTERNAL', message: e instanceof Error ? e.message : String(e) };
}

/** Is somebody listening on `path`? A file there that is not a socket is an error. */
export async function probeSocket(path: string): Promise<'live' | 'stale' | 'absent'> {
  let isSocket: boolean;
  try {
    isSocket = lstatSync(path).isSocket();
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return 'absent';
    throw new ControlSocketError(path, (e as Error).message, { cause: e });
  }
  if (!isSocket) throw new ControlSocketError(path, 'exists and is not a socket; remove it or choose another id');
  return new Promise((resolve, reject) => {
    const s = createConnection(path);
    s.once('connect', () => {
      s.destroy();
      resolve('live');
    });
    s.once('error', (e: NodeJS.ErrnoException) => {
      if (e.code === 'ECONNREFUSED') resolve('stale');
      else if (e.code === 'ENOENT') resolve('absent');
      else reject(new ControlSocketError(path, e.message, { cause: e }));
    });
  });
}

/** The listening end, owned by `pvisor run`. */
export class ControlServer {
  private ino: number | undefined;

  private constructor(
    /** The socket's path. */
    readonly path: string,
    private readonly server: Server,
  ) {}

  /**
   * Claims `path` for VM `id` and answers requests with `handler`. A live socket there is an
   * {@link InvalidOptionError} (the id is taken); a stale one (no listener) is replaced.
   */
  static async listen(path: string, id: string, handler: ControlHandler): Promise<ControlServer> {
    if (Buffer.byteLength(path) > MAX_SOCKET_PATH_BYTES) {
      throw new InvalidOptionError('control socket', `${path} is longer than the ${MAX_SOCKET_PATH_BYTES} bytes a Unix socket path may have; set PVISOR_RUNTIME_DIR to a shorter directory`);
    }
    const server = createServer((conn) => serve(conn, handler));
    // Two runs of one id racing: both may see no socket, one of them gets EADDRINUSE and looks again.
    for (let attempt = 0; ; attempt++) {
      const found = await probeSocket(path);
      if (found === 'live') throw new InvalidOptionError('name', `a VM named ${id} is already running (control socket ${path}); choose another --name or end it with: pvisor stop ${id}`);
      if (found === 'stale') rmSync(path, { force: true });
      try {
        await new Promise<void>((resolve, reject) => {
          server.once('error', reject);
          server.listen(path, () => {
            server.off('error', reject);
            resolve();
          });
        });
        break;
      } catch (e) {
        if ((e as NodeJS.ErrnoException).code === 'EADDRINUSE' && attempt < 2) continue;
        throw new ControlSocketError(path, `cannot listen: ${(e as Error).message}`, { cause: e });
      }
    }
    const cs = new ControlServer(path, server);
    cs.ino = lstatSync(path).ino;
    return cs;
  }

  /** Stops listening and removes the socket file (only if it is still this server's). */
  close(): void {
    this.server.close();
    try {
      if (this.ino !== undefined && lstatSync(this.path).ino === this.ino) rmSync(this.path, { force: true });
    } catch {
      // Already gone: Node removes a Unix socket's file when its server closes.
    }
    this.ino = undefined;
  }
}

/**
 * Requests of one connection that may wait for their answer at once: beyond it the connection is
 * not read (the kernel's socket buffer fills and the client waits), so a client pipelining
 * requests cannot grow the VM's process (294k queued requests grew it by 681 MiB).
 */
const MAX_QUEUED_REQUESTS = 16;

function serve(conn: Socket, handler: ControlHandler): void {
  let buffered = '';
  let chain = Promise.resolve();
  let queued = 0;
  conn.setEncoding('utf8');
  conn.on('error', () => {}); // a client that goes away mid-answer is not the VM's problem
  // Takes complete lines off the buffer while fewer than the bound wait; reads on only below it.
  const pump = () => {
    let nl: number;
    while (queued < MAX_QUEUED_REQUESTS && (nl = buffered.indexOf('\n')) >= 0) {
      const line = buffered.slice(0, nl).trim();
      buffered = buffered.slice(nl + 1);
      if (!line) continue;
      queued++;
      // One connection's requests are answered in order.
      chain = chain.then(async () => {
        let answer: Awaited<ReturnType<ControlHandler>>;
        try {
          answer = await handler(parseRequest(line));
        } catch (e) {
          answer = { response: { ok: false, error: errorPayload(e) } };
        }
        if (conn.destroyed) answer.afterSent?.();
        else conn.write(`${JSON.stringify(answer.response)}\n`, () => answer.afterSent?.());
        queued--;
        pump();
      });
    }
    if (queued >= MAX_QUEUED_REQUESTS) conn.pause();
    else if (!conn.destroyed) conn.resume();
  };
  conn.on('data', (chunk: string) => {
    buffered += chunk;
    if (buffered.length > MAX_LINE_BYTES && !buffered.slice(0, MAX_LINE_BYTES + 1).includes('\n')) {
      conn.end(`${JSON.stringify({ ok: false, error: { code: 'PVISOR_INVALID_OPTION', message: `control request: longer than ${MAX_LINE_BYTES} bytes` } })}\n`);
      buffered = '';
      return;
    }
    pump();
  });
}

/**
 * Sends one request to VM `id` at `path` and resolves with its answer (which may say `ok: false`).
 * No socket, or nobody listening, is a {@link VmNotFoundError}.
 */
export function controlRequest(path: string, id: string, request: ControlRequest, timeoutMs: number): Promise<ControlResponse> {
  return new Promise((resolve, reject) => {
    const conn = createConnection(path);
    let buffered = '';
    let settled = false;
    const settle = (f: () => void) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      conn.destroy();
      f();
    };
    const timer = setTimeout(() => settle(() => reject(new TimeoutError(`${id} did not answer ${request.op} on ${path} within ${timeoutMs} ms`))), timeoutMs);
    conn.setEncoding('utf8');
    conn.once('connect', () => conn.write(`${JSON.stringify(request)}\n`));
    conn.on('data', (chunk: string) => {
      buffered += chunk;
      const nl = buffered.indexOf('\n');
      if (nl < 0) return;
      settle(() => {
        try {
          const r = JSON.parse(buffered.slice(0, nl)) as ControlResponse;
          if (typeof r !== 'object' || r === null || typeof r.ok !== 'boolean') throw new Error('no "ok" field');
          resolve(r);
        } catch (e) {
          reject(new ControlSocketError(path, `malformed answer: ${(e as Error).message}`));
        }
      });
    });
    conn.on('error', (e: NodeJS.ErrnoException) =>
      settle(() => {
        if (e.code === 'ENOENT') reject(new VmNotFoundError(id, `no VM named ${id} is running (no control socket ${path})`));
        else if (e.code === 'ECONNREFUSED') reject(new VmNotFoundError(id, `no VM named ${id} is running (${path} is left from a run that has ended)`));
        else reject(new ControlSocketError(path, e.message, { cause: e }));
      }),
    );
    conn.on('close', () => settle(() => reject(new ControlSocketError(path, `${id} closed the connection without answering (the VM may have ended)`))));
  });
}
