#!/usr/bin/env bash
# Installs the packed pvisor tarball on a machine without a compiler, as a user would, and checks
# what works there (docs/install.md, "Measured"). The machine is a fresh Debian bookworm chroot
# (debootstrap --variant=minbase: no gcc, g++, cc, make or python3), so zstd-napi's build from
# source fails and npm must leave it out. Node is not Debian's (bookworm's 18 is older than the
# engines field's 20.15): the host's own node binary and npm are copied in.
#
#   sudo scripts/install-check.sh            # a few minutes; downloads a Debian base (~50 MB)
#
# Needs root (debootstrap, chroot, mounts), debootstrap (apt-get install debootstrap), access to
# a Debian mirror (DEBIAN_MIRROR, default http://deb.debian.org/debian) and to the npm registry.
# The .debs are cached in PVISOR_INSTALL_CHECK_CACHE (default /var/cache/pvisor-install-check),
# so a second run downloads only the npm packages. Everything else lives in
# PVISOR_INSTALL_CHECK_DIR (default /tmp/pvisor-install-check), which is removed at the end, also
# on failure or Ctrl-C, after its mounts (/proc, /dev/kvm) are undone (PVISOR_INSTALL_CHECK_KEEP=1
# keeps it to look at; the next run removes it). Not part of `npm test`:
# it needs the network and takes minutes.
#
# If /dev/kvm exists it is bind-mounted into the chroot and the probe guest is run with the
# installed CLI: ffi-rs's prebuilt binary and pvisor's prebuilt helpers then drive real KVM
# without a compiler. Prints the figures at the end; exits non-zero on the first check that fails.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${PVISOR_INSTALL_CHECK_DIR:-/tmp/pvisor-install-check}
CACHE=${PVISOR_INSTALL_CHECK_CACHE:-/var/cache/pvisor-install-check}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOT=$WORK/root

say() { printf 'install-check: %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }

# WORK is removed at the end: never / or a directory directly under it.
case $(dirname "$(realpath -m "$WORK")") in /) die "PVISOR_INSTALL_CHECK_DIR=$WORK: choose a directory of its own, e.g. /tmp/pvisor-install-check" ;; esac
[ "$(id -u)" = 0 ] || die 'needs root (debootstrap, chroot, mounts)'
CHROOT=$(command -v chroot) || die 'needs chroot'
command -v debootstrap >/dev/null || die 'needs debootstrap (apt-get install -y debootstrap)'

