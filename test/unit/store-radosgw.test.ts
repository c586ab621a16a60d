// Snapshots in a real object store (scripts/object-store.sh: Ceph radosgw on loopback; never a
// fake S3 server): a snapshot directory (writeSnapshot over real guest memory, no KVM) sent and
// fetched into a new cache, RAM identical; a child sends only the chunks that changed, counted at
// the PutObject calls; a chunk corrupted in the store, a manifest too large or malformed, a store
// that refuses connections and one that accepts and never answers, each a typed StoreError
// within a bound, with nothing left behind. One store for the whole file.
// Skipped, saying why, only when this machine cannot have the store's Debian packages.
import { randomBytes } from 'node:crypto';
import { existsSync, mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { connect, createServer, type Server, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { PutObjectCommand, S3Client } from '@aws-sdk/client-s3';
import { StoreError } from '../../src';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { SnapshotReader, writeSnapshot, type SnapshotState } from '../../src/snapshot/snapshot-dir';
import { ChunkCache, sha256Hex } from '../../src/store/chunk-cache';
import { fetchFromStore, snapshotToStore } from '../../src/store/snapshot-store';
import type { StoreOptions, StoreProgress, StoreTransfer } from '../../src/store/store-options';
import { chunkKey } from '../../src/store/store-url';
import { objectStoreScript, objectStoreSkipReason, startObjectStore } from '../object-store-env';

const ROOT = join(__dirname, '..', '..', '..');
const STATE_DIR = join(ROOT, '.cache', `object-store-store-test-${process.pid}`);
const MiB = 1024 * 1024;
const RAM_BYTES = 32 * MiB;
const script = objectStoreScript(STATE_DIR);
const why = objectStoreSkipReason('object store snapshots');

const state: SnapshotState = { version: 1, guest: 'probe', memoryBytes: RAM_BYTES, vcpus: 1, machine: { m: 1 }, devices: {}, agent: {}, guestClient: null };

(why ? describe.skip : describe)(`snapshots in the object store (radosgw)${why ? ` (skipped: ${why})` : ''}`, () => {
  let restoreEnv = () => {};
  let base: string;
  let mem: GuestMemory;
  const run = randomBytes(4).toString('hex');
  let first: StoreTransfer;

  /** Fresh cache directory for a "host" of its own. */
  const newCache = (): string => mkdtempSync(join(base, 'cache-'));
  const workLeft = (cacheDir: string): string[] => readdirSync(join(cacheDir, 'work'));

  beforeAll(() => {
    ({ restoreEnv } = startObjectStore(script));
    base = mkdtempSync(join(tmpdir(), 'pvisor-store-test-'));
    mem = GuestMemory.map(RAM_BYTES);
    // Chunks 0-3 random, 4 and 5 the same bytes (stored once), 6 one page of data, the rest zero.
    const view = mem.hostView(0, RAM_BYTES);
    randomBytes(8 * MiB).copy(view, 0);
    const twin = randomBytes(2 * MiB);
    twin.copy(view, 8 * MiB);
    twin.copy(view, 10 * MiB);
    view.fill(7, 12 * MiB + 8192, 12 * MiB + 12288);
  }, 320_000);

  afterAll(() => {
    mem?.unmap();
    if (base) rmSync(base, { recursive: true, force: true });
    restoreEnv();
    const r = script('stop');
    expect(r.status).toBe(0);
  }, 60_000);

  it('sends a snapshot as chunks and brings it back into a new cache: RAM, state and manifest identical', async () => {
    const progress: StoreProgress[] = [];
    const url = `s3://pvisor/test-${run}/template`;
    const { transfer } = await snapshotToStore(url, { cacheDir: newCache(), onProgress: (p) => progress.push(p) }, async (dir) => writeSnapshot(dir, mem, state));
    first = transfer;
    expect(transfer).toMatchObject({ url, chunksTotal: 16, zeroChunks: 9 });
    // 6 distinct RAM chunks (the twins once) and the two small files; chunk 6, one page of data,
    // as a page delta against zeros (8 + 4 + 4096 bytes).
    expect(transfer.chunksTransferred + transfer.chunksPresent).toBe(8);
    expect(transfer.chunksTransferred).toBe(8);
    expect(transfer.bytesTransferred).toBeGreaterThan(5 * 2 * MiB + 4108);
    expect(transfer.bytesTransferred).toBeLessThan(5 * 2 * MiB + 64 * 1024);
    expect(JSON.parse((await fetchObject(`test-${run}/template/snapshot.json`)).toString())).toMatchObject({ version: 2, ramDeltas: { [sha256Hex(mem.hostView(12 * MiB, 2 * MiB))]: { base: null, sizeBytes: 4108 } } });
    expect(progress.at(-1)).toMatchObject({ direction: 'upload', chunksDone: 16, chunksTotal: 16 });

    const cacheDir = newCache();
    const fetched = await fetchFromStore(url, { cacheDir });
    try {
      expect(fetched.transfer).toMatchObject({ chunksTotal: 16, zeroChunks: 9, chunksTransferred: 8, chunksPresent: 0 });
      const reader = SnapshotReader.open(fetched.dir);
      const back = GuestMemory.map(RAM_BYTES);
      try {
        expect(reader.state).toMatchObject({ guest: 'probe', memoryBytes: RAM_BYTES, machine: { m: 1 } });
        reader.readRam(back);
        expect(back.hostView(0, RAM_BYTES).equals(mem.hostView(0, RAM_BYTES))).toBe(true);
      } finally {
        reader.close();
        back.unmap();
      }
    } finally {
      fetched.remove();
    }
    expect(workLeft(cacheDir)).toEqual([]);
    // A second restore on that host fetches nothing but the manifest.
    const again = await fetchFromStore(url, { cacheDir });
    again.remove();
    expect(again.transfer).toMatchObject({ chunksTransferred: 0, chunksPresent: 8 });
    expect(again.transfer.bytesTransferred).toBeLessThan(4096);
  });

  it("with SharedSnapshot: assembled once into the cache's snapshots/<manifest sha256>, RAM identical; a second restore holds the same files and fetches no chunk", async () => {
    const url = `s3://pvisor/test-${run}/shared`;
    await snapshotToStore(url, { cacheDir: newCache() }, async (dir) => writeSnapshot(dir, mem, state));
    const cacheDir = newCache();
    const a = await fetchFromStore(url, { cacheDir }, true);
    const b = await fetchFromStore(url, { cacheDir }, true);
    try {
      expect(a.transfer).toMatchObject({ sharedEntry: 'assembled', chunksTransferred: 8, chunksPresent: 0 });
      expect(b.transfer).toMatchObject({ sharedEntry: 'reused', chunksTransferred: 0, chunksPresent: 8 });
      expect(b.transfer.bytesTransferred).toBeLessThan(4096);
      expect(a.dir).toBe(join(cacheDir, 'snapshots', sha256Hex(await fetchObject(`test-${run}/shared/snapshot.json`))));
      expect(b.dir).toBe(a.dir);
      expect(workLeft(cacheDir)).toEqual([]);
      const reader = SnapshotReader.open(b.dir);
      const back = GuestMemory.map(RAM_BYTES);
      try {
        reader.readRam(back);
        expect(back.hostView(0, RAM_BYTES).equals(mem.hostView(0, RAM_BYTES))).toBe(true);
      } finally {
        reader.close();
        back.unmap();
      }
    } finally {
      a.remove();
      b.remove();
    }
    // Let go of, it stays for the next clone, until eviction needs its room.
    expect(existsSync(join(a.dir, 'ram'))).toBe(true);
    expect(ChunkCache.open(cacheDir, 0).evict().sharedSnapshotsRemoved).toBe(1);
    expect(existsSync(a.dir)).toBe(false);
  });

  it('a child snapshot that changed 3 MiB sends only the 2 chunks it changed', async () => {
    const url = `s3://pvisor/test-${run}/child`;
    const view = mem.hostView(0, RAM_BYTES);
    const before = Buffer.from(view.subarray(MiB, 4 * MiB));
    randomBytes(3 * MiB).copy(view, MiB);
    const { client, puts } = countingPuts();
    try {
      const { transfer } = await snapshotToStore(url, { client, cacheDir: newCache() }, async (dir) => writeSnapshot(dir, mem, state));
      const chunkPuts = puts.filter((p) => p.key.startsWith('pvisor-chunks/'));
      // Chunks 0 and 1 changed (bytes 1-4 MiB), and the local manifest (their CRC32Cs); the
      // state is the template's and is not sent again.
      expect(chunkPuts.filter((p) => p.bytes === 2 * MiB)).toHaveLength(2);
      expect(chunkPuts).toHaveLength(3);
      expect(transfer).toMatchObject({ chunksTransferred: 3, chunksPresent: 5 });
      const sent = puts.reduce((n, p) => n + p.bytes, 0);
      expect(sent).toBe(transfer.bytesTransferred);
      expect(sent).toBeLessThan(2 * 2 * MiB + 64 * 1024);
      expect(sent).toBeLessThan(first.bytesTransferred / 2);
      process.stdout.write(`store upload: template ${first.bytesTransferred} bytes in ${first.chunksTransferred} objects (${first.ms.toFixed(0)} ms); child ${sent} bytes in ${transfer.chunksTransferred} objects (${transfer.ms.toFixed(0)} ms)\n`);
    } finally {
      client.destroy();
      before.copy(view, MiB);
    }
  });

  it('a child that changed one page in each of four chunks sends four page deltas against its template; a new host restores it; a delta corrupted in the store is corrupt', async () => {
    const hostA = newCache();
    const template = await snapshotToStore(`s3://pvisor/test-${run}/delta-template`, { cacheDir: hostA }, async (dir) => writeSnapshot(dir, mem, state));
    const view = mem.hostView(0, RAM_BYTES);
    const saved = Buffer.from(view.subarray(0, 8 * MiB));
    for (let k = 0; k < 4; k++) randomBytes(4096).copy(view, k * 2 * MiB + 3 * 4096);
    const { client, puts } = countingPuts();
    const url = `s3://pvisor/test-${run}/delta-child`;
    try {
      // The bases are the template's chunks, whose page hashes host A's cache kept as it sent them.
      const child = await snapshotToStore(url, { client, cacheDir: hostA }, async (dir) => writeSnapshot(dir, mem, state), undefined, template.bases);
      const deltaPuts = puts.filter((p) => p.key.startsWith('pvisor-chunks/delta/'));
      expect(deltaPuts).toHaveLength(4);
      for (const p of deltaPuts) expect(p.bytes).toBe(8 + 4 + 4096);
      expect(puts.filter((p) => p.bytes >= 2 * MiB)).toEqual([]);
      expect(child.transfer.bytesTransferred).toBeLessThan(4 * 4108 + 64 * 1024);
      const manifest = JSON.parse((await fetchObject(`test-${run}/delta-child/snapshot.json`)).toString()) as { version: number; ramChunks: (string | null)[]; ramDeltas: Record<string, { base: string | null }> };
      expect(manifest.version).toBe(2);
      for (let k = 0; k < 4; k++) expect(manifest.ramDeltas[manifest.ramChunks[k]!].base).toBe(template.bases[k]);
      // The next child's bases stay the template's chunks: a delta is never against a delta.
      expect(child.bases.slice(0, 4)).toEqual(template.bases.slice(0, 4));
      process.stdout.write(`store upload: a child that changed 4 pages in 4 chunks sent ${child.transfer.bytesTransferred} bytes in ${child.transfer.chunksTransferred} objects\n`);

      // Host B, a fresh cache: fetches each template chunk and its delta, RAM identical.
      const hostB = newCache();
      const fetched = await fetchFromStore(url, { cacheDir: hostB });
      try {
        const reader = SnapshotReader.open(fetched.dir);
        const back = GuestMemory.map(RAM_BYTES);
        try {
          reader.readRam(back);
          expect(back.hostView(0, RAM_BYTES).equals(view)).toBe(true);
        } finally {
          reader.close();
          back.unmap();
        }
      } finally {
        fetched.remove();
      }

      // One page of one delta changed in the store: refused before anything is restored.
      const key = deltaPuts[0].key;
      const damaged = await fetchObject(key);
      damaged[damaged.length - 100] ^= 1;
      await client.send(new PutObjectCommand({ Bucket: 'pvisor', Key: key, Body: damaged }));
      const hostC = newCache();
      const e = await fetchFromStore(url, { cacheDir: hostC }).catch((x: unknown) => x);
      expect(e).toBeInstanceOf(StoreError);
      expect((e as StoreError).reason).toBe('corrupt');
      expect((e as StoreError).message).toContain(key);
      expect(workLeft(hostC)).toEqual([]);
    } finally {
      client.destroy();
      saved.copy(view, 0);
    }
  });

  it('refuses a snapshot to a location that has one before writing anything, and reports none where there is none', async () => {
    let wrote = false;
    const e = await snapshotToStore(`s3://pvisor/test-${run}/template`, { cacheDir: newCache() }, async () => {
      wrote = true;
    }).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(StoreError);
    expect((e as StoreError).reason).toBe('exists');
    expect(wrote).toBe(false);
    const missing = await fetchFromStore(`s3://pvisor/test-${run}/nothing-here`, { cacheDir: newCache() }).catch((x: unknown) => x);
    expect((missing as StoreError).reason).toBe('not-found');
  });

  it('a chunk corrupted in the store is a StoreError corrupt, and nothing is restored or cached', async () => {
    const url = `s3://pvisor/test-${run}/corrupt`;
    const view = mem.hostView(0, RAM_BYTES);
    const before = Buffer.from(view.subarray(20 * MiB, 22 * MiB));
    randomBytes(2 * MiB).copy(view, 20 * MiB);
    try {
      await snapshotToStore(url, { cacheDir: newCache() }, async (dir) => writeSnapshot(dir, mem, state));
      const manifest = JSON.parse(await (await fetchObject(`test-${run}/corrupt/snapshot.json`)).toString()) as { ramChunks: (string | null)[] };
      const sha = manifest.ramChunks[10]!;
      const damaged = Buffer.from(view.subarray(20 * MiB, 22 * MiB));
      damaged[12345] ^= 1;
      const client = new S3Client({});
      await client.send(new PutObjectCommand({ Bucket: 'pvisor', Key: chunkKey(sha), Body: damaged }));
      client.destroy();
      const cacheDir = newCache();
      const e = await fetchFromStore(url, { cacheDir }).catch((x: unknown) => x);
      expect(e).toBeInstanceOf(StoreError);
      expect((e as StoreError).reason).toBe('corrupt');
      expect((e as StoreError).message).toContain(sha);
      expect(workLeft(cacheDir)).toEqual([]);
      expect(readdirSync(join(cacheDir, 'chunks'))).not.toContain(sha);
    } finally {
      before.copy(view, 20 * MiB);
    }
  });

  it("a hibernated VM's snapshot is not continued from a store (no claim that it resumes at most once yet)", async () => {
    const url = `s3://pvisor/test-${run}/hibernated`;
    await snapshotToStore(url, { cacheDir: newCache() }, async (dir) => writeSnapshot(dir, mem, { ...state, hibernated: { name: 'job-1' } }));
    const cacheDir = newCache();
    const e = await fetchFromStore(url, { cacheDir }).catch((x: unknown) => x);
    expect((e as StoreError).reason).toBe('malformed');
    expect((e as StoreError).message).toMatch(/holds a hibernated VM/);
    expect(workLeft(cacheDir)).toEqual([]);
  });

  it('a manifest larger than this host can need, or of the wrong shape, is refused as malformed', async () => {
    const client = new S3Client({});
    try {
      await client.send(new PutObjectCommand({ Bucket: 'pvisor', Key: `test-${run}/huge/snapshot.json`, Body: Buffer.alloc(8 * MiB, 0x20) }));
      await client.send(new PutObjectCommand({ Bucket: 'pvisor', Key: `test-${run}/shape/snapshot.json`, Body: JSON.stringify({ format: 'pvisor-store-snapshot', version: 1, ramBytes: 4096, chunkBytes: 2 * MiB, ramChunks: ['../../x'], files: {} }) }));
    } finally {
      client.destroy();
    }
    for (const [where, message] of [['huge', /more than the \d+ it may have/], ['shape', /ramChunks\[0\]/]] as const) {
      const cacheDir = newCache();
      const e = await fetchFromStore(`s3://pvisor/test-${run}/${where}`, { cacheDir }).catch((x: unknown) => x);
      expect((e as StoreError).reason).toBe('malformed');
      expect((e as StoreError).message).toMatch(message);
      expect(workLeft(cacheDir)).toEqual([]);
    }
  });

  it('a store that refuses connections, or accepts and never answers, is a StoreError within the request timeout', async () => {
    const silent = await listen((s) => sockets.push(s));
    const sockets: Socket[] = [];
    const closed = await listen(() => undefined);
    const closedPort = port(closed);
    await new Promise((r) => closed.close(r));
    const savedEndpoint = process.env.AWS_ENDPOINT_URL;
    try {
      for (const [endpoint, reason] of [[`http://127.0.0.1:${port(silent)}`, 'timeout'], [`http://127.0.0.1:${closedPort}`, 'unreachable']] as const) {
        // The client pvisor makes from the environment, as on a host whose store went away.
        process.env.AWS_ENDPOINT_URL = endpoint;
        const options: StoreOptions = { cacheDir: newCache(), requestTimeoutMs: 1500 };
        const t0 = performance.now();
        const e = await fetchFromStore(`s3://pvisor/test-${run}/template`, options).catch((x: unknown) => x);
        const ms = performance.now() - t0;
        expect(e).toBeInstanceOf(StoreError);
        expect((e as StoreError).reason).toBe(reason);
        expect(ms).toBeLessThan(1500 + 1000);
        expect(workLeft(options.cacheDir!)).toEqual([]);
        const t1 = performance.now();
        const up = await snapshotToStore(`s3://pvisor/test-${run}/never`, options, async () => undefined).catch((x: unknown) => x);
        expect((up as StoreError).reason).toBe(reason);
        expect(performance.now() - t1).toBeLessThan(1500 + 1000);
      }
    } finally {
      process.env.AWS_ENDPOINT_URL = savedEndpoint;
      for (const s of sockets) s.destroy();
      await new Promise((r) => silent.close(r));
    }
  });

  it('a store that stops answering mid-restore is a StoreError timeout within the bound, and nothing is left', async () => {
    // A TCP relay to radosgw that passes its first 3 MiB of answers (the manifest, the small
    // files, a chunk or so), then passes nothing more: the store as seen by a host whose link
    // to it died half-way. The relay is not an S3 server: every byte it passes is radosgw's.
    const upstream = new URL(process.env.AWS_ENDPOINT_URL!);
    let passed = 0;
    let stalled = false;
    const sockets: Socket[] = [];
    const relay = await listen((client) => {
      const server = connect(Number(upstream.port), upstream.hostname);
      sockets.push(client, server);
      client.on('data', (d) => server.write(d));
      server.on('data', (d) => {
        stalled ||= passed + d.length > 3 * MiB;
        if (stalled) return;
        passed += d.length;
        client.write(d);
      });
      client.on('error', () => undefined);
      server.on('error', () => undefined);
    });
    const savedEndpoint = process.env.AWS_ENDPOINT_URL;
    process.env.AWS_ENDPOINT_URL = `http://127.0.0.1:${port(relay)}`;
    try {
      const cacheDir = newCache();
      const t0 = performance.now();
      const e = await fetchFromStore(`s3://pvisor/test-${run}/template`, { cacheDir, requestTimeoutMs: 2000 }).catch((x: unknown) => x);
      const ms = performance.now() - t0;
      expect(e).toBeInstanceOf(StoreError);
      expect((e as StoreError).reason).toBe('timeout');
      expect(passed).toBeGreaterThan(MiB);
      expect(ms).toBeLessThan(2000 * 2 + 1000);
      expect(workLeft(cacheDir)).toEqual([]);
      // What did arrive whole and checked may stay cached; nothing else is.
      expect(readdirSync(join(cacheDir, 'tmp'))).toEqual([]);
    } finally {
      process.env.AWS_ENDPOINT_URL = savedEndpoint;
      for (const s of sockets) s.destroy();
      await new Promise((r) => relay.close(r));
    }
  });
});

/** An S3 client that records every PutObject's key and body size, as the client sends them. */
function countingPuts(): { client: S3Client; puts: { key: string; bytes: number }[] } {
  const client = new S3Client({});
  const puts: { key: string; bytes: number }[] = [];
  client.middlewareStack.add((next) => async (args) => {
    const input = args.input as { Key?: string; Body?: Buffer };
    if (input.Body !== undefined) puts.push({ key: input.Key!, bytes: input.Body.length });
    return next(args);
  }, { step: 'initialize', name: 'countPuts' });
  return { client, puts };
}

async function fetchObject(key: string): Promise<Buffer> {
  const { GetObjectCommand } = await import('@aws-sdk/client-s3');
  const client = new S3Client({});
  try {
    const r = await client.send(new GetObjectCommand({ Bucket: 'pvisor', Key: key }));
    return Buffer.from(await r.Body!.transformToByteArray());
  } finally {
    client.destroy();
  }
}

function listen(onConnection: (s: Socket) => void): Promise<Server> {
  return new Promise((resolve) => {
    const server = createServer(onConnection);
    server.listen(0, '127.0.0.1', () => resolve(server));
  });
}

function port(server: Server): number {
  return (server.address() as { port: number }).port;
}

