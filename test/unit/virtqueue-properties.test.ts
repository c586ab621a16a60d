// The split virtqueue against a fuzzing driver: random ring sizes (not only powers of two), rings
// unaligned, across the 1 GiB seam between GuestMemory's views and at the edges of the MMIO hole,
// random available and used indices (from a saved state), chains that loop, alias, run out of the
// ring or out of guest RAM, available indices that lie. Real guest RAM, no KVM. Each take is
// checked against the split ring's rules (fuzz-guest-ram.ts modelChain), and guest RAM against a
// model of what the queue may write: its used ring, nothing else.
import { MMIO_HOLE_START, HIGH_RAM_START, type GuestMemory } from '../../src/backends/kvm/guest-memory';
import { SnapshotError } from '../../src/errors';
import { ChainError, parseQueueState, QueueError, SplitQueue, VIRTQ_DESC_F_WRITE, type DescriptorChain, type QueueConfig } from '../../src/backends/kvm/virtio/queue';
import { property, thrown, type Rng } from '../fuzz-seed';
import { bufferAt, FUZZ_RAM_END, FuzzDriver, GuestImage, inFuzzRam, mapFuzzRam, modelChain, modelUsed, placeRings, Placer, scramble, u16le, type Buf } from '../fuzz-guest-ram';

function randomSize(rng: Rng): number {
  return rng.weighted([[4, () => rng.between(1, 8)], [3, () => 2 ** rng.int(11)], [1, () => rng.between(1, 1024)]] as const)();
}

/** What one take from the queue gave: the error's class (and a chain error's head), or the chain. */
interface Outcome {
  error: string | undefined;
  head: number | undefined;
  chain: DescriptorChain | null;
}

/** The class of what was thrown (Node's own errors come from another realm than jest's: no instanceof). */
function errorName(e: unknown): string {
  return typeof e === 'object' && e !== null ? `${e.constructor.name}: ${(e as Error).message}`.replace(/^((?:Chain|Queue|QueueBroken)Error):.*$/, '$1') : typeof e;
}

function ringsInRam(c: QueueConfig): boolean {
  return inFuzzRam(c.descGpa, 16 * c.size) && inFuzzRam(c.availGpa, 6 + 2 * c.size) && inFuzzRam(c.usedGpa, 6 + 8 * c.size);
}

/** Random buffers of a chain: 1 to 6, or as many as the ring holds and more, anywhere in the pools or outside RAM. */
function randomBufs(rng: Rng, placer: Placer, size: number, long: boolean): Buf[] {
  const n = long ? size + rng.between(-1, 2) : rng.between(1, 6);
  const pools = placer.pools();
  return Array.from({ length: n }, () => ({ ...bufferAt(rng, rng.pick(pools), rng.size(8192)), flags: rng.chance(0.5) ? VIRTQ_DESC_F_WRITE : 0 }));
}

