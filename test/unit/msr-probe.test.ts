// Which MSRs a vCPU both returns and takes back, worked out in batches (vcpu-state.ts): the answer
// must be what asking one MSR at a time gives, whatever KVM refuses. A model vCPU stands in for KVM
// here (pure logic); test/kvm/machine-state.test.ts compares both ways on real KVM.
import { MAX_MSRS_PER_CALL, type MsrEntry } from '../../src/backends/kvm/ioctls';
import { msrsReadAndWrittenBack } from '../../src/backends/kvm/vcpu-state';
import { property } from '../fuzz-seed';

/** A vCPU that refuses to read some MSRs and to write back others, stopping at the first, as KVM does. */
function modelVcpu(unreadable: Set<number>, unwritable: Set<number>) {
  const calls = { get: 0, set: 0 };
  return {
    calls,
    getMsrs(indices: readonly number[]): MsrEntry[] {
      calls.get++;
      expect(indices.length).toBeLessThanOrEqual(MAX_MSRS_PER_CALL);
      const n = indices.findIndex((i) => unreadable.has(i));
      return indices.slice(0, n < 0 ? indices.length : n).map((index) => ({ index, value: BigInt(index) * 3n }));
    },
    setMsrs(entries: readonly MsrEntry[]): number {
      calls.set++;
      const n = entries.findIndex((e) => unwritable.has(e.index) || e.value !== BigInt(e.index) * 3n);
      return n < 0 ? entries.length : n;
    },
  };
}

describe('msrsReadAndWrittenBack', () => {
  property('keeps exactly the MSRs that read and write back one at a time, in order', 200, (rng, round) => {
    {
      const count = rng.int(1300);
      const candidates = Array.from({ length: count }, (_, i) => 0x1000 + i * 7);
      const unreadable = new Set(candidates.filter(() => rng.chance(0.05)));
      const unwritable = new Set(candidates.filter(() => rng.chance(0.05)));
      // Edges: the first and last candidates refused.
      if (count > 0 && round % 3 === 0) unreadable.add(candidates[0]);
      if (count > 0 && round % 5 === 0) unwritable.add(candidates[count - 1]);
      const vcpu = modelVcpu(unreadable, unwritable);
      const kept = msrsReadAndWrittenBack(vcpu, candidates);
      expect(kept).toEqual(candidates.filter((i) => !unreadable.has(i) && !unwritable.has(i)));
      // One call per batch plus one per refusal, not one per MSR.
      const batches = Math.ceil(count / MAX_MSRS_PER_CALL);
      expect(vcpu.calls.get).toBeLessThanOrEqual(batches + unreadable.size);
    }
  });

  it('an empty list asks nothing', () => {
    const vcpu = modelVcpu(new Set(), new Set());
    expect(msrsReadAndWrittenBack(vcpu, [])).toEqual([]);
    expect(vcpu.calls).toEqual({ get: 0, set: 0 });
  });
});
