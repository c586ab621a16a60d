#!/usr/bin/env bash
# Boots the shipped guest (linux-x64/vmlinuz + initramfs.cpio.gz) under plain QEMU TCG, without
# pvisor's VMM, and runs scripts/agent-smoke.js against the agent over the virtio console.
# The devices mirror what pvisor's VMM offers: virtio-mmio (QEMU's microvm adds them to the
# kernel command line as virtio_mmio.device=...), a balloon with free page reporting, the 8250
# at 0x3f8 for the kernel log; no ACPI, no PCI. Two boots:
#  1. console: the agent channel is a virtio console with ONE port (max_ports=1, no MULTIPORT),
#     i.e. /dev/hvc0 as under pvisor's VMM; runs every check except the bulk ones, because QEMU's
#     virtconsole DROPS guest output its chardev cannot take at once (hw/char/virtio-console.c:
#     "we should be queuing data to send later for the console devices too");
#  2. port: the channel is a multiport virtio-serial port (/dev/vport0p1, given to the agent by
#     pvisor.channel=), which QEMU throttles instead of dropping; runs every check.
# usage: qemu-smoke.sh [agent-smoke.js args, e.g. --only hello,uname]
# env: SMOKE_MODES ("console port"), SMOKE_RAM_MIB (512), SMOKE_SMP (2),
#      SMOKE_LOG (serial log file prefix, default in a temp dir)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
bin="$repo/native-prebuilds/linux-x64"
ram=${SMOKE_RAM_MIB:-512}
smp=${SMOKE_SMP:-2}
command -v qemu-system-x86_64 >/dev/null || apt-get install -y qemu-system-x86
work=$(mktemp -d)
qemu_pid=
cleanup() { [ -n "$qemu_pid" ] && kill "$qemu_pid" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

# the release uname -r must show: the version of the kernel that built linux-guest/config
release="$(sed -n 's/^# Linux\/x86[^ ]* \([^ ]*\) Kernel Configuration$/\1/p' "$here/config")$(sed -n 's/^CONFIG_LOCALVERSION="\(.*\)"$/\1/p' "$here/config")"


boot_and_check() { # MODE [agent-smoke args]
  local mode=$1 log=${SMOKE_LOG:-$work/serial}.$1.log sock="$work/agent.$1.sock" chan light=() rc=0
  shift
  if [ "$mode" = console ]; then
    chan=(-device virtio-serial-device,max_ports=1 -device virtconsole,chardev=agent,nr=0)
    light=(--light)
    append=
  else
    chan=(-device virtio-serial-device -device virtserialport,chardev=agent,nr=1,name=pvisor.agent)
    append=" pvisor.channel=/dev/vport0p1"
  fi
  echo "== $mode: $(basename "$bin")/vmlinuz $release, ${ram} MiB, $smp vCPUs"
  local t0
  t0=$(date +%s%3N)
  qemu-system-x86_64 -M microvm,acpi=off -accel tcg -cpu max -m "${ram}M" -smp "$smp" \
    -nographic -no-reboot -nodefaults -serial "file:$log" -monitor none \
    -kernel "$bin/vmlinuz" -initrd "$bin/initramfs.cpio.gz" \
    -append "console=ttyS0 panic=-1 reboot=t quiet$append" \
    -chardev "socket,id=agent,path=$sock,server=on,wait=off" "${chan[@]}" \
    -device virtio-balloon-device,free-page-reporting=on &
  qemu_pid=$!
  node "$repo/scripts/agent-smoke.js" --socket "$sock" --t0-ms "$t0" --kernel-release "$release" \
    --ram-mib "$ram" --smp "$smp" "${light[@]}" "$@" || rc=$?
  # the smoke client ends with SHUTDOWN: the guest reboots, which -no-reboot turns into QEMU's exit
  local i
  for i in $(seq 50); do kill -0 "$qemu_pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$qemu_pid" 2>/dev/null; then echo "FAIL QEMU still running 5 s after SHUTDOWN"; rc=1; kill "$qemu_pid"; fi
  wait "$qemu_pid" 2>/dev/null || true
  qemu_pid=
  if [ "$rc" != 0 ]; then echo "--- serial log ($mode) ---"; tail -40 "$log"; fi
  return $rc
}

status=0
for mode in ${SMOKE_MODES:-console port}; do boot_and_check "$mode" "$@" || status=1; done
exit $status
