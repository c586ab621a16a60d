import { IoBus } from '../../src/backends/kvm/io-bus';

describe('I/O bus decoding', () => {
  const dev = { read: () => 0, write: () => undefined };

  it('a port belongs to its device whatever the access width', () => {
    const pio = new IoBus('pio');
    pio.add(0x600, 3, dev);
    expect(pio.find(0x602, 4)).toEqual({ device: dev, offset: 2 });
    expect(pio.find(0x603, 1)).toBeUndefined();
  });

  it('an MMIO access must fit inside the window', () => {
    const mmio = new IoBus('mmio');
    mmio.add(0xd0000000, 0x200, dev);
    expect(mmio.find(0xd00001fc, 4)?.offset).toBe(0x1fc);
    expect(mmio.find(0xd00001fe, 4)).toBeUndefined();
  });

  it('refuses overlapping claims', () => {
    const pio = new IoBus('pio');
    pio.add(0x3f8, 8, dev);
    expect(() => pio.add(0x3ff, 2, dev)).toThrow(/overlaps/);
  });
});
