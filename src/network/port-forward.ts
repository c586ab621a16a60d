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
 * the peer's socket is full, which holds the guest's output in the guest.
 */
import { createServer, type Server, type Socket } from 'node:net';
import { InvalidOptionError } from '../errors';
import type { Command, GuestProcess, SpawnOptions } from '../guest/linux-client';

/**
 * Host to guest, the most that waits for the write in flight to finish before the socket is
 * paused, and so the largest write (plus one socket read): one agent frame's data
 * (linux-client's DATA_PER_FRAME), so that a write is one round trip.
 */
export const STDIN_BATCH_BYTES = 512 * 1024;

/** Options of {@link Vm.forward}. */
export interface ForwardOptions {
  /** The host port to listen on, 1-65535; default 0 (one the kernel chooses). */
  hostPort?: number;
  /** The host address to listen on. Default `127.0.0.1` (this host only). */
  host?: string;
}

/** A forwarded port: connect to `host`:`port` to reach the guest's port. */
export interface PortForward {
  host: string;
  port: number;
  guestPort: number;
  /** Stops listening and ends the connections under way. */
  close(): Promise<void>;
}

function checkPort(option: string, value: unknown, min: number): number {
  if (!Number.isInteger(value) || (value as number) < min || (value as number) > 65535) throw new InvalidOptionError(option, `expected a port number from ${min} to 65535, got ${JSON.stringify(value)}`);
  return value as number;
}

/** Listens on the host and relays each connection to `guestPort` through a guest `nc`. */
export async function forwardPort(spawn: (command: Command, options: SpawnOptions) => GuestProcess, guestPort: number, options: ForwardOptions = {}): Promise<PortForward> {
  checkPort('guestPort', guestPort, 1);
  const hostPort = options.hostPort === undefined ? 0 : checkPort('hostPort', options.hostPort, 1);
  const host = options.host ?? '127.0.0.1';
  const sockets = new Set<Socket>();
  // allowHalfOpen: a peer that shuts its write side down (sent its request, waits for the answer)
  // must still get what the guest sends back; by default Node would end our side at its FIN.
  const server: Server = createServer({ allowHalfOpen: true }, (socket) => {
    sockets.add(socket);
    let p: GuestProcess;
    try {
      p = spawn(['nc', '127.0.0.1', String(guestPort)], { stdin: true });
    } catch {
      socket.destroy();
      return;
    }
    // Guest to host, with backpressure: while the peer does not read, the relay stops taking
    // the guest's stream, which (past its 1 MiB) holds the guest's output in the guest like any
    // spawned stream nobody reads (docs/agent-protocol.md, "Backpressure"). Written on regardless,
    // a guest sending to a peer that never reads would grow this process without bound.
    p.stdout.on('data', (b: Buffer) => {
      if (!socket.write(b)) p.stdout.pause();
    });
    socket.on('drain', () => p.stdout.resume());
    p.stdout.on('end', () => socket.end());
    p.exited.then(() => socket.end(), () => socket.destroy());
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
      sockets.delete(socket);
      // A paused stream would hold the VM's agent channel (every answer waits behind it).
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
  const port = typeof address === 'object' && address ? address.port : hostPort;
  return {
    host,
    port,
    guestPort,
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy();
        server.close(() => resolve());
      }),
  };
}
