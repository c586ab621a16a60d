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
import { parseOutputMode, type OutputMode } from './guest/output-ring';
import { lstatSync, mkdirSync, rmSync, chmodSync } from 'node:fs';
import { createConnection, createServer, type Server, type Socket } from 'node:net';
import { basename, isAbsolute, join } from 'node:path';
import { AbortError, CommandNotFoundError, ControlProtocolError, ControlSocketError, GuestRequestError, InvalidOptionError, OutputLimitError, PvisorError, TimeoutError, VmNotFoundError, VmStateError } from './errors';
import type { ExecResult } from './guest/guest-types';
import type { StrategyStats } from './memory/strategy';
import type { Labels } from './labels';
import type { GuestKind, SnapshotInfo, VmMemoryUsage, VmState } from './vm-types';
import type { DirEntry, FileStat } from './guest/file-wire';
import { isStoreUrl, parseStoreUrl } from './store/store-url';
import type { StoreTransfer } from './store/store-options';

/** The version of the control protocol this pvisor speaks; see docs/control-protocol.md. */
export const CONTROL_PROTOCOL_VERSION = 1;

/** A request to a VM's control socket (sent with `v`, {@link CONTROL_PROTOCOL_VERSION}). */
export type ControlRequest =
  | { op: 'status' }
  | { op: 'exec'; command: string | string[]; timeoutMs?: number }
  | { op: 'suspend'; offload: boolean }
  | { op: 'resume' }
  | { op: 'snapshot'; dir: string; leavePaused: boolean }
  | { op: 'hibernate'; store?: string }
  /**
   * `signal`: the stop of a signal the run's launcher got and relays (a jailed run,
   * src/cli/run-jailed.ts): the run ends as it ends on that signal (its message, 128 + N).
   */
  | { op: 'stop'; signal?: 'SIGINT' | 'SIGTERM' }
  | ControlFilesRequest
  | ControlStreamRequest;

/** A files call that is one request and one answer (docs/control-protocol.md, "Files"). */
export type ControlFilesRequest =
  | { op: 'files'; call: 'stat'; path: string; followSymlinks?: boolean; timeoutMs?: number; user?: string }
  | { op: 'files'; call: 'list'; path: string; maxEntries?: number; timeoutMs?: number; user?: string }
  | { op: 'files'; call: 'mkdir'; path: string; recursive?: boolean; mode?: number; timeoutMs?: number; user?: string }
  | { op: 'files'; call: 'remove'; path: string; recursive?: boolean; timeoutMs?: number; user?: string }
  | { op: 'files'; call: 'rename'; path: string; to: string; timeoutMs?: number; user?: string };

/**
 * A request that turns its connection into a stream (docs/control-protocol.md, "Streams"): it
 * must be the connection's first line; after its answer the connection carries frames.
 */
export type ControlStreamRequest =
  | { op: 'spawn'; command: string | string[]; env?: Record<string, string>; cwd?: string; stdin: boolean; timeoutMs?: number; user?: string; stdout?: OutputMode; stderr?: OutputMode }
  | { op: 'files.readStream'; path: string; timeoutMs?: number; user?: string }
  | { op: 'files.writeStream'; path: string; mode?: number; timeoutMs?: number; user?: string }
  | { op: 'watch' };

/** The ops of {@link ControlStreamRequest}. */
const STREAM_OPS: ReadonlySet<string> = new Set(['spawn', 'files.readStream', 'files.writeStream', 'watch']);

/** Is `r` a request that turns its connection into a stream? */
export function isStreamRequest(r: ControlRequest): r is ControlStreamRequest {
  return STREAM_OPS.has(r.op);
}

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
  /** A restored VM's guest RAM: read, or loading lazily (`Vm.restoreInfo.ramLoad`); absent for a booted one. */
  ramLoad?: string;
}

/**
/**
 * A VM's memory figures, in bytes: those of {@link VmMemoryUsage} (what {@link Vm.memoryUsage}
 * gives in the VM's process) and two of the control protocol's own.
 * @category VM
 */
export interface ControlMemory extends VmMemoryUsage {
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
  /** Hibernated to an object store: `dir` and `record` are `s3://` locations, and this is what was sent. */
  store?: StoreTransfer;
}

