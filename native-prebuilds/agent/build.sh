#!/usr/bin/env bash
# Builds the Linux guest agent (agent.c) as a static binary at $1, with the memory study's
# pvisor-workset (../linux-guest/workset.c) linked in: called by that name, it runs that.
# build-initramfs.sh calls it and installs the result as /init; the binary is not shipped alone.
# Reproducible: no build paths, build id or timestamps end up in the output.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUTPUT}
gcc -static -Os -g0 -Wall -Wextra -Werror -ffile-prefix-map="$(dirname "$here")"=. -Wl,--build-id=none \
  -o "$out" "$here/agent.c" "$here/../linux-guest/workset.c"
strip --strip-all "$out"
echo "built $out ($(stat -c %s "$out") bytes)"
