// The Linux guest with a user's root filesystem image (virtio-blk, /dev/vda) on real KVM. Needs a
// /dev/kvm that runs guest kernel code (hardware virtualisation, or scripts/with-kvm.js), a static
// busybox at /bin/busybox (busybox-static) and e2fsprogs (mke2fs, e2fsck, debugfs) on the host.
import { execFileSync, spawnSync } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { chmodSync, copyFileSync, mkdirSync, mkdtempSync, readFileSync, rmSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GuestCrashError, InvalidOptionError, Vm } from '../../src';

const MiB = 2 ** 20;
const IMAGE_BYTES = 32 * MiB;
const main = join(__dirname, '..', '..', 'src', 'cli', 'main.js');
const sha = (b: Buffer) => createHash('sha256').update(b).digest('hex');

describe('Linux guest with a rootfs image', () => {
  let dir: string;
  let image: string;
  let marker: string;
  const timings: string[] = [];

  beforeAll(() => {
    dir = mkdtempSync(join(tmpdir(), 'pvisor-rootfs-'));
    // The image holds only a static busybox with its applets and a marker: nothing the
    // initramfs has, so a command that finds /marker ran in the image. Of the mount points it
    // has only /dev and /proc, which a read-only image needs; the agent makes the others when
    // the image is writable.
    const root = join(dir, 'root');
    for (const d of ['bin', 'dev', 'proc']) mkdirSync(join(root, d), { recursive: true });
    copyFileSync('/bin/busybox', join(root, 'bin', 'busybox'));
    chmodSync(join(root, 'bin', 'busybox'), 0o755);
    for (const applet of execFileSync('/bin/busybox', ['--list'], { encoding: 'utf8' }).split('\n')) {
      if (applet && applet !== 'busybox') symlinkSync('busybox', join(root, 'bin', applet));
    }
    marker = `rootfs marker ${randomBytes(8).toString('hex')}\n`;
    writeFileSync(join(root, 'marker'), marker);
    image = join(dir, 'rootfs.img');
    execFileSync('mke2fs', ['-q', '-t', 'ext4', '-d', root, image, '32M']);
  });
  afterAll(() => {
    if (timings.length) console.log(`rootfs boot timings:\n  ${timings.join('\n  ')}`);
    rmSync(dir, { recursive: true, force: true });
  });

  it('a missing image is an InvalidOptionError before anything boots', async () => {
    await expect(Vm.start({ memory: '256MiB', rootfs: join(dir, 'no-such.img') })).rejects.toThrow(InvalidOptionError);
  });

  // First, while the image is freshly made (a read-only disk cannot replay a journal).
  it('pvisor run --rootfs IMG --rootfs-readonly runs CMD in the image and never writes it', () => {
    const before = sha(readFileSync(image));
    const script = 'cat /marker; if touch /new-file 2>/dev/null; then echo writable; else echo read-only; fi';
    const r = spawnSync(process.execPath, [main, 'run', '--memory', '256MiB', '--vcpus', '1', '--rootfs', image, '--rootfs-readonly', '--', 'sh', '-c', script], { encoding: 'utf8', timeout: 200_000 });
    expect({ stdout: r.stdout, status: r.status, stderr: r.status ? r.stderr : '' }).toEqual({ stdout: `${marker}read-only\n`, status: 0, stderr: '' });
    expect(sha(readFileSync(image))).toBe(before);
    timings.push(`CLI, read-only rootfs: ${r.stderr.match(/ready in \d+ ms/)?.[0]}`);
  }, 220_000);

  it('commands run in the image, and what they write reaches the file', async () => {
    const warnings: string[] = [];
    const t0 = performance.now();
    const vm = await Vm.start({ memory: '256MiB', vcpus: 1, rootfs: image, bootTimeoutMs: 180_000 });
    timings.push(`Vm.start, read-write rootfs: ready in ${(performance.now() - t0).toFixed(0)} ms`);
    const data = randomBytes(300 * 1024);
    try {
      vm.on('warning', (m) => warnings.push(m));
      expect(await vm.exec('cat /marker')).toEqual({ exitCode: 0, signal: null, stdout: marker, stderr: '' });
      expect((await vm.exec(['sh', '-c', 'grep " / " /proc/mounts'])).stdout).toMatch(/^\/dev\/vda \/ ext4 rw/);
      // The mount points the image lacked were made, and the initramfs' mounts moved there.
      expect((await vm.exec(['sh', '-c', 'grep -c " /tmp \\| /run \\| /sys " /proc/mounts'])).stdout).toBe('3\n');
      await vm.files.write('/written.bin', data);
      expect((await vm.exec('sync')).exitCode).toBe(0);
    } finally {
      await vm.stop();
    }
    expect(warnings).toEqual([]);
    // The file is used in place: same size. Check a copy: e2fsck replays the journal (the VM
    // was stopped, not shut down) and must find the filesystem consistent, then debugfs reads.
    expect(statSync(image).size).toBe(IMAGE_BYTES);
    const copy = join(dir, 'check.img');
    copyFileSync(image, copy);
    const fsck = spawnSync('e2fsck', ['-fy', copy], { encoding: 'utf8' });
    // 0: clean; 1: fixed, which the journal replay counts as; anything else: a corrupt filesystem.
    expect({ ok: fsck.status === 0 || fsck.status === 1, output: fsck.stdout }).toEqual({ ok: true, output: fsck.stdout });
    const out = join(dir, 'written.out');
    execFileSync('debugfs', ['-R', `dump /written.bin ${out}`, copy], { stdio: 'pipe' });
    expect(sha(readFileSync(out))).toBe(sha(data));
  }, 300_000);

  // After the stopped VM above, the image's journal needs a replay: the mount does it, and the
  // CLI's clean shutdown must leave the image clean, with what CMD wrote (no sync of its own).
  it('pvisor run with a writable rootfs ends the guest cleanly: what CMD wrote is in a clean image', () => {
    const text = `written by CMD ${randomBytes(8).toString('hex')}`;
    const r = spawnSync(process.execPath, [main, 'run', '--memory', '256MiB', '--vcpus', '1', '--rootfs', image, '--', 'sh', '-c', `echo ${text} > /from-cli`], { encoding: 'utf8', timeout: 200_000 });
    expect({ status: r.status, stderr: r.status ? r.stderr : '' }).toEqual({ status: 0, stderr: '' });
    expect(execFileSync('dumpe2fs', ['-h', image], { encoding: 'utf8', stdio: 'pipe' })).not.toMatch(/needs_recovery/);
    const fsck = spawnSync('e2fsck', ['-fn', image], { encoding: 'utf8' });
    expect({ status: fsck.status, output: fsck.stdout }).toEqual({ status: 0, output: fsck.stdout });
    expect(execFileSync('debugfs', ['-R', 'cat /from-cli', image], { encoding: 'utf8', stdio: 'pipe' })).toBe(`${text}\n`);
  }, 220_000);

  it('an image the guest cannot mount ends the start with the agent\'s reason', async () => {
    const junk = join(dir, 'junk.img');
    writeFileSync(junk, Buffer.alloc(MiB, 0x5a));
    const start = Vm.start({ memory: '256MiB', vcpus: 1, rootfs: junk, bootTimeoutMs: 180_000 });
    await expect(start).rejects.toThrow(GuestCrashError);
    await expect(start).rejects.toThrow(/its console says the agent ended it: .*cannot mount the rootfs \/dev\/vda .*no ext2\/3\/4 filesystem/);
  }, 200_000);

  it('without --rootfs the same command runs in the initramfs, which has no marker', () => {
    const r = spawnSync(process.execPath, [main, 'run', '--memory', '256MiB', '--vcpus', '1', '--', 'cat', '/marker'], { encoding: 'utf8', timeout: 200_000 });
    expect(r.stderr).toMatch(/cat: can't open '\/marker': No such file or directory/);
    expect(r.status).toBe(1);
    timings.push(`CLI, no rootfs: ${r.stderr.match(/ready in \d+ ms/)?.[0]}`);
  }, 220_000);
});