/** An answer from a VM's control socket. */
export type ControlResponse =
  | {
      ok: true;
      vm: ControlVmInfo;
      memory?: ControlMemory;
      before?: ControlMemory;
      tookMs?: number;
      releasedMs?: number;
      snapshot?: SnapshotInfo;
      exec?: ExecResult;
      hibernation?: ControlHibernation;
      /** A spawn's guest pid. */
      pid?: number;
      /** A files call's answer: a stat's, a listing's entries. */
      stat?: FileStat;
      entries?: DirEntry[];
    }
  | { ok: false; error: ControlErrorPayload; vm?: ControlVmInfo; memory?: ControlMemory };

/** What the server does with a request: the answer, and what to do once it has been sent. */
export type ControlHandler = (request: ControlRequest) => Promise<{ response: ControlResponse; afterSent?: () => void }>;

/**
 * What the server does with a stream request ({@link ControlStreamRequest}), the first line of
 * `conn`: it answers on `conn` and serves the stream; `leftover` is what the client sent after the
 * line. `conn` is paused: the handler reads it when it is ready.
 */
export type ControlStreamHandler = (request: ControlStreamRequest, conn: Socket, leftover: Buffer) => void;

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
      // To an object store: the VM leaves this host (docs/object-store.md, "Hibernated VMs in a store").
      if (r!.store === undefined) return { op: 'hibernate' };
      try {
        if (typeof r!.store !== 'string') throw new Error('not a string');
        parseStoreUrl(r!.store);
      } catch (e) {
        throw new InvalidOptionError('control request', `hibernate: store: ${(e as Error).message}`);
      }
      return { op: 'hibernate', store: r!.store };
    case 'stop':
      if (r!.signal !== undefined && r!.signal !== 'SIGINT' && r!.signal !== 'SIGTERM') throw new InvalidOptionError('control request', 'stop: signal must be SIGINT or SIGTERM');
      return r!.signal === undefined ? { op: 'stop' } : { op: 'stop', signal: r!.signal };
    case 'suspend':
      if (r!.offload !== undefined && typeof r!.offload !== 'boolean') throw new InvalidOptionError('control request', 'suspend: offload must be true or false');
      return { op: 'suspend', offload: r!.offload === true };
    case 'snapshot': {
      // The run's cwd is not the client's: a relative directory would land somewhere unexpected.
      if (typeof r!.dir === 'string' && isStoreUrl(r!.dir)) {
        try {
          parseStoreUrl(r!.dir);
        } catch (e) {
          throw new InvalidOptionError('control request', `snapshot: dir: ${(e as Error).message}`);
        }
      } else if (typeof r!.dir !== 'string' || !isAbsolute(r!.dir) || r!.dir.includes('\0')) throw new InvalidOptionError('control request', 'snapshot: dir must be an absolute path or an s3://bucket/prefix location');
      if (r!.leavePaused !== undefined && typeof r!.leavePaused !== 'boolean') throw new InvalidOptionError('control request', 'snapshot: leavePaused must be true or false');
      return { op: 'snapshot', dir: r!.dir, leavePaused: r!.leavePaused === true };
    }
    case 'spawn': {
      const command = r!.command;
      const argv = Array.isArray(command) && command.length > 0 && command.every((w) => typeof w === 'string');
      if (!argv && !(typeof command === 'string' && command.trim())) throw new InvalidOptionError('control request', 'spawn: command must be a non-empty string or array of strings');
      const env = r!.env;
      if (env !== undefined && (env === null || typeof env !== 'object' || Array.isArray(env) || !Object.values(env).every((v) => typeof v === 'string'))) {
        throw new InvalidOptionError('control request', 'spawn: env must be an object of strings');
      }
      return {
        op: 'spawn',
        command: command as string | string[],
        ...(env !== undefined && { env: { ...(env as Record<string, string>) } }),
        ...optionalField(r!, 'spawn', 'cwd', 'string'),
        stdin: booleanField(r!, 'spawn', 'stdin') ?? false,
        ...timeoutField(r!, 'spawn'),
        ...userField(r!, 'spawn'),
        ...outputModeField(r!, 'spawn', 'stdout'),
        ...outputModeField(r!, 'spawn', 'stderr'),
      };
    }
    case 'files.readStream':
      return { op: 'files.readStream', path: pathField(r!, 'files.readStream', 'path'), ...timeoutField(r!, 'files.readStream'), ...userField(r!, 'files.readStream') };
    case 'files.writeStream':
      return { op: 'files.writeStream', path: pathField(r!, 'files.writeStream', 'path'), ...optionalField(r!, 'files.writeStream', 'mode', 'number'), ...timeoutField(r!, 'files.writeStream'), ...userField(r!, 'files.writeStream') };
    case 'watch':
      return { op: 'watch' };
    case 'files':
      return parseFilesRequest(r!);
    default:
      throw new InvalidOptionError('control request', `expected {"v": 1, "op": "status" | "exec" | "suspend" | "resume" | "snapshot" | "hibernate" | "stop" | "files" | "spawn" | "files.readStream" | "files.writeStream" | "watch"}, got ${JSON.stringify(line.slice(0, 80))}`);
  }
}

