// The client's reading of the daemon's answer to Hello (src/daemon/pool-protocol.ts): the pool
// protocol's version is said there, not in the frame header, and a daemon of another version is
// refused. The real daemon's answer is read in pool-daemon.test.ts.
import { decodeWelcome, POOL_PROTOCOL_VERSION, PoolProtocolError } from '../../src/daemon/pool-protocol';

const json = (v: unknown) => Buffer.from(JSON.stringify(v));

describe('decodeWelcome', () => {
  it("reads a daemon of this pool protocol version, the one the daemon's Welcome names", () => {
    expect(decodeWelcome(json({ version: POOL_PROTOCOL_VERSION, poolBytes: 65536, clientId: 3 }))).toEqual({ poolBytes: 65536, clientId: 3 });
  });

  it.each([
    ['another version', { version: POOL_PROTOCOL_VERSION + 1, poolBytes: 1, clientId: 1 }, /speaks pool protocol version 2; this pvisor speaks 1/],
    ['a version that is a string', { version: String(POOL_PROTOCOL_VERSION), poolBytes: 1, clientId: 1 }, /speaks pool protocol version "1"/],
    ['no version', { poolBytes: 1, clientId: 1 }, /speaks pool protocol version undefined/],
    ['no poolBytes', { version: POOL_PROTOCOL_VERSION, clientId: 1 }, /not numbers/],
    ['a clientId that is a string', { version: POOL_PROTOCOL_VERSION, poolBytes: 1, clientId: '1' }, /not numbers/],
  ])('refuses %s with a PoolProtocolError', (_, welcome, message) => {
    expect(() => decodeWelcome(json(welcome))).toThrow(PoolProtocolError);
    expect(() => decodeWelcome(json(welcome))).toThrow(message);
  });

  it('refuses what is not a JSON object of at most 4096 bytes', () => {
    expect(() => decodeWelcome(Buffer.from('{"version":1'))).toThrow(/not JSON/);
    expect(() => decodeWelcome(json([1]))).toThrow(/not an object/);
    expect(() => decodeWelcome(json({ version: 1, poolBytes: 1, clientId: 1, pad: 'p'.repeat(4096) }))).toThrow(/at most 4096/);
  });
});
