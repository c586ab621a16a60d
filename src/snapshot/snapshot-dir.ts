/**
 * A sealed snapshot directory: `ram` (guest RAM, sparse, see ram-file.ts), `state.json` (the
 * machine description: KVM state, device state, the agent channel, the VM's options and guest
 * kind) and `manifest.json` (the format version, a CRC32C per RAM chunk and of the state). Every
 * file is 0444 once written. Reading opens each file once, as a regular file (snapshot-file.ts),
 * checks the manifest, the VM's shape and the state before anything is built, each read bounded
 * by what a snapshot can need; the RAM chunks are checked as they are read into the new machine's
 * RAM, through the descriptor opened here.
 */
import { chmodSync, closeSync, fstatSync, fsyncSync, mkdirSync, openSync, readdirSync, writeSync } from 'node:fs';
import { join } from 'node:path';
import type { GuestMemory } from '../backends/kvm/guest-memory';
import { arrayAt, booleanAt, checkVersion, choiceAt, integerAt, objectAt, stringAt } from '../persist/state-fields';
import { InvalidOptionError, SnapshotError } from '../errors';
import { hostMemTotalBytes } from '../memory-usage';
import type { FileRange } from '../memory/uffd-server';
import { crc32c } from '../native/crc32c';
import type { PageRun } from '../guest-ram/pages';
import { fileDataRuns } from '../guest-ram/file-runs';
import { checkGuestMemoryBytes, checkVmShape } from '../vm-shape';
import { validateVmName } from '../vm-name';
import { parseLabels, type Labels } from '../labels';
import { parseMac } from '../network/addresses';
import { parseNetworkOption, type NatNetworkOptions } from '../network/options';
import { checkRamFile, dataChunkRanges, hex32, RAM_CHUNK_BYTES, readRamFile, writeRamFile } from './ram-file';
import { closeSnapshotFiles, openSnapshotFile, readSnapshotFile, type SnapshotFile } from './snapshot-file';

/** The version of the directory's layout and manifest this code writes and reads. */
export const SNAPSHOT_FORMAT_VERSION = 1;
/** The version of {@link SnapshotState} this code writes and reads. */
export const SNAPSHOT_STATE_VERSION = 1;

const MANIFEST = 'manifest.json';
const STATE = 'state.json';
const RAM = 'ram';

/**
 * The largest state.json read back (and written). Its fixed part grows with the vCPUs (10-12 KB
 * of JSON each) and is about 100 KB for 8 vCPUs (docs/snapshots.md has the figures); the
 * rest is bytes in flight on the agent channel: what the host had queued for the guest and half
 * a frame from the guest, each at most a frame (1 MiB of payload) in the common case, and base64
 * in JSON (4/3). 4 MiB holds two whole frames and the fixed part many times over, and bounds what
 * a hostile file costs to parse (under a second here for 4 MiB of the costliest JSON).
 */
export const MAX_STATE_BYTES = 4 * 1024 * 1024;

/**
 * The largest manifest of a snapshot of `ramBytes` of guest RAM: its fixed fields, and a CRC32C
 * per 2 MiB chunk (16 bytes each as written, one a line), with room for twice that.
 */
export function manifestBytesLimit(ramBytes: number): number {
  return 4096 + 32 * Math.ceil(ramBytes / RAM_CHUNK_BYTES);
}

/**
 * What a snapshot says of its VM besides RAM. Each part is checked by its owner when restored
 * (machine, devices, agent, guest client); here only its shape around them.
 */
export interface SnapshotState {
  version: typeof SNAPSHOT_STATE_VERSION;
  guest: 'probe' | 'linux';
  memoryBytes: number;
  vcpus: number;
  /**
   * The Linux guest's root filesystem image, which every clone attaches read-only (the disk's
   * saved state says which bytes it must be). Absent: no rootfs (the guest runs in its
   * initramfs, in RAM). A writable rootfs is never saved.
   */
  rootfs?: SnapshotRootfs;
  /**
   * The Linux guest's network, when it had one (only `'nat'` is saved): every clone gets a network
   * of its own with this policy (see docs/networking.md, "Snapshots and clones").
   */
  network?: SnapshotNetwork;
  /** {@link KvmMachine.captureState}. */
  machine: unknown;
  /** {@link KvmMachine.captureDevices}. */
  devices: unknown;
  /** The host end of the agent channel. */
  agent: unknown;
  /** The guest client's own state (the probe's working set). */
  guestClient: unknown;
  /**
   * Present when {@link Vm.hibernate} wrote the directory: the VM moved out of its process and
   * continues, under the same name, in the one that restores it; the restore consumes the
   * directory. Absent: a snapshot, which any number of restores may clone.
   */
  hibernated?: SnapshotHibernation;
}

