#!/usr/bin/env node
// Smoke checks of the Linux guest agent (native-prebuilds/agent/agent.c) over a unix socket that
// carries the agent channel (QEMU's virtconsole chardev: see native-prebuilds/linux-guest/qemu-smoke.sh).
//
// The file has three parts, so the checks can move to jest on pvisor's own VMM unchanged:
//  - LinuxAgent: a minimal host end of agent protocol v1 with the Linux ops (docs/agent-protocol.md)
//    over any Duplex stream; its framing duplicates src/protocol/frame.ts on purpose, so this
//    script runs without a TypeScript build;
//  - CHECKS: named async checks `run(agent, ctx)` that throw on failure and return a detail line;
//  - main: connects, waits for HELLO, runs the checks, prints PASS/FAIL, exits 1 on any failure.
//
// usage: node scripts/agent-smoke.js --socket PATH [--t0-ms EPOCH_MS] [--kernel-release R] [--ram-mib N] [--smp N] [--only a,b] [--light]
'use strict';
const net = require('node:net');
const crypto = require('node:crypto');
const { performance } = require('node:perf_hooks');

const HDR = 16;
const MAX_PAYLOAD = 1 << 20;
const T = { request: 1, response: 2, chunk: 3, error: 4, event: 5, credit: 6 };
/** Stream credit (docs/agent-protocol.md): each output stream may send this much before a grant. */
const STREAM_WINDOW = 256 * 1024;
const OP = {
  hello: 0x0001, ping: 0x0002, credit: 0x0003,
  exec: 0x0201, stdinWrite: 0x0202, stdinClose: 0x0203, kill: 0x0204,
  fileRead: 0x0210, fileWrite: 0x0211,
  meminfo: 0x0220, dropCaches: 0x0221, shutdown: 0x0230, restored: 0x0231,
};
const CHUNK = { stdout: 1, stderr: 2, started: 4 };
const ERR = { unsupported: 1, badArg: 2, badFrame: 5, os: 6, noProcess: 7, busy: 8, restored: 9 };

/** A request the guest refused: `code` from the error frame, `message` its text. */
class AgentError extends Error {
  constructor(code, text, op) {
    super(`guest error ${code} for op 0x${op.toString(16)}: ${text}`);
    this.code = code;
    this.text = text;
  }
}

function str(s) {
  const b = Buffer.from(s, 'utf8');
  const l = Buffer.alloc(4);
  l.writeUInt32LE(b.length);
  return Buffer.concat([l, b]);
}

class LinuxAgent {
  constructor(stream) {
    this.stream = stream;
    this.buf = Buffer.alloc(0);
    this.pending = new Map();
    this.nextId = 1;
    this.events = [];
    this.protocolErrors = [];
    /** Requests whose output is not granted back (id to bytes received): see grant(). */
    this.withheld = new Map();
    this.hello = new Promise((resolve) => { this.onHello = resolve; });
    stream.on('data', (d) => this.receive(d));
  }

  receive(d) {
    this.buf = this.buf.length ? Buffer.concat([this.buf, d]) : d;
    let off = 0;
    while (this.buf.length - off >= HDR) {
      const b = this.buf;
      if (b[off] !== 0x50 || b[off + 1] !== 0x56 || b[off + 2] !== 1) throw new Error(`bad frame from guest at byte ${off}`);
      const len = b.readUInt32LE(off + 12);
      if (len > MAX_PAYLOAD) throw new Error(`guest frame of ${len} bytes`);
      if (b.length - off < HDR + len) break;
      const f = { type: b[off + 3], id: b.readUInt32LE(off + 4), op: b.readUInt16LE(off + 8), flags: b.readUInt16LE(off + 10),
        payload: Buffer.from(b.subarray(off + HDR, off + HDR + len)) };
      off += HDR + len;
      this.dispatch(f);
    }
    this.buf = this.buf.subarray(off);
  }

