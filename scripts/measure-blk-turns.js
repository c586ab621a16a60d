#!/usr/bin/env node
// Measures how long virtio-blk holds the event loop (docs/reliability.md): the real device model
// over real guest RAM and a real image, no KVM; this script plays the guest's driver. Needs
// `npx tsc -p tsconfig.json` first.
//   node scripts/measure-blk-turns.js [imageMiB=512] [hostileRequestMiB=256] [hostileChains=128]
// - hostile: one notification of `hostileChains` available entries that all name one chain, a
//   read of `hostileRequestMiB` into one buffer of guest RAM (aliased: the same RAM each time);
// - sequential read and write of the whole image in 1280 KiB requests (Linux's default largest),
//   64 a notification, as a guest's driver keeps its queue busy: MB/s.
// Each prints the turns of the event loop (gaps between two setImmediate ticks, the device's own
// work included: longest, 99th percentile, median, count; on a shared machine the longest may be
// the scheduler's) and the longest synchronous part of a notification.
'use strict';
const { mkdtempSync, openSync, writeSync, closeSync, rmSync } = require('node:fs');
const { tmpdir } = require('node:os');
const { join } = require('node:path');
const { performance } = require('node:perf_hooks');
const { GuestMemory } = require('../dist/src/backends/kvm/guest-memory');
const { SplitQueue } = require('../dist/src/backends/kvm/virtio/queue');
const { VirtioBlk, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT } = require('../dist/src/backends/kvm/devices/virtio-blk');

const MIB = 2 ** 20;
const imageMiB = Number(process.argv[2] ?? 512);
const hostileMiB = Number(process.argv[3] ?? 256);
const hostileChains = Number(process.argv[4] ?? 128);
const SEQ_REQUEST = 1280 * 1024;
const SEQ_BATCH = 64;
const SIZE = 256;
const DESC = 0x1000, AVAIL = 0x2000, USED = 0x4000, HDRS = 0x10000, STATUS = 0x20000, DATA = 0x100000;

const dir = mkdtempSync(join(tmpdir(), 'pvisor-blk-turns-'));
const image = join(dir, 'disk.img');
{
  // Real bytes in the page cache, not a sparse file: reads copy what a disk would hold.
  const fd = openSync(image, 'w');
  const chunk = Buffer.alloc(MIB);
  for (let i = 0; i < imageMiB; i++) {
    chunk.fill(i & 0xff);
    writeSync(fd, chunk);
  }
  closeSync(fd);
}
const ramBytes = DATA + Math.max(hostileMiB * MIB + 4096, SEQ_BATCH * SEQ_REQUEST);
const mem = GuestMemory.map(ramBytes);
// Guest RAM touched once before anything is timed: a first touch of a page costs a fault (on
// these machines, themselves guests, tens of microseconds), which would be counted to the device.
const ones = Buffer.alloc(MIB, 1);
for (let at = 0; at < ramBytes; at += MIB) mem.write(at, ones.subarray(0, Math.min(MIB, ramBytes - at)));
const q = new SplitQueue(mem, { size: SIZE, descGpa: DESC, availGpa: AVAIL, usedGpa: USED });
const errors = [];
const blk = new VirtioBlk(mem, { path: image, readOnly: false }, () => {}, (m) => errors.push(m));
blk.activate([q]);
// What the transport does when a budget stopped the device: it goes on as if notified.
q.onBudgetRenewed = () => {
  q.renewBudget();
  blk.notify(0);
};
let availIdx = 0;
let syncMs = 0;

function descriptor(i, gpa, len, flags, next) {
  const d = DESC + 16 * i;
  mem.writeU64(d, gpa);
  mem.writeU32(d + 8, len);
  mem.writeU16(d + 12, flags);
  mem.writeU16(d + 14, next);
}
function header(i, type, sector) {
  const h = Buffer.alloc(16);
  h.writeUInt32LE(type, 0);
  h.writeBigUInt64LE(BigInt(sector), 8);
  mem.write(HDRS + 16 * i, h);
  return HDRS + 16 * i;
}
function offer(head) {
  mem.writeU16(AVAIL + 4 + 2 * (availIdx % SIZE), head);
  availIdx = (availIdx + 1) & 0xffff;
  mem.writeU16(AVAIL + 2, availIdx);
}
function notify() {
  const t0 = performance.now();
  q.renewBudget();
  blk.notify(0);
  syncMs = Math.max(syncMs, performance.now() - t0);
}

