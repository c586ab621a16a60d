#!/usr/bin/env bash
# Build the agent workload's root filesystem: an ext4 image of Debian bookworm (debootstrap
# minbase) with Debian's own nodejs and node-typescript, and the agent program of
# scripts/agent-workload/ at /opt/agent (run it with `node /opt/agent/agent.js`).
#
#   scripts/agent-rootfs.sh [OUTPUT.img]
#
# OUTPUT defaults to $PVISOR_AGENT_ROOTFS, else .cache/agent-rootfs/agent-rootfs.img in the
# repository (where the nested harness's L1 sees it too). The packages come from the Debian
# archive given by $PVISOR_DEBIAN_MIRROR (default http://deb.debian.org/debian), never from this
# host's apt sources (which may carry other builds of nodejs). Docs, man pages and locales are
# left out. Idempotent: OUTPUT.stamp holds a hash of this script, the mirror and every file copied
# in; when it matches, nothing is built (a journal left dirty by a VM that was stopped is replayed).
# The downloaded packages are kept in $PVISOR_AGENT_ROOTFS_DEBS (default
# /var/cache/pvisor-agent-rootfs/debs, about 60 MB) for the next build on this machine.
# Needs root (debootstrap, chroot); installs debootstrap and e2fsprogs with apt-get if missing.
# Progress goes to stderr, prefixed "agent-rootfs:". Exit status 0 when the image is ready.
set -euo pipefail