  dispatch(f) {
    if (f.type === T.event) {
      if (f.op === OP.hello) this.onHello({ at: performance.now(), protocolVersion: f.payload.readUInt32LE(0),
        guestKind: f.payload.readUInt32LE(4), ramBytes: Number(f.payload.readBigUInt64LE(8)),
        features: f.payload.length >= 36 ? f.payload.readUInt32LE(32) : 0 });
      else this.events.push(f);
      return;
    }
    const p = this.pending.get(f.id);
    if (!p) { this.protocolErrors.push(f); return; }
    if (f.type === T.chunk) {
      p.onChunk?.(f.flags, f.payload);
      // every chunk is taken at once: its bytes are granted straight back (one CREDIT per chunk;
      // pvisor's client gathers them)
      if ((f.flags === 1 || f.flags === 2) && f.payload.length) {
        if (this.withheld.has(f.id)) this.withheld.set(f.id, this.withheld.get(f.id) + f.payload.length);
        else this.grant(f.id, f.flags, f.payload.length);
      }
      return;
    }
    this.pending.delete(f.id);
    if (f.type === T.response) p.resolve(f.payload);
    else if (f.type === T.error) p.reject(new AgentError(f.payload.readUInt32LE(0), f.payload.subarray(4).toString('utf8'), p.op));
    else p.reject(new Error(`unexpected frame type ${f.type}`));
  }

  frame(type, id, op, payload, flags = 0) {
    const h = Buffer.alloc(HDR);
    h[0] = 0x50; h[1] = 0x56; h[2] = 1; h[3] = type;
    h.writeUInt32LE(id, 4); h.writeUInt16LE(op, 8); h.writeUInt16LE(flags, 10); h.writeUInt32LE(payload.length, 12);
    return Buffer.concat([h, payload]);
  }

  /** Grants stream `flags` of request `id` `bytes` more (a CREDIT frame). */
  grant(id, flags, bytes) {
    const n = Buffer.alloc(4);
    n.writeUInt32LE(bytes);
    this.stream.write(this.frame(T.credit, id, OP.credit, n, flags));
  }

  /** Sends a request; resolves with the final response payload; chunks go to onChunk(flags, data). */
  request(op, payload = Buffer.alloc(0), onChunk) {
    const id = this.nextId++;
    const done = new Promise((resolve, reject) => this.pending.set(id, { op, resolve, reject, onChunk }));
    this.stream.write(this.frame(T.request, id, op, payload));
    return { id, done };
  }

  ping(payload) { return this.request(OP.ping, payload).done; }

  /** Starts a process; returns its handle (the EXEC request id), started (pid) and done (output + status). */
  spawn(argv, { env = [], cwd = '', stdin = false, withholdCredit = false } = {}) {
    const head = Buffer.alloc(16);
    head.writeUInt32LE(stdin ? 1 : 0, 0); head.writeUInt32LE(argv.length, 4); head.writeUInt32LE(env.length, 8);
    const payload = Buffer.concat([head, str(cwd), ...argv.map(str), ...env.map(str)]);
    const out = [], err = [];
    let chunks = 0, maxChunk = 0, onStarted;
    const started = new Promise((resolve) => { onStarted = resolve; });
    if (withholdCredit) this.withheld.set(this.nextId, 0);
    const { id, done } = this.request(OP.exec, payload, (flags, data) => {
      if (flags === CHUNK.started) return onStarted(data.readUInt32LE(0));
      chunks++; maxChunk = Math.max(maxChunk, data.length);
      (flags === CHUNK.stdout ? out : err).push(data);
    });
    const result = done.then((p) => ({ exitCode: p.readInt32LE(0), signal: p.readInt32LE(4), stdout: Buffer.concat(out),
      stderr: Buffer.concat(err), chunks, maxChunk }));
    started.catch(() => {});
    return {
      id, started, done: result,
      // one STDIN_WRITE in flight per process (the agent answers error 8 to a second): frames
      // of at most 1 MiB, each sent once the previous one is in the pipe
      write: async (data) => {
        let n = 0;
        for (let off = 0; off === 0 || off < data.length; off += MAX_PAYLOAD - 4) {
          const r = await this.request(OP.stdinWrite, Buffer.concat([u32(id), data.subarray(off, off + MAX_PAYLOAD - 4)])).done;
          n += Number(r.readBigUInt64LE(0));
        }
        return n;
      },
      closeStdin: () => this.request(OP.stdinClose, u32(id)).done,
      kill: (signal) => this.request(OP.kill, Buffer.concat([u32(id), u32(signal)])).done,
    };
  }

  exec(argv, opts) { return this.spawn(argv, opts).done; }

  async readFile(path) {
    const parts = [];
    const total = await this.request(OP.fileRead, str(path), (_f, d) => parts.push(d)).done;
    const data = Buffer.concat(parts);
    if (Number(total.readBigUInt64LE(0)) !== data.length) throw new Error('FILE_READ total disagrees with the chunks');
    return data;
  }