/** {@link SnapshotState.hibernated}. */
export interface SnapshotHibernation {
  /** The VM's name, which the restored VM takes unless told otherwise. */
  name: string;
  /** Its labels (VmOptions.labels), which the restored VM keeps unless told otherwise; absent when none. */
  labels?: Labels;
}

/** {@link SnapshotState.network}. */
export interface SnapshotNetwork {
  /** The guest's MAC (`aa:bb:cc:dd:ee:ff`), which every clone keeps: its device and driver have it. */
  mac: string;
  /** The `network` option that makes the policy again (a clone gets its own /30 and TAP from it). */
  option: NatNetworkOptions;
}

/** {@link SnapshotState.rootfs}. */
export interface SnapshotRootfs {
  path: string;
  readOnly: true;
}

interface Manifest {
  format: 'pvisor-snapshot';
  version: typeof SNAPSHOT_FORMAT_VERSION;
  ramBytes: number;
  chunkBytes: number;
  ramChunkCrc32c: string[];
  stateBytes: number;
  stateCrc32c: string;
}

/** What {@link writeSnapshot} did. */
export interface WrittenSnapshot {
  /** Guest RAM pages written into the RAM file (the rest are holes). */
  ramDataPageCount: number;
}

/** Options of {@link writeSnapshot}. */
export interface WriteSnapshotOptions {
  /**
   * The files' mode once sealed: 0444 for a snapshot, which clones of other users may read if
   * its directory lets them; 0400 for a hibernated VM's, which is nobody else's to read.
   */
  fileMode?: 0o444 | 0o400;
}

/**
 * Writes a snapshot into `dir`, which is created, or must be empty. The guest must be paused.
 * Files are written, synced and made read-only, the manifest last: a directory without one is
 * not a snapshot.
 */
export function writeSnapshot(dir: string, mem: GuestMemory, state: SnapshotState, options: WriteSnapshotOptions = {}): WrittenSnapshot {
  const fileMode = options.fileMode ?? 0o444;
  const stateBytes = Buffer.from(JSON.stringify(state));
  if (stateBytes.length > MAX_STATE_BYTES) {
    throw new SnapshotError(`the VM's state is ${stateBytes.length} bytes as JSON, more than the ${MAX_STATE_BYTES} a restore reads: ` +
      'most of it must be bytes in flight on the agent channel (requests the guest has not taken yet); snapshot it once they are answered');
  }
  mkdirSync(dir, { recursive: true });
  if (readdirSync(dir).length > 0) throw new SnapshotError(`${dir} is not empty: a snapshot goes into a new or empty directory`);
  const ram = writeRamFile(mem, join(dir, RAM));
  writeSealed(join(dir, STATE), stateBytes, fileMode);
  const manifest: Manifest = {
    format: 'pvisor-snapshot',
    version: SNAPSHOT_FORMAT_VERSION,
    ramBytes: mem.sizeBytes,
    chunkBytes: RAM_CHUNK_BYTES,
    ramChunkCrc32c: ram.chunkCrc32c.map(hex32),
    stateBytes: stateBytes.length,
    stateCrc32c: hex32(crc32c(stateBytes)),
  };
  chmodSync(join(dir, RAM), fileMode);
  writeSealed(join(dir, MANIFEST), Buffer.from(JSON.stringify(manifest, null, 1)), fileMode);
  return { ramDataPageCount: ram.dataPageCount };
}

/**
 * A snapshot directory whose manifest and state have been checked, with its RAM file open; its RAM
 * is checked as it is read. {@link close} it once the restore is done with it.
 */
export class SnapshotReader {
  private closed = false;

  private constructor(readonly dir: string, private readonly manifest: Manifest, readonly state: SnapshotState, private readonly ram: SnapshotFile) {}

