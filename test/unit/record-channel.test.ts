// RecordChannel over a real socketpair, written in pieces that split records anywhere: what every
// native helper's reports go through. No KVM needed.
import { closeSync, writeSync } from 'node:fs';
import { DataType, define, open } from 'ffi-rs';
import { RecordChannel, RECORD_BYTES, type NativeRecord } from '../../src/native/record-channel';

open({ library: 'libc-test', path: 'libc.so.6' });
const libc = define({ socketpair: { library: 'libc-test', retType: DataType.I32, paramsType: [DataType.I32, DataType.I32, DataType.I32, DataType.U8Array] } });
const AF_UNIX = 1;
const SOCK_STREAM = 1;

function socketpair(): [number, number] {
  const sv = Buffer.alloc(8);
  expect(libc.socketpair([AF_UNIX, SOCK_STREAM, 0, sv])).toBe(0);
  return [sv.readInt32LE(0), sv.readInt32LE(4)];
}

function encode(records: NativeRecord[]): Buffer {
  const out = Buffer.alloc(records.length * RECORD_BYTES);
  records.forEach((r, i) => {
    const at = i * RECORD_BYTES;
    out.writeUInt16LE(r.kind, at);
    out.writeUInt16LE(r.tag, at + 2);
    out.writeInt32LE(r.err, at + 4);
    out.writeBigUInt64LE(BigInt(r.value), at + 8);
  });
  return out;
}

const tick = () => new Promise((r) => setTimeout(r, 5));

describe('RecordChannel', () => {
  it('delivers every record in order, however the stream is cut', async () => {
    const records: NativeRecord[] = Array.from({ length: 40 }, (_, i) => ({
      kind: (i % 5) + 1,
      tag: i === 7 ? 65535 : i,
      err: i % 3 === 0 ? -2 : i,
      value: i === 9 ? 2 ** 52 + 3 : i * 0x1_0000_0001,
    }));
    const bytes = encode(records);
    const [helperFd, nodeFd] = socketpair();
    const got: NativeRecord[] = [];
    const channel = new RecordChannel(nodeFd, (r) => got.push(r));
    try {
      // Pieces of 1 to 37 bytes, each read on its own turn of the event loop.
      for (let at = 0, k = 0; at < bytes.length; k++) {
        const n = Math.min(bytes.length - at, [5, 11, 1, 16, 37, 15, 17, 32][k % 8]);
        writeSync(helperFd, bytes, at, n);
        at += n;
        await tick();
      }
      expect(got).toEqual(records);
    } finally {
      channel.destroy();
      channel.destroy(); // idempotent
      closeSync(helperFd);
    }
  });

  it('delivers nothing once destroyed, even from a chunk already read', async () => {
    const [helperFd, nodeFd] = socketpair();
    const got: NativeRecord[] = [];
    const channel = new RecordChannel(nodeFd, (r) => {
      got.push(r);
      channel.destroy();
    });
    try {
      writeSync(helperFd, encode([{ kind: 1, tag: 1, err: 0, value: 1 }, { kind: 1, tag: 2, err: 0, value: 2 }]));
      for (let i = 0; i < 100 && !got.length; i++) await tick();
      await tick();
      expect(got.map((r) => r.tag)).toEqual([1]);
    } finally {
      closeSync(helperFd);
    }
  });
});
