#!/usr/bin/env bash
# Rebuilds every native helper library into native-prebuilds/linux-x64/, each with its checksum:
#   libpvisor-vcpu.so    vcpu_runner.c  (a thread per vCPU running KVM_RUN)
#   libpvisor-memory.so  uffd_server.c crc32c.c  (the userfaultfd server of memory strategies)
# Reproducible: no build paths, build ids or timestamps end up in the output.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/../linux-x64"
mkdir -p "$out"
cd "$here"

build() { # build LIBRARY SOURCE...
  local lib=$1
  shift
  gcc -O2 -g0 -Wall -Wextra -Werror -fPIC -shared -pthread \
    -ffile-prefix-map="$here"=. -Wl,--build-id=none -Wl,-soname,"$lib" \
    -o "$out/$lib" "$@"
  strip --strip-unneeded "$out/$lib"
  (cd "$out" && sha256sum "$lib" > "$lib.sha256")
  echo "built $out/$lib ($(stat -c %s "$out/$lib") bytes)"
}

build libpvisor-vcpu.so vcpu_runner.c
build libpvisor-memory.so uffd_server.c crc32c.c
