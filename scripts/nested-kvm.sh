#!/usr/bin/env bash
# Run a command on a Linux that has a hardware-style /dev/kvm, even on a host without one.
#
#   scripts/nested-kvm.sh [--timeout SECONDS] [--memory 4G] -- CMD [ARGS...]
#
# The development machines have no usable /dev/kvm (they are themselves PVM guests), so this boots
# a nested "L1" VM: QEMU with TCG (software emulation) emulates AMD SVM with nested paging, the L1
# runs Debian's own linux-image-amd64 kernel, loads kvm + kvm-amd, and gets a real /dev/kvm. CMD
# runs in a chroot whose /usr and /etc are the host's (shared read-only over 9p) and whose copy of
# the repository (shared read-write over 9p) sits at the same absolute path as on the host, so node,
# node_modules and absolute paths just work. See /work/shared/design/host-facts.md, section
# "A hardware-style KVM for tests: nested under QEMU TCG", for the measurements behind the choices.
#
# Output: CMD's stdout and stderr (merged, stdin is /dev/null, stdout is a pipe, not a tty) go to
# this script's stdout. This script's own messages go to stderr, prefixed "nested-kvm:".
# Exit status: CMD's; 124 when the timeout or the silence watchdog fired; 125 when the L1 failed
# (no /dev/kvm, QEMU died, ...). Nothing is retried: the caller decides. The timeout (default
# 1800 s) counts from QEMU's launch; the one-time cache build (a 70 MB download) is not included.
# A line of output appears once its newline arrives (or the command ends).
#
# Environment:
#   PVISOR_NESTED_CACHE      cache dir (default REPO/.cache/nested-kvm), one subdir per kernel version
#   PVISOR_NESTED_SILENCE_S  silence watchdog in seconds (default 120)
#   PVISOR_NESTED_TIMEOUT_S  the timeout when --timeout is not given (default 1800)
#   CI, PVISOR_*, JEST_*, NODE_OPTIONS, FORCE_COLOR are passed through to CMD when set.
# Needs qemu-system-x86, busybox-static, cpio, kmod, e2fsprogs (installed with apt-get when running
# as root).
set -euo pipefail

