#!/usr/bin/env bash
# Rebuilds native-prebuilds/linux-x64/initramfs.cpio.gz and its checksum: busybox (static) with
# its applets under /bin, the agent (native-prebuilds/agent) as /init, the memory study's
# pvisor-workset (workset.c) in /bin, a minimal /etc.
# Reproducible: fixed mtimes, owners and order (sorted newc cpio), gzip -n.
# Needs root (mknod of /dev/console, which the kernel opens for init's stdio before /init runs).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/../linux-x64"
busybox=/bin/busybox
[ -x "$busybox" ] && "$busybox" --list >/dev/null 2>&1 && ! ldd "$busybox" >/dev/null 2>&1 || apt-get install -y busybox-static
[ "$(id -u)" = 0 ] || { echo "build-initramfs.sh: needs root (mknod /dev/console)" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cd "$stage"
mkdir -p bin dev etc proc sys tmp run root usr var/tmp
chmod 1777 tmp var/tmp
chmod 0700 root
# merged /usr: every applet lives in /bin, the usual paths lead there
ln -s bin sbin
ln -s ../bin usr/bin
ln -s ../bin usr/sbin
install -m 0755 "$busybox" bin/busybox
for applet in $("$busybox" --list | LC_ALL=C sort); do
  [ "$applet" = busybox ] || ln -s busybox "bin/$applet"
done
"$here/../agent/build.sh" "$stage/init" >/dev/null
chmod 0755 init
ln -s ../init bin/pvisor-workset  # the memory study's working set, linked into the agent
mknod -m 0600 dev/console c 5 1
mknod -m 0666 dev/null c 1 3
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' > etc/passwd
printf 'root:x:0:\nnogroup:x:65534:\n' > etc/group
printf 'pvisor\n' > etc/hostname
chmod 0644 etc/*

find . -exec touch -h -d @0 {} +
find . -mindepth 1 -printf '%P\n' | LC_ALL=C sort | cpio -o -H newc --reproducible -R 0:0 --quiet | gzip -9 -n > "$out/initramfs.cpio.gz"
(cd "$out" && sha256sum initramfs.cpio.gz > initramfs.cpio.gz.sha256)
echo "built $out/initramfs.cpio.gz ($(stat -c %s "$out/initramfs.cpio.gz") bytes, $(find . -mindepth 1 | wc -l) entries)"
