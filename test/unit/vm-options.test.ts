// Vm.start validates its options and the host before allocating anything: no KVM needed.
import { HostUnsupportedError, InvalidOptionError, Vm } from '../../src';

describe('bad input is rejected before anything is allocated', () => {
  it.each([
    [{ memory: 0 }, /memory: must be a non-zero multiple of 4 KiB/],
    [{ memory: 4097 }, /memory: must be a non-zero multiple of 4 KiB/],
    [{ memory: 'plenty' }, /memory: cannot parse size/],
    [{ memory: '64TiB' }, /memory: .* more than this host has/],
    [{ vcpus: 0 }, /vcpus: must be a whole number from 1 to 8/],
    [{ vcpus: 9 }, /vcpus/],
    [{ vcpus: 1.5 }, /vcpus/],
  ])('%j', async (opts, message) => {
    await expect(Vm.start({ guest: 'probe', ...opts })).rejects.toThrow(InvalidOptionError);
    await expect(Vm.start({ guest: 'probe', ...opts })).rejects.toThrow(message);
  });

  it('a missing KVM device is a HostUnsupportedError that says what to do', async () => {
    process.env.PVISOR_KVM_DEVICE = '/dev/no-such-kvm';
    try {
      await expect(Vm.start({ guest: 'probe' })).rejects.toThrow(HostUnsupportedError);
      await expect(Vm.start({ guest: 'probe' })).rejects.toThrow(/does not exist.*nested-kvm/s);
    } finally {
      delete process.env.PVISOR_KVM_DEVICE;
    }
  });
});