/** Runs `drive` (which notifies) and waits until every chain is used; the longest turn meanwhile. */
function measured(drive) {
  return new Promise((resolve) => {
    const turns = [];
    let last = performance.now();
    const t0 = last;
    const cpu0 = process.cpuUsage();
    syncMs = 0;
    const tick = () => {
      const now = performance.now();
      turns.push(now - last);
      last = now;
      if (mem.readU16(USED + 2) === availIdx && !drive.more()) {
        turns.sort((a, b) => a - b);
        const at = (f) => turns[Math.min(turns.length - 1, Math.floor(f * turns.length))];
        const cpu = process.cpuUsage(cpu0);
        resolve({ longestTurnMs: turns[turns.length - 1], p99TurnMs: at(0.99), medianTurnMs: at(0.5), turns: turns.length, syncMs, totalMs: now - t0, cpuMs: (cpu.user + cpu.system) / 1000 });
      }
      else {
        if (mem.readU16(USED + 2) === availIdx) drive.next();
        setImmediate(tick);
      }
    };
    drive.next();
    setImmediate(tick);
  });
}

async function hostile() {
  // header, then one writable buffer of the data and the status byte (buffer boundaries mean nothing).
  descriptor(0, header(0, VIRTIO_BLK_T_IN, 0), 16, 1, 1);
  descriptor(1, DATA, hostileMiB * MIB + 1, 2, 0);
  let sent = false;
  const r = await measured({ more: () => !sent, next: () => { for (let i = 0; i < hostileChains; i++) offer(0); sent = true; notify(); } });
  const status = mem.read(DATA + hostileMiB * MIB, 1)[0];
  return { ...r, status };
}

async function sequential(type) {
  const requests = Math.floor(imageMiB * MIB / SEQ_REQUEST);
  let done = 0;
  for (let i = 0; i < SEQ_BATCH; i++) {
    descriptor(3 * i, HDRS + 16 * i, 16, 1, 3 * i + 1);
    descriptor(3 * i + 1, DATA + i * SEQ_REQUEST, SEQ_REQUEST, 1 | (type === VIRTIO_BLK_T_IN ? 2 : 0), 3 * i + 2);
    descriptor(3 * i + 2, STATUS + i, 1, 2, 0);
  }
  const r = await measured({
    more: () => done < requests,
    next: () => {
      for (let i = 0; i < SEQ_BATCH && done < requests; i++, done++) {
        header(i, type, (done * SEQ_REQUEST) / 512);
        offer(3 * i);
      }
      notify();
    },
  });
  const failed = mem.read(STATUS, SEQ_BATCH).some((s) => s !== 0);
  return { ...r, mbPerS: (requests * SEQ_REQUEST) / MIB / (r.totalMs / 1000), failed };
}

(async () => {
  const fmt = (o) => Object.entries(o).map(([k, v]) => `${k} ${typeof v === 'number' ? v.toFixed(1) : v}`).join(', ');
  console.log(`image ${imageMiB} MiB; hostile: ${hostileChains} aliased reads of ${hostileMiB} MiB in one notification`);
  if (hostileChains > 0) console.log(`hostile:          ${fmt(await hostile())}`);
  console.log(`sequential read:  ${fmt(await sequential(VIRTIO_BLK_T_IN))}`);
  console.log(`sequential write: ${fmt(await sequential(VIRTIO_BLK_T_OUT))}`);
  console.log(`device errors: ${errors.length}${errors.length ? ` (first: ${errors[0]})` : ''}`);
  blk.close();
  mem.unmap();
  rmSync(dir, { recursive: true, force: true });
})();
