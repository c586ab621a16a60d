#!/usr/bin/env bash
# Rebuilds native-prebuilds/linux-x64/libpvisor-uffd.so and its checksum.
# Reproducible: no build paths or timestamps end up in the output.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/../linux-x64"
mkdir -p "$out"
cd "$here"
gcc -O2 -g0 -Wall -Wextra -Werror -fPIC -shared -pthread \
  -ffile-prefix-map="$here"=. -Wl,--build-id=none -Wl,-soname,libpvisor-uffd.so \
  -o "$out/libpvisor-uffd.so" uffd_loader.c
strip --strip-unneeded "$out/libpvisor-uffd.so"
(cd "$out" && sha256sum libpvisor-uffd.so > libpvisor-uffd.so.sha256)
echo "built $out/libpvisor-uffd.so ($(stat -c %s "$out/libpvisor-uffd.so") bytes)"
