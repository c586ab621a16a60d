import { writeSync } from 'node:fs';
import { VcpuRunner, RecordKind, type VcpuRecord } from '../../src/backends/kvm/vcpu-runner';
import { closeFd, createEventFd, EVENTFD_ONE as ONE } from '../../src/sys/libc';

// The runner's eventfd watcher (how ioeventfd notifications reach the event loop). Real native
// threads, a real eventfd and socket; no KVM needed.

describe('vCPU runner, watched eventfds', () => {
  it('reports a fired eventfd as a NOTIFY record with its tag', async () => {
    const records: VcpuRecord[] = [];
    const runner = new VcpuRunner((r) => records.push(r));
    const fd = createEventFd();
    try {
      runner.watch(fd, 513);
      writeSync(fd, ONE);
      for (let i = 0; i < 100 && !records.length; i++) await new Promise((r) => setTimeout(r, 10));
      expect(records[0]).toMatchObject({ index: 513, kind: RecordKind.Notify });
    } finally {
      runner.destroy();
      closeFd(fd);
    }
  });

  it('destroy returns even while records pile up unread', () => {
    const runner = new VcpuRunner(() => {});
    const fd = createEventFd();
    try {
      runner.watch(fd, 1);
      // The event loop is busy here, so nothing reads the socket: the watcher fills it and blocks.
      const end = Date.now() + 500;
      while (Date.now() < end) writeSync(fd, ONE);
    } finally {
      runner.destroy(); // would hang forever if the blocked watcher were joined as is
      closeFd(fd);
    }
  });
});
