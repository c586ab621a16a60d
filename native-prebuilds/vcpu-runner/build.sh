#!/usr/bin/env bash
# Rebuilds native-prebuilds/linux-x64/libpvisor-vcpu.so and its checksum.
# Reproducible: no build paths or timestamps end up in the output.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/../linux-x64"
mkdir -p "$out"
cd "$here"
gcc -O2 -g0 -Wall -Wextra -Werror -fPIC -shared -pthread \
  -ffile-prefix-map="$here"=. -Wl,--build-id=none -Wl,-soname,libpvisor-vcpu.so \
  -o "$out/libpvisor-vcpu.so" vcpu_runner.c
strip --strip-unneeded "$out/libpvisor-vcpu.so"
(cd "$out" && sha256sum libpvisor-vcpu.so > libpvisor-vcpu.so.sha256)
echo "built $out/libpvisor-vcpu.so ($(stat -c %s "$out/libpvisor-vcpu.so") bytes)"
