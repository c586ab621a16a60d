// A lazy restore's pieces between a real object store (scripts/object-store.sh: Ceph radosgw on
// loopback) and a real userfaultfd server over anonymous memory of this process, no KVM: the
// snapshot is opened with its small files only; a fault (on a libuv pool thread, as a vCPU's
// would be) brings its chunk through the fetcher thread, checked; the prefetch brings the rest,
// the recorded touch order first; a chunk corrupted in the store is reported as a StoreError
// `corrupt` and never mapped, the faulting thread left waiting until the server is destroyed.
// Skipped, saying why, only when this machine cannot have the store's Debian packages.
import { randomBytes } from 'node:crypto';
import { closeSync, mkdtempSync, openSync, readdirSync, readlinkSync, readSync, rmSync, write } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { StoreError } from '../../src';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { FetchFailure } from '../../src/memory/fetch-protocol';
import { RangeState, UffdServer, type UffdSource, type UffdSourceEvent } from '../../src/memory/uffd-server';
import { writeSnapshot, type SnapshotState } from '../../src/snapshot/snapshot-dir';
import { LazyStoreSnapshot } from '../../src/store/lazy-ram';
import { snapshotToStore } from '../../src/store/snapshot-store';
import { chunkKey } from '../../src/store/store-url';
import { MAP_ANONYMOUS, MAP_NORESERVE, MAP_PRIVATE, PAGE_SIZE, PROT_READ, PROT_WRITE } from '../../src/sys/constants';
import { mmap, munmap, viewAt } from '../../src/sys/libc';
import { getObject, objectStoreScript, objectStoreSkipReason, putObject, startObjectStore } from '../object-store-env';

const ROOT = join(__dirname, '..', '..', '..');
const STATE_DIR = join(ROOT, '.cache', `object-store-lazy-test-${process.pid}`);
const MiB = 1024 * 1024;
const RAM_BYTES = 32 * MiB;
const script = objectStoreScript(STATE_DIR);
const why = objectStoreSkipReason('lazy restore from the object store');
const state: SnapshotState = { version: 1, guest: 'probe', memoryBytes: RAM_BYTES, vcpus: 1, machine: { m: 1 }, devices: {}, agent: {}, guestClient: null };
const tick = (ms = 10) => new Promise((r) => setTimeout(r, ms));

async function until<T>(what: () => T | undefined, timeoutMs = 30_000): Promise<T> {
  for (const end = Date.now() + timeoutMs; Date.now() < end; await tick()) {
    const v = what();
    if (v !== undefined) return v;
  }
  throw new Error('timed out');
}

