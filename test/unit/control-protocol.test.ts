// The control protocol's version, over real Unix sockets: a run refuses a request of another
// version, a client refuses an answer of another version, both with typed errors; requests
// without "v" (clients from before versioning) are version 1. No VM: the handler answers.
import { mkdtempSync, rmSync } from 'node:fs';
import { createConnection, createServer, type Server } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { CONTROL_PROTOCOL_VERSION, ControlServer, controlRequest, parseRequest, type ControlVmInfo } from '../../src/control-socket';
import { ControlProtocolError, VmHandle, VmNotFoundError, VmStateError } from '../../src/index';

const vm: ControlVmInfo = { id: 'P1', pid: process.pid, state: 'running', guest: 'probe', memoryBytes: 64 << 20, vcpus: 1, labels: {} };

/** Sends one raw line and resolves with the raw answer line. */
function rawRequest(path: string, line: string): Promise<Record<string, unknown>> {
  return new Promise((resolve, reject) => {
    const c = createConnection(path);
    let buf = '';
    c.setEncoding('utf8');
    c.on('connect', () => c.write(`${line}\n`));
    c.on('data', (d: string) => {
      buf += d;
      if (buf.includes('\n')) {
        c.destroy();
        resolve(JSON.parse(buf.slice(0, buf.indexOf('\n'))) as Record<string, unknown>);
      }
    });
    c.on('error', reject);
  });
}

describe('control protocol version', () => {
  let dir: string;
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-proto-'));
  });
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  it('is 1, and a request of another version is refused before the handler sees it', async () => {
    expect(CONTROL_PROTOCOL_VERSION).toBe(1);
    const seen: string[] = [];
    const server = await ControlServer.listen(join(dir, 'P1.sock'), 'P1', async (r) => (seen.push(r.op), { response: { ok: true, vm } }));
    try {
      const v2 = await rawRequest(server.path, '{"v":2,"op":"stop"}');
      expect(v2).toMatchObject({ v: 1, ok: false, error: { code: 'PVISOR_CONTROL_PROTOCOL' } });
      expect((v2.error as { message: string }).message).toMatch(/version 2; this VM speaks version 1/);
      expect(seen).toEqual([]);
      // Without "v": a client from before versioning, which spoke version 1.
      expect(await rawRequest(server.path, '{"op":"status"}')).toMatchObject({ v: 1, ok: true, vm: { id: 'P1' } });
      expect(await rawRequest(server.path, '{"v":1,"op":"status"}')).toMatchObject({ v: 1, ok: true });
      expect(seen).toEqual(['status', 'status']);
    } finally {
      server.close();
    }
  });

  it('a client refuses an answer of another version with ControlProtocolError', async () => {
    const path = join(dir, 'OLD.sock');
    const old: Server = createServer((c) => c.on('data', () => c.write(`${JSON.stringify({ v: 7, ok: true, vm })}\n`)));
    await new Promise<void>((r) => old.listen(path, r));
    try {
      const e = await controlRequest(path, 'OLD', { op: 'status' }, 5000).catch((x: unknown) => x);
      expect(e).toBeInstanceOf(ControlProtocolError);
      expect(e).toMatchObject({ code: 'PVISOR_CONTROL_PROTOCOL', version: 7 });
      await expect(VmHandle.connect('OLD', { socketPath: path })).rejects.toBeInstanceOf(ControlProtocolError);
    } finally {
      old.close();
    }
  });

  it('exec requests: an argv or a shell string, nothing else', () => {
    expect(parseRequest('{"v":1,"op":"exec","command":["uname","-a"],"timeoutMs":5000}')).toEqual({ op: 'exec', command: ['uname', '-a'], timeoutMs: 5000 });
    expect(parseRequest('{"v":1,"op":"exec","command":"echo hi | wc -c"}')).toEqual({ op: 'exec', command: 'echo hi | wc -c', timeoutMs: undefined });
    // A jailed run's launcher relays the signal it got, so the run ends as on that signal.
    expect(parseRequest('{"v":1,"op":"stop","signal":"SIGINT"}')).toEqual({ op: 'stop', signal: 'SIGINT' });
    expect(parseRequest('{"v":1,"op":"stop"}')).toEqual({ op: 'stop' });
    expect(() => parseRequest('{"v":1,"op":"stop","signal":"SIGKILL"}')).toThrow(/stop: signal must be SIGINT or SIGTERM/);
    for (const bad of ['[]', '""', '[1]', 'null']) expect(() => parseRequest(`{"v":1,"op":"exec","command":${bad}}`)).toThrow(/exec: command must be/);
    expect(() => parseRequest('{"v":1,"op":"exec","command":"true","timeoutMs":-1}')).toThrow(/timeoutMs must be a positive number/);
  });

  it('VmHandle: no VM of that id is a VmNotFoundError; a failed operation its typed error', async () => {
    await expect(VmHandle.connect('NOPE', { socketPath: join(dir, 'NOPE.sock') })).rejects.toBeInstanceOf(VmNotFoundError);
    const server = await ControlServer.listen(join(dir, 'P2.sock'), 'P2', async (r) =>
      r.op === 'status' ? { response: { ok: true, vm } } : { response: { ok: false, error: { code: 'PVISOR_VM_STATE', message: 'P2 is running; this needs it paused or suspended' }, vm } },
    );
    try {
      const h = await VmHandle.connect('P2', { socketPath: server.path });
      expect(await h.status()).toEqual(vm);
      await expect(h.resume()).rejects.toBeInstanceOf(VmStateError);
      await expect(h.memoryUsage()).rejects.toThrow(/no memory figures/);
    } finally {
      server.close();
    }
  });
});
