/**
 * Port forwarding without a network: a TCP listener on the host whose connections each reach a
 * TCP port inside the guest through the agent channel. Each connection is one guest process,
 * `nc 127.0.0.1 PORT` (busybox's in the shipped initramfs), whose stdin and stdout are the
 * connection's two directions; it works with `network: 'none'`, since the guest side is its
 * loopback. Half-close carries over both ways (busybox nc shuts down its write side on EOF of
 * its stdin; the connection ends when the guest server closes).
 *
 * Both ways are flow-controlled: host to guest, at most one write in flight and STDIN_BATCH_BYTES
 * waiting, beyond that the socket is paused; guest to host, the guest's stream is paused while
 * the peer's socket is full, and under its stream credit the guest then sends nothing more of
 * that connection: a peer that does not read holds its own connection, nothing else.
 *
 * Each connection is a guest process and a host socket, so their number is capped: per forward
 * (`maxConnections`) and per VM (the {@link ConnectionBudget} the VM shares among its forwards);
 * a connection beyond either is closed at once, before a byte or a process.
 */
import { createServer, type Server, type Socket } from 'node:net';
import { InvalidOptionError } from '../errors';
import type { GuestProcess } from '../guest/guest-process';
import type { Command, SpawnOptions } from '../guest/guest-types';

/**
 * Host to guest, the most that waits for the write in flight to finish before the socket is
 * paused, and so the largest write (plus one socket read): one agent frame's data
 * (linux-client's DATA_PER_FRAME), so that a write is one round trip.
 */
export const STDIN_BATCH_BYTES = 512 * 1024;

/** Default of {@link ForwardOptions.maxConnections}. */
export const DEFAULT_MAX_FORWARD_CONNECTIONS = 64;
/** The most connections all the forwards of one VM have open at once (each is a guest process). */
export const MAX_VM_FORWARD_CONNECTIONS = 256;

/**
 * Options of {@link Vm.forward}.
 * @category Network
 */
export interface ForwardOptions {
  /** The host port to listen on, 1-65535; default 0 (one the kernel chooses). */
  hostPort?: number;
  /** The host address to listen on. Default `127.0.0.1` (this host only). */
  host?: string;
  /**
   * The most connections open at once through this forward, 1 to 256; default 64. One more is
   * closed at once (its peer reads an end of stream before any byte), as is one beyond the 256
   * that all the forwards of a VM may have open; each closed one is a VM `warning`.
   */
  maxConnections?: number;
}

/**
 * How many connections a forward has, and has turned away.
 * @category Network
 */
export interface ForwardConnections {
  /** Open now: each a guest `nc` process and a host socket. */
  open: number;
  /** Closed at once since the forward began, being over `maxConnections` or the VM's cap. */
  refused: number;
}

/**
 * A forwarded port: connect to `host`:`port` to reach the guest's port.
 * @category Network
 */
export interface PortForward {
  host: string;
  port: number;
  guestPort: number;
  /** Its connections now. */
  connections(): ForwardConnections;
  /** Stops listening and ends the connections under way. */
  close(): Promise<void>;
}

/** Connections a VM's forwards may still open: the cap they share. */
export class ConnectionBudget {
  private used = 0;
  constructor(readonly max: number) {}

  /** Takes one; false if all are taken. */
  take(): boolean {
    if (this.used >= this.max) return false;
    this.used++;
    return true;
  }

  /** Gives one back (its connection closed). */
  give(): void {
    this.used = Math.max(0, this.used - 1);
  }

  /** Taken now. */
  get inUse(): number {
    return this.used;
  }
}

function checkCount(option: string, value: unknown, max: number): number {
  if (!Number.isInteger(value) || (value as number) < 1 || (value as number) > max) throw new InvalidOptionError(option, `expected a whole number from 1 to ${max}, got ${JSON.stringify(value)}`);
  return value as number;
}

function checkPort(option: string, value: unknown, min: number): number {
  if (!Number.isInteger(value) || (value as number) < min || (value as number) > 65535) throw new InvalidOptionError(option, `expected a port number from ${min} to 65535, got ${JSON.stringify(value)}`);
  return value as number;
}

/** What a VM gives {@link forwardPort}: the cap its forwards share, and where refusals are told. */
export interface ForwardLimits {
  vmConnections: ConnectionBudget;
  onRefused?: (message: string) => void;
}