usage() {
  sed -n '2,4p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  echo "See the comments at the top of ${BASH_SOURCE[0]} for details." >&2
  exit 2
}
die() { echo "nested-kvm: error: $*" >&2; exit 125; }
note() { echo "nested-kvm: $*" >&2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
CACHE=${PVISOR_NESTED_CACHE:-$REPO/.cache/nested-kvm}
SILENCE_S=${PVISOR_NESTED_SILENCE_S:-120}
TIMEOUT_S=${PVISOR_NESTED_TIMEOUT_S:-1800}
MEMORY=4G

while (($#)); do
  case $1 in
    --timeout) [[ $# -ge 2 ]] || usage; TIMEOUT_S=$2; shift 2 ;;
    --timeout=*) TIMEOUT_S=${1#*=}; shift ;;
    --memory) [[ $# -ge 2 ]] || usage; MEMORY=$2; shift 2 ;;
    --memory=*) MEMORY=${1#*=}; shift ;;
    -h|--help) usage ;;
    --) shift; break ;;
    *) echo "nested-kvm: unexpected argument: $1" >&2; usage ;;
  esac
done
(($#)) || usage
[[ $TIMEOUT_S =~ ^[1-9][0-9]*$ ]] || die "--timeout wants a positive number of seconds, got '$TIMEOUT_S'"
[[ $SILENCE_S =~ ^[1-9][0-9]*$ ]] || die "PVISOR_NESTED_SILENCE_S wants a positive number, got '$SILENCE_S'"
[[ $MEMORY =~ ^[1-9][0-9]*[MGT]?$ ]] || die "--memory wants a size like 4G or 2048M, got '$MEMORY'"

# ---------------------------------------------------------------------------------------------
# Cleanup: QEMU must not outlive this script (Ctrl-C, kill, errors).
# ---------------------------------------------------------------------------------------------

QEMU_PID="" FILTER_PID="" RUN="" BUILD_TMP="" VAR_TMP_IMG=""
stop_qemu() {
  [[ -n $QEMU_PID ]] || return 0
  if kill -0 "$QEMU_PID" 2>/dev/null; then
    kill -TERM "$QEMU_PID" 2>/dev/null || true
    local _
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      kill -0 "$QEMU_PID" 2>/dev/null || break
      sleep 0.2
    done
    kill -KILL "$QEMU_PID" 2>/dev/null || true
  fi
  wait "$QEMU_PID" 2>/dev/null || true
  QEMU_PID=""
}
# shellcheck disable=SC2317 # called from the EXIT trap
cleanup() {
  stop_qemu
  # The console filter ends by itself once QEMU is gone (end of its input).
  [[ -z $FILTER_PID ]] || wait "$FILTER_PID" 2>/dev/null || true
  [[ -z $RUN ]] || rm -rf "$RUN"
  [[ -z $VAR_TMP_IMG ]] || rm -f "$VAR_TMP_IMG"
  [[ -z $BUILD_TMP ]] || rm -rf "$BUILD_TMP"
}
trap cleanup EXIT
trap 'note "interrupted; stopping QEMU"; exit 130' INT
trap 'note "terminated; stopping QEMU"; exit 143' TERM

# ---------------------------------------------------------------------------------------------
# Host tools
# ---------------------------------------------------------------------------------------------

BUSYBOX=""
find_static_busybox() {
  # The initramfs has no libc, so busybox must be the static build (package busybox-static);
  # ldd fails on a static binary.
  local b
  for b in /bin/busybox /usr/bin/busybox "$(command -v busybox 2>/dev/null || true)"; do
    if [[ -n $b && -x $b ]] && ! ldd "$b" >/dev/null 2>&1; then BUSYBOX=$b; return 0; fi
  done
  return 1
}

missing_tools() {
  local t missing=()
  for t in qemu-system-x86_64 cpio depmod modprobe mkfs.ext4; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
  done
  find_static_busybox || missing+=("static busybox")
  echo "${missing[*]}"
}

ensure_tools() {
  local missing
  missing=$(missing_tools)
  if [[ -z $missing ]]; then
    find_static_busybox  # missing_tools ran in a subshell: set BUSYBOX here
    return 0
  fi
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    note "installing missing host tools ($missing)"
    local pkgs=(qemu-system-x86 busybox-static cpio kmod e2fsprogs)
    # A fresh machine often has no package lists yet: update only when the install fails.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" >&2 ||
      { apt-get update -q >&2 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" >&2; } ||
      die "apt-get could not install ${pkgs[*]}"
    missing=$(missing_tools)
    [[ -z $missing ]] || die "still missing after apt-get: $missing"
    find_static_busybox
  else
    die "missing host tools: $missing. Install them with:" \
        "apt-get install --no-install-recommends qemu-system-x86 busybox-static cpio kmod"
  fi
}

# ---------------------------------------------------------------------------------------------
# Cache: Debian kernel + initramfs, one directory per kernel version
# ---------------------------------------------------------------------------------------------

# The kernel package that linux-image-amd64 currently points at, e.g. 6.1.0-57-amd64.
# apt-cache takes about 1 s here, so the answer is remembered until the package lists change
# (apt-get update replaces files in /var/lib/apt/lists, which updates the directory's mtime).
apt_kernel_version() {
  local memo=$CACHE/apt-kernel-version v
  if [[ -s $memo && $memo -nt /var/lib/apt/lists ]]; then cat "$memo"; return; fi
  v=$(apt-cache depends linux-image-amd64 2>/dev/null |
    sed -n 's/^ *Depends: linux-image-\([0-9][^ ]*\)$/\1/p' | head -n 1)
  if [[ -n $v ]]; then echo "$v" >"$memo"; fi
  echo "$v"
}

# Modules the L1 needs, in insmod order (dependencies first). Measured deps: irqbypass, kvm, ccp,
# kvm-amd; virtio_ring, virtio, virtio_pci_{modern,legacy}_dev, virtio_pci; 9pnet, 9pnet_virtio;
# netfs, fscache, 9p.
# virtio_blk and ext4: the L1's /var/tmp is an ext4 disk; loop: tests mount small filesystems.
# Guest networking (test/kvm/linux-network.test.ts): tun and vhost_net for the VM's TAP, nf_tables
# with NAT, masquerade and conntrack for its rules, veth for the test's server behind another netns.
L1_MODULES=(kvm-amd virtio_pci 9pnet_virtio 9p virtio_blk ext4 loop tun vhost_net nf_tables nft_chain_nat nft_masq nft_ct veth)

# Write the uncompressed ELF vmlinux inside a bzImage to $2, if QEMU can boot it directly (it can
# when the ELF has a PVH note; Debian 6.1 has one). Booting it skips the in-guest decompression,
# which is slow under TCG: L1 reaches init in 4.5-5.9 s instead of 8.7-11.4 s.
extract_vmlinux() {
  local img=$1 out=$2 magic tool pos
  local xz=(xz -dc)
  command -v xz >/dev/null 2>&1 || xz=("$BUSYBOX" xz -dc)
  # Same idea as the kernel's scripts/extract-vmlinux: try every offset where a compressed
  # stream's magic appears until one decompresses to an ELF file.
  for magic in '\xfd7zXZ\x00:xz' '\x1f\x8b\x08:gzip' '\x28\xb5\x2f\xfd:zstd'; do
    tool=${magic##*:}
    case $tool in
      xz) ;;
      gzip) command -v gzip >/dev/null 2>&1 || continue ;;
      zstd) command -v zstd >/dev/null 2>&1 || continue ;;
    esac
    # shellcheck disable=SC2013 # one offset (a number) per line
    for pos in $(LC_ALL=C grep -obUaP "${magic%:*}" "$img" 2>/dev/null | cut -d: -f1); do
      case $tool in
        xz) tail -c "+$((pos + 1))" "$img" | "${xz[@]}" >"$out" 2>/dev/null || true ;;
        gzip) tail -c "+$((pos + 1))" "$img" | gzip -dc >"$out" 2>/dev/null || true ;;
        zstd) tail -c "+$((pos + 1))" "$img" | zstd -dcq >"$out" 2>/dev/null || true ;;
      esac
      if [[ $(head -c 4 "$out" 2>/dev/null | od -An -tx1 | tr -d ' \n') == 7f454c46 ]]; then
        # QEMU loads an ELF -kernel only through its PVH note; ask it (with the CPU stopped).
        if echo quit | qemu-system-x86_64 -nodefaults -no-user-config -M pc -accel tcg -m 256M \
             -display none -S -monitor stdio -kernel "$out" >/dev/null 2>&1; then
          return 0
        fi
      fi
    done
  done
  rm -f "$out"
  return 1
}

