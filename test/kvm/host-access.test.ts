// A KVM device this user may not open is refused up front with a typed error. Needs /dev/kvm.
import { spawnSync } from 'node:child_process';
import { chmodSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const index = join(__dirname, '..', '..', 'src', 'index.js');
const script = `require(${JSON.stringify(index)}).Vm.start({ guest: 'probe' }).then(
  () => { console.log('started'); process.exit(0); },
  (e) => { console.log(e.constructor.name + ': ' + e.message); process.exit(3); })`;

describe('KVM device permissions', () => {
  it('a /dev/kvm the user may not open is a HostUnsupportedError naming the fix', () => {
    const dir = mkdtempSync(join(tmpdir(), 'pvisor-perm-'));
    try {
      let r;
      if (process.getuid?.() === 0) {
        // Root may open anything; an unprivileged user may not open the real device (mode 0600 or 0660 root:kvm).
        chmodSync(dir, 0o755);
        r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8', uid: 65534, gid: 65534, env: { ...process.env, PVISOR_KVM_DEVICE: '/dev/kvm' } });
      } else {
        const denied = join(dir, 'kvm');
        writeFileSync(denied, '');
        chmodSync(denied, 0);
        r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8', env: { ...process.env, PVISOR_KVM_DEVICE: denied } });
      }
      expect(r.stdout).toMatch(/^HostUnsupportedError: .*is not readable and writable by this user.*group that owns it/);
      expect(r.status).toBe(3);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
