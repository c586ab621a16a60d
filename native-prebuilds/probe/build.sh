#!/bin/sh
# Build the pvisor probe guest (docs/probe-guest.md) into native-prebuilds/linux-x64/probe.bin
# and its checksum, then build and run the host-side content/digest self-test.
#
# Usage: native-prebuilds/probe/build.sh [--no-selftest]
# Needs the Debian gcc/binutils toolchain (x86-64). The output is reproducible: the flat binary
# depends only on the sources and the compiler version (no paths, timestamps or build ids).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
out="$here/../linux-x64"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM

CC=${CC:-gcc}
OBJCOPY=${OBJCOPY:-objcopy}

CFLAGS="-std=gnu11 -O2 -Wall -Wextra -ffreestanding -fno-pic -fno-pie -mno-red-zone \
 -fno-stack-protector -fno-asynchronous-unwind-tables -fno-unwind-tables -fcf-protection=none \
 -fno-strict-aliasing -fno-tree-loop-distribute-patterns -fno-jump-tables -mgeneral-regs-only \
 -march=x86-64 -mtune=generic"
LDFLAGS="-nostdlib -static -no-pie -Wl,--build-id=none -Wl,-z,noexecstack -Wl,-z,norelro \
 -Wl,--no-warn-rwx-segments -Wl,-T,$here/probe.ld"

cd "$here"
# shellcheck disable=SC2086
$CC $CFLAGS -c probe.c -o "$tmp/probe.o"
# shellcheck disable=SC2086
$CC $CFLAGS $LDFLAGS "$tmp/probe.o" -o "$tmp/probe.elf"
$OBJCOPY -O binary "$tmp/probe.elf" "$tmp/probe.bin"

# No port I/O anywhere in the code: kvm_pvm clears RFLAGS.IOPL, so `in`/`out` at CPL3 is a #GP
# (a triple fault without an IDT). The probe talks to the VMM through its doorbell page instead.
if objdump -d "$tmp/probe.elf" | grep -E $'\t(in|out|ins|outs)[bwl]?( |$)'; then
    echo "build.sh: the probe must not use port I/O (see the doorbell page in docs/probe-guest.md)" >&2
    exit 1
fi

size=$(wc -c < "$tmp/probe.bin")
if [ "$size" -gt 524288 ]; then
    echo "build.sh: probe.bin is $size bytes (limit 512 KiB)" >&2
    exit 1
fi

mkdir -p "$out"
cp "$tmp/probe.bin" "$out/probe.bin"
(cd "$out" && sha256sum probe.bin > probe.bin.sha256)
echo "probe.bin: $size bytes"
cat "$out/probe.bin.sha256"

if [ "${1:-}" != "--no-selftest" ]; then
    # Host build of the same content.h (hosted, normal flags).
    $CC -std=gnu11 -O2 -Wall -Wextra -fno-strict-aliasing selftest.c -o "$tmp/selftest"
    "$tmp/selftest"
fi
