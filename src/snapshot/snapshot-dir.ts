/**
 * A sealed snapshot directory: `ram` (guest RAM, sparse, see ram-file.ts), `state.json` (the
 * machine description: KVM state, device state, the agent channel, the VM's options and guest
 * kind) and `manifest.json` (the format version, a CRC32C per RAM chunk and of the state). Every
 * file is 0444 once written. Reading checks the manifest and the state before anything is built;
 * the RAM chunks are checked as they are read into the new machine's RAM.
 */
import { chmodSync, closeSync, fstatSync, fsyncSync, mkdirSync, openSync, readdirSync, readFileSync, statSync, writeSync } from 'node:fs';
import { join } from 'node:path';
import type { GuestMemory } from '../backends/kvm/guest-memory';
import { arrayAt, booleanAt, checkVersion, choiceAt, integerAt, objectAt, stringAt } from '../backends/kvm/state-fields';
import { SnapshotError } from '../errors';
import { crc32c, type FileRange } from '../memory/uffd-server';
import type { PageRun } from '../memory/pages';
import { fileDataRuns } from '../memory/file-runs';
import { validateVmName } from '../vm-name';
import { checkRamFile, dataChunkRanges, hex32, RAM_CHUNK_BYTES, readRamFile, writeRamFile } from './ram-file';

/** The version of the directory's layout and manifest this code writes and reads. */
export const SNAPSHOT_FORMAT_VERSION = 1;
/** The version of {@link SnapshotState} this code writes and reads. */
export const SNAPSHOT_STATE_VERSION = 1;

const MANIFEST = 'manifest.json';
const STATE = 'state.json';
const RAM = 'ram';
const MAX_STATE_BYTES = 256 * 1024 * 1024;

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
  mkdirSync(dir, { recursive: true });
  if (readdirSync(dir).length > 0) throw new SnapshotError(`${dir} is not empty: a snapshot goes into a new or empty directory`);
  const ram = writeRamFile(mem, join(dir, RAM));
  const stateBytes = Buffer.from(JSON.stringify(state));
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

/** A snapshot directory whose manifest and state have been checked; its RAM is checked as it is read. */
export class SnapshotReader {
  private constructor(readonly dir: string, private readonly manifest: Manifest, readonly state: SnapshotState) {}

  /**
   * Reads and checks `dir`'s manifest and state, and that the RAM file is whole: a missing or
   * malformed file, a newer format, a state whose checksum differs, a RAM file of the wrong
   * size, are each a {@link SnapshotError}.
   */
  static open(dir: string): SnapshotReader {
    const manifest = parseManifest(readJson(join(dir, MANIFEST), 64 * 1024 * 1024), `${dir}/${MANIFEST}`);
    const statePath = join(dir, STATE);
    const stateBytes = readBounded(statePath, MAX_STATE_BYTES);
    const crc = hex32(crc32c(stateBytes));
    if (stateBytes.length !== manifest.stateBytes || crc !== manifest.stateCrc32c) {
      throw new SnapshotError(`${statePath}: ${stateBytes.length} bytes with CRC32C ${crc}, the manifest says ${manifest.stateBytes} bytes with ${manifest.stateCrc32c}: the state was changed`);
    }
    const state = parseState(parseJson(stateBytes, statePath), manifest);
    const ramPath = join(dir, RAM);
    const ramSize = statOrThrow(ramPath).size;
    if (ramSize !== manifest.ramBytes) throw new SnapshotError(`${ramPath}: ${ramSize} bytes, the manifest says ${manifest.ramBytes}: the file was truncated or grown`);
    return new SnapshotReader(dir, manifest, state);
  }

  /** The RAM file's path. */
  get ramPath(): string {
    return join(this.dir, RAM);
  }

  /** Reads guest RAM into `mem` (fresh), checking every chunk first. */
  readRam(mem: GuestMemory): void {
    readRamFile(this.ramPath, mem, this.chunkChecksums());
  }

  /**
   * Opens the RAM file for a lazy restore: its size is checked now, and so is every chunk that
   * is a hole; the chunks with data come back as ranges for a userfaultfd source, each checked
   * against the manifest as it loads. The caller closes `fd` (a source reads from a duplicate).
   */
  openRamForLazyLoad(): { fd: number; ranges: FileRange[] } {
    const fd = openSync(this.ramPath, 'r');
    try {
      const size = fstatSync(fd).size;
      if (size !== this.manifest.ramBytes) throw new SnapshotError(`${this.ramPath}: ${size} bytes, the manifest says ${this.manifest.ramBytes}: the file was truncated or grown`);
      return { fd, ranges: dataChunkRanges(fd, this.ramPath, size, this.chunkChecksums()) };
    } catch (e) {
      closeSync(fd);
      throw e;
    }
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
  const ramBytes = integerAt(o, 'ramBytes', path, 4096, Number.MAX_SAFE_INTEGER);
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
  const memoryBytes = integerAt(o, 'memoryBytes', path, 4096, Number.MAX_SAFE_INTEGER);
  if (memoryBytes !== manifest.ramBytes) throw new SnapshotError(`${path}.memoryBytes: ${memoryBytes}, the RAM file ${manifest.ramBytes}`);
  const guest = choiceAt(o, 'guest', path, ['probe', 'linux'] as const);
  return {
    version: SNAPSHOT_STATE_VERSION,
    guest,
    memoryBytes,
    vcpus: integerAt(o, 'vcpus', path, 1, 8),
    ...(o.rootfs !== undefined && { rootfs: parseRootfs(o.rootfs, guest, `${path}.rootfs`) }),
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
    return { name: validateVmName(name, `${path}.name`) };
  } catch (e) {
    throw new SnapshotError((e as Error).message);
  }
}

function parseRootfs(value: unknown, guest: SnapshotState['guest'], path: string): SnapshotRootfs {
  if (guest !== 'linux') throw new SnapshotError(`${path}: only the Linux guest has a root filesystem, the snapshot is of the ${guest} guest`);
  const o = objectAt(value, path);
  if (!booleanAt(o, 'readOnly', path)) throw new SnapshotError(`${path}.readOnly: a snapshot's rootfs is read-only, the state says writable`);
  return { path: stringAt(o, 'path', path, 4096), readOnly: true };
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

function statOrThrow(path: string) {
  try {
    return statSync(path);
  } catch (e) {
    throw new SnapshotError(`${path}: ${(e as Error).message}`, { cause: e });
  }
}

function readBounded(path: string, maxBytes: number): Buffer {
  if (statOrThrow(path).size > maxBytes) throw new SnapshotError(`${path}: larger than ${maxBytes} bytes`);
  return readFileSync(path);
}

function readJson(path: string, maxBytes: number): unknown {
  return parseJson(readBounded(path, maxBytes), path);
}

function parseJson(bytes: Buffer, path: string): unknown {
  try {
    return JSON.parse(bytes.toString('utf8'));
  } catch (e) {
    throw new SnapshotError(`${path}: not JSON (${(e as Error).message})`);
  }
}
