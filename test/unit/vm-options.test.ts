// Vm.start validates its options and the host before allocating anything: no KVM needed.
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { HostUnsupportedError, InvalidOptionError, Vm, type VmOptions } from '../../src';

describe('bad input is rejected before anything is allocated', () => {
  it.each([
    [{ memory: 0 }, /memory: must be a non-zero multiple of 4 KiB/],
    [{ memory: 4097 }, /memory: must be a non-zero multiple of 4 KiB/],
    [{ memory: 'plenty' }, /memory: cannot parse size/],
    [{ memory: '64TiB' }, /memory: .* more than this host has/],
    [{ vcpus: 0 }, /vcpus: must be a whole number from 1 to 8/],
    [{ vcpus: 9 }, /vcpus/],
    [{ vcpus: 1.5 }, /vcpus/],
    // A name ends up in file names: it must not reach outside their directory.
    [{ name: 'x/../../../var/tmp/y' }, /name: .* is not a VM id/],
    [{ name: '' }, /name: "" is not a VM id/],
    [{ name: '.hidden' }, /name/],
    // A timeout of 2^31 ms would fire at once; NaN never.
    [{ bootTimeoutMs: 2 ** 31 }, /bootTimeoutMs: expected a whole number of milliseconds/],
    [{ bootTimeoutMs: NaN }, /bootTimeoutMs/],
    // Labels, the sandbox's env and the lifetime are checked before the host is.
    [{ labels: { 'no spaces': 'x' } }, /labels\.no spaces: a label key/],
    [{ labels: ['a=b'] }, /labels: expected an object/],
    [{ env: { A: 'x' } }, /env: only the Linux guest runs commands/],
    [{ timeoutMs: 0 }, /timeoutMs: expected a whole number of milliseconds/],
    [{ onTimeout: 'pause' }, /onTimeout: expected "suspend", "hibernate" or "stop"/],
    [{ onTimeout: 'hibernate' }, /hibernateDir: onTimeout: 'hibernate' needs hibernateDir/],
    [{ hibernateDir: '/tmp/x' }, /hibernateDir: only goes with onTimeout: 'hibernate'/],
  ])('%j', async (opts, message) => {
    await expect(Vm.start({ guest: 'probe', ...(opts as VmOptions) })).rejects.toThrow(InvalidOptionError);
    await expect(Vm.start({ guest: 'probe', ...(opts as VmOptions) })).rejects.toThrow(message);
  });

  it("the Linux guest's env and lifetime are checked before the host too", async () => {
    await expect(Vm.start({ env: { 'A=B': 'x' } })).rejects.toThrow(/env: bad variable name "A=B"/);
    await expect(Vm.start({ env: { A: 'x'.repeat(70_000) } })).rejects.toThrow(/env: more than 65536 bytes/);
    await expect(Vm.start({ onTimeout: 'hibernate', hibernateDir: '/tmp/h', network: 'nat' })).rejects.toThrow(/onTimeout: 'hibernate' needs a VM that can hibernate: no network/);
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

describe('a bad rootfs is rejected before anything boots, naming the file', () => {
  let dir: string;
  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-rootfs-opt-'));
    writeFileSync(join(dir, 'empty.img'), '');
    writeFileSync(join(dir, 'odd.img'), Buffer.alloc(1000));
    writeFileSync(join(dir, 'good.img'), Buffer.alloc(4096));
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it.each([
    ['missing.img', /rootfs: cannot use .*missing\.img read-write: ENOENT/],
    ['empty.img', /rootfs: .*empty\.img is 0 bytes; a disk image must be a non-zero multiple of 512 bytes/],
    ['odd.img', /rootfs: .*odd\.img is 1000 bytes/],
    ['.', /rootfs: .* is not a regular file/],
  ])('%s', async (name, message) => {
    const start = Vm.start({ rootfs: { path: join(dir, name), readOnly: true } });
    await expect(start).rejects.toThrow(InvalidOptionError);
    await expect(Vm.start({ rootfs: join(dir, name) })).rejects.toThrow(message);
  });

  it('readOnly is true or false, not a truthy value', async () => {
    const start = Vm.start({ rootfs: { path: join(dir, 'good.img'), readOnly: 'yes' as never } });
    await expect(start).rejects.toThrow(new InvalidOptionError('rootfs.readOnly', 'expected true or false, got "yes"'));
  });

  it('the probe guest has no root filesystem', async () => {
    await expect(Vm.start({ guest: 'probe', rootfs: join(dir, 'good.img') })).rejects.toThrow(/rootfs: only the Linux guest has a root filesystem/);
  });
});
