// The logger option on real KVM with the probe guest: one VM's trace holds its agent requests,
// its strategies' operations with their durations, and its states and exit, each line naming it.
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { DEFAULT_BACKING_DIR } from '../../src/memory/backing-file';
import { Offload, Vm, type LogFields } from '../../src';

describe('Vm.start({ logger })', () => {
  it("traces the VM's requests, strategy operations, states and exit", async () => {
    const dir = mkdtempSync(join(DEFAULT_BACKING_DIR, 'pvisor-logger-test-'));
    const lines: { level: string; message: string; fields: LogFields }[] = [];
    const at = (level: string) => (message: string, fields: LogFields) => void lines.push({ level, message, fields });
    try {
      const vm = await Vm.start({ guest: 'probe', memory: '64MiB', name: 'traced', strategies: [new Offload({ dir })], logger: { debug: at('debug'), info: at('info'), warn: at('warn'), error: at('error') } });
      await vm.probe.fill({ sizeMiB: 4, content: 'random', seed: 1 });
      await vm.suspend();
      await vm.resume();
      await vm.stop();
      expect(lines.every((l) => l.fields.vm === 'traced')).toBe(true);
      const offload = lines.filter((l) => l.fields.strategy === 'offload');
      expect(offload.map((l) => l.fields.hook)).toEqual(expect.arrayContaining(['suspend', 'resume']));
      for (const l of offload) expect(typeof l.fields.ms).toBe('number');
      expect(lines.some((l) => l.level === 'debug' && typeof l.fields.op === 'number' && l.fields.ok === true)).toBe(true);
      expect(lines.filter((l) => l.level === 'info').map((l) => l.message)).toEqual(expect.arrayContaining(['state running', 'state suspended', 'exited (stopped)']));
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