describe('split virtqueue under a fuzzing driver', () => {
  let mem: GuestMemory;
  beforeAll(() => {
    mem = mapFuzzRam();
  });
  afterAll(() => mem.unmap());

  property('takes exactly the chains the ring rules give, fails only with queue errors, and writes only its used ring', 150, (rng) => {
    scramble(mem, rng);
    const placer = new Placer(rng);
    const size = randomSize(rng);
    const config = placeRings(placer, rng, size, rng.chance(0.25));
    if (rng.chance(0.08)) {
      // A ring partly or wholly outside guest RAM.
      const key = rng.pick(['descGpa', 'availGpa', 'usedGpa'] as const);
      config[key] = rng.pick([MMIO_HOLE_START - 8, HIGH_RAM_START - 2, FUZZ_RAM_END - 4, 2 ** 40]);
    }
    const nextAvail0 = rng.chance(0.5) ? rng.int(0x10000) : 0xffff - rng.int(4);
    const nextUsed0 = rng.int(0x10000);
    const viaState = rng.chance(0.5);
    let q!: SplitQueue;
    const refused = thrown(() => {
      q = viaState
        ? SplitQueue.fromState(mem, parseQueueState({ version: 1, ...config, size: 2 ** Math.ceil(Math.log2(size)), nextAvail: nextAvail0, nextUsed: nextUsed0 }))
        : new SplitQueue(mem, config);
    });
    if (viaState) config.size = 2 ** Math.ceil(Math.log2(size)); // a saved state's size is a power of two
    if (refused !== undefined) {
      expect(refused).toBeInstanceOf(viaState ? SnapshotError : QueueError);
      return;
    }
    expect({ ringsInRam: ringsInRam(config), config }).toEqual({ ringsInRam: true, config });

    const image = new GuestImage(mem);
    const driver = new FuzzDriver(image, config, viaState ? nextAvail0 : 0);
    driver.setAvailIdx(driver.availIdx);
    let nextAvail = viaState ? nextAvail0 : 0;
    let nextUsed = viaState ? nextUsed0 : 0;
    let broken = false;

    for (let round = rng.between(1, 4); round > 0; round--) {
      if (rng.chance(0.2) && (config.size & (config.size - 1)) === 0) {
        // Saved and restored mid-stream, as a snapshot does: it goes on where it was.
        const state = JSON.parse(JSON.stringify(q.saveState()));
        expect(state).toEqual({ version: 1, ...config, nextAvail, nextUsed, ...(broken && { brokenBy: expect.any(String) }) });
        q = SplitQueue.fromState(mem, parseQueueState(state));
      }
      // A turn of the event loop (a notification): the budget is one ring's worth of descriptors.
      q.renewBudget();
      const useValid = rng.chance(0.5);
      let taken = 0;
      const errors: string[] = [];
      let expectedErrors = 0;

      /** The reference's next step: what the device's next pop must give. */
      const step = (): 'none' | 'broken' | 'budget' | ReturnType<typeof modelChain> => {
        if (broken) return 'none';
        const availIdx = image.u16(config.availGpa + 2);
        if (availIdx === nextAvail) return 'none';
        if (((availIdx - nextAvail) & 0xffff) > config.size) return 'broken';
        // The budget is one ring's worth of descriptors walked (a bad head counts as one).
        if (taken >= config.size) return 'budget';
        const chain = modelChain(image, config, nextAvail);
        taken += Math.max(1, chain.walked);
        nextAvail = (nextAvail + 1) & 0xffff;
        return chain;
      };
      const returned = (head: number, len: number) => {
        modelUsed(image, config, nextUsed, head, len);
        nextUsed = (nextUsed + 1) & 0xffff;
      };
      const push = (head: number, len: number) => {
        const e = thrown(() => q.push(head, len));
        if (e !== undefined) expect(e).toBeUndefined();
        returned(head, len);
      };

      // In batches: the driver posts while the device takes, as a vCPU does in parallel.
      for (let batch = rng.between(1, 3); batch > 0; batch--) {
        // A few chains, or as many as the ring has room for (now and then one more: a broken queue);
        // now and then one as long as the ring.
        const room = config.size - ((driver.availIdx - nextAvail) & 0xffff);
        const chains = rng.chance(0.25) ? Math.max(0, room + (rng.chance(0.8) ? 0 : rng.between(1, 2))) : rng.int(Math.min(room, 32) + 1);
        const long = rng.chance(0.1) ? rng.int(chains) : -1;
        for (let n = 0; n < chains; n++) driver.offer(rng, randomBufs(rng, placer, config.size, n === long), rng.chance(0.1));
        if (rng.chance(0.03)) driver.setAvailIdx(rng.int(0x10000)); // the driver lies
        const takes = rng.chance(0.5) ? Infinity : rng.int(config.size + 1);
        for (let t = 0; t < takes; t++) {
          let got: DescriptorChain | null = null;
          const e = thrown(() => (got = useValid ? q.popValid((m) => errors.push(m)) : q.pop()));
          const actual: Outcome = { error: e === undefined ? undefined : errorName(e), head: e instanceof ChainError ? e.head : undefined, chain: got };
          // What the reference says, for pop(); popValid() goes past malformed chains and reports them.
          let want = step();
          if (useValid) {
            while (typeof want !== 'string' && want.kind !== 'chain') {
              expectedErrors++;
              if (want.kind === 'bad-chain') returned(want.head, 0);
              want = step();
            }
          }
          if (want === 'broken') {
            broken = true;
            if (useValid) expectedErrors++;
          }
          const expected: Outcome = typeof want === 'string'
            ? { error: want === 'broken' && !useValid ? 'QueueBrokenError' : undefined, head: undefined, chain: null }
            : want.kind === 'chain'
              ? { error: undefined, head: undefined, chain: { head: want.head, descriptors: want.descriptors } }
              : { error: want.kind === 'bad-chain' ? 'ChainError' : 'QueueError', head: want.kind === 'bad-chain' ? want.head : undefined, chain: null };
          if (JSON.stringify(actual) !== JSON.stringify(expected)) expect(actual).toEqual(expected);
          if (expected.chain) push(expected.chain.head, rng.int(0x10000));
          else if (expected.error === 'ChainError') push(expected.head!, 0); // as popValid does
          else if (expected.error === undefined) break;
        }
      }
      expect(errors).toHaveLength(expectedErrors);
      expect(q.broken !== undefined).toBe(broken);

      // Notifications and interrupts: flags in the rings, read and written through the same checks.
      const wanted = rng.chance(0.5);
      expect(thrown(() => q.setNotifications(wanted))).toBeUndefined();
      image.write(config.usedGpa, u16le(wanted ? 0 : 1));
      const availFlags = rng.int(4);
      driver.setAvailFlags(availFlags);
      expect(q.interruptWanted).toBe((availFlags & 1) === 0);
      const availIdx = image.u16(config.availGpa + 2);
      expect(q.hasAvailable()).toBe(!broken && taken < config.size && availIdx !== nextAvail);
      expect(q.usedIndex).toBe(nextUsed);
      const diff = image.firstDifference();
      expect({ diff }).toEqual({ diff: undefined });
    }
  });
});
