// Real `pvisor` processes for the CLI's KVM tests: a `pvisor run` whose output is watched as it
// comes, and one-shot commands (suspend, resume, ps, ...) with their status and output.
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';

export const PVISOR_MAIN = join(__dirname, '..', 'src', 'cli', 'main.js');

/** A `pvisor run` under way. */
export interface Run {
  child: ChildProcess;
  out: () => string;
  err: () => string;
  exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  /** Resolves when stdout (or stderr) matches; rejects if the run ends first. */
  waitFor(pattern: RegExp, stream?: 'out' | 'err'): Promise<void>;
}

/** Starts `pvisor ARGS` with `env`, watching its output. */
export function startPvisor(env: NodeJS.ProcessEnv, args: string[]): Run {
  const child = spawn(process.execPath, [PVISOR_MAIN, ...args], { env, stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  let err = '';
  const waiters: (() => void)[] = [];
  const poke = () => waiters.forEach((w) => w());
  child.stdout!.setEncoding('utf8').on('data', (d: string) => ((out += d), poke()));
  child.stderr!.setEncoding('utf8').on('data', (d: string) => ((err += d), poke()));
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => child.on('exit', (code, signal) => (poke(), resolve({ code, signal }))));
  return {
    child,
    out: () => out,
    err: () => err,
    exited,
    waitFor: (pattern, stream = 'out') =>
      new Promise((resolve, reject) => {
        const check = () => {
          if (pattern.test(stream === 'out' ? out : err)) resolve();
          else if (child.exitCode !== null || child.signalCode !== null) reject(new Error(`run ended before ${pattern}: stdout ${out} stderr ${err}`));
          else return false;
          return true;
        };
        if (!check()) waiters.push(() => void check());
      }),
  };
}

/** Runs `pvisor ARGS` to its end. */
export function pvisorOnce(env: NodeJS.ProcessEnv, args: string[], cwd = process.cwd()): Promise<{ status: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(process.execPath, [PVISOR_MAIN, ...args], { cwd, env, encoding: 'utf8' }, (error, stdout, stderr) => {
      resolve({ status: error ? Number((error as { code?: number }).code ?? 1) : 0, stdout, stderr });
    });
  });
}

/** Whether process `pid` has ended (gone, or a zombie nobody has reaped yet). */
export function gone(pid: number): boolean {
  try {
    process.kill(pid, 0);
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'ESRCH';
  }
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2).startsWith('Z');
  } catch {
    return true;
  }
}
