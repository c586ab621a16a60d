// The snapshot directory as SnapshotReader reads it back: the guest kind and a Linux guest's
// rootfs, and each file as hostile input (its type, its size, the VM shape it gives). Written by
// writeSnapshot over real guest memory (an anonymous mapping, no KVM); state.json is then
// rewritten with its manifest checksum fixed, so that each malformed value reaches the parser (a
// changed checksum alone is refused before it). No KVM.
import { spawnSync } from 'node:child_process';
import { chmodSync, chownSync, mkdirSync, mkdtempSync, readFileSync, rmSync, statSync, symlinkSync, truncateSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { SharedSnapshot, SnapshotError, Vm } from '../../src';
import { GuestMemory } from '../../src/backends/kvm/guest-memory';
import { hostMemTotalBytes } from '../../src/memory-usage';
import { crc32c } from '../../src/native/crc32c';
import { hex32, RAM_CHUNK_BYTES } from '../../src/snapshot/ram-file';
import { manifestBytesLimit, MAX_STATE_BYTES, SnapshotReader, writeSnapshot, type SnapshotState } from '../../src/snapshot/snapshot-dir';

const MiB = 1024 * 1024;

describe('snapshot state: guest kind and rootfs', () => {
  let base: string;
  let mem: GuestMemory;
  let n = 0;
  beforeAll(() => {
    base = mkdtempSync(join(tmpdir(), 'pvisor-snapshot-dir-'));
    mem = GuestMemory.map(2 * 1024 * 1024);
  });
  afterAll(() => {
    mem.unmap();
    rmSync(base, { recursive: true, force: true });
  });

  const linux: SnapshotState = {
    version: 1,
    guest: 'linux',
    memoryBytes: 2 * 1024 * 1024,
    vcpus: 2,
    rootfs: { path: '/images/rootfs.img', readOnly: true },
    machine: {},
    devices: {},
    agent: {},
    guestClient: null,
  };

  /** A snapshot directory whose state.json is `state`, with the manifest's checksum of it right. */
  function snapshotWith(state: unknown): string {
    const dir = join(base, `s${++n}`);
    writeSnapshot(dir, mem, linux);
    const bytes = Buffer.from(JSON.stringify(state));
    const manifestPath = join(dir, 'manifest.json');
    const manifest = JSON.parse(readFileSync(manifestPath, 'utf8'));
    manifest.stateBytes = bytes.length;
    manifest.stateCrc32c = hex32(crc32c(bytes));
    for (const f of ['state.json', 'manifest.json']) chmodSync(join(dir, f), 0o644);
    writeFileSync(join(dir, 'state.json'), bytes);
    writeFileSync(manifestPath, JSON.stringify(manifest));
    return dir;
  }

  it('a Linux snapshot reads back with its read-only rootfs; one without a rootfs has none', () => {
    const dir = join(base, 'plain');
    writeSnapshot(dir, mem, linux);
    expect(SnapshotReader.open(dir).state).toMatchObject({ guest: 'linux', rootfs: { path: '/images/rootfs.img', readOnly: true } });
    const { rootfs: _, ...initramfs } = linux;
    expect(SnapshotReader.open(snapshotWith(initramfs)).state.rootfs).toBeUndefined();
  });

  it('a malformed guest kind or rootfs is a SnapshotError naming the field', () => {
    const cases: [unknown, RegExp][] = [
      [{ ...linux, guest: 'windows' }, /snapshot\.guest: expected one of probe, linux, got "windows"/],
      [{ ...linux, guest: 'probe' }, /snapshot\.rootfs: only the Linux guest has a root filesystem, the snapshot is of the probe guest/],
      [{ ...linux, rootfs: { path: '/images/rootfs.img', readOnly: false } }, /snapshot\.rootfs\.readOnly: a snapshot's rootfs is read-only/],
      [{ ...linux, rootfs: { path: '/images/rootfs.img' } }, /snapshot\.rootfs\.readOnly: expected true or false, got nothing/],
      [{ ...linux, rootfs: { path: '', readOnly: true } }, /snapshot\.rootfs\.path: expected a string of 1 to 4096 characters, got ""/],
      [{ ...linux, rootfs: { path: 'x'.repeat(4097), readOnly: true } }, /snapshot\.rootfs\.path: expected a string of 1 to 4096 characters, got a string of 4097/],
      [{ ...linux, rootfs: { path: 7, readOnly: true } }, /snapshot\.rootfs\.path: expected a string/],
      [{ ...linux, rootfs: '/images/rootfs.img' }, /snapshot\.rootfs: expected an object/],
      [{ ...linux, rootfs: null }, /snapshot\.rootfs: expected an object, got null/],
    ];
    for (const [state, message] of cases) {
      const dir = snapshotWith(state);
      expect(() => SnapshotReader.open(dir)).toThrow(SnapshotError);
      expect(() => SnapshotReader.open(dir)).toThrow(message);
    }
  });

  it("a networked VM's state says its MAC and NAT policy, checked as Vm.start checks the option; only 'nat' is taken", () => {
    const network = { mac: '02:70:0a:0b:0c:0d', option: { mode: 'nat', allow: ['198.18.0.0/30:8080'], subnetRange: '10.200.0.0/16' } };
    expect(SnapshotReader.open(snapshotWith({ ...linux, network })).state.network).toEqual(network);
    expect(SnapshotReader.open(snapshotWith(linux)).state.network).toBeUndefined();
    const cases: [unknown, RegExp][] = [
      [{ ...linux, guest: 'probe', rootfs: undefined, network }, /snapshot\.network: only the Linux guest has a network device/],
      [{ ...linux, network: { ...network, mac: '03:70:0a:0b:0c:0d' } }, /snapshot\.network\.mac: expected a unicast MAC address/],
      [{ ...linux, network: { ...network, mac: '02:70:0A:0b:0c:0d' } }, /snapshot\.network\.mac: expected a unicast MAC address/],
      [{ ...linux, network: { ...network, mac: 7 } }, /snapshot\.network\.mac: expected a string/],
      [{ ...linux, network: { ...network, option: { tap: 'tap0' } } }, /snapshot\.network\.option\.mode: only a 'nat' network is saved/],
      [{ ...linux, network: { ...network, option: { ...network.option, allow: ['10.0.0.1/8'] } } }, /snapshot\.network\.option: network\.allow\[0\]: "10\.0\.0\.1\/8" is not CIDR/],
      [{ ...linux, network: { ...network, option: { ...network.option, subnetRange: '10.0.0.0/31' } } }, /snapshot\.network\.option: network\.subnetRange/],
      [{ ...linux, network: { ...network, option: { ...network.option, extra: 1 } } }, /snapshot\.network\.option: network: unknown field extra/],
      [{ ...linux, network: 'nat' }, /snapshot\.network: expected an object/],
    ];
    for (const [state, message] of cases) {
      const dir = snapshotWith(state);
      expect(() => SnapshotReader.open(dir)).toThrow(SnapshotError);
      expect(() => SnapshotReader.open(dir)).toThrow(message);
    }
  });

  it("a hibernated VM's state says its name, checked as a VM name; its files may be 0400", () => {
    const dir = join(base, 'hibernated');
    writeSnapshot(dir, mem, { ...linux, hibernated: { name: 'job-7' } }, { fileMode: 0o400 });
    for (const f of ['ram', 'state.json', 'manifest.json']) expect(statSync(join(dir, f)).mode & 0o777).toBe(0o400);
    expect(SnapshotReader.open(dir).state.hibernated).toEqual({ name: 'job-7' });
    expect(SnapshotReader.open(snapshotWith(linux)).state.hibernated).toBeUndefined();
    const cases: [unknown, RegExp][] = [
      [{ ...linux, hibernated: { name: '../etc' } }, /snapshot\.hibernated\.name: "\.\.\/etc" is not a VM id/],
      [{ ...linux, hibernated: { name: '' } }, /snapshot\.hibernated\.name: expected a string/],
      [{ ...linux, hibernated: 'job-7' }, /snapshot\.hibernated: expected an object/],
    ];
    for (const [state, message] of cases) expect(() => SnapshotReader.open(snapshotWith(state))).toThrow(message);
  });
});

/**
 * SnapshotReader.open(dir) in a child process, killed after `boundMs`: a read that blocks (a FIFO)
 * or never ends (/dev/zero) would otherwise hang the test's own thread for good.
 */
function openInChild(dir: string, boundMs = 2000): { error?: { name: string; message: string }; opened?: true; ms: number; killed: boolean } {
  const module = join(__dirname, '..', '..', 'src', 'snapshot', 'snapshot-dir');
  const script = `
    const { SnapshotReader } = require(${JSON.stringify(module)});
    const t0 = performance.now();
    let out;
    try { SnapshotReader.open(${JSON.stringify(dir)}).close(); out = { opened: true }; }
    catch (e) { out = { error: { name: e.constructor.name, message: e.message } }; }
    process.stdout.write(JSON.stringify({ ...out, ms: performance.now() - t0 }));`;
  const r = spawnSync(process.execPath, ['-e', script], { timeout: boundMs, killSignal: 'SIGKILL', encoding: 'utf8' });
  if (r.signal) return { ms: boundMs, killed: true };
  return { ...JSON.parse(r.stdout), killed: false };
}

describe('snapshot files as hostile input: type, size and shape', () => {
  let base: string;
  let mem: GuestMemory;
  let good: string;
  let n = 0;
  const probe: SnapshotState = { version: 1, guest: 'probe', memoryBytes: 2 * MiB, vcpus: 1, machine: {}, devices: {}, agent: {}, guestClient: null };
  beforeAll(() => {
    base = mkdtempSync(join(tmpdir(), 'pvisor-snapshot-files-'));
    mem = GuestMemory.map(2 * MiB);
    mem.write(4096, Buffer.from('a working set'));
    good = join(base, 'good');
    writeSnapshot(good, mem, probe);
  });
  afterAll(() => {
    mem.unmap();
    rmSync(base, { recursive: true, force: true });
  });

  /** A fresh, writable snapshot of `probe`. */
  function fresh(): string {
    const dir = join(base, `s${++n}`);
    writeSnapshot(dir, mem, probe);
    for (const f of ['manifest.json', 'state.json', 'ram']) chmodSync(join(dir, f), 0o644);
    return dir;
  }

  /** `dir` with `file` replaced by whatever `make(path)` puts at its path. */
  function replaced(file: string, make: (path: string) => void): string {
    const dir = fresh();
    rmSync(join(dir, file));
    make(join(dir, file));
    return dir;
  }

  /** Rewrites the manifest (and, given, the state and the RAM file's size) of a fresh snapshot. */
  function withManifest(change: (m: Record<string, unknown>) => void, state?: unknown, ramBytes?: number): string {
    const dir = fresh();
    const manifest = JSON.parse(readFileSync(join(dir, 'manifest.json'), 'utf8'));
    if (state !== undefined) {
      const bytes = Buffer.from(JSON.stringify(state));
      writeFileSync(join(dir, 'state.json'), bytes);
      manifest.stateBytes = bytes.length;
      manifest.stateCrc32c = hex32(crc32c(bytes));
    }
    if (ramBytes !== undefined) truncateSync(join(dir, 'ram'), ramBytes);
    change(manifest);
    writeFileSync(join(dir, 'manifest.json'), JSON.stringify(manifest, null, 1));
    return dir;
  }

  /** Opens `dir` here: a SnapshotError matching `message`, within `withinMs`. */
  function refused(dir: string, message: RegExp, withinMs = 1000): void {
    const t0 = performance.now();
    let err: unknown;
    try {
      SnapshotReader.open(dir).close();
    } catch (e) {
      err = e;
    }
    const ms = performance.now() - t0;
    expect({ dir, err }).toEqual({ dir, err: expect.any(SnapshotError) });
    expect((err as Error).message).toMatch(message);
    expect(ms).toBeLessThan(withinMs);
  }

  it('a good snapshot opens, its RAM file once, through the descriptor it keeps', () => {
    const r = SnapshotReader.open(good);
    try {
      expect(r.state.memoryBytes).toBe(2 * MiB);
      const target = GuestMemory.map(2 * MiB);
      try {
        r.readRam(target);
        expect(target.read(4096, 13).toString()).toBe('a working set');
      } finally {
        target.unmap();
      }
    } finally {
      r.close();
    }
    expect(() => r.ramFd).toThrow(/closed/);
  });

  it('a symbolic link in place of any file is refused, even one to a good copy of it', () => {
    for (const file of ['manifest.json', 'state.json', 'ram']) {
      refused(replaced(file, (p) => symlinkSync(join(good, file), p)), new RegExp(`${file}: is a symbolic link, not a regular file`));
    }
  });

  it('a directory or a socket in place of a file is refused at once', async () => {
    refused(replaced('state.json', (p) => mkdirSync(p)), /state\.json: is a directory, not a regular file/);
    const servers: Server[] = [];
    try {
      for (const file of ['manifest.json', 'ram']) {
        const dir = fresh();
        rmSync(join(dir, file));
        const server = createServer();
        servers.push(server);
        await new Promise<void>((resolve) => server.listen(join(dir, file), resolve));
        refused(dir, new RegExp(`${file}: is a socket, not a regular file`));
      }
    } finally {
      for (const s of servers) s.close();
    }
  });

  // Each in a child process bounded to 2 s: without the checks, the open blocks on the FIFO (no
  // writer ever comes), or reads /dev/zero and /dev/urandom until memory runs out.
  it('a FIFO, /dev/zero or /dev/urandom in place of a file is a SnapshotError at once, never a hang', () => {
    const cases: [string, string, (p: string) => void, RegExp][] = [
      ['manifest.json', 'FIFO', (p) => spawnSync('mkfifo', [p]), /manifest\.json: is a FIFO/],
      ['state.json', 'FIFO', (p) => spawnSync('mkfifo', [p]), /state\.json: is a FIFO/],
      ['ram', 'FIFO', (p) => spawnSync('mkfifo', [p]), /ram: is a FIFO/],
      ['manifest.json', '/dev/zero by symlink', (p) => symlinkSync('/dev/zero', p), /manifest\.json: is a symbolic link/],
      ['state.json', '/dev/urandom by symlink', (p) => symlinkSync('/dev/urandom', p), /state\.json: is a symbolic link/],
      ['manifest.json', '/dev/zero by mknod', (p) => spawnSync('mknod', [p, 'c', '1', '5']), /manifest\.json: is a character device/],
      ['state.json', '/dev/urandom by mknod', (p) => spawnSync('mknod', [p, 'c', '1', '9']), /state\.json: is a character device/],
      ['ram', '/dev/zero by mknod', (p) => spawnSync('mknod', [p, 'c', '1', '5']), /ram: is a character device/],
    ];
    for (const [file, what, make, message] of cases) {
      const dir = replaced(file, make);
      const r = openInChild(dir);
      expect({ file, what, killed: r.killed, error: r.error?.name }).toEqual({ file, what, killed: false, error: 'SnapshotError' });
      expect(r.error!.message).toMatch(message);
      expect(r.ms).toBeLessThan(500);
    }
  });

  it('a manifest or a state larger than a snapshot can need is refused by its size, before it is read', () => {
    // A manifest of a 1 TiB VM: 524288 checksums, its RAM file a sparse 1 TiB.
    const chunks = 2 ** 40 / RAM_CHUNK_BYTES;
    const tib = withManifest((m) => {
      m.ramBytes = 2 ** 40;
      m.ramChunkCrc32c = Array(chunks).fill(hex32(crc32c(Buffer.alloc(RAM_CHUNK_BYTES))));
    }, { ...probe, memoryBytes: 2 ** 40 }, 2 ** 40);
    const limit = manifestBytesLimit(hostMemTotalBytes());
    refused(tib, new RegExp(`manifest\\.json: \\d+ bytes, more than the ${limit} that a manifest of this host's largest guest RAM needs`));
    // A state of 16 MiB of valid JSON (about a second to parse here), its size and checksum in
    // the manifest: refused by the manifest's bound on it, with the file's size, unread.
    const big = Buffer.from(`[${'0,'.repeat(8 * MiB - 1)}0]`);
    const bigState = withManifest((m) => {
      m.stateBytes = big.length;
      m.stateCrc32c = hex32(crc32c(big));
    });
    writeFileSync(join(bigState, 'state.json'), big);
    refused(bigState, new RegExp(`manifest\\.json\\.stateBytes: expected an integer in \\[1, ${MAX_STATE_BYTES}\\], got number ${big.length}`), 300);
    // A state whose size is not the manifest's is refused by fstat too.
    const grown = fresh();
    writeFileSync(join(grown, 'state.json'), Buffer.concat([readFileSync(join(good, 'state.json')), Buffer.from(' ')]));
    refused(grown, /state\.json: \d+ bytes, the manifest says \d+: the state was changed/);
  });

  it('a snapshot says the VM shape Vm.start would accept, or is refused before its state is read', () => {
    const ok = (memoryBytes: number) => Array(Math.ceil(memoryBytes / RAM_CHUNK_BYTES)).fill('0x00000000');
    // 1 TiB in a small manifest: more than this host has.
    refused(withManifest((m) => {
      m.ramBytes = 2 ** 40;
      m.ramChunkCrc32c = [];
    }), new RegExp(`manifest\\.json\\.ramBytes: 1099511627776 bytes is more than this host has \\(${hostMemTotalBytes()} bytes\\)`));
    // 64 MiB + 1: KVM would refuse the mapping; the shape check refuses it first.
    const odd = 64 * MiB + 1;
    refused(withManifest((m) => {
      m.ramBytes = odd;
      m.ramChunkCrc32c = ok(odd);
    }, { ...probe, memoryBytes: odd }, odd), /manifest\.json\.ramBytes: must be a non-zero multiple of 4 KiB, got 67108865 bytes/);
    const four = 4 * MiB;
    const shaped = (state: Partial<SnapshotState>) => withManifest((m) => {
      m.ramBytes = four;
      m.ramChunkCrc32c = ok(four);
    }, { ...probe, memoryBytes: four, ...state }, four);
    refused(shaped({ vcpus: 9 }), /snapshot\.vcpus: must be a whole number from 1 to 8, got 9/);
    refused(shaped({ vcpus: 0 }), /snapshot\.vcpus: expected an integer in \[1, /);
  });

  it('SharedSnapshot refuses a RAM file that another user owns, or that its group or others may write', async () => {
    const owned = fresh();
    chmodSync(join(owned, 'ram'), 0o444);
    chownSync(join(owned, 'ram'), 65534, 65534);
    const writable = fresh();
    chmodSync(join(writable, 'ram'), 0o664);
    // Refused before anything is built: no KVM is needed to see it.
    await expect(Vm.restore(owned, { strategies: [new SharedSnapshot()] })).rejects.toThrow(new RegExp(`ram: owned by uid 65534, not by this process's user \\(${process.geteuid!()}\\) or root`));
    await expect(Vm.restore(writable, { strategies: [new SharedSnapshot()] })).rejects.toThrow(/ram: mode 664, writable by its group/);
    await expect(Vm.restore(writable, { strategies: [new SharedSnapshot()] })).rejects.toThrow(SnapshotError);
  });
});