  /**
   * Opens `dir`'s three files, each once and as a regular file, and checks, in this order, before
   * reading anything whose size a file decides: the manifest's size against the largest this
   * host can restore, then the manifest, the guest RAM size it gives (as {@link Vm.start} checks
   * it: a non-zero multiple of 4 KiB, no larger than this host's RAM), the state's size against
   * the manifest and {@link MAX_STATE_BYTES}, the state's checksum, the state and the VM's shape,
   * and the RAM file's size. Each failure is a {@link SnapshotError}, and nothing stays open.
   */
  static open(dir: string): SnapshotReader {
    let files: { manifest: SnapshotFile; state?: SnapshotFile; ram?: SnapshotFile } | undefined;
    try {
      files = { manifest: openSnapshotFile(join(dir, MANIFEST)) };
      files.state = openSnapshotFile(join(dir, STATE));
      files.ram = openSnapshotFile(join(dir, RAM));
      const { manifest: m, state: st, ram } = files;
      const manifestBytes = readSnapshotFile(m, manifestBytesLimit(hostMemTotalBytes()), "a manifest of this host's largest guest RAM needs");
      const manifest = parseManifest(parseJson(manifestBytes, m.path), m.path);
      if (st.sizeBytes !== manifest.stateBytes) {
        throw new SnapshotError(`${st.path}: ${st.sizeBytes} bytes, the manifest says ${manifest.stateBytes}: the state was changed`);
      }
      const stateBytes = readSnapshotFile(st, MAX_STATE_BYTES, "a snapshot's state can need");
      const crc = hex32(crc32c(stateBytes));
      if (stateBytes.length !== manifest.stateBytes || crc !== manifest.stateCrc32c) {
        throw new SnapshotError(`${st.path}: ${stateBytes.length} bytes with CRC32C ${crc}, the manifest says ${manifest.stateBytes} bytes with ${manifest.stateCrc32c}: the state was changed`);
      }
      const state = parseState(parseJson(stateBytes, st.path), manifest);
      if (ram.sizeBytes !== manifest.ramBytes) throw new SnapshotError(`${ram.path}: ${ram.sizeBytes} bytes, the manifest says ${manifest.ramBytes}: the file was truncated or grown`);
      closeSnapshotFiles(m, st);
      return new SnapshotReader(dir, manifest, state, ram);
    } catch (e) {
      closeSnapshotFiles(files?.manifest, files?.state, files?.ram);
      throw e;
    }
  }

  /** The RAM file's path, for messages: it is read through {@link ramFd} only. */
  get ramPath(): string {
    return this.ram.path;
  }

  /** The RAM file, open read-only: what a clone maps (duplicated), what a restore reads. */
  get ramFd(): number {
    if (this.closed) throw new SnapshotError(`${this.ram.path}: the snapshot reader was closed`);
    return this.ram.fd;
  }

  /** Closes the RAM file. Idempotent. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    closeSnapshotFiles(this.ram);
  }

  /** Reads guest RAM into `mem` (fresh), checking every chunk first. */
  readRam(mem: GuestMemory): void {
    readRamFile(this.ramFd, this.ramPath, mem, this.chunkChecksums());
  }

  /**
   * The RAM file for a lazy restore: its size is checked now, and so is every chunk that is a
   * hole; the chunks with data come back as ranges for a userfaultfd source, each checked against
   * the manifest as it loads. `fd` is {@link ramFd}, still this reader's (a source reads from a
   * duplicate).
   */
  openRamForLazyLoad(): { fd: number; ranges: FileRange[] } {
    const fd = this.ramFd;
    const size = fstatSync(fd).size;
    if (size !== this.manifest.ramBytes) throw new SnapshotError(`${this.ramPath}: ${size} bytes, the manifest says ${this.manifest.ramBytes}: the file was truncated or grown`);
    return { fd, ranges: dataChunkRanges(fd, this.ramPath, size, this.chunkChecksums()) };
  }

  /**
   * Checks every RAM chunk of the RAM file open as `fd` (the descriptor guest RAM maps, so what
   * is checked is what the guest reads), unless this process has checked the same file before:
   * same device, inode, size, modification and change times, and the same manifest checksums.
   * `again` checks it anyway.
   */
  checkMappedRam(fd: number, again: boolean): MappedRamCheck {
    const t0 = performance.now();
    const st = fstatSync(fd, { bigint: true });
    if (st.size !== BigInt(this.manifest.ramBytes)) throw new SnapshotError(`${this.ramPath}: ${st.size} bytes, the manifest says ${this.manifest.ramBytes}: the file was truncated or grown`);
    const identity = [st.dev, st.ino, st.size, st.mtimeNs, st.ctimeNs, this.manifest.ramChunkCrc32c.join()].join(':');
    const holes = holeRuns(fileDataRuns(fd, this.manifest.ramBytes), this.manifest.ramBytes);
    if (!again && checkedRamFiles.has(identity)) return { checkedBefore: true, chunksRead: 0, ms: performance.now() - t0, holes };
    const { chunksRead } = checkRamFile(fd, this.ramPath, this.chunkChecksums());
    checkedRamFiles.add(identity);
    return { checkedBefore: false, chunksRead, ms: performance.now() - t0, holes };
  }