# Undo our mounts (deepest first) and remove the work directory. Refuses to remove anything while
# a mount is left under it: rm -rf through a bind mount would reach the host's files.
cleanup() {
  local m
  if [ -d "$ROOT" ]; then
    for m in $(awk -v r="$ROOT" 'index($2, r) == 1 { print $2 }' /proc/mounts | sort -r); do
      umount "$m" 2>/dev/null || umount -l "$m" || true
    done
  fi
  if awk -v r="$ROOT" 'index($2, r) == 1 { found = 1 } END { exit !found }' /proc/mounts; then
    say "mounts are still left under $ROOT; not removing $WORK"
    return
  fi
  if [ "${1:-}" != start ] && [ "${PVISOR_INSTALL_CHECK_KEEP:-0}" = 1 ]; then say "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
cleanup start # what an earlier run left behind
mkdir -p "$WORK" "$CACHE"

# 1. The tarball, as `npm publish` would make it (prepack empties dist/, prepare rebuilds it).
say 'building and packing'
(cd "$REPO" && npx tsc -p . && npm pack --silent --pack-destination "$WORK" >/dev/null)
TGZ=$(ls "$WORK"/pvisor-*.tgz)
TGZ_BYTES=$(stat -c %s "$TGZ")
TGZ_FILES=$(tar tzf "$TGZ" | wc -l)

# 2. The machine: Debian minbase, checked to have no toolchain.
say 'debootstrap --variant=minbase bookworm (the .debs are cached)'
t0=$(date +%s)
debootstrap --variant=minbase --cache-dir="$CACHE" bookworm "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
  || { tail -20 "$WORK/debootstrap.log" >&2; die 'debootstrap'; }
say "debootstrap took $(( $(date +%s) - t0 )) s"
for tool in gcc g++ cc c++ make python3 python; do
  if chroot "$ROOT" sh -c "command -v $tool" >/dev/null 2>&1; then die "the chroot has $tool"; fi
done

# Node and npm from the host (the binary needs only libc, libstdc++ and libgcc_s, which minbase
# has for apt).
NODE=$(readlink -f "$(command -v node)")
NPM_DIR=$(readlink -f "$(dirname "$(readlink -f "$(command -v npm)")")/..")
[ -f "$NPM_DIR/bin/npm-cli.js" ] || die "npm not found at $NPM_DIR"
install -D -m 0755 "$NODE" "$ROOT/usr/local/bin/node"
mkdir -p "$ROOT/usr/local/lib/node_modules"
cp -a "$NPM_DIR" "$ROOT/usr/local/lib/node_modules/npm"
ln -sf ../lib/node_modules/npm/bin/npm-cli.js "$ROOT/usr/local/bin/npm"
ln -sf ../lib/node_modules/npm/bin/npx-cli.js "$ROOT/usr/local/bin/npx"
cp "$TGZ" "$ROOT/tmp/"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
# Node carries its own root certificates. A host that reaches the registry through a proxy with
# its own CA says so with NODE_EXTRA_CA_CERTS: that bundle is copied in (the chroot has no
# ca-certificates package).
EXTRA_CA=
if [ -n "${NODE_EXTRA_CA_CERTS:-}" ] && [ -f "$NODE_EXTRA_CA_CERTS" ]; then
  install -D -m 0644 "$NODE_EXTRA_CA_CERTS" "$ROOT/etc/pvisor-install-check-ca.pem"
  EXTRA_CA=/etc/pvisor-install-check-ca.pem
fi
mount -t proc proc "$ROOT/proc"
KVM=no
if [ -c /dev/kvm ]; then
  touch "$ROOT/dev/kvm"
  mount --bind /dev/kvm "$ROOT/dev/kvm"
  KVM=yes
fi

# Runs a shell command in the chroot, in /proj, with nothing of this host's environment.
in_root() {
  env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 ${EXTRA_CA:+NODE_EXTRA_CA_CERTS=$EXTRA_CA} \
    "$CHROOT" "$ROOT" sh -ec "cd /proj && $1"
}
mkdir -p "$ROOT/proj"
NODE_VERSION=$(in_root 'node --version')
NPM_VERSION=$(in_root 'npm --version')
say "node $NODE_VERSION (copied from the host's $NODE), npm $NPM_VERSION"

# 3. The install, timed: cold (empty npm cache), then again from the cache it filled.
NPM_INSTALL="npm install --no-audit --no-fund /tmp/$(basename "$TGZ")"
in_root 'npm init -y >/dev/null'
ms() { date +%s%3N; }
t0=$(ms)
in_root "$NPM_INSTALL" >"$WORK/install.log" 2>&1 || { cat "$WORK/install.log" >&2; die 'npm install (cold)'; }
COLD_MS=$(( $(ms) - t0 ))
cat "$WORK/install.log" >&2
[ ! -e "$ROOT/proj/node_modules/zstd-napi" ] || die 'zstd-napi was installed: the chroot must have built it'
grep -l 'zstd-napi' "$ROOT"/root/.npm/_logs/*.log >/dev/null || die "npm's log does not mention zstd-napi"
ZSTD_LOG=$(grep -h -m1 -E 'info run zstd-napi@.* install \{ code' "$ROOT"/root/.npm/_logs/*.log | sed 's/^[0-9]* //' || true)
MODULES_KIB=$(du -sk "$ROOT/proj/node_modules" | cut -f1)
PACKAGES=$(in_root 'npm ls --all --parseable 2>/dev/null | tail -n +2 | wc -l')
PACKAGE_LIST=$(in_root 'npm ls --all --parseable 2>/dev/null | tail -n +2 | sed "s|.*/node_modules/||" | tr "\n" " "')
rm -rf "$ROOT/proj/node_modules" "$ROOT/proj/package-lock.json"
t0=$(ms)
in_root "$NPM_INSTALL" >/dev/null 2>&1 || die 'npm install (warm)'
WARM_MS=$(( $(ms) - t0 ))

# Why it failed: its install script once more, in the foreground, in a scratch project.
mkdir -p "$ROOT/scratch"
env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 ${EXTRA_CA:+NODE_EXTRA_CA_CERTS=$EXTRA_CA} \
  "$CHROOT" "$ROOT" sh -c 'cd /scratch && npm init -y >/dev/null && timeout 300 npm install --no-audit --no-fund --foreground-scripts zstd-napi@0.0.13' \
  >"$WORK/zstd.log" 2>&1 || true
ZSTD_WHY=$(grep -m2 -E 'prebuild-install (warn|err)|gyp ERR! find Python You need' "$WORK/zstd.log" | tr '\n' ';' || true)

# 4. What a user does next.
say 'require, import, type-check, CLI'
cat >"$ROOT/proj/check.cjs" <<'EOF'
// CommonJS: importing pvisor maps no native code; CompressedOffload reports the missing binding.
const fs = require('node:fs');
const p = require('pvisor');
const native = fs.readFileSync('/proc/self/maps', 'utf8').split('\n').filter((l) => /node_modules|pvisor|\.node$/.test(l));
const loaded = Object.keys(require.cache).filter((k) => /ffi-rs|zstd-napi|\.node$/.test(k));
if (native.length || loaded.length) throw new Error(`native code loaded at import: ${[...native, ...loaded].join('\n')}`);
try {
  new p.CompressedOffload();
  throw new Error('CompressedOffload constructed without zstd-napi');
} catch (e) {
  if (!(e instanceof p.OptionalDependencyError) || !(e instanceof p.PvisorError)) throw e;
  if (e.dependency !== 'zstd-napi' || e.feature !== 'CompressedOffload' || e.code !== 'PVISOR_OPTIONAL_DEPENDENCY' || !/npm install zstd-napi/.test(e.message)) throw e;
  console.log(`cjs: require('pvisor') mapped no native code; new CompressedOffload(): ${e.name} ${e.code}: ${e.message}`);
}
EOF
cat >"$ROOT/proj/check.mjs" <<'EOF'
// ESM: named imports resolve; a typed error from a call that needs no native code.
import { Vm, VmHandle, VmNotFoundError, OptionalDependencyError, CompressedOffload } from 'pvisor';
if (typeof Vm.start !== 'function' || typeof OptionalDependencyError !== 'function') throw new Error('missing exports');
try { new CompressedOffload(); throw new Error('constructed'); } catch (e) { if (!(e instanceof OptionalDependencyError)) throw e; }
try {
  await VmHandle.connect('no-such-vm');
  throw new Error('connected to a VM that does not exist');
} catch (e) {
  if (!(e instanceof VmNotFoundError)) throw e;
  console.log(`esm: import { ... } from 'pvisor' works; VmHandle.connect('no-such-vm'): ${e.name} ${e.code}`);
}
EOF
cat >"$ROOT/proj/check.mts" <<'EOF'
// Strict TypeScript (nodenext): the package's own .d.ts, and @types/node which it brings.
import { Vm, VmHandle, OptionalDependencyError, CompressedOffload, type VmOptions, type ExecResult } from 'pvisor';
const options: VmOptions = { memory: '256MiB', vcpus: 1, network: 'none', strategies: [] };
export async function run(): Promise<string> {
  await using vm = await Vm.start(options);
  const r: ExecResult = await vm.exec(['uname', '-r']);
  const h: VmHandle = await Vm.connect(vm.name);
  await h.stop();
  return r.stdout;
}
export function zstdMissing(e: unknown): e is OptionalDependencyError {
  return e instanceof OptionalDependencyError && e.dependency === 'zstd-napi';
}
export const strategy = (): CompressedOffload => new CompressedOffload({ level: 3 });
// The types are real, not any: each of these must be an error.
// @ts-expect-error memory is a size, not a boolean
export const bad1: VmOptions = { memory: true };
// @ts-expect-error dependency is a string
export const bad2 = (e: OptionalDependencyError): number => e.dependency;
EOF
cat >"$ROOT/proj/tsconfig.json" <<'EOF'
{ "compilerOptions": { "strict": true, "noEmit": true, "module": "nodenext", "moduleResolution": "nodenext", "target": "es2022", "lib": ["es2022", "esnext.disposable"], "skipLibCheck": false }, "files": ["check.mts"] }
EOF
CJS=$(in_root 'node check.cjs') || die 'check.cjs'
ESM=$(in_root 'node check.mjs') || die 'check.mjs'
in_root 'npm install --no-audit --no-fund --save-dev typescript@5.9 >/dev/null 2>&1' || die 'npm install typescript'
TSC_VERSION=$(in_root 'npx tsc --version')
in_root 'npx tsc -p tsconfig.json' || die 'tsc --strict on check.mts'
VERSION=$(in_root 'npx pvisor --version') || die 'pvisor --version'
in_root 'npx pvisor --help' >"$WORK/help.txt" || die 'pvisor --help'
grep -q 'run' "$WORK/help.txt" || die 'pvisor --help says nothing of run'
set +e
in_root 'npx pvisor run --guest probe --vm-ram-compression -- digest' >"$WORK/compression.txt" 2>&1
COMPRESSION_STATUS=$?
set -e
[ "$COMPRESSION_STATUS" = 125 ] && grep -q 'zstd-napi' "$WORK/compression.txt" \
  || { cat "$WORK/compression.txt" >&2; die "pvisor run --vm-ram-compression: exit $COMPRESSION_STATUS, expected 125 naming zstd-napi"; }

PROBE='skipped (no /dev/kvm)'
if [ "$KVM" = yes ]; then
  say 'the probe guest on /dev/kvm'
  t0=$(ms)
  in_root 'npx pvisor run --guest probe -- fill 16MiB random 1, digest' >"$WORK/probe.txt" 2>&1 \
    || { cat "$WORK/probe.txt" >&2; die 'pvisor run --guest probe'; }
  PROBE="ok in $(( $(ms) - t0 )) ms: $(grep -i -m1 digest "$WORK/probe.txt" || tail -1 "$WORK/probe.txt")"
  cat "$WORK/probe.txt" >&2
fi

cat <<EOF
install-check results ($(date -u +%Y-%m-%d), $(nproc) cores; load $(cut -d' ' -f1-3 /proc/loadavg)):
  machine:            Debian bookworm minbase chroot, no gcc/g++/cc/make/python3
  node / npm:         $NODE_VERSION (the host's $NODE, copied in) / $NPM_VERSION
  tarball:            $(basename "$TGZ"), $TGZ_BYTES bytes, $TGZ_FILES files
  npm install (cold): $COLD_MS ms (empty npm cache)
  npm install (warm): $WARM_MS ms (cache filled by the cold run)
  node_modules:       $MODULES_KIB KiB, $PACKAGES packages: $PACKAGE_LIST
  zstd-napi:          left out; npm log: ${ZSTD_LOG:-(no build line found)}
  zstd-napi's script: ${ZSTD_WHY:-(see zstd.log)}
  $CJS
  $ESM
  typescript:         $TSC_VERSION --strict, nodenext: check.mts type-checks (with two expected errors)
  pvisor --version:   $VERSION; --help: $(wc -l <"$WORK/help.txt") lines
  --vm-ram-compression: exit 125: $(grep -m1 zstd-napi "$WORK/compression.txt")
  probe guest:        $PROBE
EOF