/** A files call's request, its fields checked for type (their values are checked where they are used, as for a call in the VM's own process). */
function parseFilesRequest(r: Record<string, unknown>): ControlFilesRequest {
  const what = `files.${String(r.call)}`;
  const path = pathField(r, what, 'path');
  const timeout = { ...timeoutField(r, what), ...userField(r, what) };
  switch (r.call) {
    case 'stat':
      return { op: 'files', call: 'stat', path, ...optionalField(r, what, 'followSymlinks', 'boolean'), ...timeout };
    case 'list':
      return { op: 'files', call: 'list', path, ...optionalField(r, what, 'maxEntries', 'number'), ...timeout };
    case 'mkdir':
      return { op: 'files', call: 'mkdir', path, ...optionalField(r, what, 'recursive', 'boolean'), ...optionalField(r, what, 'mode', 'number'), ...timeout };
    case 'remove':
      return { op: 'files', call: 'remove', path, ...optionalField(r, what, 'recursive', 'boolean'), ...timeout };
    case 'rename':
      return { op: 'files', call: 'rename', path, to: pathField(r, what, 'to'), ...timeout };
    default:
      throw new InvalidOptionError('control request', `files: call must be "stat", "list", "mkdir", "remove" or "rename", got ${JSON.stringify(r.call)}`.slice(0, 200));
  }
}

/** The longest path a request carries (the agent's own bound is PATH_MAX; this only keeps junk short). */
const MAX_REQUEST_PATH_CHARS = 4096;

function pathField(r: Record<string, unknown>, what: string, key: string): string {
  const v = r[key];
  if (typeof v !== 'string' || !v || v.length > MAX_REQUEST_PATH_CHARS) throw new InvalidOptionError('control request', `${what}: ${key} must be a path of 1 to ${MAX_REQUEST_PATH_CHARS} characters`);
  return v;
}

/** The longest user spec a request carries (a name of 32, or "uid:gid"; the guest checks the rest). */
const MAX_USER_CHARS = 32;

/** `user`: a short string; the VM's call checks it fully (a name or uid:gid) and names what is wrong. */
function userField(r: Record<string, unknown>, what: string): { user?: string } {
  const v = r.user;
  if (v === undefined) return {};
  if (typeof v !== 'string' || !v || v.length > MAX_USER_CHARS) throw new InvalidOptionError('control request', `${what}: user must be a user name or uid:gid of 1 to ${MAX_USER_CHARS} characters`);
  return { user: v };
}

/** `stdout`/`stderr` of a spawn: 'pipe', 'ignore' or { keep: bytes }, as the VM's spawn takes them. */
function outputModeField(r: Record<string, unknown>, what: string, key: 'stdout' | 'stderr'): { stdout?: OutputMode } | { stderr?: OutputMode } {
  if (r[key] === undefined) return {};
  try {
    return { [key]: parseOutputMode(key, r[key]) };
  } catch (e) {
    throw new InvalidOptionError('control request', `${what}: ${(e as Error).message}`);
  }
}

function booleanField(r: Record<string, unknown>, what: string, key: string): boolean | undefined {
  const v = r[key];
  if (v !== undefined && typeof v !== 'boolean') throw new InvalidOptionError('control request', `${what}: ${key} must be true or false`);
  return v;
}

