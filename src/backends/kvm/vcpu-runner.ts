/**
 * Binding to native-prebuilds' libpvisor-vcpu.so: a native thread per vCPU runs KVM_RUN and
 * reports each exit as a record on a Unix socket that this module reads on the event loop. See
 * native-prebuilds/helpers/vcpu_runner.c for why threads are native.
 */
import { writeSync } from 'node:fs';
import { DataType, define, open } from 'ffi-rs';
import { nativePrebuild } from '../../native';
import { RecordChannel, type NativeRecord } from '../../native/record-channel';
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
  /** The vCPU's index, or a Notify record's tag. */
  index: number;
  kind: RecordKind;
  /** KVM_RUN's errno for Interrupted and Error, else 0. */
  err: number;
}

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
  private readonly channel: RecordChannel;
  private destroyed = false;
  /** Each vCPU's "go" eventfd (owned by the native group). */
  private readonly goFds: number[] = [];

  constructor(private readonly onRecord: (rec: VcpuRecord) => void) {
    loadVcpuRunner();
    const r = fns!.pv_group_create([]) as unknown as { value: number; errnoCode: number };
    if (!r.value) throw new SystemCallError('pv_group_create', r.errnoCode);
    this.group = r.value;
    // pv_record: tag = vCPU index (or Notify tag), value = KVM_RUN's return, err = its errno.
    this.channel = new RecordChannel(fns!.pv_group_node_fd([this.group]), (r: NativeRecord) => this.onRecord({ index: r.tag, kind: r.kind, err: r.err }));
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
   * fires, a {@link RecordKind.Notify} record with index `tag` (0..65535) arrives.
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
    this.channel.destroy();
  }
}
