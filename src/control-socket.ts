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
 * **Protocol.** Newline-delimited JSON over a Unix stream socket, versioned: every request and
 * answer carries `"v": 1` ({@link CONTROL_PROTOCOL_VERSION}), and a peer that speaks another
 * version is refused with a {@link ControlProtocolError}. The requests (status, suspend, resume,
 * snapshot, hibernate, stop, exec) and their answers are specified in docs/control-protocol.md; the CLI's
 * suspend, resume, snapshot, stop and ps and the SDK's {@link VmHandle} are its clients.
 * @module
 */
import { lstatSync, mkdirSync, rmSync, chmodSync } from 'node:fs';
import { createConnection, createServer, type Server, type Socket } from 'node:net';
import { basename, isAbsolute, join } from 'node:path';
import { ControlProtocolError, ControlSocketError, InvalidOptionError, PvisorError, TimeoutError, VmNotFoundError, VmStateError } from './errors';
import type { ExecResult } from './guest/linux-client';
import type { StrategyStats } from './memory/strategy';
import type { Labels } from './labels';
import type { GuestKind, SnapshotInfo, VmState } from './vm';

/** The version of the control protocol this pvisor speaks; see docs/control-protocol.md. */
export const CONTROL_PROTOCOL_VERSION = 1;

/** A request to a VM's control socket (sent with `v`, {@link CONTROL_PROTOCOL_VERSION}). */
export type ControlRequest =
  | { op: 'status' }
  | { op: 'exec'; command: string | string[]; timeoutMs?: number }
  | { op: 'suspend'; offload: boolean }
  | { op: 'resume' }
  | { op: 'snapshot'; dir: string; leavePaused: boolean }
  | { op: 'hibernate' }
  | { op: 'stop' };

/**
 * Who the VM is and what state it is in.
 * @category VM
 */
export interface ControlVmInfo {
  id: string;
  /** The `pvisor run` process. */
  pid: number;
  /** `hibernated`: in the answer to a hibernate only, whose process then ends. */
  state: VmState | 'starting' | 'hibernated';
  guest: GuestKind;
  memoryBytes: number;
  vcpus: number;
  /** The VM's labels (`pvisor run --label KEY=VALUE`); `{}` from a pvisor that had none. */
  labels: Labels;
  /** When its run began (ISO 8601); absent from a pvisor that did not say. */
  startedAt?: string;
}

/**
 * A VM's memory figures, in bytes.
 * @category VM
 */
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

/** Where a hibernated VM went: the answer to a hibernate. */
export interface ControlHibernation {
  /** The directory on disk that holds the VM's state (under its backing directory). */
  dir: string;
  /** The record beside the control socket that names it (`ID.hibernated`). */
  record: string;
  /** Where the run that resumes it writes its output (`ID.log`). */
  log: string;
  ramDataPageCount: number;
  bytesOnDisk: number;
}

/** An answer from a VM's control socket. */
export type ControlResponse =
  | { ok: true; vm: ControlVmInfo; memory?: ControlMemory; before?: ControlMemory; tookMs?: number; releasedMs?: number; snapshot?: SnapshotInfo; exec?: ExecResult; hibernation?: ControlHibernation }
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
  // A request without "v" is from a client older than versioning, which spoke version 1.
  if (r && typeof r === 'object' && r.v !== undefined && r.v !== CONTROL_PROTOCOL_VERSION) {
    throw new ControlProtocolError(r.v, `control request of protocol version ${JSON.stringify(r.v)}; this VM speaks version ${CONTROL_PROTOCOL_VERSION}`);
  }
  switch (r && typeof r === 'object' ? r.op : undefined) {
    case 'status':
      return { op: 'status' };
    case 'exec': {
      const command = r!.command;
      const argv = Array.isArray(command) && command.length > 0 && command.every((w) => typeof w === 'string');
      if (!argv && !(typeof command === 'string' && command.trim())) throw new InvalidOptionError('control request', 'exec: command must be a non-empty string or array of strings');
      const timeoutMs = r!.timeoutMs;
      if (timeoutMs !== undefined && (typeof timeoutMs !== 'number' || !(timeoutMs > 0))) throw new InvalidOptionError('control request', 'exec: timeoutMs must be a positive number');
      return { op: 'exec', command: command as string | string[], timeoutMs: timeoutMs as number | undefined };
    }
    case 'resume':
      return { op: 'resume' };
    case 'hibernate':
      return { op: 'hibernate' };
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
      throw new InvalidOptionError('control request', `expected {"v": 1, "op": "status" | "exec" | "suspend" | "resume" | "snapshot" | "hibernate" | "stop"}, got ${JSON.stringify(line.slice(0, 80))}`);
  }
}

