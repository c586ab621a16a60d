// The Linux guest's agent (native-prebuilds/agent/agent.c) built with the host's C compiler and
// run on the host as an ordinary process, its channel a socketpair end (`agent --fd 3`), served
// by the real AgentClient and LinuxGuest: the real agent code, real processes, real pipes, without
// a VM. It runs the commands it is given on this host, as the user running the tests.
import { execFileSync, spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import type { Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { LinuxGuest } from '../src/guest/linux-client';
import { AgentClient, CommonOp } from '../src/protocol/agent-client';

// As native-prebuilds/agent/build.sh links it: the agent with the memory study's pvisor-workset.
const AGENT_SOURCES = [join(__dirname, '..', '..', 'native-prebuilds', 'agent', 'agent.c'), join(__dirname, '..', '..', 'native-prebuilds', 'linux-guest', 'workset.c')];

/** $CC, else the first of gcc, clang and cc that runs; undefined without one. */
export function findCompiler(): string | undefined {
  for (const cc of [process.env.CC, 'gcc', 'clang', 'cc']) {
    if (!cc) continue;
    if (spawnSync(cc, ['--version'], { stdio: 'ignore' }).status === 0) return cc;
  }
  return undefined;
}

/** Builds the agent into a fresh directory, under ASan and UBSan; the directory goes with `remove()`. */
export function buildAgent(compiler: string): { bin: string; remove(): void } {
  const dir = mkdtempSync(join(tmpdir(), 'pvisor-host-agent-'));
  const bin = join(dir, 'agent');
  execFileSync(compiler, ['-O1', '-g', '-Wall', '-Wextra', '-Werror', '-fsanitize=address,undefined', '-fno-sanitize-recover=all', '-o', bin, ...AGENT_SOURCES], { stdio: 'pipe' });
  return { bin, remove: () => rmSync(dir, { recursive: true, force: true }) };
}

export interface HostAgent {
  client: AgentClient;
  linux: LinuxGuest;
  /** What the client reported as protocol errors. */
  warnings: string[];
  /** The agent's own log (its stderr), for a failure's message. */
  log(): string;
  /** Sends raw bytes down the channel (hostile frames); answers to ids the client did not send come back as `warnings`. */
  sendRaw(bytes: Buffer): void;
  /** Ends the agent (SIGKILL) and waits for it. */
  stop(): Promise<void>;
}

/**
 * Starts the agent at `bin` and resolves once its HELLO has come. `etcDir`: where it reads passwd
 * and group (PVISOR_AGENT_ETC), instead of this host's /etc.
 */
export async function startHostAgent(bin: string, options: { etcDir?: string } = {}): Promise<HostAgent> {
  const env = { ...process.env, ASAN_OPTIONS: 'detect_leaks=0', ...(options.etcDir !== undefined && { PVISOR_AGENT_ETC: options.etcDir }) };
  const child: ChildProcess = spawn(bin, ['--fd', '3'], { stdio: ['ignore', 'ignore', 'pipe', 'pipe'], env });
  let log = '';
  child.stderr!.on('data', (d: Buffer) => (log = (log + d.toString()).slice(-8000)));
  const channel = child.stdio[3] as Socket;
  const warnings: string[] = [];
  let hello!: () => void;
  const ready = new Promise<void>((resolve) => (hello = resolve));
  const client = new AgentClient(
    (bytes) => channel.write(bytes),
    (f) => {
      if (f.op === CommonOp.Hello) hello();
    },
    (m) => warnings.push(m),
  );
  channel.on('data', (b: Buffer) => client.receive(b));
  channel.on('error', () => {});
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  await Promise.race([ready, exited.then(() => Promise.reject(new Error(`the agent exited before its HELLO: ${log}`)))]);
  return {
    client,
    linux: new LinuxGuest(client),
    warnings,
    log: () => log,
    sendRaw: (bytes) => channel.write(bytes),
    stop: async () => {
      client.close();
      child.kill('SIGKILL');
      await exited;
      channel.destroy();
      child.stderr!.destroy();
    },
  };
}

/**
 * One agent for a whole describe block: built (once) and started before its tests, ended and
 * removed after them. The object returned is filled in by the block's beforeAll, so tests use it
 * as they would the agent itself.
 */
export function useHostAgent(compiler: string): HostAgent {
  const agent = {} as HostAgent;
  let built: ReturnType<typeof buildAgent> | undefined;
  beforeAll(async () => {
    built = buildAgent(compiler);
    Object.assign(agent, await startHostAgent(built.bin));
  }, 120_000);
  afterAll(async () => {
    await agent.stop?.();
    built?.remove();
  });
  return agent;
}