  /** Writes in frames of at most 1 MiB: one create frame, then APPEND frames (all sent at once). */
  async writeFile(path, data, { mode = 0o644, mkdirs = false } = {}) {
    const p = str(path);
    const room = MAX_PAYLOAD - 8 - p.length;
    const sends = [];
    for (let off = 0; off === 0 || off < data.length; off += room) {
      const flags = (off ? 1 : 0) | (mkdirs ? 2 : 0);
      sends.push(this.request(OP.fileWrite, Buffer.concat([u32(flags), u32(mode), p, data.subarray(off, off + room)])).done);
    }
    const written = await Promise.all(sends);
    return written.reduce((s, b) => s + Number(b.readBigUInt64LE(0)), 0);
  }

  async meminfo() {
    const p = await this.request(OP.meminfo).done;
    return { memTotalKb: Number(p.readBigUInt64LE(0)), memFreeKb: Number(p.readBigUInt64LE(8)),
      memAvailableKb: Number(p.readBigUInt64LE(16)), cachedKb: Number(p.readBigUInt64LE(24)) };
  }

  dropCaches(what = 3) { return this.request(OP.dropCaches, u32(what)).done; }

  /** RESTORED with the wall clock `epochMs` and `entropy`; resolves with the agent's answer. */
  async restored(epochMs, entropy = crypto.randomBytes(64)) {
    const head = Buffer.alloc(16);
    head.writeBigUInt64LE(BigInt(epochMs) * 1000000n, 0);
    const p = await this.request(OP.restored, Buffer.concat([head, entropy])).done;
    return { protocolVersion: p.readUInt32LE(0), guestKind: p.readUInt32LE(4), detachedProcesses: p.readUInt32LE(8), endedRequests: p.readUInt32LE(12) };
  }
}

function u32(v) { const b = Buffer.alloc(4); b.writeUInt32LE(v >>> 0); return b; }
function sha(b) { return crypto.createHash('sha256').update(b).digest('hex'); }
function assert(cond, what) { if (!cond) throw new Error(`assertion failed: ${what}`); }
function eq(actual, expected, what) {
  if (actual !== expected) throw new Error(`${what}: expected ${JSON.stringify(expected)}, got ${JSON.stringify(actual)}`);
}
async function rejects(promise, code, textPart, what) {
  try { await promise; } catch (e) {
    if (!(e instanceof AgentError)) throw e;
    eq(e.code, code, `${what}: error code`);
    if (textPart) assert(e.text.includes(textPart), `${what}: error text "${e.text}" contains "${textPart}"`);
    return e;
  }
  throw new Error(`${what}: expected an error, got a response`);
}
const ms = (t0) => (performance.now() - t0).toFixed(0);

/**
 * The checks: [name, run(agent, ctx), { bulk }]; run throws on failure and returns a one-line
 * detail. bulk: the guest sends megabytes at once, which needs a channel with flow control
 * towards the host (QEMU's virtconsole drops console output the host socket cannot take at once,
 * so qemu-smoke.sh runs these over a virtio-serial port; pvisor's VMM must not drop).
 */