(why ? describe.skip : describe)(`lazy restore from the object store (radosgw)${why ? ` (skipped: ${why})` : ''}`, () => {
  let restoreEnv = () => {};
  let base: string;
  let mem: GuestMemory;
  const url = `s3://pvisor/lazy-${randomBytes(4).toString('hex')}/template`;

  /** A fresh "host": guest RAM under a userfaultfd server, a cache of its own, the snapshot opened lazily and served. */
  async function host(): Promise<{ lazy: LazyStoreSnapshot; server: UffdServer; source: UffdSource; events: UffdSourceEvent[]; ram: Buffer; cacheDir: string; failure: (why: string, offset: number, code: number) => Error; done(): void }> {
    const cacheDir = mkdtempSync(join(base, 'cache-'));
    const opened = await LazyStoreSnapshot.open(url, { cacheDir, requestTimeoutMs: 20_000 });
    if (opened === 'hibernated') throw new Error('the template is a snapshot, not a hibernated VM');
    const lazy = opened;
    const ramAddr = mmap(0, RAM_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0, 'test RAM');
    const server = UffdServer.create(ramAddr, RAM_BYTES);
    const { fd, ranges, deferred, failure } = lazy.ramFile.openRamForLazyLoad();
    const events: UffdSourceEvent[] = [];
    const fetchFd = server.openFetchChannel();
    const source = server.addSource({ kind: 'file', fd, ranges, checksum: true, deferred: true, punch: true }, (e) => events.push(e));
    deferred!.start(fetchFd, source.id);
    lazy.removeDir();
    return {
      lazy,
      server,
      source,
      events,
      ram: viewAt(ramAddr, RAM_BYTES),
      cacheDir,
      failure: failure!,
      done: () => {
        lazy.close();
        server.destroy();
        munmap(ramAddr, RAM_BYTES);
      },
    };
  }

  /** Reads a page of `ram` at `offset` on a libuv pool thread (write(2) from it into a file): its bytes once the fault is served. */
  function readOnPoolThread(ram: Buffer, offset: number): { bytes: () => Buffer | undefined } {
    const path = join(base, `out-${randomBytes(4).toString('hex')}`);
    const out = openSync(path, 'w+');
    let result: Buffer | undefined;
    write(out, ram, offset, PAGE_SIZE, 0, (err) => {
      result = Buffer.alloc(PAGE_SIZE);
      if (!err) readSync(out, result, 0, PAGE_SIZE, 0);
      closeSync(out);
    });
    return { bytes: () => result };
  }

  beforeAll(async () => {
    ({ restoreEnv } = startObjectStore(script));
    base = mkdtempSync(join(tmpdir(), 'pvisor-lazy-test-'));
    mem = GuestMemory.map(RAM_BYTES);
    // Chunks 0-3 random, 6 one page of data, the rest zero.
    const view = mem.hostView(0, RAM_BYTES);
    randomBytes(8 * MiB).copy(view, 0);
    view.fill(7, 12 * MiB + 8192, 12 * MiB + 12288);
    // As a lazily restored VM's snapshot: its faults loaded chunk 6, then chunk 0 (and 5, zero now).
    await snapshotToStore(url, { cacheDir: mkdtempSync(join(base, 'cache-')) }, async (dir) => writeSnapshot(dir, mem, state), () => [12 * MiB + 4096, 0, 5 * 2 * MiB]);
  }, 320_000);

  afterAll(() => {
    mem?.unmap();
    if (base) rmSync(base, { recursive: true, force: true });
    restoreEnv();
    const r = script('stop');
    expect(r.status).toBe(0);
  }, 60_000);

  it('records the touch order in the manifest, chunks with data only; chunk 6, one page, is a page delta against zeros that the fetcher puts together', async () => {
    const manifest = JSON.parse((await getObject(url.replace('s3://pvisor/', '') + '/snapshot.json')).toString('utf8'));
    expect(manifest.touchOrder).toEqual([6, 0]);
    expect(manifest.version).toBe(2);
    expect(manifest.ramDeltas).toEqual({ [manifest.ramChunks[6]]: { base: null, sizeBytes: 8 + 4 + 4096 } });
  });

  it('opens with the small files only; a fault brings its chunk, checked; the prefetch the rest; RAM identical', async () => {
    const h = await host();
    try {
      // The manifest and the two small files: nothing of guest RAM yet.
      expect(h.lazy.transfer()).toMatchObject({ chunksTotal: 16, zeroChunks: 11, chunksTransferred: 2, chunksPresent: 0 });
      expect(h.lazy.transfer().bytesTransferred).toBeLessThan(64 * 1024);
      const page = readOnPoolThread(h.ram, 2 * MiB + 5 * PAGE_SIZE);
      const got = await until(page.bytes);
      expect(got.equals(mem.hostView(2 * MiB + 5 * PAGE_SIZE, PAGE_SIZE))).toBe(true);
      expect(h.lazy.transfer().chunksTransferred).toBe(3);
      expect(h.source.rangeStates()[1]).toBe(RangeState.Loaded);
      expect(h.source.touchOrder()).toEqual([1]);
      h.lazy.startPrefetch();
      await until(() => (h.events.length ? h.events : undefined));
      expect(h.events).toEqual([{ kind: 'done', rangesLoaded: 5 }]);
      expect(h.lazy.transfer().chunksTransferred).toBe(2 + 5);
      expect(h.ram.equals(mem.hostView(0, RAM_BYTES))).toBe(true);
      // Every chunk is in the host's cache now.
      expect(readdirSync(join(h.cacheDir, 'chunks')).length).toBe(2 + 5);
      expect(readdirSync(join(h.cacheDir, 'work'))).toEqual([]);
    } finally {
      h.done();
    }
  });

  it('a chunk corrupted in the store is a StoreError corrupt, never mapped nor cached; the faulting thread waits until the server ends', async () => {
    const sha = JSON.parse((await getObject(url.replace('s3://pvisor/', '') + '/snapshot.json')).toString('utf8')).ramChunks[2];
    const bytes = await getObject(chunkKey(sha));
    bytes[12345] ^= 0x40;
    await putObject(chunkKey(sha), bytes);
    const h = await host();
    try {
      const page = readOnPoolThread(h.ram, 2 * 2 * MiB + 7 * PAGE_SIZE);
      const event = (await until(() => (h.events.length ? h.events : undefined)))[0];
      expect(event).toMatchObject({ kind: 'error', offset: 4 * MiB, code: FetchFailure.corrupt });
      const e = h.failure((event as { why: string }).why, 4 * MiB, FetchFailure.corrupt);
      expect(e).toBeInstanceOf(StoreError);
      expect((e as StoreError).reason).toBe('corrupt');
      expect(e.message).toMatch(/SHA-256/);
      expect(h.source.rangeStates()[2]).toBe(RangeState.Bad);
      expect(readdirSync(join(h.cacheDir, 'chunks'))).not.toContain(sha);
      await tick(200);
      expect(page.bytes()).toBeUndefined();
      h.server.destroy();
      // Released: the page it then reads is an ordinary anonymous page, never the bad bytes.
      expect((await until(page.bytes)).equals(Buffer.alloc(PAGE_SIZE))).toBe(true);
    } finally {
      h.done();
    }
  });

  it('a restore that ends before guest RAM has its server: the job the fetcher opened early lets go of the scratch file, having fetched nothing', async () => {
    const cacheDir = mkdtempSync(join(base, 'cache-'));
    /** This process's descriptors open on a file of `cacheDir` (the scratch RAM file, once its directory is removed, as "(deleted)"). */
    const held = () =>
      readdirSync('/proc/self/fd').filter((fd) => {
        try {
          return readlinkSync(`/proc/self/fd/${fd}`).startsWith(cacheDir);
        } catch {
          return false;
        }
      });
    const opened = await LazyStoreSnapshot.open(url, { cacheDir, requestTimeoutMs: 20_000 });
    if (opened === 'hibernated') throw new Error('the template is a snapshot, not a hibernated VM');
    const smallFiles = opened.transfer();
    opened.removeDir();
    expect(held().length).toBeGreaterThan(0);
    await tick(200);
    opened.close();
    await until(() => (held().length === 0 ? true : undefined));
    const after = opened.transfer();
    expect(after.chunksTransferred + after.chunksPresent).toBe(smallFiles.chunksTransferred + smallFiles.chunksPresent);
    expect(readdirSync(join(cacheDir, 'chunks')).length).toBe(2);
  });
});