/** Listens on the host and relays each connection to `guestPort` through a guest `nc`. */
export async function forwardPort(
  spawn: (command: Command, options: SpawnOptions) => GuestProcess,
  guestPort: number,
  options: ForwardOptions = {},
  limits: ForwardLimits = { vmConnections: new ConnectionBudget(MAX_VM_FORWARD_CONNECTIONS) },
): Promise<PortForward> {
  checkPort('guestPort', guestPort, 1);
  const hostPort = options.hostPort === undefined ? 0 : checkPort('hostPort', options.hostPort, 1);
  const host = options.host ?? '127.0.0.1';
  const maxConnections = options.maxConnections === undefined ? DEFAULT_MAX_FORWARD_CONNECTIONS : checkCount('maxConnections', options.maxConnections, MAX_VM_FORWARD_CONNECTIONS);
  const sockets = new Set<Socket>();
  let refused = 0;
  let port = hostPort;
  // allowHalfOpen: a peer that shuts its write side down (sent its request, waits for the answer)
  // must still get what the guest sends back; by default Node would end our side at its FIN.
  const server: Server = createServer({ allowHalfOpen: true }, (socket) => {
    const over =
      sockets.size >= maxConnections ? `${maxConnections} connections of this forward are open (maxConnections)`
      : !limits.vmConnections.take() ? `the VM's forwards have ${limits.vmConnections.max} connections open`
      : undefined;
    if (over) {
      refused++;
      socket.destroy();
      limits.onRefused?.(`forward ${host}:${port} to guest port ${guestPort}: a connection was closed at once, ${over}`);
      return;
    }
    sockets.add(socket);
    socket.once('close', () => {
      sockets.delete(socket);
      limits.vmConnections.give();
    });
    let p: GuestProcess;
    try {
      p = spawn(['nc', '127.0.0.1', String(guestPort)], { stdin: true });
    } catch {
      socket.destroy();
      return;
    }
    // Guest to host, with backpressure: while the peer does not read, the relay stops taking the
    // guest's stream; past its credit window the guest then sends nothing more of it and nc
    // blocks in write, like any spawned stream nobody reads (docs/agent-protocol.md, "Stream
    // credit"). Written on regardless, a guest sending to a peer that never reads would grow this
    // process without bound.
    p.stdout.on('data', (b: Buffer) => {
      if (!socket.write(b)) p.stdout.pause();
    });
    socket.on('drain', () => p.stdout.resume());
    // The connection ends once all of the guest's output is in the socket: at the stream's end,
    // which comes after its last byte was read, never at the process's exit, which may come
    // while output still waits in the stream for the peer to read.
    p.stdout.on('end', () => socket.end());
    // nc's own messages are not the peer's: read and dropped, so they never stop it.
    p.stderr.resume();
    p.exited.catch(() => socket.destroy());
    // Host to guest: the agent takes one STDIN_WRITE per process at a time, and each costs a
    // round trip through it, so what the peer sends meanwhile is gathered (up to
    // STDIN_BATCH_BYTES, then the socket pauses) and goes in the next write.
    let queued: Buffer[] = [];
    let queuedBytes = 0;
    let writing = false;
    let peerEnded = false;
    let stdinClosed = false;
    const pump = (): void => {
      if (writing) return;
      if (queuedBytes === 0) {
        if (peerEnded && !stdinClosed) {
          stdinClosed = true;
          void p.end().catch(() => {});
        }
        return;
      }
      const data = queued.length === 1 ? queued[0] : Buffer.concat(queued, queuedBytes);
      queued = [];
      queuedBytes = 0;
      writing = true;
      socket.resume();
      p.write(data).then(
        () => {
          writing = false;
          pump();
        },
        () => socket.destroy(),
      );
    };
    socket.on('data', (b: Buffer) => {
      queued.push(b);
      queuedBytes += b.length;
      if (queuedBytes >= STDIN_BATCH_BYTES) socket.pause();
      pump();
    });
    socket.on('end', () => {
      peerEnded = true;
      pump();
    });
    socket.on('error', () => {});
    socket.on('close', () => {
      // Nobody reads it any more: what still comes is dropped, so nc is not left blocked.
      p.stdout.destroy();
      // The guest side goes with the connection (it may be waiting on a server that never closes).
      p.kill('SIGKILL').catch(() => {});
    });
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(hostPort, host, () => resolve());
  });
  const address = server.address();
  port = typeof address === 'object' && address ? address.port : hostPort;
  return {
    host,
    port,
    guestPort,
    connections: () => ({ open: sockets.size, refused }),
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy();
        server.close(() => resolve());
      }),
  };
}