/** An error as it travels in a response. */
export function errorPayload(e: unknown): { code: string; message: string } {
  if (e instanceof PvisorError) return { code: e.code, message: e.message };
  return { code: 'PVISOR_INTERNAL', message: e instanceof Error ? e.message : String(e) };
}

/**
 * The error an answer carries, as the typed error the client throws: the classes a caller is
 * likely to handle by kind keep theirs, the others are a {@link PvisorError} with the same code.
 */
export function errorFromPayload(error: { code: string; message: string }): PvisorError {
  switch (error.code) {
    case 'PVISOR_VM_STATE':
      return new VmStateError(error.message);
    case 'PVISOR_TIMEOUT':
      return new TimeoutError(error.message);
    default:
      return new PvisorError(error.code, error.message);
  }
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

  /**
   * Answers requests with `handler` on a socket already listening at `fd`, which someone else bound
   * (a jailed VMM's launcher, src/jail/launcher.ts): nothing is claimed or removed here; `path`
   * is the name clients know it by, for messages.
   */
  static async listenOnFd(fd: number, path: string, handler: ControlHandler): Promise<ControlServer> {
    const server = createServer((conn) => serve(conn, handler));
    await new Promise<void>((resolve, reject) => {
      server.once('error', (e) => reject(new ControlSocketError(path, `cannot listen on fd ${fd}: ${e.message}`, { cause: e })));
      server.listen({ fd }, () => resolve());
    });
    return new ControlServer(path, server);
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
/**
 * Answers a connection may hold unsent (what the kernel's socket buffer did not take): beyond it
 * the connection is not read until the socket drains, so a client that pipelines requests and
 * never reads the answers cannot grow the VM's process either. At most this and the answers to
 * the queued requests wait in it.
 */
const MAX_UNSENT_ANSWER_BYTES = 64 * 1024;

function serve(conn: Socket, handler: ControlHandler): void {
  let buffered = '';
  let chain = Promise.resolve();
  let queued = 0;
  conn.setEncoding('utf8');
  conn.on('error', () => {}); // a client that goes away mid-answer is not the VM's problem
  // Takes complete lines off the buffer while fewer than the bound wait and the client takes its
  // answers; reads on only then. Over the bound, a write returned false: 'drain' follows.
  const full = () => queued >= MAX_QUEUED_REQUESTS || conn.writableLength > MAX_UNSENT_ANSWER_BYTES;
  const pump = () => {
    let nl: number;
    while (!full() && (nl = buffered.indexOf('\n')) >= 0) {
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
        else conn.write(`${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, ...answer.response })}\n`, () => answer.afterSent?.());
        queued--;
        pump();
      });
    }
    if (full()) conn.pause();
    else if (!conn.destroyed) conn.resume();
  };
  conn.on('drain', pump);
  conn.on('data', (chunk: string) => {
    buffered += chunk;
    if (buffered.length > MAX_LINE_BYTES && !buffered.slice(0, MAX_LINE_BYTES + 1).includes('\n')) {
      conn.end(`${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, ok: false, error: { code: 'PVISOR_INVALID_OPTION', message: `control request: longer than ${MAX_LINE_BYTES} bytes` } })}\n`);
      buffered = '';
      return;
    }
    pump();
  });
}

/**
 * Sends one request to VM `id` at `path` and resolves with its answer (which may say `ok: false`).
 * No socket, or nobody listening, is a {@link VmNotFoundError}. An answer longer than
 * `maxAnswerBytes` (a process that is not a pvisor run, listening in the runtime directory) is a
 * {@link ControlSocketError}.
 */
export function controlRequest(path: string, id: string, request: ControlRequest, timeoutMs: number, maxAnswerBytes = Infinity): Promise<ControlResponse> {
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
    conn.once('connect', () => conn.write(`${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, ...request })}\n`));
    conn.on('data', (chunk: string) => {
      buffered += chunk;
      const nl = buffered.indexOf('\n');
      if (nl < 0) {
        if (buffered.length > maxAnswerBytes) settle(() => reject(new ControlSocketError(path, `answered ${request.op} with more than ${maxAnswerBytes} bytes`)));
        return;
      }
      settle(() => {
        try {
          const r = JSON.parse(buffered.slice(0, nl)) as (ControlResponse & { v?: unknown }) | null;
          if (typeof r !== 'object' || r === null || typeof r.ok !== 'boolean') throw new Error('no "ok" field');
          if (r.v !== CONTROL_PROTOCOL_VERSION) {
            reject(new ControlProtocolError(r.v, `${path}: ${id} answered in control protocol version ${JSON.stringify(r.v)}; this pvisor speaks version ${CONTROL_PROTOCOL_VERSION} (a pvisor run of another pvisor version?)`));
            return;
          }
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
