// Every reader of saved state under seeded mutation: a snapshot file is hostile input. Valid
// states (the machine description's builder, and states saved by the real devices, transports,
// agent client and probe client after some traffic) get fields deleted, replaced by values of
// other types, huge, negative, fractional, NaN-like strings, long strings, big arrays, deep nesting,
// and keys added, then go through JSON as a file would. Every restore path either takes the state
// or throws SnapshotError (PVISOR_SNAPSHOT), never another error, within a second; a transport
// that refused one is unchanged, and one that took one works on and saves a state that restores.
// A snapshot directory's files get the same, and are also replaced by links, FIFOs, devices,
// sockets, directories and files of any size, and their VM shape by any size and count.
import { spawnSync } from 'node:child_process';
import { chmodSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, truncateSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { CmosRtc } from '../../src/backends/kvm/devices/cmos-rtc';
import { Serial8250 } from '../../src/backends/kvm/devices/serial';
import { VirtioBalloon, VIRTIO_BALLOON_F_FREE_PAGE_REPORTING } from '../../src/backends/kvm/devices/virtio-balloon';
import { VirtioBlk } from '../../src/backends/kvm/devices/virtio-blk';
import { VirtioConsole } from '../../src/backends/kvm/devices/virtio-console';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { parseMachineState } from '../../src/backends/kvm/machine-state';
import { checkVcpuStateFits } from '../../src/backends/kvm/vcpu-state';
import { checkVmStateFits } from '../../src/backends/kvm/vm-state';
import { MmioTransport, VIRTIO_F_VERSION_1, type VirtioDevice } from '../../src/backends/kvm/virtio/mmio-transport';
import { parseQueueState, QueueError, SplitQueue } from '../../src/backends/kvm/virtio/queue';
import { SnapshotError } from '../../src/errors';
import { ProbeGuest } from '../../src/guest/probe-client';
import { AgentClient } from '../../src/protocol/agent-client';
import { encodeFrame } from '../../src/protocol/frame';
import { crc32c } from '../../src/native/crc32c';
import { hostMemTotalBytes } from '../../src/memory-usage';
import { hex32, RAM_CHUNK_BYTES } from '../../src/snapshot/ram-file';
import { manifestBytesLimit, MAX_STATE_BYTES, SnapshotReader, writeSnapshot } from '../../src/snapshot/snapshot-dir';
import { randomFrame, randomSplits } from '../fuzz-frames';
import { property, same, thrown, type Rng } from '../fuzz-seed';
import { machine } from '../saved-states';
import { DriverQueue, driverUp, SIZE } from '../virtio-driver';

type Json = null | boolean | number | string | Json[] | { [key: string]: Json };
type Path = (string | number)[];

/** The path to every value in `v` down to depth 16 (a nesting bomb is not walked), the root's first. */
function places(v: Json, path: Path = [], out: Path[] = []): Path[] {
  out.push(path);
  if (path.length >= 16 || out.length > 5000) return out;
  if (Array.isArray(v)) v.slice(0, 64).forEach((x, i) => places(x, [...path, i], out));
  else if (v !== null && typeof v === 'object') for (const k of Object.keys(v)) places(v[k], [...path, k], out);
  return out;
}

/** A value a hostile file may hold where `was` was (a copy of it, where one is embedded). */
function nasty(rng: Rng, was: Json): Json {
  const old: Json = was === undefined ? null : JSON.parse(JSON.stringify(was));
  const n = typeof old === 'number' ? old : 1;
  const s = typeof old === 'string' ? old : 'AAAA';
  // A number, mostly: another near it, at a power of two, or some times it.
  if (typeof old === 'number' && rng.chance(0.6)) return rng.pick([n + 1, n - 1, 2 * n, 4 * n, 256 * n, Math.floor(n / 2), 2 ** rng.int(17), 2 ** rng.int(65), 0xffff, 0x10000]);
  return rng.pick<() => Json>([
    () => null, () => true, () => 0, () => -1, () => -0, () => 0.5, () => n + 0.5, () => n + 1, () => n - 1, () => -n,
    () => 2 ** rng.int(17), () => 2 ** 31, () => 2 ** 32, () => 2 ** 53, () => 2 ** 53 + 2, () => 2 ** 64, () => 1e308, () => -1e308, () => 5e-324,
    () => 'NaN', () => 'Infinity', () => '-1', () => '0x10', () => String(n), () => '', () => 'é\u0000\ud800',
    () => s.slice(0, rng.int(s.length + 1)), () => `${s}A`, () => `${s}=`, () => `*${s.slice(1)}`, () => s.toUpperCase(),
    () => `0x${'f'.repeat(rng.pick([1, 8, 16, 17]))}`, () => '0x', () => 'A'.repeat(rng.pick([1e5, 1e6 + 1])),
    () => Buffer.alloc(rng.pick([0, 1, 7, 8, 4095, 4096, 65536])).toString('base64'),
    () => [], () => ({}), () => [old], () => ({ '0': old }), () => Array(rng.pick([65, 1025, 70000])).fill(rng.pick([0, 'AAAA', null])),
    () => {
      let deep: Json = 0;
      for (let i = 0; i < 2000; i++) deep = rng.chance(0.5) ? { a: deep } : [deep];
      return deep;
    },
  ])();
}

function at(root: Json, path: Path): Json {
  return path.reduce<Json>((v, k) => (v as Record<string | number, Json>)[k], root);
}

/** `root` with one to three random mutations, through JSON as a file would carry it. */
function mutated(rng: Rng, root: Json): unknown {
  let v: Json = JSON.parse(JSON.stringify(root));
  for (let n = rng.between(1, 3); n > 0; n--) {
    const ps = places(v);
    const path = rng.chance(0.03) ? [] : rng.pick(ps.slice(1).length ? ps.slice(1) : ps);
    if (path.length === 0) {
      v = nasty(rng, v);
      continue;
    }
    const parent = at(v, path.slice(0, -1)) as Record<string | number, Json> | Json[];
    const key = path[path.length - 1];
    const old = (parent as Record<string | number, Json>)[key];
    switch (rng.int(5)) {
      case 0:
        if (Array.isArray(parent)) parent.splice(Number(key), 1);
        else delete parent[key as string];
        break;
      case 1:
        if (old !== null && typeof old === 'object' && !Array.isArray(old)) (old as Record<string, Json>)[rng.pick(['__proto__', 'constructor', 'version', 'x', 'queues', 'active'])] = nasty(rng, old);
        else (parent as Record<string | number, Json>)[key] = nasty(rng, old);
        break;
      default:
        (parent as Record<string | number, Json>)[key] = nasty(rng, old);
    }
  }
  const text = JSON.stringify(v);
  return text.length > 32 * 1024 * 1024 ? mutated(rng, root) : JSON.parse(text);
}

/** Runs a restore: it takes the state, or throws SnapshotError; never anything else, never long. */
function restoreOrRefuse(name: string, f: () => void): boolean {
  const t0 = performance.now();
  const e = thrown(f);
  const ms = performance.now() - t0;
  const typed = e === undefined || (e instanceof SnapshotError && e.code === 'PVISOR_SNAPSHOT');
  same({ name, typed: typed || String((e as Error)?.stack ?? e), quick: ms < 1000 }, { name, typed: true, quick: true });
  return e === undefined;
}

describe('saved state readers under seeded mutation', () => {
  let mem: GuestMemory;
  let dir: string;
  beforeAll(() => {
    mem = GuestMemory.map(1024 * 1024);
    dir = mkdtempSync(join(tmpdir(), 'pvisor-fuzz-state-'));
  });
  afterAll(() => {
    mem.unmap();
    rmSync(dir, { recursive: true, force: true });
  });

  property('machine, VM and vCPU descriptions', 300, (rng) => {
    const value = mutated(rng, machine() as unknown as Json);
    restoreOrRefuse('machine', () => {
      const m = parseMachineState(value);
      // What was taken reads back the same, and the checks against a host only refuse, typed.
      same(parseMachineState(JSON.parse(JSON.stringify(m))), m);
      const format = { sregsFormat: rng.pick(['sregs2', 'sregs'] as const), xsaveBytes: rng.pick([0, 4096, 8192]), xcrs: rng.chance(0.5), lapic: rng.chance(0.5), msrIndices: [0x10, 0x6e0] };
      for (const v of m.vcpus) restoreOrRefuse('vcpu fits', () => checkVcpuStateFits(v.kvm, format));
      restoreOrRefuse('vm fits', () => checkVmStateFits(m.vm, rng.chance(0.5)));
    });
  });

  /** A device behind its transport after some traffic, and a fresh pair to restore into. */
  function device(rng: Rng, kind: 'console' | 'balloon' | 'blk', image: string): { saved: Json; fresh: () => { t: MmioTransport; dev: VirtioDevice } } {
    const make = (): VirtioDevice => (kind === 'console'
      ? new VirtioConsole(mem, () => {}, () => {}, () => {}, () => {})
      : kind === 'balloon' ? new VirtioBalloon((gpa, len) => mem.discard(gpa, len, 'backing'), () => {}, () => {}) : new VirtioBlk(mem, { path: image, readOnly: true }, () => {}, () => {}));
    const dev = make();
    const t = new MmioTransport(0xd0000000, dev, mem);
    const rings = Array.from({ length: dev.queueCount }, (_, i) => new DriverQueue(mem, 0x10000 * (i + 1)));
    if (rng.chance(0.8)) {
      // Active, its own state saved with the transport's (blk's: a read-only image's identity).
      const features = kind === 'console' ? VIRTIO_F_VERSION_1 | (rng.chance(0.5) ? 1n << 1n : 0n) : kind === 'balloon' ? VIRTIO_F_VERSION_1 | VIRTIO_BALLOON_F_FREE_PAGE_REPORTING : VIRTIO_F_VERSION_1;
      driverUp(t, features, rings.map((r) => (rng.chance(0.8) ? r.queue.config : null)));
      if (dev instanceof VirtioConsole) {
        for (let n = rng.int(SIZE); n > 0; n--) rings[0].offer(0x80000 + 0x100 * n, rng.int(0x100), true);
        dev.send(rng.bytes(rng.size(8192)));
        dev.hold(rng.bytes(rng.size(64)));
      }
    } else {
      // Registers only, as a driver part way through setting the device up leaves them.
      t.write(0x070, 4, 3);
      t.write(0x030, 4, rng.int(dev.queueCount));
      t.write(0x038, 4, 8);
    }
    const saved = JSON.parse(JSON.stringify(t.saveState()));
    (dev as { close?: () => void }).close?.();
    return {
      saved,
      fresh: () => {
        const d = make();
        return { t: new MmioTransport(0xd0000000, d, mem), dev: d };
      },
    };
  }

  property('virtio transports with the console, the balloon and blk: refused unchanged, or taken and working', 200, (rng) => {
    const image = join(dir, 'disk.img');
    writeFileSync(image, rng.bytes(4096));
    const kind = rng.pick(['console', 'balloon', 'blk'] as const);
    const { saved, fresh } = device(rng, kind, image);
    const value = mutated(rng, saved);
    const { t, dev } = fresh();
    const before = t.saveState();
    const taken = restoreOrRefuse(kind, () => t.restoreState(value));
    try {
      if (!taken) {
        same(t.saveState(), before);
        return;
      }
      // Its queues are ones a driver could have set up: within the device's maximum size.
      const restored = t.saveState();
      (restored.active?.queues ?? []).forEach((q, i) => {
        if (q) same({ queue: i, size: q.size, withinMax: q.size <= (dev.maxQueueSize?.(i) ?? 256) }, { queue: i, size: q.size, withinMax: true });
      });
      // It works on: registers, notifications, and a state that restores again, the same.
      for (let off = 0; off < 0x100; off += 4) expect(thrown(() => t.read(off, 4))).toBeUndefined();
      for (let q = 0; q < dev.queueCount; q++) {
        const e = thrown(() => t.write(0x050, 4, q));
        if (e !== undefined) expect({ notify: q, e }).toEqual({ notify: q, e: undefined });
      }
      if (!dev.saveState && (t.read(0x070, 4) & 4)) return;
      const again = JSON.parse(JSON.stringify(t.saveState()));
      const other = fresh();
      restoreOrRefuse(`${kind} again`, () => other.t.restoreState(again));
      same(other.t.saveState(), again);
      (other.dev as { close?: () => void }).close?.();
    } finally {
      t.write(0x070, 4, 0);
      (dev as { close?: () => void }).close?.();
    }
  });

  property('split queue states: refused, or a queue that only ever throws queue errors', 200, (rng) => {
    const ring = new DriverQueue(mem, 0x20000);
    for (let n = rng.int(SIZE); n > 0; n--) ring.offer(0x80000, rng.int(512), rng.chance(0.5));
    const value = mutated(rng, JSON.parse(JSON.stringify({ ...ring.queue.saveState(), nextAvail: rng.int(0x10000) })));
    let q: SplitQueue | undefined;
    if (!restoreOrRefuse('queue', () => (q = SplitQueue.fromState(mem, parseQueueState(value))))) return;
    for (let n = 0; n < 40; n++) {
      const e = thrown(() => {
        const chain = q!.pop();
        if (chain) q!.push(chain.head, 0);
      });
      if (e !== undefined && !(e instanceof QueueError)) expect(e).toBeInstanceOf(QueueError);
      q!.renewBudget();
    }
  });

  property('the UART, the RTC, the agent channel and the probe client', 300, (rng) => {
    // Whatever a guest wrote, the state saved restores as it is; then mutated ones.
    const uart = new Serial8250(() => {});
    for (const c of rng.bytes(rng.int(6000))) uart.write(rng.chance(0.7) ? 0 : rng.int(8), c);
    const uartBack = new Serial8250(() => {});
    restoreOrRefuse('serial as saved', () => uartBack.restoreState(JSON.parse(JSON.stringify(uart.saveState()))));
    same(uartBack.saveState(), uart.saveState());
    const uartValue = mutated(rng, uart.saveState() as unknown as Json);
    const uartFresh = new Serial8250(() => {});
    const uartBefore = uartFresh.saveState();
    if (!restoreOrRefuse('serial', () => uartFresh.restoreState(uartValue))) same(uartFresh.saveState(), uartBefore);

    const rtc = new CmosRtc();
    rtc.write(0, rng.int(256));
    const rtcBack = new CmosRtc();
    restoreOrRefuse('cmos as saved', () => rtcBack.restoreState(JSON.parse(JSON.stringify(rtc.saveState()))));
    same(rtcBack.saveState(), rtc.saveState());
    restoreOrRefuse('cmos', () => new CmosRtc().restoreState(mutated(rng, rtc.saveState() as unknown as Json)));

    // The agent channel with requests in flight and half a frame received.
    const a = new AgentClient(() => {}, () => {}, () => {});
    for (let n = rng.int(5); n > 0; n--) void a.request(rng.int(0x10000)).catch(() => {});
    a.receive(encodeFrame(randomFrame(rng, 256)).subarray(0, rng.int(40)));
    const agentSaved = JSON.parse(JSON.stringify(a.saveState()));
    const agentBack = new AgentClient(() => {}, () => {}, () => {});
    restoreOrRefuse('agent as saved', () => agentBack.restoreState(agentSaved));
    same(JSON.parse(JSON.stringify(agentBack.saveState())), { ...agentSaved, inFlight: [] }); // its in-flight requests are the old VM's
    const agentValue = mutated(rng, agentSaved);
    a.close();
    const b = new AgentClient(() => {}, () => {}, () => {});
    if (restoreOrRefuse('agent', () => b.restoreState(agentValue))) {
      // It goes on: frames of any kind, new requests.
      for (const piece of randomSplits(rng, Buffer.concat(Array.from({ length: 4 }, () => encodeFrame(randomFrame(rng, 256)))))) {
        expect(thrown(() => b.receive(piece))).toBeUndefined();
      }
      void b.request(1).catch(() => {});
    }
    b.close();

    const probe = new ProbeGuest(new AgentClient(() => {}, () => {}, () => {}));
    restoreOrRefuse('probe', () => probe.restoreState(mutated(rng, { version: 1, fillSeed: rng.u32(), fillBytes: rng.int(2 ** 40) })));
  });

  property('a snapshot directory whose manifest or state was changed', 60, (rng) => {
    const snap = smallSnapshot(rng);
    const file = join(snap, rng.pick(['manifest.json', 'state.json']));
    const original = JSON.parse(readFileSync(file, 'utf8'));
    const bytes = rng.chance(0.9) ? Buffer.from(JSON.stringify(mutated(rng, original))) : rng.bytes(rng.size(256));
    writeFileSync(file, bytes);
    if (file.endsWith('state.json') && rng.chance(0.8)) {
      // With the manifest's checksum made to match, the state's own checks run.
      const manifestPath = join(snap, 'manifest.json');
      const manifest = JSON.parse(readFileSync(manifestPath, 'utf8'));
      writeFileSync(manifestPath, JSON.stringify({ ...manifest, stateBytes: bytes.length, stateCrc32c: hex32(crc32c(bytes)) }));
    }
    let reader: SnapshotReader | undefined;
    if (!restoreOrRefuse('snapshot', () => (reader = SnapshotReader.open(snap)))) return;
    const target = GuestMemory.map(64 * 1024);
    try {
      restoreOrRefuse('snapshot RAM', () => reader!.readRam(target));
    } finally {
      target.unmap();
      reader!.close();
    }
  });

  /** A small probe snapshot with some RAM written, its files writable, in a new directory. */
  function smallSnapshot(rng: Rng): string {
    const snap = join(dir, `files-${rng.u32()}-${rng.u32()}`);
    const small = GuestMemory.map(64 * 1024);
    try {
      small.write(rng.int(60 * 1024), rng.bytes(rng.size(4096)));
      writeSnapshot(snap, small, { version: 1, guest: 'probe', memoryBytes: small.sizeBytes, vcpus: 1, machine: machine(), devices: {}, agent: {}, guestClient: {} });
    } finally {
      small.unmap();
    }
    for (const f of ['manifest.json', 'state.json', 'ram']) chmodSync(join(snap, f), 0o644);
    return snap;
  }

  /** Sizes about a bound, and far past it. */
  const sizesAbout = (rng: Rng, bound: number) => rng.pick([0, 1, bound - 1, bound, bound + 1, 2 * bound, 2 ** rng.between(20, 40), rng.size(bound)]);

  property('a snapshot directory whose files are links, FIFOs, devices, sockets, directories or of any size: refused at once, or opened', 40, async (rng) => {
    const snap = smallSnapshot(rng);
    const file = rng.pick(['manifest.json', 'state.json', 'ram']);
    const path = join(snap, file);
    const kind = rng.pick(['link to a copy', 'link to a device', 'dangling link', 'fifo', 'device', 'directory', 'socket', 'sized', 'sized', 'sized'] as const);
    const server = kind === 'socket' ? createServer() : undefined;
    let size = -1;
    rmSync(path);
    switch (kind) {
      case 'link to a copy': {
        const copy = join(snap, `${file}.copy`);
        writeFileSync(copy, readFileSync(join(smallSnapshot(rng), file)));
        symlinkSync(copy, path);
        break;
      }
      case 'link to a device': symlinkSync(rng.pick(['/dev/zero', '/dev/urandom', '/dev/null', '/dev/full']), path); break;
      case 'dangling link': symlinkSync(join(snap, 'nothing'), path); break;
      case 'fifo': spawnSync('mkfifo', [path]); break;
      case 'device': spawnSync('mknod', [path, 'c', '1', String(rng.pick([3, 5, 7, 8, 9]))]); break;
      case 'directory': mkdirSync(path); break;
      case 'socket': await new Promise<void>((resolve) => server!.listen(path, resolve)); break;
      case 'sized': {
        const bound = file === 'manifest.json' ? manifestBytesLimit(hostMemTotalBytes()) : file === 'state.json' ? MAX_STATE_BYTES : 64 * 1024;
        size = sizesAbout(rng, bound);
        // Mostly a sparse file; small ones of random bytes or of JSON whitespace.
        if (size <= 64 * 1024 && rng.chance(0.5)) writeFileSync(path, rng.chance(0.5) ? rng.bytes(size) : Buffer.alloc(size, 0x20));
        else {
          writeFileSync(path, '');
          truncateSync(path, size);
        }
        break;
      }
    }
    try {
      const opened = restoreOrRefuse(`${file} as ${kind}`, () => SnapshotReader.open(snap).close());
      // Only a regular file can pass, of the right size (its content is checked as RAM is read).
      const canOpen = file === 'ram' && kind === 'sized' && size === 64 * 1024;
      if (opened !== canOpen) same({ file, kind, size, opened }, { file, kind, size, opened: canOpen });
    } finally {
      server?.close();
    }
  });

  property('a snapshot directory whose VM shape is any size or count: refused before its state is read, or opened', 60, (rng) => {
    const snap = smallSnapshot(rng);
    const manifestPath = join(snap, 'manifest.json');
    const statePath = join(snap, 'state.json');
    const manifest = JSON.parse(readFileSync(manifestPath, 'utf8'));
    const state = JSON.parse(readFileSync(statePath, 'utf8'));
    const host = hostMemTotalBytes();
    const ramBytes = rng.pick([0, 1, 4095, 4096, 4097, 64 * 1024, 64 * 1024 + 1, 2 ** 26 + 1, host - 4096, host, host + 4096, 2 ** 40, 2 ** 53 - 1, 2 ** 53, -4096, 0.5 * 4096]);
    const chunks = Math.max(0, Math.min(Math.ceil(ramBytes / RAM_CHUNK_BYTES), 4096));
    manifest.ramBytes = ramBytes;
    if (rng.chance(0.7)) manifest.ramChunkCrc32c = Array(chunks).fill('0x00000000');
    if (rng.chance(0.5)) state.memoryBytes = rng.chance(0.8) ? ramBytes : rng.pick([0, 4096, '64MiB', null]);
    state.vcpus = rng.chance(0.5) ? state.vcpus : rng.pick([0, 1, 8, 9, 64, -1, 1.5, '2', null]);
    if (rng.chance(0.2)) state.guest = rng.pick(['linux', 'windows', 7]);
    const bytes = Buffer.from(JSON.stringify(state));
    writeFileSync(statePath, bytes);
    manifest.stateBytes = bytes.length;
    manifest.stateCrc32c = hex32(crc32c(bytes));
    writeFileSync(manifestPath, JSON.stringify(manifest));
    if (rng.chance(0.5) && Number.isSafeInteger(ramBytes) && ramBytes >= 0 && ramBytes <= 2 ** 40) truncateSync(join(snap, 'ram'), ramBytes);
    let reader: SnapshotReader | undefined;
    if (!restoreOrRefuse('shape', () => (reader = SnapshotReader.open(snap)))) return;
    // Opened: a shape Vm.start takes.
    const r = reader!;
    r.close();
    same(
      { ram: r.state.memoryBytes % 4096 === 0 && r.state.memoryBytes > 0 && r.state.memoryBytes <= host, vcpus: r.state.vcpus >= 1 && r.state.vcpus <= 8 },
      { ram: true, vcpus: true },
    );
  });
});
