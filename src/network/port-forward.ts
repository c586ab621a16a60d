/**
 * Port forwarding without a network: a TCP listener on the host whose connections each reach a
 * TCP port inside the guest through the agent channel. Each connection is one guest process,
 * `nc 127.0.0.1 PORT` (busybox's in the shipped initramfs), whose stdin and stdout are the
 * connection's two directions; it works with `network: 'none'`, since the guest side is its
 * loopback. Half-close carries over both ways (busybox nc shuts down its write side on EOF of
 * its stdin; the connection ends when the guest server closes).
 *
 * Host to guest is flow-controlled (the socket is paused until the agent has each piece in nc's
 * stdin); guest to host is what the agent's stream sends, which the agent bounds on its side.
 */
import { createServer, type Server, type Socket } from 'node:net';
import { InvalidOptionError } from '../errors';
import type { Command, GuestProcess, SpawnOptions } from '../guest/linux-client';

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
  const server: Server = createServer((socket) => {
    sockets.add(socket);
    let p: GuestProcess;
    try {
      p = spawn(['nc', '127.0.0.1', String(guestPort)], { stdin: true });
    } catch {
      socket.destroy();
      return;
    }
    p.stdout.on('data', (b: Buffer) => socket.write(b));
    p.stdout.on('end', () => socket.end());
    p.exited.then(() => socket.end(), () => socket.destroy());
    socket.on('data', (b: Buffer) => {
      socket.pause();
      p.write(b).then(() => socket.resume(), () => socket.destroy());
    });
    socket.on('end', () => void p.end().catch(() => {}));
    socket.on('error', () => {});
    socket.on('close', () => {
      sockets.delete(socket);
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
