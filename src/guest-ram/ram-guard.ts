/**
 * Guest RAM's SIGBUS guard (libpvisor-memory.so, native-prebuilds/helpers/ram_guard.c): a page of
 * a file mapped as guest RAM that is gone (the file truncated, a read error) raises SIGBUS in the
 * thread that touches it from user space, and by default that ends the whole process, with every
 * VM in it. Under the guard, the page reads zero instead, the mapping is marked hit, and its owner
 * hears of it on the event loop, to end that VM alone.
 *
 * The native table is read here through a view of it: checking whether a mapping was hit costs a
 * memory read, so a VM can check before each vCPU runs on. The record socket only wakes Node.
 */
import type * as Ffi from 'ffi-rs';
import { SystemCallError } from '../errors';
import { nativePrebuild } from '../native';
import { RecordChannel } from '../native/record-channel';
import { openLibc, viewAt } from '../sys/libc';

/** One guarded mapping. */
export interface RamGuard {
  /** The offset into the mapping of the first access that found its page gone, if one did. */
  readonly lostAt: number | undefined;
  /** Stops guarding it: before the mapping goes away. Idempotent. */
  release(): void;
}

const LIB = 'pvisor-memory-guard';
/** struct pv_guard_slot: u64 start, u64 length, u64 hit (0, or 1 + the offset). */
const SLOT_BYTES = 24;
const HIT_OFFSET = 16;

type NativeCall = (args: unknown[]) => unknown;
interface Guarding {
  add: NativeCall;
  remove: NativeCall;
  table: Buffer;
  slotCount: number;
  channel: RecordChannel;
  owners: Map<number, Guard>;
}
let guarding: Guarding | undefined;

/**
 * Loads the helper, installs the handler and watches its socket: once per process (once per
 * module registry under a test runner, each with its own socket: see pv_ram_guard_init).
 */
function setUp(): Guarding {
  if (guarding) return guarding;
  const ffi: typeof Ffi = openLibc();
  ffi.open({ library: LIB, path: nativePrebuild('libpvisor-memory.so') });
  const { DataType } = ffi;
  const fns = ffi.define({
    pv_ram_guard_init: { library: LIB, retType: DataType.I32, paramsType: [] },
    pv_ram_guard_table: { library: LIB, retType: DataType.U64, paramsType: [] },
    pv_ram_guard_slot_count: { library: LIB, retType: DataType.U32, paramsType: [] },
    pv_ram_guard_add: { library: LIB, retType: DataType.I32, paramsType: [DataType.U64, DataType.U64] },
    pv_ram_guard_remove: { library: LIB, retType: DataType.Void, paramsType: [DataType.I32] },
  }) as unknown as Record<string, NativeCall>;
  const fd = fns.pv_ram_guard_init([]) as number;
  if (fd < 0) throw new SystemCallError('pv_ram_guard_init', -fd, 'installing the SIGBUS handler of guest RAM');
  const slotCount = fns.pv_ram_guard_slot_count([]) as number;
  const owners = new Map<number, Guard>();
  const channel = new RecordChannel(fd, (rec) => owners.get(rec.tag)?.check());
  // The process may end with the socket open: it is there for as long as guest RAM is.
  channel.unref();
  guarding = {
    add: fns.pv_ram_guard_add,
    remove: fns.pv_ram_guard_remove,
    table: viewAt(fns.pv_ram_guard_table([]) as number, slotCount * SLOT_BYTES),
    slotCount,
    channel,
    owners,
  };
  return guarding;
}

class Guard implements RamGuard {
  private released = false;
  private reported = false;

  constructor(private readonly g: Guarding, private readonly slot: number, private readonly onLost: (offset: number) => void) {}

  get lostAt(): number | undefined {
    if (this.released) return undefined;
    const hit = Number(this.g.table.readBigUInt64LE(this.slot * SLOT_BYTES + HIT_OFFSET));
    return hit === 0 ? undefined : hit - 1;
  }

  /** The socket said this slot was hit: tells the owner once (a record may be late, for a slot since reused: the table says). */
  check(): void {
    const at = this.lostAt;
    if (at === undefined || this.reported) return;
    this.reported = true;
    this.onLost(at);
  }

  release(): void {
    if (this.released) return;
    this.released = true;
    this.g.owners.delete(this.slot);
    this.g.remove([this.slot]);
  }
}

/**
 * Guards guest RAM at [address, address + length): a page there that is gone reads zero instead
 * of raising SIGBUS, and `onLost` is called on the event loop with the offset of the first such
 * access. Throws {@link SystemCallError} (ENOSPC) when the table is full.
 */
export function guardRam(address: number, length: number, onLost: (offset: number) => void): RamGuard {
  const g = setUp();
  const slot = g.add([address, length]) as number;
  if (slot < 0) throw new SystemCallError('pv_ram_guard_add', -slot, `guarding guest RAM (${g.slotCount} mappings are guarded already)`);
  const guard = new Guard(g, slot, onLost);
  g.owners.set(slot, guard);
  return guard;
}
