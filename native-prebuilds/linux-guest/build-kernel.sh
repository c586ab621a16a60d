#!/usr/bin/env bash
# Rebuilds the shipped guest kernel: native-prebuilds/linux-x64/vmlinuz (bzImage) + vmlinuz.sha256,
# and native-prebuilds/linux-guest/config (the resolved .config, for review).
# Base: Debian's linux-source-6.1, `make tinyconfig` + kernel.fragment (merge_config.sh), olddefconfig.
# The source and objects live outside the repo (PVISOR_KERNEL_BUILD, default /work/build/linux) and
# are reused, so a rebuild after a fragment change only recompiles what changed.
# Reproducible where practical: fixed build timestamp, user, host and version number; the
# compiler (Debian 12's gcc) is the remaining input.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/../linux-x64"
build=${PVISOR_KERNEL_BUILD:-/work/build/linux}
jobs=${PVISOR_KERNEL_JOBS:-2}
tarball=/usr/src/linux-source-6.1.tar.xz

[ -f "$tarball" ] || apt-get install -y linux-source-6.1 flex bison libelf-dev bc
for tool in flex bison bc; do command -v $tool >/dev/null || apt-get install -y flex bison bc libelf-dev; done

mkdir -p "$build"
if [ ! -f "$build/src/Makefile" ]; then
  rm -rf "$build/src" && mkdir -p "$build/src"
  tar -xJf "$tarball" -C "$build/src" --strip-components=1
fi
obj="$build/out"
mkdir -p "$obj"

export KBUILD_BUILD_TIMESTAMP='Thu Jan  1 00:00:00 UTC 2026'
export KBUILD_BUILD_USER=pvisor KBUILD_BUILD_HOST=pvisor KBUILD_BUILD_VERSION=1
mk() { nice -n 19 make -C "$build/src" O="$obj" ARCH=x86_64 "$@"; }

mk tinyconfig >/dev/null
# -m: merge only (no alldefconfig run); olddefconfig then resolves dependencies.
(cd "$build/src" && ARCH=x86_64 scripts/kconfig/merge_config.sh -m -O "$obj" "$obj/.config" "$here/kernel.fragment" >/dev/null)
mk olddefconfig >/dev/null

# Every option of the fragment must have survived dependency resolution as written.
missing=0
while IFS= read -r line; do
  case "$line" in
    CONFIG_*=*) grep -qxF "$line" "$obj/.config" || { echo "config: wanted '$line', got '$(grep -E "^(# )?${line%%=*}[= ]" "$obj/.config" || echo absent)'" >&2; missing=1; } ;;
    "# CONFIG_"*" is not set") sym=${line#\# }; sym=${sym%% *}; ! grep -q "^$sym=" "$obj/.config" || { echo "config: $sym should be unset" >&2; missing=1; } ;;
  esac
done < "$here/kernel.fragment"
[ $missing = 0 ] || { echo "kernel config does not match kernel.fragment" >&2; exit 1; }

mk -j"$jobs" bzImage
mkdir -p "$out"
cp "$obj/arch/x86/boot/bzImage" "$out/vmlinuz"
cp "$obj/.config" "$here/config"
(cd "$out" && sha256sum vmlinuz > vmlinuz.sha256)
echo "built $out/vmlinuz ($(stat -c %s "$out/vmlinuz") bytes), kernel $(cat "$obj/include/config/kernel.release")"
