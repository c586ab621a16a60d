// `pvisor run --console` over the real parts: the UART a guest prints through (bytes written to its
// transmit register, as the guest's 8250 driver does) and a real pipe whose reader stops (a `cat`
// held with SIGSTOP, as a pager or a stalled log shipper). What the host keeps must stay bounded
// however much the guest prints; once the reader goes on, it learns how much it missed.
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { openSync, closeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Serial8250 } from '../../src/backends/kvm/devices/serial';
import { CONSOLE_COPY_MAX_BUFFERED_BYTES, ConsoleCopy } from '../../src/cli/console-copy';

const MiB = 2 ** 20;
const turn = () => new Promise((r) => setImmediate(r));

describe('pvisor run --console: the copy of the guest console to a slow stderr', () => {
  it('a guest printing 32 MiB into a stopped pipe leaves at most 1 MiB and a line buffered; the reader then learns how many lines were dropped', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'pvisor-console-'));
    const outFd = openSync(join(dir, 'out'), 'w');
    const reader = spawn('cat', [], { stdio: ['pipe', outFd, 'inherit'] });
    closeSync(outFd);
    try {
      const pipe = reader.stdin!;
      reader.kill('SIGSTOP');
      const copy = new ConsoleCopy(pipe);
      const uart = new Serial8250((line) => copy.line(line));
      // 1 KiB lines, each numbered; written a byte at a time through the transmit register.
      const LINES = 32 * 1024;
      let maxBuffered = 0;
      for (let i = 0; i < LINES; i++) {
        const line = Buffer.from(`${String(i).padStart(8, '0')} ${'x'.repeat(1014)}\n`);
        for (const b of line) uart.write(0, b);
        maxBuffered = Math.max(maxBuffered, pipe.writableLength);
        if (i % 256 === 0) await turn(); // the event loop goes round as it does between vCPU exits
      }
      expect(maxBuffered).toBeGreaterThanOrEqual(CONSOLE_COPY_MAX_BUFFERED_BYTES);
      expect(maxBuffered).toBeLessThanOrEqual(CONSOLE_COPY_MAX_BUFFERED_BYTES + 4096 + 16);
      expect(copy.droppedLines).toBeGreaterThan(LINES / 2); // a pipe holds 64 KiB, the copy 1 MiB: most were dropped

      // The reader goes on: what was buffered arrives, then the notice, then new lines.
      reader.kill('SIGCONT');
      await new Promise((r) => pipe.once('drain', r));
      copy.line('after');
      copy.close();
      pipe.end();
      await new Promise((r) => reader.once('exit', r));
      const lines = readFileSync(join(dir, 'out'), 'utf8').split('\n').filter((l) => l);
      const notice = lines.filter((l) => l.includes('dropped'));
      expect(notice).toHaveLength(1);
      const [, dropped, bytes] = /pvisor: (\d+) console line\(s\), (\d+) bytes, dropped/.exec(notice[0])!;
      const copied = lines.filter((l) => /^\[console\] \d{8} x+$/.test(l));
      expect(Number(dropped)).toBe(copy.droppedLines);
      expect(Number(bytes)).toBe(copy.droppedLines * 1024);
      expect(copied.length + Number(dropped)).toBe(LINES);
      // Copied lines come in order, a run from the first, and the notice follows them.
      expect(copied.map((l) => Number(l.slice(10, 18)))).toEqual(copied.map((_, i) => i));
      expect(lines.indexOf(notice[0])).toBe(copied.length);
      expect(lines[lines.length - 1]).toBe('[console] after');
    } finally {
      reader.kill('SIGKILL');
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('a reader that keeps up gets every line and no notice', async () => {
    const chunks: string[] = [];
    const { Writable } = await import('node:stream');
    const out = new Writable({
      write(chunk: Buffer, _enc, done) {
        chunks.push(chunk.toString());
        setImmediate(done);
      },
    });
    const copy = new ConsoleCopy(out);
    for (let i = 0; i < 1000; i++) {
      copy.line(`line ${i}`);
      if (i % 10 === 0) await turn();
    }
    copy.close();
    await new Promise((r) => out.end(r));
    expect(copy.droppedLines).toBe(0);
    expect(chunks.join('')).toBe(Array.from({ length: 1000 }, (_, i) => `[console] line ${i}\n`).join(''));
    expect(chunks.join('').length).toBeLessThan(MiB);
  });
});
