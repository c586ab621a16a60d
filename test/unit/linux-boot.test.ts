import { InvalidOptionError } from '../../src/errors';
import { cpuidForVcpu, e820Map, parseBzImage } from '../../src/backends/kvm/linux-boot';
import { buildMpTable, MPTABLE_GPA } from '../../src/backends/kvm/mptable';
import { CmosRtc } from '../../src/backends/kvm/devices/cmos-rtc';

/** A bzImage-shaped buffer: setup header fields as boot.rst places them. */
function fakeBzImage(o: { protocol?: number; xloadflags?: number; loadflags?: number; setupSects?: number; size?: number } = {}): Buffer {
  const b = Buffer.alloc(o.size ?? 64 * 1024);
  b[0x1f1] = o.setupSects ?? 27;
  b[0x201] = 0x6a; // jump offset: header ends at 0x202 + 0x6a
  b.write('HdrS', 0x202, 'latin1');
  b.writeUInt16LE(o.protocol ?? 0x020f, 0x206);
  b[0x211] = o.loadflags ?? 0x01;
  b.writeUInt32LE(0x7fffffff, 0x22c);
  b.writeUInt16LE(o.xloadflags ?? 0x7f, 0x236);
  b.writeUInt32LE(2048, 0x238);
  b.writeUInt32LE(0x1000000, 0x260);
  return b;
}

describe('bzImage setup header', () => {
  it('finds the protected-mode kernel and the header to copy', () => {
    const info = parseBzImage(fakeBzImage());
    expect(info.protocol).toBe(0x020f);
    expect(info.kernelOffset).toBe(28 * 512);
    expect(info.setupHeader.length).toBe(0x202 + 0x6a - 0x1f1);
    expect(info.cmdlineMax).toBe(2048);
    expect(info.initSize).toBe(0x1000000);
    expect(parseBzImage(fakeBzImage({ setupSects: 0 })).kernelOffset).toBe(5 * 512); // 0 means 4
  });

  it.each([
    ['not a kernel', Buffer.alloc(8192), /no "HdrS"/],
    ['an old boot protocol', fakeBzImage({ protocol: 0x0206 }), /older than 2\.12/],
    ['no 64-bit entry', fakeBzImage({ xloadflags: 0 }), /no 64-bit entry/],
    ['a zImage', fakeBzImage({ loadflags: 0 }), /zImage/],
    ['a truncated file', fakeBzImage({ size: 4096, setupSects: 30 }), /truncated/],
  ])('rejects %s with a typed error', (_what, image, message) => {
    expect(() => parseBzImage(image)).toThrow(InvalidOptionError);
    expect(() => parseBzImage(image)).toThrow(message);
  });
});

describe('e820 map', () => {
  it('reserves the EBDA and puts RAM beyond the MMIO hole above 4 GiB', () => {
    expect(e820Map(512 * 2 ** 20)).toEqual([
      { addr: 0, size: MPTABLE_GPA, type: 1 },
      { addr: MPTABLE_GPA, size: 0x100000 - MPTABLE_GPA, type: 2 },
      { addr: 0x100000, size: 512 * 2 ** 20 - 0x100000, type: 1 },
    ]);
    const big = e820Map(4 * 2 ** 30);
    expect(big[2]).toEqual({ addr: 0x100000, size: 3 * 2 ** 30 - 0x100000, type: 1 });
    expect(big[3]).toEqual({ addr: 4 * 2 ** 30, size: 2 ** 30, type: 1 });
  });
});

describe('MP table', () => {
  const sum = (b: Buffer) => b.reduce((s, x) => (s + x) & 0xff, 0);
  it('has valid checksums and one processor entry per vCPU, the first the BSP', () => {
    const t = buildMpTable(2);
    expect(t.toString('latin1', 0, 4)).toBe('_MP_');
    expect(sum(t.subarray(0, 16))).toBe(0);
    expect(t.readUInt32LE(4)).toBe(MPTABLE_GPA + 16);
    const config = t.subarray(16);
    expect(config.toString('latin1', 0, 4)).toBe('PCMP');
    expect(config.readUInt16LE(4)).toBe(config.length);
    expect(sum(config)).toBe(0);
    expect([config[44], config[45], config[47]]).toEqual([0, 0, 3]); // processor, APIC id 0, enabled + BSP
    expect([config[64], config[65], config[67]]).toEqual([0, 1, 1]);
  });

  it('wires every ISA IRQ to the I/O APIC pin of its number, the timer to pin 0 where KVM sends GSI 0', () => {
    const config = buildMpTable(2).subarray(16);
    const pins = new Map<number, number>();
    // Entries after the 44-byte header: processors are 20 bytes, the rest 8.
    for (let at = 44; at < config.length; at += config[at] === 0 ? 20 : 8) {
      if (config[at] === 3) pins.set(config[at + 5], config[at + 7]); // I/O interrupt: source IRQ -> pin
    }
    expect(pins.get(0)).toBe(0);
    expect(pins.has(2)).toBe(false); // the PIC cascade
    for (const [irq, pin] of pins) expect(pin).toBe(irq);
    expect(pins.size).toBe(23);
  });
});

describe('per-vCPU CPUID', () => {
  it('puts the APIC id in leaf 1 EBX[31:24] and leaf 0xB EDX, leaving the rest (the hypervisor bit too)', () => {
    // struct kvm_cpuid_entry2: function, index, flags, eax, ebx, ecx, edx, padding[3] (40 bytes)
    const cpuid = Buffer.alloc(8 + 2 * 40);
    cpuid.writeUInt32LE(2, 0);
    cpuid.writeUInt32LE(1, 8);
    cpuid.writeUInt32LE(0x00020800, 8 + 16); // ebx
    cpuid.writeUInt32LE(0x00000201, 8 + 20); // ecx
    cpuid.writeUInt32LE(0xb, 48);
    cpuid.writeUInt32LE(0x12345678, 48 + 28); // padding: not a register
    const out = cpuidForVcpu(cpuid, 3);
    expect(out.readUInt32LE(8 + 16)).toBe(0x03020800);
    expect(out.readUInt32LE(8 + 20)).toBe(0x00000201);
    expect(out.readUInt32LE(48 + 24)).toBe(3);
    expect(out.readUInt32LE(48 + 28)).toBe(0x12345678);
    expect(cpuid.readUInt32LE(8 + 16)).toBe(0x00020800); // the shared copy is untouched
    expect(cpuid.readUInt32LE(8 + 20)).toBe(0x00000201);
  });
});

describe('CMOS RTC', () => {
  it("gives the host's UTC time in BCD, with no update in progress", () => {
    const rtc = new CmosRtc(() => new Date(Date.UTC(2026, 10, 29, 14, 7, 59)));
    const reg = (i: number) => {
      rtc.write(0, i | 0x80); // NMI-mask bit set, as Linux writes it
      return rtc.read(1);
    };
    expect([reg(0x00), reg(0x02), reg(0x04), reg(0x07), reg(0x08), reg(0x09), reg(0x32)]).toEqual([0x59, 0x07, 0x14, 0x29, 0x11, 0x26, 0x20]);
    expect(reg(0x0a) & 0x80).toBe(0); // update-in-progress clear
    expect(reg(0x0b) & 0x04).toBe(0); // BCD mode
  });
});