function optionalField<K extends string, T extends 'string' | 'number' | 'boolean'>(r: Record<string, unknown>, what: string, key: K, type: T): { [k in K]?: T extends 'string' ? string : T extends 'number' ? number : boolean } {
  const v = r[key];
  if (v === undefined) return {};
  if (typeof v !== type || (type === 'number' && !Number.isFinite(v as number)) || (type === 'string' && (v as string).length > MAX_REQUEST_PATH_CHARS)) {
    throw new InvalidOptionError('control request', `${what}: ${key} must be a ${type}`);
  }
  return { [key]: v } as { [k in K]?: T extends 'string' ? string : T extends 'number' ? number : boolean };
}

function timeoutField(r: Record<string, unknown>, what: string): { timeoutMs?: number } {
  const v = r.timeoutMs;
  if (v === undefined) return {};
  if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < 1 || v > 2 ** 31 - 1) throw new InvalidOptionError('control request', `${what}: timeoutMs must be a whole number of ms from 1 to 2^31-1`);
  return { timeoutMs: v };
}

/** An error as it travels in a response. */
export function errorPayload(e: unknown): ControlErrorPayload {
  if (e instanceof CommandNotFoundError) return { code: e.code, message: e.message, kind: 'command-not-found', command: e.command, guestCode: e.guestCode, op: e.op, ...(e.call !== undefined && { call: e.call }), ...(e.errno !== undefined && { errno: e.errno }) };
  if (e instanceof GuestRequestError) return { code: e.code, message: e.message, guestCode: e.guestCode, op: e.op, ...(e.call !== undefined && { call: e.call }), ...(e.errno !== undefined && { errno: e.errno }) };
  if (e instanceof OutputLimitError) return { code: e.code, message: e.message, limitBytes: e.limitBytes };
  if (e instanceof InvalidOptionError) return { code: e.code, message: e.message, option: e.option };
  if (e instanceof PvisorError) return { code: e.code, message: e.message };
  return { code: 'PVISOR_INTERNAL', message: e instanceof Error ? e.message : String(e) };
}

/**
 * An error as it travels: its code and message, and the fields its class carries (a guest
 * error's errno and call, an output limit, an option's name), so the client rebuilds the class.
 * @category VM
 */
export interface ControlErrorPayload {
  code: string;
  message: string;
  kind?: 'command-not-found';
  command?: string;
  guestCode?: number;
  op?: number;
  call?: string;
  errno?: string;
  limitBytes?: number;
  option?: string;
}

/**
 * The error an answer carries, as the typed error the client throws: the classes a caller is
 * likely to handle by kind keep theirs, the others are a {@link PvisorError} with the same code.
 */
export function errorFromPayload(error: ControlErrorPayload): PvisorError {
  const message = String(error.message).slice(0, 4096);
  const str = (v: unknown) => (typeof v === 'string' ? v.slice(0, 4096) : undefined);
  const int = (v: unknown) => (typeof v === 'number' && Number.isSafeInteger(v) ? v : 0);
  switch (error.code) {
    case 'PVISOR_VM_STATE':
      return new VmStateError(message);
    case 'PVISOR_TIMEOUT':
      return new TimeoutError(message);
    case 'PVISOR_ABORTED':
      return new AbortError(message);
    case 'PVISOR_OUTPUT_LIMIT':
      return new OutputLimitError(typeof error.limitBytes === 'number' ? error.limitBytes : 0, message);
    case 'PVISOR_INVALID_OPTION':
      return withMessage(new InvalidOptionError(str(error.option) ?? 'option', ''), message);
    case 'PVISOR_GUEST_REQUEST': {
      const cause = new GuestRequestError(int(error.guestCode), message, { op: int(error.op), call: str(error.call), errno: str(error.errno) });
      if (error.kind !== 'command-not-found' || typeof error.command !== 'string') return cause;
      return withMessage(new CommandNotFoundError(error.command.slice(0, 4096), cause), message);
    }
    default:
      return new PvisorError(String(error.code).slice(0, 100), message);
  }
}