  private chunkChecksums(): number[] {
    return this.manifest.ramChunkCrc32c.map((h) => Number.parseInt(h, 16));
  }
}

/** A snapshot directory's RAM size and per-chunk CRC32C, from its manifest: {@link readRamChecksums}. */
export interface RamChecksums {
  ramBytes: number;
  chunkCrc32c: number[];
}

/**
 * Reads and checks `dir`'s manifest only (bounded and parsed as {@link SnapshotReader.open}
 * does): what a copy of its RAM file elsewhere (an object store) checks each chunk against.
 */
export function readRamChecksums(dir: string): RamChecksums {
  const m = openSnapshotFile(join(dir, MANIFEST));
  try {
    const manifest = parseManifest(parseJson(readSnapshotFile(m, manifestBytesLimit(hostMemTotalBytes()), "a manifest of this host's largest guest RAM needs"), m.path), m.path);
    return { ramBytes: manifest.ramBytes, chunkCrc32c: manifest.ramChunkCrc32c.map((h) => Number.parseInt(h, 16)) };
  } finally {
    closeSnapshotFiles(m);
  }
}

/** What {@link SnapshotReader.checkMappedRam} did. */
export interface MappedRamCheck {
  /** The same file was checked earlier in this process; nothing was read. */
  checkedBefore: boolean;
  /** RAM chunks read and checked (chunks that are holes are checked without reading). */
  chunksRead: number;
  ms: number;
  /** The file's holes (page-aligned runs of guest RAM that were zero), in address order. */
  holes: PageRun[];
}

/** The page-aligned runs of [0, size) outside `data` (sorted [start, end) runs). */
function holeRuns(data: readonly [number, number][], size: number): PageRun[] {
  const out: PageRun[] = [];
  let at = 0;
  for (const [start, end] of [...data, [size, size] as [number, number]]) {
    const from = Math.ceil(at / 4096) * 4096;
    const to = Math.floor(start / 4096) * 4096;
    if (to > from) out.push({ offset: from, length: to - from });
    at = Math.max(at, end);
  }
  return out;
}

/**
 * RAM files this process has checked in full, by identity. A snapshot's files are read-only and
 * sealed; a file changed in place changes its modification and change times, so a second clone of
 * an unchanged snapshot need not read it again.
 */
const checkedRamFiles = new Set<string>();

function parseManifest(value: unknown, path: string): Manifest {
  const o = objectAt(value, path);
  if (o.format !== 'pvisor-snapshot') throw new SnapshotError(`${path}.format: not a pvisor snapshot`);
  const version = o.version;
  if (typeof version === 'number' && version > SNAPSHOT_FORMAT_VERSION) {
    throw new SnapshotError(`${path}.version: the snapshot is of format ${version}, written by a newer pvisor; this one reads format ${SNAPSHOT_FORMAT_VERSION}`);
  }
  checkVersion(o, path, SNAPSHOT_FORMAT_VERSION);
  const ramBytes = shaped(path, { memory: 'ramBytes' }, () => checkGuestMemoryBytes(integerAt(o, 'ramBytes', path, 1, Number.MAX_SAFE_INTEGER)));
  const chunkBytes = integerAt(o, 'chunkBytes', path, RAM_CHUNK_BYTES, RAM_CHUNK_BYTES);
  const chunks = arrayAt(o, 'ramChunkCrc32c', path, Math.ceil(ramBytes / chunkBytes));
  if (chunks.length !== Math.ceil(ramBytes / chunkBytes)) throw new SnapshotError(`${path}.ramChunkCrc32c: ${chunks.length} checksums for ${Math.ceil(ramBytes / chunkBytes)} chunks`);
  const crc = (v: unknown, at: string): string => {
    if (typeof v !== 'string' || !/^0x[0-9a-f]{8}$/.test(v)) throw new SnapshotError(`${at}: expected a CRC32C as 0x and 8 hex digits`);
    return v;
  };
  return {
    format: 'pvisor-snapshot',
    version: SNAPSHOT_FORMAT_VERSION,
    ramBytes,
    chunkBytes,
    ramChunkCrc32c: chunks.map((c, i) => crc(c, `${path}.ramChunkCrc32c[${i}]`)),
    stateBytes: integerAt(o, 'stateBytes', path, 1, MAX_STATE_BYTES),
    stateCrc32c: crc(o.stateCrc32c, `${path}.stateCrc32c`),
  };
}

