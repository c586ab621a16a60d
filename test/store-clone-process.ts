// A clone restored from an object store in a node process of its own (a "host" is a runtime
// directory and a chunk cache; two clones of one host share the cache), driven line by line over
// its stdin and stdout: the store tests' way to have clones in other processes.
import { spawn, type ChildProcess } from 'node:child_process';
import { join } from 'node:path';
import { createInterface } from 'node:readline';

const index = join(__dirname, '..', 'src', 'index.js');

/** What the clone process says once its VM is restored. */
export interface CloneReady {
  pid: number;
  restoreInfo: { ramLoad: string; readyMs: number; store: { chunksTransferred: number; chunksPresent: number; bytesTransferred: number; sharedEntry?: string } };
}

/** A clone in another process. */
export interface CloneProcess {
  ready: CloneReady;
  /** Sends one command, resolves with its answer (a JSON object). */
  ask(command: { op: 'digest' } | { op: 'exec'; argv: string[] } | { op: 'write'; path: string; text: string } | { op: 'stop' }): Promise<Record<string, unknown>>;
  /** Stops the VM if it runs, and waits for the process to exit. */
  end(): Promise<void>;
  child: ChildProcess;
}

/**
 * Restores `url` with SharedSnapshot (unless `shared` is false) in a new node process whose
 * runtime directory is `runDir` and whose chunk cache is `cacheDir`.
 */
export async function startCloneProcess(url: string, o: { runDir: string; cacheDir: string; readyTimeoutMs: number; shared?: boolean }): Promise<CloneProcess> {
  const script = `
    const { Vm, SharedSnapshot } = require(${JSON.stringify(index)});
    const { createInterface } = require('node:readline');
    const out = (o) => process.stdout.write(JSON.stringify(o) + '\\n');
    (async () => {
      const vm = await Vm.restore(${JSON.stringify(url)}, {
        strategies: ${o.shared === false ? '[]' : '[new SharedSnapshot()]'},
        readyTimeoutMs: ${o.readyTimeoutMs},
        store: { cacheDir: ${JSON.stringify(o.cacheDir)}, requestTimeoutMs: 60000 },
      });
      out({ pid: process.pid, restoreInfo: vm.restoreInfo });
      for await (const line of createInterface({ input: process.stdin })) {
        const c = JSON.parse(line);
        if (c.op === 'digest') out({ digest: (await vm.probe.digest()).hex });
        else if (c.op === 'exec') { const r = await vm.exec(c.argv); out({ stdout: r.stdout, exitCode: r.exitCode }); }
        else if (c.op === 'write') { await vm.files.write(c.path, c.text); out({ written: c.path }); }
        else if (c.op === 'stop') { await vm.stop(); out({ stopped: true }); break; }
      }
    })().catch((e) => { console.error(e); process.exit(1); });`;
  const child = spawn(process.execPath, ['-e', script], { stdio: ['pipe', 'pipe', 'pipe'], env: { ...process.env, PVISOR_RUNTIME_DIR: o.runDir } });
  let stderr = '';
  child.stderr!.on('data', (d: Buffer) => (stderr += d.toString()));
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
  const lines = createInterface({ input: child.stdout! })[Symbol.asyncIterator]();
  const next = async (): Promise<Record<string, unknown>> => {
    const r = await Promise.race([lines.next(), exited.then((code) => ({ done: true, value: `exited ${code}` }))]);
    if (r.done) throw new Error(`the clone process ${r.value ?? 'ended'}: ${stderr}`);
    return JSON.parse(r.value as string);
  };
  const ready = (await next()) as unknown as CloneReady;
  let stopped = false;
  return {
    ready,
    child,
    async ask(command) {
      child.stdin!.write(`${JSON.stringify(command)}\n`);
      const answer = await next();
      if (command.op === 'stop') stopped = true;
      return answer;
    },
    async end() {
      if (!stopped && child.exitCode === null) {
        try {
          child.stdin!.write(`${JSON.stringify({ op: 'stop' })}\n`);
          await next();
        } catch {
          // Ended already; the exit below says how.
        }
      }
      child.stdin!.end();
      await exited;
    },
  };
}

/** `dev:inode` of each file mapped in `maps` (a /proc/PID/maps) whose path contains `part`. */
export function mappedFiles(maps: string, part: string): string[] {
  const out = new Set<string>();
  for (const line of maps.split('\n')) {
    const f = line.trim().split(/\s+/);
    if (f.length >= 6 && f.slice(5).join(' ').includes(part)) out.add(`${f[3]}:${f[4]}`);
  }
  return [...out];
}