/** `e` with the message it had where it was thrown (a constructor that words its own would word it twice). */
function withMessage<E extends Error>(e: E, message: string): E {
  Object.defineProperty(e, 'message', { value: message, writable: true, configurable: true });
  return e;
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
  static async listen(path: string, id: string, handler: ControlHandler, streams?: ControlStreamHandler): Promise<ControlServer> {
    if (Buffer.byteLength(path) > MAX_SOCKET_PATH_BYTES) {
      throw new InvalidOptionError('control socket', `${path} is longer than the ${MAX_SOCKET_PATH_BYTES} bytes a Unix socket path may have; set PVISOR_RUNTIME_DIR to a shorter directory`);
    }
    const openStreams = { count: 0 };
    const server = createServer((conn) => serve(conn, handler, streams, openStreams));
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
  static async listenOnFd(fd: number, path: string, handler: ControlHandler, streams?: ControlStreamHandler): Promise<ControlServer> {
    const openStreams = { count: 0 };
    const server = createServer((conn) => serve(conn, handler, streams, openStreams));
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
 * Streams (spawned processes, file streams, watches) a VM's socket serves at once, from all its
 * clients: each holds a connection and up to a window per channel, so their number is bounded too.
 */
export const MAX_OPEN_STREAMS = 256;
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

function serve(conn: Socket, handler: ControlHandler, streams: ControlStreamHandler | undefined, openStreams: { count: number }): void {
  // Bytes, not text: after a stream request the connection carries frames.
  let buffered: Buffer = Buffer.alloc(0);
  let chain = Promise.resolve();
  let queued = 0;
  let lines = 0;
  let upgraded = false;
  conn.on('error', () => {}); // a client that goes away mid-answer is not the VM's problem
  const refuse = (message: string) => {
    conn.end(`${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, ok: false, error: { code: 'PVISOR_INVALID_OPTION', message } })}\n`);
    buffered = Buffer.alloc(0);
  };
  // Takes complete lines off the buffer while fewer than the bound wait and the client takes its
  // answers; reads on only then. Over the bound, a write returned false: 'drain' follows.
  const full = () => queued >= MAX_QUEUED_REQUESTS || conn.writableLength > MAX_UNSENT_ANSWER_BYTES;
  const pump = () => {
    let nl: number;
    while (!upgraded && !full() && (nl = buffered.indexOf(0x0a)) >= 0) {
      const line = buffered.subarray(0, nl).toString('utf8').trim();
      buffered = buffered.subarray(nl + 1);
      if (!line) continue;
      let request: ControlRequest | undefined;
      let refusal: unknown;
      try {
        request = parseRequest(line);
      } catch (e) {
        refusal = e;
      }
      if (request && isStreamRequest(request)) {
        // A stream owns its connection: it must be the first request, and nothing follows it in JSON.
        if (lines > 0 || !streams) {
          // After the answers to the requests before it, in order; nothing after it is read.
          upgraded = true;
          const message = `control request: ${request.op} must be the first request of its connection`;
          chain = chain.then(() => refuse(message));
          return;
        }
        upgraded = true;
        if (openStreams.count >= MAX_OPEN_STREAMS) return refuse(`control request: ${MAX_OPEN_STREAMS} streams of this VM are open; ${request.op} refused`);
        openStreams.count++;
        conn.once('close', () => openStreams.count--);
        conn.off('data', onData);
        conn.off('drain', pump);
        conn.pause();
        streams(request, conn, buffered);
        return;
      }
      lines++;
      queued++;
      // One connection's requests are answered in order.
      chain = chain.then(async () => {
        let answer: Awaited<ReturnType<ControlHandler>>;
        try {
          if (!request) throw refusal;
          answer = await handler(request);
        } catch (e) {
          answer = { response: { ok: false, error: errorPayload(e) } };
        }
        if (conn.destroyed) answer.afterSent?.();
        else conn.write(`${JSON.stringify({ v: CONTROL_PROTOCOL_VERSION, ...answer.response })}\n`, () => answer.afterSent?.());
        queued--;
        pump();
      });
    }
    if (upgraded) return;
    if (full()) conn.pause();
    else if (!conn.destroyed) conn.resume();
  };
  const onData = (chunk: Buffer) => {
    buffered = buffered.length ? Buffer.concat([buffered, chunk]) : chunk;
    if (buffered.length > MAX_LINE_BYTES && buffered.subarray(0, MAX_LINE_BYTES + 1).indexOf(0x0a) < 0) return refuse(`control request: longer than ${MAX_LINE_BYTES} bytes`);
    pump();
  };
  conn.on('drain', pump);
  conn.on('data', onData);
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