die() { echo "agent-rootfs: error: $*" >&2; exit 1; }
note() { echo "agent-rootfs: $*" >&2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
WORKLOAD=$REPO/scripts/agent-workload
SUITE=bookworm
MIRROR=${PVISOR_DEBIAN_MIRROR:-http://deb.debian.org/debian}
OUT=${1:-${PVISOR_AGENT_ROOTFS:-$REPO/.cache/agent-rootfs/agent-rootfs.img}}
(($# <= 1)) || die "usage: $0 [OUTPUT.img]"
[[ $OUT == /* ]] || OUT=$PWD/$OUT
STAMP=$OUT.stamp
# debootstrap keeps the packages it downloaded here and takes them from here the next time (it
# checks each against the archive's signed index): a rebuild on the same machine downloads nothing.
DEBS=${PVISOR_AGENT_ROOTFS_DEBS:-/var/cache/pvisor-agent-rootfs/debs}
T0=$SECONDS

# What the image is made from: a change to any of it means a rebuild.
stamp_of() {
  {
    echo "suite $SUITE mirror $MIRROR"
    sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1
    (cd "$WORKLOAD" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -d' ' -f1
}
WANT=$(stamp_of)

if [[ -f $OUT && -f $STAMP && $(cat "$STAMP") == "$WANT" ]]; then
  # pvisor run --rootfs attaches the image writable; a VM stopped without a clean shutdown leaves
  # its journal to replay, and a read-only attach (the tests') cannot replay it.
  if dumpe2fs -h "$OUT" 2>/dev/null | grep -q '^Filesystem features:.*needs_recovery'; then
    note "replaying the journal of $OUT (a VM was stopped with it attached)"
    rc=0; e2fsck -p "$OUT" >&2 || rc=$?
    ((rc <= 1)) || die "e2fsck -p $OUT exited $rc: delete it and run this again"
  fi
  note "$OUT is up to date ($(du -m --apparent-size "$OUT" | cut -f1) MiB)"
  exit 0
fi

[[ $(id -u) -eq 0 ]] || die "needs root (debootstrap and chroot)"
if ! command -v debootstrap >/dev/null || ! command -v mke2fs >/dev/null; then
  note "installing debootstrap and e2fsprogs"
  command -v apt-get >/dev/null || die "no apt-get: install debootstrap and e2fsprogs"
  # A fresh machine often has no package lists yet: update only when the install fails.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap e2fsprogs >&2 ||
    { apt-get update -q >&2 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap e2fsprogs >&2; } ||
    die "apt-get could not install debootstrap e2fsprogs"
fi

mkdir -p "$(dirname "$OUT")"
BUILD=$(mktemp -d "$(dirname "$OUT")/.agent-rootfs.XXXXXX")
ROOT=$BUILD/root
# debootstrap mounts /proc, /sys and (in a container) /dev inside the tree while it works, and a
# failed run can leave them: unmount whatever is still there before deleting anything, and never
# cross into another filesystem.
cleanup() {
  local m
  while read -r m; do umount -l "$m" 2>/dev/null || true; done < <(awk -v r="$ROOT" 'index($2, r) == 1 { print $2 }' /proc/self/mounts | sort -r)
  rm -rf --one-file-system "$BUILD"
}
trap cleanup EXIT

note "debootstrap $SUITE (minbase + nodejs, node-typescript) from $MIRROR"
mkdir -p "$DEBS"
# Its stages are shown; its line per package (about 450) is not.
rc=0
debootstrap --variant=minbase --include=nodejs,node-typescript --cache-dir="$DEBS" "$SUITE" "$ROOT" "$MIRROR" 2>&1 |
  awk '/^I: (Retrieving|Validating|Extracting|Unpacking|Configuring) / && !/(packages|base system)\.\.\.$/ { next } { print; fflush() }' >&2 ||
  rc=$?
if ((rc != 0)); then
  tail -n 40 "$ROOT/debootstrap/debootstrap.log" >&2 2>/dev/null || true
  die "debootstrap failed (exit $rc; the end of its log is above)"
fi
note "debootstrap done in $((SECONDS - T0)) s"
if awk -v r="$ROOT" 'index($2, r) == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
  die "debootstrap left filesystems mounted under $ROOT"
fi

note "leaving out docs, man pages, locales, apt's caches and logs"
rm -rf "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* \
  "$ROOT"/usr/share/locale/* "$ROOT"/usr/share/lintian "$ROOT"/var/cache/apt/*.bin \
  "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/log/*
# The compiler's translated messages (it reads them only with --locale).
find "$ROOT"/usr/share/nodejs/typescript/lib -mindepth 2 -name diagnosticMessages.generated.json -delete
# A container's debootstrap leaves empty files as mount points of /dev's nodes; the agent puts
# the guest's own devtmpfs on /dev. /dev, /proc, /sys, /tmp and /run must exist: a read-only
# image cannot have the agent make them.
rm -rf --one-file-system "${ROOT:?}"/dev
mkdir -p "$ROOT"/dev "$ROOT"/proc "$ROOT"/sys "$ROOT"/run "$ROOT"/tmp
chmod 1777 "$ROOT"/tmp
echo agent-rootfs >"$ROOT"/etc/hostname

note "copying the agent program to /opt/agent"
mkdir -p "$ROOT"/opt/agent
cp -r "$WORKLOAD"/. "$ROOT"/opt/agent/
chown -R root:root "$ROOT"/opt/agent

# The image's own node, with its own TypeScript, once through the program: a package that did not
# install or a project that does not compile fails here rather than in a guest.
# Node needs /proc (process.memoryUsage); the environment is the guest agent's, not this shell's.
note "checking: the image's node runs the agent program"
mount -t proc proc "$ROOT"/proc
rc=0
check=$(echo exit | chroot "$ROOT" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  node /opt/agent/agent.js 2>&1) || rc=$?
umount "$ROOT"/proc
((rc == 0)) || die "the agent program failed in the image:"$'\n'"$check"
[[ $check == ready\ compiled* ]] || die "the agent program did not say ready:"$'\n'"$check"
note "  ${check%%$'\n'*}"

used_mib=$(du -s -B1M --one-file-system "$ROOT" | cut -f1)
# Room for what a writable run adds, and ext4's own metadata; the file is sparse.
size_mib=$(((used_mib * 5 / 4 + 64 + 15) / 16 * 16))
note "making the ext4 image: ${used_mib} MiB of files in ${size_mib} MiB"
rm -f "$OUT.tmp"
# 4 KiB blocks whatever the size (mke2fs's "small" type would pick 1 KiB); no reserved blocks.
mke2fs -q -t ext4 -b 4096 -m 0 -L agent-rootfs -d "$ROOT" "$OUT.tmp" "${size_mib}M" >/dev/null
e2fsck -fn "$OUT.tmp" >/dev/null 2>&1 || die "e2fsck finds the new image inconsistent"
mv -f "$OUT.tmp" "$OUT"
echo "$WANT" >"$STAMP"
note "$OUT ready: ${size_mib} MiB ($(du -m "$OUT" | cut -f1) MiB on disk), built in $((SECONDS - T0)) s"