const CHECKS = [
  ['hello', async (a, ctx) => {
    const h = await a.hello;
    eq(h.protocolVersion, 1, 'protocolVersion'); eq(h.guestKind, 2, 'guestKind (linux)');
    eq(h.features & 1, 1, 'features: stream credit');
    assert(h.ramBytes > 256 << 20 && h.ramBytes <= ctx.ramBytes, `ramBytes ${h.ramBytes} within (256 MiB, ${ctx.ramBytes}]`);
    return `ramBytes ${h.ramBytes}` + (ctx.t0Ms ? `, boot to HELLO ${(ctx.helloEpochMs - ctx.t0Ms)} ms` : '');
  }],
  ['ping is binary-clean', async (a) => {
    const all = Buffer.from([...Array(1024).keys()].map((i) => i & 255));
    const t = performance.now();
    const r = await a.ping(all);
    const rtt = ms(t);
    assert(r.equals(all), 'echo of every byte value identical');
    eq((await a.ping(Buffer.alloc(0))).length, 0, 'empty echo');
    return `1 KiB round trip ${rtt} ms`;
  }],
  ['ping 1 MiB', async (a) => {
    const big = crypto.randomBytes(MAX_PAYLOAD);
    const t = performance.now();
    assert((await a.ping(big)).equals(big), '1 MiB echo identical');
    return `1 MiB echo ${ms(t)} ms`;
  }, { bulk: true }],
  ['uname shows the shipped kernel', async (a, ctx) => {
    const r = await a.exec(['uname', '-r']);
    eq(r.exitCode, 0, 'exit code');
    const release = r.stdout.toString().trim();
    if (ctx.kernelRelease) eq(release, ctx.kernelRelease, 'uname -r');
    else assert(release.endsWith('-pvisor'), `uname -r "${release}" ends with -pvisor`);
    const h = (await a.exec(['hostname'])).stdout.toString().trim();
    eq(h, 'pvisor', 'hostname');
    return release;
  }],
  ['exec round trip', async (a) => {
    const times = [];
    for (let i = 0; i < 7; i++) {
      const t = performance.now();
      const r = await a.exec(['true']);
      times.push(performance.now() - t);
      eq(r.exitCode, 0, 'true exits 0');
    }
    times.sort((x, y) => x - y);
    return `exec of true: median ${times[3].toFixed(1)} ms, min ${times[0].toFixed(1)} ms (7 runs)`;
  }],
  ['stdout and stderr kept apart', async (a) => {
    const r = await a.exec(['sh', '-c', 'echo out1; echo err1 >&2; echo out2; echo err2 >&2']);
    eq(r.stdout.toString(), 'out1\nout2\n', 'stdout'); eq(r.stderr.toString(), 'err1\nerr2\n', 'stderr');
    eq(r.exitCode, 0, 'exit code');
    return 'ok';
  }],
  ['exit code 3', async (a) => {
    const r = await a.exec(['sh', '-c', 'exit 3']);
    eq(r.exitCode, 3, 'exit code'); eq(r.signal, 0, 'signal');
    return 'exitCode 3, signal 0';
  }],
  ['killed by a signal', async (a) => {
    const r = await a.exec(['sh', '-c', 'kill -9 $$']);
    eq(r.signal, 9, 'signal'); eq(r.exitCode, -1, 'exitCode');
    return 'signal 9, exitCode -1';
  }],
  ['env and cwd', async (a) => {
    const r = await a.exec(['sh', '-c', 'echo "$FOO|$HOME|$PATH"; pwd'], { env: ['FOO=bar baz', 'HOME=/tmp'], cwd: '/tmp' });
    eq(r.stdout.toString(), 'bar baz|/tmp|/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n/tmp\n', 'output');
    return 'ok';
  }],
  ['exec failure is an error frame', async (a) => {
    await rejects(a.exec(['/no/such/program']), ERR.os, 'ENOENT', 'missing program');
    await rejects(a.exec(['true'], { cwd: '/no/such/dir' }), ERR.os, 'ENOENT', 'missing cwd');
    await rejects(a.exec([]), ERR.badArg, '', 'empty argv');
    const e = await rejects(a.exec(['/etc/passwd']), ERR.os, 'EACCES', 'not executable');
    return e.text;
  }],
  ['8 concurrent execs', async (a) => {
    const t = performance.now();
    const rs = await Promise.all([...Array(8).keys()].map((i) => a.exec(['sh', '-c', `sleep 1; echo ${i}`])));
    const elapsed = performance.now() - t;
    rs.forEach((r, i) => { eq(r.stdout.toString(), `${i}\n`, `output of #${i}`); eq(r.exitCode, 0, `exit of #${i}`); });
    assert(elapsed < 6000, `8 x sleep 1 ran concurrently (${elapsed.toFixed(0)} ms < 6000 ms)`);
    return `8 x 'sleep 1' in ${elapsed.toFixed(0)} ms`;
  }],
  ['kill of sleep 100', async (a) => {
    const p = a.spawn(['sleep', '100']);
    const pid = await p.started;
    const t = performance.now();
    await p.kill(15);
    const r = await p.done;
    eq(r.signal, 15, 'signal'); eq(r.exitCode, -1, 'exitCode');
    assert(performance.now() - t < 5000, 'ended within 5 s of KILL');
    await rejects(p.kill(9), ERR.noProcess, '', 'KILL after the end');
    return `pid ${pid} ended by SIGTERM ${ms(t)} ms after KILL`;
  }],
  ['kill reaches the process group', async (a) => {
    // the shell's background child keeps stdout open: EXEC can only end once KILL reached it too
    const p = a.spawn(['sh', '-c', 'sleep 100 & echo started; wait']);
    await p.started;
    await new Promise((r) => setTimeout(r, 300));
    await p.kill(9);
    const r = await p.done;
    eq(r.signal, 9, 'signal');
    return 'ok';
  }],
  ['stdin round trip (cat)', async (a) => {
    const p = a.spawn(['cat'], { stdin: true });
    await p.started;
    const parts = [Buffer.from('hello\n'), Buffer.from([...Array(256).keys()]), crypto.randomBytes(3 << 20 >> 1)];
    for (const part of parts) eq(await p.write(part), part.length, 'bytes written');
    await p.closeStdin();
    const r = await p.done;
    const all = Buffer.concat(parts);
    assert(r.stdout.equals(all), `cat echoed ${all.length} bytes identically (got ${r.stdout.length})`);
    assert(r.maxChunk <= 65536, `chunks <= 64 KiB (max ${r.maxChunk})`);
    await rejects(p.write(Buffer.from('x')), ERR.noProcess, '', 'STDIN_WRITE after the end');
    return `${all.length} bytes in ${r.chunks} chunks`;
  }, { bulk: true }],
  ['stdin closed by default', async (a) => {
    const r = await a.exec(['cat']);
    eq(r.stdout.length, 0, 'cat reads /dev/null'); eq(r.exitCode, 0, 'exit code');
    return 'ok';
  }],
  ['10 MiB file write + read identical', async (a) => {
    const data = crypto.randomBytes(10 << 20);
    let t = performance.now();
    eq(await a.writeFile('/tmp/smoke/big.bin', data, { mode: 0o600, mkdirs: true }), data.length, 'bytes written');
    const wMs = ms(t);
    t = performance.now();
    const back = await a.readFile('/tmp/smoke/big.bin');
    const rMs = ms(t);
    eq(sha(back), sha(data), 'sha256 of the read-back');
    const g = await a.exec(['sh', '-c', 'sha256sum /tmp/smoke/big.bin; stat -c %a /tmp/smoke/big.bin']);
    eq(g.stdout.toString(), `${sha(data)}  /tmp/smoke/big.bin\n600\n`, 'guest sha256sum and mode');
    await rejects(a.readFile('/no/such/file'), ERR.os, 'ENOENT', 'read of a missing file');
    await rejects(a.readFile('/tmp'), ERR.os, 'EISDIR', 'read of a directory');
    const empty = await a.writeFile('/tmp/smoke/empty', Buffer.alloc(0));
    eq(empty, 0, 'empty file written'); eq((await a.readFile('/tmp/smoke/empty')).length, 0, 'empty file read');
    return `sha256 ${sha(data).slice(0, 16)}..., write ${wMs} ms, read ${rMs} ms`;
  }, { bulk: true }],
  ['large stdout stays whole', async (a) => {
    const r = await a.exec(['sh', '-c', 'head -c 4194304 /dev/urandom > /tmp/out.bin && sha256sum /tmp/out.bin >&2 && cat /tmp/out.bin']);
    const guestSha = r.stderr.toString().split(' ')[0];
    eq(r.stdout.length, 4 << 20, 'stdout length'); eq(sha(r.stdout), guestSha, 'stdout sha256 equals the guest\'s');
    assert(r.maxChunk <= 65536, `chunks <= 64 KiB (max ${r.maxChunk})`);
    return `4 MiB in ${r.chunks} chunks`;
  }, { bulk: true }],
  ['backpressure: a host that stops reading does not grow the agent', async (a) => {
    const p = a.spawn(['sh', '-c', 'head -c 16777216 /dev/zero']);
    await p.started;
    a.stream.pause();
    await new Promise((r) => setTimeout(r, 3000));
    a.stream.resume();
    const r = await p.done;
    eq(r.stdout.length, 16 << 20, 'all 16 MiB arrived');
    const st = (await a.readFile('/proc/self/status')).toString();
    const hwmKb = Number(/VmHWM:\s+(\d+)/.exec(st)[1]);
    assert(hwmKb < 12 * 1024, `agent peak RSS ${hwmKb} kB < 12 MiB after 16 MiB passed through a paused host`);
    return `agent VmHWM ${hwmKb} kB`;
  }, { bulk: true }],
  ['stream credit: a stream that is granted nothing stops only itself', async (a) => {
    const p = a.spawn(['sh', '-c', 'head -c 4194304 /dev/zero'], { withholdCredit: true });
    await p.started;
    await new Promise((r) => setTimeout(r, 1000));
    const held = a.withheld.get(p.id);
    assert(held > 0 && held <= STREAM_WINDOW, `${held} bytes sent without a grant, at most the window (${STREAM_WINDOW})`);
    const t = performance.now();
    eq((await a.exec(['echo', 'meanwhile'])).stdout.toString(), 'meanwhile\n', 'another command runs meanwhile');
    const echoMs = ms(t);
    await new Promise((r) => setTimeout(r, 300));
    eq(a.withheld.get(p.id), held, 'nothing more came without a grant');
    a.grant(p.id, 1, 4 << 20);
    const r = await p.done;
    eq(r.stdout.length, 4 << 20, 'all 4 MiB once granted');
    a.withheld.delete(p.id);
    return `${held} bytes before the first grant, an echo meanwhile in ${echoMs} ms`;
  }, { bulk: true }],
  ['meminfo and drop caches', async (a) => {
    eq((await a.exec(['sh', '-c', 'head -c 16777216 /dev/zero > /tmp/mem.bin'])).exitCode, 0, 'fill 16 MiB of tmpfs');
    const m0 = await a.meminfo();
    assert(m0.cachedKb >= 16 * 1024, `Cached ${m0.cachedKb} kB counts the 16 MiB tmpfs file`);
    assert(m0.memTotalKb > 256 * 1024 && m0.memFreeKb <= m0.memTotalKb && m0.memAvailableKb <= m0.memTotalKb, `sane figures ${JSON.stringify(m0)}`);
    await a.exec(['rm', '-rf', '/tmp/mem.bin', '/tmp/smoke', '/tmp/out.bin']);
    await a.dropCaches(3);
    const m1 = await a.meminfo();
    assert(m1.memFreeKb > m0.memFreeKb + 10 * 1024, `removing 16 MiB of tmpfs frees memory (${m0.memFreeKb} -> ${m1.memFreeKb} kB free)`);
    const own = (await a.readFile('/proc/meminfo')).toString();
    eq(Number(/MemTotal:\s+(\d+)/.exec(own)[1]), m1.memTotalKb, 'MemTotal as /proc/meminfo');
    await rejects(a.dropCaches(7), ERR.badArg, '', 'DROP_CACHES 7');
    return `MemTotal ${m1.memTotalKb} kB, free ${m0.memFreeKb} -> ${m1.memFreeKb} kB`;
  }],
  ['vCPUs online', async (a, ctx) => {
    const n = Number((await a.exec(['nproc'])).stdout.toString().trim());
    if (ctx.smp) eq(n, ctx.smp, 'nproc');
    return `${n} online`;
  }],
  ['virtio devices present', async (a) => {
    const r = await a.exec(['sh', '-c', 'cat /sys/bus/virtio/devices/*/device | sort']);
    const ids = r.stdout.toString().trim().split('\n');
    assert(ids.includes('0x0003') && ids.includes('0x0005'), `console (3) and balloon (5) bound: ${ids}`);
    const rep = await a.exec(['sh', '-c', 'cat /sys/bus/virtio/drivers/virtio_balloon/*/features']);
    const features = rep.stdout.toString().trim();
    eq(features[5], '1', 'balloon FREE_PAGE_REPORTING (bit 5) negotiated');
    return `device ids ${ids.join(',')}`;
  }],
  ['restored: clock set, what was in flight detached', async (a) => {
    // RESTORED needs no snapshot: any running agent takes it as a restored one would.
    const cat = a.spawn(['cat'], { stdin: true });
    const talker = a.spawn(['sh', '-c', 'echo before; sleep 2; echo after']);
    await cat.started;
    await talker.started;
    await new Promise((r) => setTimeout(r, 300));
    const dayMs = 86400 * 1000;
    const r = await a.restored(Date.now() + dayMs);
    eq(JSON.stringify(r), JSON.stringify({ protocolVersion: 1, guestKind: 2, detachedProcesses: 2, endedRequests: 0 }), 'answer');
    // cat's stdin was closed: it ends; the talker runs on, its later output dropped.
    const c = await cat.done;
    eq(c.exitCode, 0, 'cat ends at EOF');
    const t = await talker.done;
    eq(t.exitCode, 0, 'the detached talker ends normally');
    eq(t.stdout.toString(), 'before\n', 'output after RESTORED is dropped');
    const guestS = Number((await a.exec(['date', '+%s'])).stdout.toString());
    assert(Math.abs(guestS - (Date.now() + dayMs) / 1000) < 30, `guest clock ${guestS} is the one sent (host + 1 day)`);
    await rejects(a.request(OP.restored, Buffer.alloc(16 + 8)).done, ERR.badArg, 'entropy', 'RESTORED with 8 bytes of entropy');
    await rejects(a.request(OP.restored, Buffer.alloc(16 + 64)).done, ERR.badArg, 'wall clock', 'RESTORED at time 0');
    const back = await a.restored(Date.now());
    eq(back.detachedProcesses, 0, 'nothing left to detach');
    const skew = Number((await a.exec(['date', '+%s'])).stdout.toString()) - Date.now() / 1000;
    assert(Math.abs(skew) < 30, `clock back to the host's (skew ${skew.toFixed(1)} s)`);
    return `clock skew after RESTORED ${skew.toFixed(1)} s`;
  }],
  ['protocol errors', async (a) => {
    await rejects(a.request(0x02ff).done, ERR.unsupported, '', 'unknown op');
    await rejects(a.request(OP.kill, u32(999999)).done, ERR.badArg, '', 'short KILL');
    await rejects(a.request(OP.kill, Buffer.concat([u32(999999), u32(9)])).done, ERR.noProcess, '', 'KILL of no process');
    await rejects(a.request(OP.exec, Buffer.alloc(8)).done, ERR.badArg, '', 'short EXEC');
    assert((await a.ping(Buffer.from('still alive'))).toString() === 'still alive', 'agent serves after errors');
    return 'ok';
  }],
];

