// The page pool protocol's encoders and decoders and their bounds (the daemon itself, native, is
// tested as a process in pool-daemon.test.ts). No KVM needed.
import { decodeOffer, decodePut, decodeSettle, encodeOffer, encodePut, encodeSettle, MAX_PUT_PAGES, PoolProtocolError } from '../../src/daemon/pool-protocol';

const page = (fill: number) => Buffer.alloc(4096, fill);

describe('pool protocol bounds', () => {
  it('round-trips its payloads and refuses malformed or oversized ones', () => {
    const offer = [{ page: 3, key: { lo: 1, hi: 2 } }];
    expect(decodeOffer(encodeOffer(offer))).toEqual(offer);
    const put = decodePut(encodePut([{ page: 9, bytes: page(1) }]));
    expect(put.pages).toEqual([9]);
    expect(put.data.equals(page(1))).toBe(true);
    expect(decodeSettle(encodeSettle([1], [2, 3]))).toEqual({ keep: [1], drop: [2, 3] });
    expect(() => decodeOffer(Buffer.alloc(13))).toThrow(PoolProtocolError);
    expect(() => decodePut(encodePut(Array.from({ length: MAX_PUT_PAGES + 1 }, (_, i) => ({ page: i, bytes: page(0) }))))).toThrow(PoolProtocolError);
    expect(() => decodePut(Buffer.alloc(4))).toThrow(PoolProtocolError);
    const badSettle = Buffer.alloc(8);
    badSettle.writeUInt32LE(5, 0);
    expect(() => decodeSettle(badSettle)).toThrow(/keeping 5 of 1/);
  });
});
