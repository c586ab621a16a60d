/** A page pool daemon inside a Table 3 cell, so that its memory is the cell's. */
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { PVISOR_DAEMON_BIN } from './bins';
import type { CellCgroup } from './cell-cgroup';

/** pvisor-daemon serve --memory-pool in the cell's cgroup, on a socket of its own. */
export class PoolDaemon {
  private constructor(private readonly child: ChildProcess, readonly socket: string, private readonly dir: string) {}

  static async start(cgroup: CellCgroup | string, label: string): Promise<PoolDaemon> {
    const dir = mkdtempSync(join(tmpdir(), 'pvisor-bench-pool-'));
    const socket = join(dir, 'pool.sock');
    const argv = [PVISOR_DAEMON_BIN, 'serve', '--memory-pool', '--socket', socket, '--max-pool', '1GiB'];
    const [cmd, full] = typeof cgroup === 'string' ? [process.execPath, argv] : cgroup.wrap(process.execPath, argv);
    const child = spawn(cmd, full, { stdio: ['ignore', 'ignore', 'pipe'] });
    let err = '';
    await new Promise<void>((resolve, reject) => {
      child.stderr!.on('data', (d: Buffer) => {
        err += d.toString();
        if (/page pool of up to/.test(err)) resolve();
      });
      child.once('exit', (code) => reject(new Error(`${label}: pvisor-daemon exited with ${code}: ${err.trim()}`)));
    });
    return new PoolDaemon(child, socket, dir);
  }

  get pid(): number {
    return this.child.pid!;
  }

  /** SIGKILL, and waits until it is gone. */
  async kill(): Promise<void> {
    if (this.child.exitCode === null && this.child.signalCode === null) {
      const gone = new Promise((r) => this.child.once('exit', r));
      this.child.kill('SIGKILL');
      await gone;
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}
