/**
 * The Intel MultiProcessor table (MP spec 1.4): how a kernel built without ACPI finds its CPUs,
 * the I/O APIC and how ISA interrupts are wired to it. Without it Linux runs on one vCPU with the
 * legacy PIC. Written into the EBDA, which the e820 map marks reserved.
 */

/** Where the table goes: the start of the EBDA. */
export const MPTABLE_GPA = 0x9fc00;
/** Bytes reserved for it (floating pointer + configuration table). */
export const MPTABLE_MAX_BYTES = 0x400;
/** The local APIC and I/O APIC addresses KVM's in-kernel irqchip uses. */
const LAPIC_ADDR = 0xfee00000;
const IOAPIC_ADDR = 0xfec00000;
const APIC_VERSION = 0x14;
const IOAPIC_VERSION = 0x11;
/** ISA IRQs 0..23 go to the I/O APIC pins of the same number. */
const IRQS = 24;

const ENTRY_PROCESSOR = 0;
const ENTRY_BUS = 1;
const ENTRY_IOAPIC = 2;
const ENTRY_IO_INTERRUPT = 3;
const ENTRY_LOCAL_INTERRUPT = 4;
const INT_TYPE_INT = 0;
const INT_TYPE_NMI = 1;
const INT_TYPE_EXTINT = 3;

function checksum(b: Buffer): number {
  let sum = 0;
  for (const x of b) sum = (sum + x) & 0xff;
  return (0x100 - sum) & 0xff;
}

/** Builds the table for `vcpus` CPUs (APIC ids 0..vcpus-1) as it sits at {@link MPTABLE_GPA}. */
export function buildMpTable(vcpus: number): Buffer {
  const ioapicId = vcpus;
  const entries: Buffer[] = [];
  for (let i = 0; i < vcpus; i++) {
    const e = Buffer.alloc(20);
    e[0] = ENTRY_PROCESSOR;
    e[1] = i; // local APIC id
    e[2] = APIC_VERSION;
    e[3] = 1 | (i === 0 ? 2 : 0); // enabled, bootstrap processor
    e.writeUInt32LE(0x600, 4); // CPU signature: family 6
    e.writeUInt32LE(0x201, 8); // features: FPU, APIC
    entries.push(e);
  }
  const bus = Buffer.alloc(8);
  bus[0] = ENTRY_BUS;
  bus.write('ISA   ', 2, 'latin1');
  entries.push(bus);
  const ioapic = Buffer.alloc(8);
  ioapic[0] = ENTRY_IOAPIC;
  ioapic[1] = ioapicId;
  ioapic[2] = IOAPIC_VERSION;
  ioapic[3] = 1; // enabled
  ioapic.writeUInt32LE(IOAPIC_ADDR, 4);
  entries.push(ioapic);
  for (let irq = 0; irq < IRQS; irq++) {
    // Every ISA IRQ on the pin of its number, the timer's too: KVM's default routing sends GSI 0
    // (the in-kernel PIT) to I/O APIC pin 0. A PC's table says pin 2 (QEMU reroutes GSI 0 to
    // match); said here, Linux's boot-time check found no tick on pin 2 and fell back to the
    // 8259A, and on a loaded host that fallback failed too, with a panic ("IO-APIC + timer
    // doesn't work!"). ISA IRQ 2 is the PIC cascade and has no pin of its own.
    if (irq === 2) continue;
    const e = Buffer.alloc(8);
    e[0] = ENTRY_IO_INTERRUPT;
    e[1] = INT_TYPE_INT;
    e.writeUInt16LE(0, 2); // polarity and trigger conform to the bus (ISA: active high, edge)
    e[4] = 0; // source bus
    e[5] = irq;
    e[6] = ioapicId;
    e[7] = irq;
    entries.push(e);
  }
  for (const [type, lint, dest] of [[INT_TYPE_EXTINT, 0, 0], [INT_TYPE_NMI, 1, 0xff]] as const) {
    const e = Buffer.alloc(8);
    e[0] = ENTRY_LOCAL_INTERRUPT;
    e[1] = type;
    e[4] = 0;
    e[5] = 0;
    e[6] = dest;
    e[7] = lint;
    entries.push(e);
  }

  const body = Buffer.concat(entries);
  const config = Buffer.alloc(44 + body.length);
  config.write('PCMP', 0, 'latin1');
  config.writeUInt16LE(config.length, 4);
  config[6] = 4; // spec revision 1.4
  config.write('PVISOR  ', 8, 'latin1'); // OEM id
  config.write('KVM VM      ', 16, 'latin1'); // product id
  config.writeUInt16LE(entries.length, 34);
  config.writeUInt32LE(LAPIC_ADDR, 36);
  body.copy(config, 44);
  config[7] = checksum(config);

  const floating = Buffer.alloc(16);
  floating.write('_MP_', 0, 'latin1');
  floating.writeUInt32LE(MPTABLE_GPA + 16, 4); // the configuration table follows it
  floating[8] = 1; // length in 16-byte units
  floating[9] = 4; // spec revision 1.4
  floating[10] = checksum(floating);
  const table = Buffer.concat([floating, config]);
  if (table.length > MPTABLE_MAX_BYTES) throw new Error(`MP table for ${vcpus} vCPUs does not fit the EBDA`);
  return table;
}
