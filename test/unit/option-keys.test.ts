// Options objects with a key their interface does not have are refused, naming the key and the
// nearest real one, before anything is allocated (issue 26: `memroy: '1GiB'` started a VM with
// the default memory). No KVM: each is refused before the host is looked at.
import { InvalidOptionError, Vm } from '../../src';
import { checkOptionKeys, closestKey } from '../../src/option-keys';

async function refusal(p: Promise<unknown>): Promise<InvalidOptionError> {
  const e = await p.then(() => undefined, (err: unknown) => err);
  expect(e).toBeInstanceOf(InvalidOptionError);
  return e as InvalidOptionError;
}

describe('unknown option keys', () => {
  it('Vm.start refuses a typo, naming it and the option it resembles', async () => {
    const e = await refusal(Vm.start({ memroy: '1GiB' } as never));
    expect(e.option).toBe('memroy');
    expect(e.message).toMatch(/^memroy: not an option of Vm\.start; did you mean memory\? \(its options: memory, vcpus, /);
  });

  it('a key far from every option gets no suggestion, only the list', async () => {
    const e = await refusal(Vm.start({ guest: 'probe', colour: 'blue' } as never));
    expect(e.message).toMatch(/^colour: not an option of Vm\.start \(its options: /);
  });

  it("rootfs's and Vm.restore's keys are checked the same way", async () => {
    const rootfs = await refusal(Vm.start({ guest: 'linux', rootfs: { path: '/nonexistent.img', readonly: true } } as never));
    expect(rootfs.option).toBe('rootfs.readonly');
    expect(rootfs.message).toMatch(/did you mean rootfs\.readOnly\?/);
    const restore = await refusal(Vm.restore('/nonexistent-snapshot', { kep: true } as never));
    expect(restore.message).toMatch(/^kep: not an option of Vm\.restore; did you mean keep\?/);
  });

  it('known keys, undefined values and non-objects pass', () => {
    expect(() => checkOptionKeys('exec', { env: undefined, cwd: '/' }, ['env', 'cwd'])).not.toThrow();
    expect(() => checkOptionKeys('exec', undefined, ['env'])).not.toThrow();
    expect(() => checkOptionKeys('exec', { timeout: 5 }, ['timeoutMs', 'env'])).toThrow(/did you mean timeoutMs\?/);
  });

  it('closestKey: transpositions, case and a bound on distance', () => {
    expect(closestKey('memroy', ['memory', 'vcpus'])).toBe('memory');
    expect(closestKey('vcpu', ['memory', 'vcpus'])).toBe('vcpus');
    expect(closestKey('bootTimeout', ['bootTimeoutMs', 'name'])).toBe('bootTimeoutMs');
    expect(closestKey('READONLY', ['path', 'readOnly'])).toBe('readOnly');
    expect(closestKey('xyz', ['memory', 'vcpus'])).toBeUndefined();
  });
});
