/**
 * Binding to native-prebuilds' libpvisor-vcpu.so: a native thread per vCPU runs KVM_RUN and
 * reports each exit as a 16-byte record on a Unix socket that this module reads on the event
 * loop. See native-prebuilds/vcpu-runner/vcpu_runner.c for why threads are native.
 */
import { writeSync } from 'node:fs';
import { Socket } from 'node:net';
import { DataType, define, open } from 'ffi-rs';
import { nativePrebuild } from '../../native';
import { SystemCallError } from '../../errors';
import { EVENTFD_ONE } from '../../sys/libc';

/** What a vCPU thread reports. */
export const enum RecordKind {
  /** KVM_RUN returned 0; read the exit from kvm_run. */
  Exit = 1,
  /** KVM_RUN returned EINTR: the vCPU was kicked. */
  Interrupted = 2,
  /** KVM_RUN failed; `err` is the errno. */
  Error = 3,
  /** The thread left its loop. */
  Stopped = 4,
  /** A watched eventfd fired; `index` is the tag given to {@link VcpuRunner.watch}. */
  Notify = 5,
}

/** One report from a vCPU thread. */
export interface VcpuRecord {
  index: number;
  kind: RecordKind;
  err: number;
}

const RECORD_BYTES = 16;
const LIB = 'pvisor-vcpu';
const U64 = DataType.U64;
const I32 = DataType.I32;

let fns: ReturnType<typeof bind> | undefined;

function bind() {
  open({ library: LIB, path: nativePrebuild('libpvisor-vcpu.so') });
  return define({
    pv_group_create: { library: LIB, retType: U64, paramsType: [], errno: true },
    pv_group_node_fd: { library: LIB, retType: I32, paramsType: [U64] },
    pv_vcpu_start: { library: LIB, retType: I32, paramsType: [U64, I32, I32, U64] },
    pv_vcpu_go_fd: { library: LIB, retType: I32, paramsType: [U64, I32] },
    pv_vcpu_kick: { library: LIB, retType: I32, paramsType: [U64, I32] },
    pv_group_watch: { library: LIB, retType: I32, paramsType: [U64, I32, I32] },
    pv_group_destroy: { library: LIB, retType: DataType.Void, paramsType: [U64] },
  });
}

/**
 * Resolves the runner's functions now, on the main thread (ffi-rs lookups are not thread-safe).
 * Called when the KVM backend module loads.
 */
export function loadVcpuRunner(): void {
  fns ??= bind();
}

/** The vCPU threads of one VM and the socket their records arrive on. */
export class VcpuRunner {
  private readonly group: number;
  private readonly socket: Socket;
  private pending: Buffer = Buffer.alloc(0);
  private destroyed = false;
  /** Each vCPU's "go" eventfd (owned by the native group). */
  private readonly goFds: number[] = [];

  constructor(private readonly onRecord: (rec: VcpuRecord) => void) {
    loadVcpuRunner();
    const r = fns!.pv_group_create([]) as unknown as { value: number; errnoCode: number };
    if (!r.value) throw new SystemCallError('pv_group_create', r.errnoCode);
    this.group = r.value;
    const fd = fns!.pv_group_node_fd([this.group]);
    this.socket = new Socket({ fd, readable: true, writable: false });
    this.socket.on('data', (chunk: Buffer) => this.onData(chunk));
    // A read error here means the VM is being torn down; records are no longer wanted.
    this.socket.on('error', () => {});
  }

  private onData(chunk: Buffer): void {
    let buf = this.pending.length ? Buffer.concat([this.pending, chunk]) : chunk;
    let off = 0;
    while (buf.length - off >= RECORD_BYTES) {
      const rec: VcpuRecord = { index: buf.readUInt32LE(off), kind: buf.readUInt32LE(off + 4), err: buf.readInt32LE(off + 12) };
      off += RECORD_BYTES;
      if (!this.destroyed) this.onRecord(rec);
    }
    this.pending = off < buf.length ? Buffer.from(buf.subarray(off)) : Buffer.alloc(0);
  }

  /** Starts vCPU `index`'s thread; it waits for {@link go} before entering KVM_RUN. */
  start(index: number, vcpuFd: number, runAddr: number): void {
    const rc = fns!.pv_vcpu_start([this.group, index, vcpuFd, runAddr]);
    if (rc < 0) throw new SystemCallError('pv_vcpu_start', -rc);
    this.goFds[index] = fns!.pv_vcpu_go_fd([this.group, index]);
  }

  /**
   * Lets vCPU `index` enter KVM_RUN. A plain write(2) to its eventfd: this runs once per exit, and
   * an ffi-rs call would cost several microseconds of marshalling each time.
   */
  go(index: number): void {
    writeSync(this.goFds[index], EVENTFD_ONE);
  }

  /** Forces vCPU `index` out of KVM_RUN; it reports {@link RecordKind.Interrupted}. */
  kick(index: number): void {
    const rc = fns!.pv_vcpu_kick([this.group, index]);
    if (rc < 0) throw new SystemCallError('pv_vcpu_kick', -rc);
  }

  /**
   * Watches a non-blocking eventfd (kept open by the caller until {@link destroy}): each time it
   * fires, a {@link RecordKind.Notify} record with index `tag` arrives.
   */
  watch(fd: number, tag: number): void {
    const rc = fns!.pv_group_watch([this.group, fd, tag]);
    if (rc < 0) throw new SystemCallError('pv_group_watch', -rc);
  }

  /** Stops and joins every thread (blocks briefly) and closes the socket. Idempotent. */
  destroy(): void {
    if (this.destroyed) return;
    this.destroyed = true;
    fns!.pv_group_destroy([this.group]);
    this.socket.destroy();
  }
}