# The TSC rate in MHz (e.g. 2994.372) a kernel measured, from its log; empty if the log has none
# or cannot be read. Both sides use it: the host (bash) and the L1's init (busybox sh), which gets
# this very text from write_init.
tsc_mhz() {
  { dmesg 2>/dev/null || true; } | sed -n 's/.*tsc: \(Detected\|Refined TSC clocksource calibration:\) \([0-9.]*\) MHz.*/\2/p' | tail -n 1
}

# PID 1 of the L1 (busybox sh). Per-run settings come from the "run" 9p share; the per-run marker
# token comes from the kernel command line (the kernel hands unknown name=value words to init as
# environment variables). Every line the host must parse is "@@nested-kvm:TOKEN:WHAT@@".
write_init() {
  {
  echo '#!/bin/busybox sh'
  declare -f tsc_mhz
  cat <<'INIT'
/bin/busybox --install -s /bin
export PATH=/bin
mkdir -p /proc /sys /dev
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys

M="@@nested-kvm:${nkvm_token:-none}"
# No \n -> \r\n on the serial console: the host gets CMD's bytes as they are. busybox stty applies
# settings with tcsetattr(TCSADRAIN), which waits until the UART has sent everything queued:
# "drain" before reboot so that the end of the output is not lost.
drain() { stty -onlcr 2>/dev/null || true; }
drain
finish() {
  sync
  drain
  printf '%s:%s@@\n' "$M" "$1"
  drain
  reboot -f
  sleep 30
}
fail() {
  echo "nested-kvm (L1): $*"
  dmesg | tail -n 25
  finish "error:$*"
}

grep -qw svm /proc/cpuinfo || fail "no /dev/kvm: the L1 CPU has no svm flag (QEMU's -cpu max should give it)"
while read -r m; do
  insmod "/lib/modules/$m" || fail "insmod $m failed"
done </modules.list
[ -c /dev/kvm ] || fail "no /dev/kvm after loading kvm-amd"
# The TSC rate the L1 timed itself by: the host compares the L1's clock with its own at the end.
tsc=$(tsc_mhz)
printf '%s:ready:%s %s@@\n' "$M" "$(cut -d' ' -f1 /proc/uptime)" "${tsc:-?}"

P9=trans=virtio,version=9p2000.L,msize=512000
mkdir -p /share
mount -t 9p -o "$P9,cache=loose,ro" run /share || fail "cannot mount the run share"
. /share/l1.conf

# The chroot: a tmpfs with the host's usr-merge symlinks, /usr and /etc from the host (read-only,
# cache=loose: nobody changes them during a run), and the repository at its host path. cache=loose
# on the read-write repo share is fine because 9p in 6.1 writes through to the host; it only means
# that changes made on the host during the run may not be seen in the L1.
R=/newroot
mkdir -p $R
mount -t tmpfs -o mode=0755 newroot $R
mkdir -p $R/usr $R/etc $R/proc $R/sys $R/dev $R/tmp $R/root $R/run $R/var/tmp $R/home $R/mnt
chmod 1777 $R/var/tmp
for l in $NK_LINKS; do ln -s "${l#*=}" "$R/${l%%=*}"; done
mount -t 9p -o "$P9,cache=loose,ro" usr $R/usr || fail "cannot mount /usr"
mount -t 9p -o "$P9,cache=loose,ro" etc $R/etc || fail "cannot mount /etc"
# What udev would add to /dev (bash process substitution needs /dev/fd), then share it.
ln -s /proc/self/fd /dev/fd
ln -s /proc/self/fd/0 /dev/stdin
ln -s /proc/self/fd/1 /dev/stdout
ln -s /proc/self/fd/2 /dev/stderr
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777 shm /dev/shm
mount -o bind /dev $R/dev
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
# cgroup v2, unified, at /sys/fs/cgroup as on a current Debian or Ubuntu host: a jailed VM
# (pvisor run --isolation process) gets a cgroup with memory.max, pids.max and cpu.max, and group
# memory (pvisor bench memory) reads memory.current. (The development hosts mount the memory
# controller in cgroup v1, which a v2 hierarchy could then not have; the L1 has its own kernel.)
if mount -t cgroup2 -o nsdelegate cgroup2 $R/sys/fs/cgroup; then :; else
  echo "nested-kvm (L1): cannot mount cgroup v2; jailed VMs and group memory will not work"
fi
mount -t tmpfs -o mode=1777 tmp $R/tmp
mount -t tmpfs -o mode=0700 root $R/root
mount -t tmpfs -o mode=0755 run $R/run
mkdir -p $R/run/nested-kvm
mount -o bind /share $R/run/nested-kvm
mkdir -p "$R$NK_REPO" || fail "cannot create $NK_REPO in the chroot"
mount -t 9p -o "$P9,cache=loose" repo "$R$NK_REPO" || fail "cannot mount the repository"
# A git worktree's node_modules may link to another checkout's, outside the repository share.
if [ -n "$NK_NODE_MODULES" ]; then
  mkdir -p "$R$NK_NODE_MODULES" && mount -t 9p -o "$P9,cache=loose,ro" node_modules "$R$NK_NODE_MODULES" ||
    fail "cannot mount $NK_NODE_MODULES"
fi
# /var/tmp on a disk, as on most hosts (where /tmp may be tmpfs): Offload's default backing
# directory, which refuses tmpfs. This run's ext4 image, the L1's virtio disk: real block
# accounting, O_DIRECT and fdatasync, which the 9p share does not give.
n=0
while [ ! -b /dev/vda ] && [ $n -lt 50 ]; do sleep 0.1; n=$((n + 1)); done
mount -t ext4 /dev/vda $R/var/tmp || fail "cannot mount /var/tmp (the ext4 disk /dev/vda)"
chmod 1777 $R/var/tmp
hostname nested-kvm
ip link set lo up 2>/dev/null || true

# stdout becomes a pipe (as in CI, not a tty) read by cat; a FIFO rather than "| cat" so that
# processes CMD leaves behind holding stdout cannot keep the L1 alive after CMD exits.
mkfifo /out
cat /out &
catpid=$!
printf '%s:start@@\n' "$M"
env -i /bin/chroot $R /bin/sh /run/nested-kvm/cmd.sh </dev/null >/out 2>&1
rc=$?
n=0
while kill -0 $catpid 2>/dev/null && [ $n -lt 20 ]; do sleep 0.1; n=$((n + 1)); done
kill -9 -1 2>/dev/null  # leftovers of CMD (PID 1 itself is spared)
wait $catpid 2>/dev/null
printf '%s:clock:%s@@\n' "$M" "$(cut -d' ' -f1 /proc/uptime)"
finish "exit:$rc"
INIT
  } >"$1"
  chmod 755 "$1"
}

