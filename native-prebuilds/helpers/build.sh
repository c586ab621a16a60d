#!/usr/bin/env bash
# Rebuilds every native helper library into native-prebuilds/linux-x64/, each with its checksum:
#   libpvisor-vcpu.so    vcpu_runner.c  (a thread per vCPU running KVM_RUN)
#   libpvisor-memory.so  uffd_server.c cold_store.c crc32c.c map_runs.c ram_guard.c + lz4's lz4.c (the
#                        userfaultfd server of memory strategies, with ColdCompression's block store;
#                        guest RAM's SIGBUS guard)
#   pvisor-pool-daemon   pool_daemon.c pool_pages.c pool_hello.c pool_grants.c pool_peers.c
#                        pool_orphans.c crc32c.c  (the page pool's daemon, an executable: what
#                        `pvisor-daemon serve --memory-pool` execs)
#   pvisor-seccomp-bpf   seccomp_bpf.c  (a jail's allowlist to its seccomp BPF program; links
#                        Debian's libseccomp: needs libseccomp-dev here, libseccomp2 where it runs)
#   pvisor-jail-exec     jail_exec.c  (in the jail: drops to its uid, installs that program, execs node)
# lz4 is built from its release source (1.9.4, the tarball Debian ships as lz4_1.9.4.orig.tar.gz,
# checked against its SHA-256), not from a system package: the library must not depend on a
# liblz4 at run time, and only its block decompressor is used (the format lz4-napi writes).
# Reproducible: no build paths, build ids or timestamps end up in the output.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out="$here/../linux-x64"
mkdir -p "$out"
cd "$here"

# build NAME SOURCE...: a shared library if NAME ends in .so, else an executable; stripped, with
# its checksum beside it.
build() {
  local name=$1 kind strip_mode
  shift
  if [[ $name == *.so ]]; then
    kind=(-fPIC -shared -Wl,-soname,"$name")
    strip_mode=--strip-unneeded
  else
    kind=()
    strip_mode=--strip-all
  fi
  gcc -O2 -g0 -Wall -Wextra -Werror "${kind[@]}" -pthread \
    -ffile-prefix-map="$here"=. -Wl,--build-id=none \
    -o "$out/$name" "$@"
  strip "$strip_mode" "$out/$name"
  (cd "$out" && sha256sum "$name" > "$name.sha256")
  echo "built $out/$name ($(stat -c %s "$out/$name") bytes)"
}

LZ4_VERSION=1.9.4
LZ4_SHA256=0b0e3aa07c8c063ddf40b082bdf7e37a1562bda40a0ff5272957f3e987e0e54b
LZ4_URL=https://deb.debian.org/debian/pool/main/l/lz4/lz4_${LZ4_VERSION}.orig.tar.gz
lz4_source() { # fetches and checks lz4's source once; prints the directory holding lz4.c and lz4.h
  local cache="$here/../../.cache/lz4" tarball
  tarball="$cache/lz4_${LZ4_VERSION}.orig.tar.gz"
  mkdir -p "$cache"
  if [ ! -f "$tarball" ]; then
    curl -fsSL --retry 3 -o "$tarball.part" "$LZ4_URL" >&2
    mv "$tarball.part" "$tarball"
  fi
  if ! echo "$LZ4_SHA256  $tarball" | sha256sum -c --quiet >&2; then
    rm -f "$tarball"
    echo "lz4 source: checksum mismatch for $LZ4_URL" >&2
    return 1
  fi
  tar -xzf "$tarball" -C "$cache" "lz4-${LZ4_VERSION}/lib/lz4.c" "lz4-${LZ4_VERSION}/lib/lz4.h"
  echo "$cache/lz4-${LZ4_VERSION}/lib"
}
lz4=$(lz4_source)

build libpvisor-vcpu.so vcpu_runner.c
# lz4.c as released (third-party code: not under pvisor's warnings), its symbols kept private.
gcc -O2 -g0 -fPIC -fvisibility=hidden -DLZ4LIB_VISIBILITY= -c -ffile-prefix-map="$lz4"=lz4 -o "$lz4/lz4.o" "$lz4/lz4.c"
build libpvisor-memory.so -I"$lz4" uffd_server.c cold_store.c crc32c.c map_runs.c ram_guard.c "$lz4/lz4.o"
# Its keys are crc32c.c's pv_page_hashes, the function VM processes key their offers with.
build pvisor-pool-daemon pool_daemon.c pool_pages.c pool_hello.c pool_grants.c pool_peers.c pool_orphans.c crc32c.c
build pvisor-seccomp-bpf seccomp_bpf.c -lseccomp
build pvisor-jail-exec jail_exec.c
