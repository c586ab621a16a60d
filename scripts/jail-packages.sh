#!/usr/bin/env bash
# What a jailed VM needs from Debian (pvisor run's default, docs/security.md): bubblewrap for its
# namespaces and empty root, libseccomp2 for the seccomp helper, util-linux's prlimit for its
# rlimits. Installed when missing, as root with apt-get, so that the README's two commands set up
# a fresh machine; elsewhere it says what is missing and leaves it to `pvisor run`, which refuses
# with the same words and `--isolation none` as the way out.
set -euo pipefail
missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
ldconfig -p 2>/dev/null | grep 'libseccomp\.so\.2' >/dev/null || missing+=(libseccomp2)
command -v prlimit >/dev/null 2>&1 || missing+=(util-linux)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "jail-packages: installing ${missing[*]} (a jailed VM needs them)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
else
  echo "jail-packages: missing ${missing[*]}: a jailed pvisor run will be refused (install them, or run with --isolation none)" >&2
fi