build_cache() {
  local kver=$1 dest=$2 tmp deb moddir m f name
  note "preparing the L1 (Debian kernel $kver) in $dest; this happens once per kernel version"
  mkdir -p "$CACHE"
  tmp=$(mktemp -d "$CACHE/.build.XXXXXX")
  BUILD_TMP=$tmp  # removed by cleanup()
  mkdir -p "$tmp/deb" "$tmp/pkg" "$tmp/initramfs/bin" "$tmp/initramfs/lib/modules" "$tmp/out"

  # apt-get download, not install: installing would run initramfs hooks on the host. As root,
  # apt's download sandbox user _apt cannot write into our private temp dir: skip the sandbox.
  local apt_opts=()
  [[ $(id -u) -eq 0 ]] && apt_opts=(-o APT::Sandbox::User=root)
  (cd "$tmp/deb" && apt-get "${apt_opts[@]}" download -q "linux-image-$kver" >&2) ||
    die "apt-get download linux-image-$kver failed"
  deb=$(ls "$tmp"/deb/*.deb)
  dpkg-deb -x "$deb" "$tmp/pkg"

  # Debian 12's package ships /lib/modules; later ones may ship /usr/lib/modules. depmod -b looks
  # in BASE/lib/modules.
  moddir=$tmp/pkg/lib/modules/$kver
  if [[ ! -d $moddir && -d $tmp/pkg/usr/lib/modules/$kver ]]; then
    ln -s usr/lib "$tmp/pkg/lib"
    moddir=$tmp/pkg/lib/modules/$kver
  fi
  [[ -d $moddir ]] || die "no modules for $kver in $deb"
  # The package has no modules.dep; compute it to learn the insmod order.
  depmod -b "$tmp/pkg" "$kver"
  : >"$tmp/initramfs/modules.list"
  for m in "${L1_MODULES[@]}"; do
    modprobe -d "$tmp/pkg" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" { print $2 }'
  done | awk '!seen[$0]++' | while read -r f; do
    # busybox insmod wants plain .ko files; some kernel builds compress them.
    name=$(basename "$f")
    case $f in
      *.ko.xz) name=${name%.xz}; xz -dc "$f" >"$tmp/initramfs/lib/modules/$name" ;;
      *.ko.zst) name=${name%.zst}; zstd -dcq "$f" >"$tmp/initramfs/lib/modules/$name" ;;
      *.ko.gz) name=${name%.gz}; gzip -dc "$f" >"$tmp/initramfs/lib/modules/$name" ;;
      *) cp "$f" "$tmp/initramfs/lib/modules/$name" ;;
    esac
    echo "$name" >>"$tmp/initramfs/modules.list"
  done
  grep -q '^kvm-amd\.ko$' "$tmp/initramfs/modules.list" || die "kvm-amd.ko not found in $deb"

  cp "$BUSYBOX" "$tmp/initramfs/bin/busybox"
  # The tree stays in the cache so that a change to /init (in this script) only re-packs it.
  mv "$tmp/initramfs" "$tmp/out/initramfs"

  if extract_vmlinux "$tmp/pkg/boot/vmlinuz-$kver" "$tmp/out/kernel"; then
    echo vmlinux >"$tmp/out/kernel.kind"
  else
    note "cannot boot the uncompressed vmlinux; using the bzImage (L1 boots about 2x slower)"
    cp "$tmp/pkg/boot/vmlinuz-$kver" "$tmp/out/kernel"
    echo bzImage >"$tmp/out/kernel.kind"
  fi
  echo "$kver" >"$tmp/out/kernel.version"
  echo "${L1_MODULES[*]}" >"$tmp/out/modules.wanted"
  rm -rf "$dest"
  mv "$tmp/out" "$dest"
  rm -rf "$tmp"
  BUILD_TMP=""
}

# Sets KVER and L1DIR, building the cache entry when needed.
prepare() {
  mkdir -p "$CACHE"
  # Several runs may start at once: build under a lock.
  exec 9>"$CACHE/.lock"
  command -v flock >/dev/null 2>&1 && flock 9
  KVER=$(apt_kernel_version)
  if [[ -z $KVER && $(id -u) -eq 0 ]] && ! compgen -G "$CACHE/*/kernel.version" >/dev/null; then
    apt-get update -q >&2 || true
    KVER=$(apt_kernel_version)
  fi
  if [[ -z $KVER ]]; then
    # No package lists (offline machine?): use the newest kernel already cached.
    local v
    v=$(cat "$CACHE"/*/kernel.version 2>/dev/null | sort -V | tail -n 1 || true)
    [[ -n $v ]] || die "apt-cache does not know linux-image-amd64 and nothing is cached in $CACHE"
    KVER=$v
  fi
  L1DIR=$CACHE/$KVER
  # Built again when the kernel or the list of modules changed.
  if [[ ! -f $L1DIR/kernel.version || $(cat "$L1DIR/modules.wanted" 2>/dev/null) != "${L1_MODULES[*]}" ]]; then
    build_cache "$KVER" "$L1DIR"
    # A new kernel makes the older entries useless (about 70 MB each).
    local d
    for d in "$CACHE"/*/; do
      d=${d%/}
      [[ $d != "$L1DIR" && -f $d/kernel.version ]] && rm -rf "$d"
    done
  fi
  # (Re)pack the initramfs when /init changed, i.e. when this script did.
  write_init "$L1DIR/init.new"
  if ! cmp -s "$L1DIR/init.new" "$L1DIR/initramfs/init" || [[ ! -f $L1DIR/initramfs.cpio ]]; then
    mv "$L1DIR/init.new" "$L1DIR/initramfs/init"
    # Uncompressed: the kernel would spend longer gunzipping under TCG than QEMU spends loading it.
    (cd "$L1DIR/initramfs" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) >"$L1DIR/initramfs.cpio.new"
    mv "$L1DIR/initramfs.cpio.new" "$L1DIR/initramfs.cpio"
  fi
  rm -f "$L1DIR/init.new"
  exec 9>&-
}

# ---------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------

ensure_tools
prepare

# POSIX-shell single quoting (the L1 side runs busybox sh and the chroot's /bin/sh).
sq() { printf "'%s'" "${1//\'/\'\\\'\'}"; }
# QEMU option values double their commas.
qe() { printf '%s' "${1//,/,,}"; }

RUN=$(mktemp -d "${TMPDIR:-/tmp}/nested-kvm.XXXXXX")
SHARE=$RUN/share          # read-only in the L1 at /share, and at /run/nested-kvm in the chroot
mkdir "$SHARE"
TOKEN=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
MARK="@@nested-kvm:$TOKEN:"

# CMD runs where the caller is when that is inside the repository (the only host directory the
# chroot has, besides /usr and /etc), else at the repository root.
CWD=$(pwd -P)
[[ $CWD == "$REPO" || $CWD == "$REPO"/* ]] || CWD=$REPO

# The host's usr-merge symlinks (/bin -> usr/bin, ...), recreated in the chroot.
links=""
for d in bin sbin lib lib32 lib64 libx32; do
  if [[ -L /$d ]]; then
    links+=" $d=$(readlink "/$d")"
  elif [[ -d /$d ]]; then
    note "warning: /$d is a directory, not a link into /usr: the L1 chroot will not have it"
  fi
done
# The L1's /var/tmp: a fresh ext4 image per run (sparse: it costs what is written to it, and
# the L1's discards give that back), beside the cache rather than in $RUN, which may be on a tmpfs.
mkdir -p "$REPO/.cache"
VAR_TMP_IMG=$(mktemp "$REPO/.cache/nested-var-tmp.XXXXXX")
truncate -s 16G "$VAR_TMP_IMG"
# A scratch filesystem: no journal, few inodes (one per MiB), inode tables written now, so that the
# L1 has no background initialisation to emulate; about 4 MB on the host until used.
mkfs.ext4 -q -F -m 0 -i 1048576 -O ^has_journal -E lazy_itable_init=0 "$VAR_TMP_IMG" >&2 || die "mkfs.ext4 failed on $VAR_TMP_IMG"
# node_modules that links outside the repository (a git worktree sharing another checkout's) is
# shared too, read-only, and mounted at the path the link resolves to.
NODE_MODULES=""
if [[ -L $REPO/node_modules ]]; then
  NODE_MODULES=$(readlink -f "$REPO/node_modules")
  if [[ $NODE_MODULES == "$REPO"/* ]]; then NODE_MODULES=""; fi
fi
{
  echo "NK_REPO=$(sq "$REPO")"
  echo "NK_NODE_MODULES=$(sq "$NODE_MODULES")"
  echo "NK_LINKS=$(sq "${links# }")"
} >"$SHARE/l1.conf"

# CMD and its environment go through a file, not the kernel command line (no quoting games).
{
  echo "# generated by scripts/nested-kvm.sh"
  echo "export PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin HOME=/root"
  # Tests that wait for periodic work scale their deadlines by it: everything here is emulated.
  echo "export PVISOR_NESTED=1"
  while IFS= read -r name; do
    [[ $name =~ ^(CI|PVISOR_[A-Za-z0-9_]*|JEST_[A-Za-z0-9_]*|NODE_OPTIONS|FORCE_COLOR)$ ]] || continue
    echo "export $name=$(sq "${!name}")"
  done < <(compgen -e)
  echo "cd $(sq "$CWD") || exit 125"
  printf 'exec'
  for a in "$@"; do printf ' %s' "$(sq "$a")"; done
  echo
} >"$SHARE/cmd.sh"

KERNEL_KIND=$(cat "$L1DIR/kernel.kind")
# Under TCG the L1 reads the host's own TSC. Left to calibrate it, the L1 does so in its first
# milliseconds, against emulated timers; on a host loaded at that moment a wrong result would
# stick (a later refinement is dropped when it differs by over 1%), and with it every clock and
# deadline in the L1. The host's kernel measured the rate once: hand it over when it says.
HOST_TSC_KHZ=""
if [[ $(tsc_mhz) =~ ^([0-9]+)\.([0-9]{3})$ ]]; then HOST_TSC_KHZ=${BASH_REMATCH[1]}${BASH_REMATCH[2]}; fi
# shellcheck disable=SC2054 # the commas belong to QEMU's option syntax
qemu_args=(
  -nodefaults -no-user-config -accel tcg -cpu max -M pc
  # -smp 2 hung the whole L1 in 3 of ~140 L2 boots (QEMU 7.2 multi-threaded TCG with SVM);
  # -smp 1 worked 180 of 180 at the same speed.
  -smp 1 -m "$MEMORY"
  -display none -no-reboot
  # The monitor answers only to the watchdog: where the L1's CPU is when it went silent.
  -monitor "unix:$(qe "$RUN/monitor.sock"),server=on,wait=off"
  # The serial console goes to stdout and to a log file: the watchdog watches the log's size
  # (it also sees partial lines), and the log is shown when the L1 dies.
  -chardev "stdio,id=con,signal=off,logfile=$(qe "$RUN/console.log")" -serial chardev:con
  -kernel "$L1DIR/kernel" -initrd "$L1DIR/initramfs.cpio"
  # A periodic tick from the local APIC (not TSC-deadline, not tickless): a wedged L1 was once
  # seen halted with interrupts on and nothing pending, i.e. a one-shot timer interrupt had been
  # lost (the emulated SVM, around exits from L2). A periodic timer re-arms itself, so a lost
  # interrupt costs one tick, not the whole run.
  -append "console=ttyS0 quiet loglevel=1 panic=-1 lapic=notscdeadline highres=off nohz=off ${HOST_TSC_KHZ:+tsc_early_khz=$HOST_TSC_KHZ }nkvm_token=$TOKEN"
  -virtfs local,path=/usr,mount_tag=usr,security_model=none,readonly=on,multidevs=remap
  -virtfs local,path=/etc,mount_tag=etc,security_model=none,readonly=on,multidevs=remap
  -virtfs "local,path=$(qe "$REPO"),mount_tag=repo,security_model=none,multidevs=remap"
  -virtfs "local,path=$(qe "$SHARE"),mount_tag=run,security_model=none,readonly=on,multidevs=remap"
  -drive "file=$(qe "$VAR_TMP_IMG"),if=virtio,format=raw,discard=unmap"
)
[[ -z $NODE_MODULES ]] ||
  qemu_args+=(-virtfs "local,path=$(qe "$NODE_MODULES"),mount_tag=node_modules,security_model=none,readonly=on,multidevs=remap")

# The console filter: prints the L1's console to our stdout without the marker lines, which it
# appends to $RUN/status instead; everything after the exit marker (the kernel's "reboot:" line)
# is dropped. awk, not a bash read loop: bash reads a pipe one byte per syscall and halved the
# throughput (1.3 MB: 20 s instead of the serial port's 8 s). mawk needs -W interactive to hand
# over each line as it arrives instead of waiting for a full input buffer. The cost: a partial
# line appears only once its newline (or the end) arrives.
awk_cmd=(awk)
awk -W version 2>&1 | grep -q mawk && awk_cmd+=(-W interactive)
# shellcheck disable=SC2016 # awk program
awk_prog='
  done { next }
  {
    sub(/\r$/, "")
    i = index($0, mark)
    if (i == 0) { print; fflush(); next }
    # Text before a marker is the unterminated last line of what came before.
    if (i > 1) { printf "%s", substr($0, 1, i - 1); fflush() }
    what = substr($0, i + length(mark))
    what = substr(what, 1, index(what, "@@") - 1)
    print what >> status; fflush(status)
    if (what ~ /^(exit|error):/) done = 1
  }'

now_ms() { local t=${EPOCHREALTIME/./}; NOW=$((t / 1000)); }
secs() { printf '%d.%d' $(($1 / 1000)) $(($1 % 1000 / 100)); }
log_size() { stat -c %s "$RUN/console.log" 2>/dev/null || echo 0; }

mkfifo "$RUN/console"
: >"$RUN/status"
now_ms; T0=$NOW
# stdin from /dev/null: QEMU then leaves the caller's terminal alone (no raw mode).
qemu-system-x86_64 "${qemu_args[@]}" </dev/null >"$RUN/console" 2>"$RUN/qemu.stderr" &
QEMU_PID=$!
"${awk_cmd[@]}" -v mark="$MARK" -v status="$RUN/status" "$awk_prog" <"$RUN/console" &
FILTER_PID=$!

LAST=$T0 SIZE=0 NSTATUS=0 T_READY="" T_START="" T_END="" RC="" L1_ERROR="" WHY="" FAILED=""
T_CLOCK="" L1_UP_READY="" L1_UP_END="" L1_TSC=""
read_status() {  # handle marker lines the filter has added since the last call
  local lines what
  mapfile -t -s "$NSTATUS" lines <"$RUN/status"
  NSTATUS=$((NSTATUS + ${#lines[@]}))
  for what in "${lines[@]}"; do
    case $what in
      ready:*)
        T_READY=$NOW
        read -r L1_UP_READY L1_TSC <<<"${what#ready:}"
        note "L1 kernel $KVER (QEMU TCG, SVM, $KERNEL_KIND), /dev/kvm ready after $(secs $((NOW - T0))) s (L1 uptime $L1_UP_READY s, its TSC ${L1_TSC:-?} MHz${HOST_TSC_KHZ:+, given $HOST_TSC_KHZ kHz})"
        ;;
      clock:*) T_CLOCK=$NOW L1_UP_END=${what#clock:} ;;
      start) T_START=$NOW ;;
      exit:*) T_END=$NOW; RC=${what#exit:} ;;
      error:*) T_END=$NOW; L1_ERROR=${what#error:} ;;
    esac
  done
}

while :; do
  sleep 0.25
  now_ms
  read_status
  [[ -n $RC || -n $L1_ERROR ]] && break
  if ! kill -0 "$QEMU_PID" 2>/dev/null; then
    # QEMU is gone: let the filter drain the console, then look at the markers once more.
    wait "$FILTER_PID" 2>/dev/null || true
    read_status
    break
  fi
  if ! kill -0 "$FILTER_PID" 2>/dev/null; then
    read_status
    [[ -n $RC || -n $L1_ERROR ]] && break
    FAILED="the console filter died (was our stdout closed?)"
    break
  fi
  size=$(log_size)
  if ((size != SIZE)); then SIZE=$size; LAST=$NOW; fi
  if ((NOW - T0 > TIMEOUT_S * 1000)); then WHY="timeout: not finished after $TIMEOUT_S s"; break; fi
  if ((NOW - LAST > SILENCE_S * 1000)); then WHY="silence watchdog: no output for $SILENCE_S s"; break; fi
done

# Where the emulated CPU is, twice 2 s apart (a wedged L1 spinning, or halted with interrupts
# off?), from QEMU's monitor: the key lines of `info registers`. Node is there: it runs us.
cpu_state() {
  node -e '
    const sock = require("net").connect(process.argv[1]);
    let out = "";
    sock.on("data", (d) => (out += d));
    sock.on("error", () => {});
    const ask = () => sock.write("info registers\n");
    setTimeout(ask, 300);
    setTimeout(ask, 2300);
    setTimeout(() => {
      const keep = out.split(/\r?\n/).filter((l) => /^(RIP|CS |CR0|EFER)/.test(l));
      for (const l of keep) process.stderr.write(`nested-kvm: L1 CPU: ${l.replace(/\s+/g, " ")}\n`);
      process.exit(0);
    }, 3000);
  ' "$RUN/monitor.sock" 2>&1 >/dev/null | cat >&2 || true
}
[[ -n $WHY ]] && cpu_state

if [[ -n $RC || -n $L1_ERROR ]]; then
  # The L1 reboots right after the marker and -no-reboot makes QEMU exit; give it a moment.
  for _ in $(seq 50); do kill -0 "$QEMU_PID" 2>/dev/null || break; sleep 0.1; done
fi
stop_qemu
wait "$FILTER_PID" 2>/dev/null || true
FILTER_PID=""
now_ms

summary() {
  local s
  s="wall $(secs $((NOW - T0))) s"
  [[ -n $T_READY ]] && s+=", /dev/kvm ready at $(secs $((T_READY - T0))) s"
  [[ -n $T_START && -n $T_END ]] && s+=", command $(secs $((T_END - T_START))) s"
  # The L1's own clock against the host's over the same stretch: a TSC calibrated wrong while the
  # L1 booted on a loaded host makes every deadline inside it (and the tests' figures) run off.
  if [[ -n $T_CLOCK && -n $L1_UP_END && -n $L1_UP_READY ]]; then
    s+=", L1 clock $(awk -v l1="$L1_UP_END" -v r="$L1_UP_READY" -v h=$((T_CLOCK - T_READY)) 'BEGIN { printf "%.2f", (h > 0 ? (l1 - r) * 1000 / h : 0) }')x the host's"
  fi
  note "$1 ($s)"
}

if [[ -n $WHY ]]; then
  summary "$WHY; killed QEMU, exit 124"
  exit 124
elif [[ -n $L1_ERROR ]]; then
  summary "the L1 failed: $L1_ERROR; exit 125"
  exit 125
elif [[ -n $FAILED ]]; then
  summary "$FAILED; killed QEMU, exit 125"
  exit 125
elif [[ -z $RC ]]; then
  # What the L1 printed (a kernel panic, say) is already on stdout; QEMU's own errors are not.
  if [[ -s $RUN/qemu.stderr ]]; then sed 's/^/nested-kvm: qemu: /' "$RUN/qemu.stderr" >&2; fi
  summary "QEMU ended without reporting the command's exit status; exit 125"
  exit 125
fi
summary "exit $RC"
exit "$RC"