function parseState(value: unknown, manifest: Manifest): SnapshotState {
  const path = 'snapshot';
  const o = objectAt(value, path);
  checkVersion(o, path, SNAPSHOT_STATE_VERSION);
  const memoryBytes = integerAt(o, 'memoryBytes', path, 1, Number.MAX_SAFE_INTEGER);
  if (memoryBytes !== manifest.ramBytes) throw new SnapshotError(`${path}.memoryBytes: ${memoryBytes}, the RAM file ${manifest.ramBytes}`);
  const guest = choiceAt(o, 'guest', path, ['probe', 'linux'] as const);
  const vcpus = integerAt(o, 'vcpus', path, 1, Number.MAX_SAFE_INTEGER);
  // The shape Vm.start would accept, with its rules and words.
  shaped(path, { memory: 'memoryBytes', vcpus: 'vcpus', guest: 'guest' }, () => checkVmShape({ memory: memoryBytes, vcpus, guest }));
  return {
    version: SNAPSHOT_STATE_VERSION,
    guest,
    memoryBytes,
    vcpus,
    ...(o.rootfs !== undefined && { rootfs: parseRootfs(o.rootfs, guest, `${path}.rootfs`) }),
    ...(o.network !== undefined && { network: parseNetwork(o.network, guest, `${path}.network`) }),
    machine: o.machine,
    devices: o.devices,
    agent: o.agent,
    guestClient: o.guestClient,
    ...(o.hibernated !== undefined && { hibernated: parseHibernation(o.hibernated, `${path}.hibernated`) }),
  };
}

function parseHibernation(value: unknown, path: string): SnapshotHibernation {
  const o = objectAt(value, path);
  const name = stringAt(o, 'name', path, 64);
  try {
    return { name: validateVmName(name, `${path}.name`), ...(o.labels !== undefined && { labels: parseLabels(`${path}.labels`, o.labels) }) };
  } catch (e) {
    throw new SnapshotError((e as Error).message);
  }
}

function parseNetwork(value: unknown, guest: SnapshotState['guest'], path: string): SnapshotNetwork {
  if (guest !== 'linux') throw new SnapshotError(`${path}: only the Linux guest has a network device, the snapshot is of the ${guest} guest`);
  const o = objectAt(value, path);
  const mac = stringAt(o, 'mac', path, 17);
  if (!parseMac(mac)) throw new SnapshotError(`${path}.mac: expected a unicast MAC address as aa:bb:cc:dd:ee:ff, got ${JSON.stringify(mac)}`);
  const option = objectAt(o.option, `${path}.option`);
  if (option.mode !== 'nat') throw new SnapshotError(`${path}.option.mode: only a 'nat' network is saved, the state says ${String(JSON.stringify(option.mode)).slice(0, 40)}`);
  // The checks of Vm.start's network option, with its words (the option it names, e.g. network.allow).
  try {
    parseNetworkOption(option);
  } catch (e) {
    if (!(e instanceof InvalidOptionError)) throw e;
    throw new SnapshotError(`${path}.option: ${e.message}`, { cause: e });
  }
  return { mac, option: option as unknown as NatNetworkOptions };
}

function parseRootfs(value: unknown, guest: SnapshotState['guest'], path: string): SnapshotRootfs {
  if (guest !== 'linux') throw new SnapshotError(`${path}: only the Linux guest has a root filesystem, the snapshot is of the ${guest} guest`);
  const o = objectAt(value, path);
  if (!booleanAt(o, 'readOnly', path)) throw new SnapshotError(`${path}.readOnly: a snapshot's rootfs is read-only, the state says writable`);
  return { path: stringAt(o, 'path', path, 4096), readOnly: true };
}

/**
 * Runs a check of {@link Vm.start}'s (vm-shape.ts) on values from a snapshot: its
 * {@link InvalidOptionError} becomes a {@link SnapshotError} naming the field at `path` that
 * holds the option (`fields`: option to field).
 */
function shaped<T>(path: string, fields: Record<string, string>, check: () => T): T {
  try {
    return check();
  } catch (e) {
    if (!(e instanceof InvalidOptionError)) throw e;
    const detail = e.message.slice(e.option.length + 2);
    throw new SnapshotError(`${path}.${fields[e.option] ?? e.option}: ${detail}`, { cause: e });
  }
}

function writeSealed(path: string, bytes: Buffer, mode: number): void {
  const fd = openSync(path, 'wx', mode);
  try {
    for (let done = 0; done < bytes.length;) done += writeSync(fd, bytes, done);
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

function parseJson(bytes: Buffer, path: string): unknown {
  try {
    return JSON.parse(bytes.toString('utf8'));
  } catch (e) {
    throw new SnapshotError(`${path}: not JSON (${(e as Error).message})`);
  }
}