async function connect(path, deadlineMs) {
  for (;;) {
    try {
      return await new Promise((resolve, reject) => {
        const s = net.createConnection(path, () => resolve(s));
        s.once('error', reject);
      });
    } catch (e) {
      if (performance.now() > deadlineMs) throw e;
      await new Promise((r) => setTimeout(r, 10));
    }
  }
}

async function main() {
  const args = process.argv.slice(2);
  const opt = (k) => { const i = args.indexOf(k); return i >= 0 ? args[i + 1] : undefined; };
  const socket = opt('--socket');
  if (!socket) { console.error('usage: agent-smoke.js --socket PATH [--t0-ms EPOCH_MS] [--kernel-release R] [--ram-mib N] [--smp N] [--only a,b] [--light]'); process.exit(2); }
  const ctx = { t0Ms: Number(opt('--t0-ms') ?? 0), kernelRelease: opt('--kernel-release'), ramBytes: Number(opt('--ram-mib') ?? 512) * 2 ** 20, smp: Number(opt('--smp') ?? 0) };
  const only = opt('--only')?.split(',');
  const s = await connect(socket, performance.now() + 10000);
  const agent = new LinuxAgent(s);
  const timer = setTimeout(() => { console.error('no HELLO within 60 s'); process.exit(1); }, 60000);
  await agent.hello;
  ctx.helloEpochMs = Date.now();
  clearTimeout(timer);
  let failed = 0;
  const light = args.includes('--light');
  for (const [name, run, tags] of CHECKS) {
    if (only && !only.some((o) => name.startsWith(o))) continue;
    if (light && tags?.bulk) continue;
    const t = performance.now();
    try {
      const detail = await Promise.race([run(agent, ctx), new Promise((_, rej) => setTimeout(() => rej(new Error('timed out after 120 s')), 120000))]);
      console.log(`PASS ${name} (${ms(t)} ms): ${detail}`);
    } catch (e) {
      failed++;
      console.log(`FAIL ${name} (${ms(t)} ms): ${e.message}`);
    }
  }
  if (agent.protocolErrors.length) { failed++; console.log(`FAIL stray frames: ${agent.protocolErrors.map((f) => `type ${f.type} id ${f.id}`).join(', ')}`); }
  console.log(`${failed ? 'FAILED' : 'ALL PASSED'}: ${failed} failure(s)`);
  await agent.request(OP.shutdown).done.catch(() => {});
  s.end();
  process.exit(failed ? 1 : 0);
}

module.exports = { LinuxAgent, AgentError, CHECKS, OP, ERR, CHUNK };
if (require.main === module) main().catch((e) => { console.error(e); process.exit(1); });
