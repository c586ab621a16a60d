#!/usr/bin/env bash
# A real S3-compatible object store on this machine's loopback, for tests and CI (issue 27):
# Ceph's radosgw (Debian's `radosgw`, Ceph 16.2 pacific) over a one-node Ceph cluster of one
# monitor and one OSD, started as plain processes (no systemd, no disk of its own).
# docs/object-store.md says why radosgw, what it costs to start and to keep running, and which
# S3 conditional writes it honours.
#
#   scripts/object-store.sh start [--dir DIR]   start it (installing Debian's packages if missing,
#                                               as root), create the bucket `pvisor`, and print
#                                               the AWS environment as shell `export` lines
#   scripts/object-store.sh env   [--dir DIR]   print those lines again (fails if not running)
#   scripts/object-store.sh status [--dir DIR]  exit 0 when it is running and answers
#   scripts/object-store.sh stop  [--dir DIR]   end every process it started, remove its state
#   scripts/object-store.sh install             install the packages now if missing (as root; exit 3
#                                               when they are missing and cannot be), so that
#                                               nested L1s, which see this host's /usr, find them
#   scripts/object-store.sh check               exit 0 when start can have its packages (they are
#                                               installed, or can be: root and apt-get), else 3
#
# Use:   eval "$(scripts/object-store.sh start)"
# State (config, pid files, logs, keys, the OSD's data) lives in DIR, by default
# .cache/object-store/ in the repository, or $OBJECT_STORE_DIR. Ports are free loopback ports
# picked at start, or $OBJECT_STORE_PORT (S3) and $OBJECT_STORE_MON_PORT (Ceph monitor).
# $OBJECT_STORE_BACKEND: bluestore (objects in a sparse file in DIR, memory bounded; the
# default) or memstore (objects in the OSD's memory: starts ~6 s sooner, but holds ~2.2x what is
# stored); $OBJECT_STORE_SIZE_MIB its capacity (4096).
# $OBJECT_STORE_TIMEOUT_S bounds each wait for a daemon (120).
# stdout carries only the export lines; progress and errors go to stderr. A start that fails
# says which step and shows that daemon's last log lines, ends the daemons it had started, and
# keeps DIR's logs until the next start or stop.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${OBJECT_STORE_DIR:-$repo/.cache/object-store}
command=${1:-}
shift || true
while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=${2:?--dir needs a directory}; shift 2 ;;
    *) echo "object-store: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

# Debian packages: the monitor, the OSD, the S3 gateway, and the `ceph`/`radosgw-admin` tools.
# curl signs S3 requests itself (--aws-sigv4), so the bucket needs no SDK.
packages=(ceph-mon ceph-osd radosgw ceph-common curl uuid-runtime)
bucket=pvisor
# rgw ignores the region in a SigV4 signature's scope; clients still need one.
region=us-east-1
# Bounds on every wait, so a store that cannot start fails start instead of hanging it.
readyTimeoutS=${OBJECT_STORE_TIMEOUT_S:-120}

log() { echo "object-store: [${SECONDS} s] $*" >&2; }
fail() {
  log "FAILED: $*"
  exit 1
}

conf() { echo "$dir/ceph.conf"; }
ceph_() { ceph -c "$(conf)" --connect-timeout 15 "$@"; }

# The daemons this script starts, each by its pid file (written by the daemon itself) and the
# command name it must still have: a pid file left from a reboot never makes stop kill a stranger.
daemons=("mon.a:ceph-mon" "osd.0:ceph-osd" "client.rgw:radosgw")

pid_of() { # NAME COMM -> the pid if that daemon is alive
  local file=$dir/run/$1.pid pid
  [ -s "$file" ] || return 1
  pid=$(cat "$file")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  echo "$pid"
}

env_lines() {
  [ -s "$dir/env" ] || return 1
  cat "$dir/env"
}

running() {
  local d
  for d in "${daemons[@]}"; do pid_of "${d%%:*}" "${d#*:}" >/dev/null || return 1; done
  local endpoint
  endpoint=$(sed -n 's/^export AWS_ENDPOINT_URL=//p' "$dir/env" 2>/dev/null)
  [ -n "$endpoint" ] && curl -fsS -o /dev/null --max-time 5 "$endpoint/"
}

stop_daemons() {
  local d name comm pid i
  # One at a time, the gateway first and the monitor last: each ends in about 2 s on SIGTERM, but
  # a radosgw whose OSD is gone first waits some 2 minutes on its requests to it.
  for ((i = ${#daemons[@]} - 1; i >= 0; i--)); do
    d=${daemons[$i]}; name=${d%%:*}; comm=${d#*:}
    pid=$(pid_of "$name" "$comm") || continue
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
    if [ -d "/proc/$pid" ]; then
      log "$name (pid $pid) did not end in 10 s on SIGTERM; SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
    fi
  done
}

stop() {
  stop_daemons
  # Refuse to remove anything but a state directory this script made (it holds our marker).
  if [ -d "$dir" ]; then
    [ -e "$dir/.object-store" ] || fail "$dir has no .object-store marker; not removing it"
    rm -rf "$dir"
  fi
}

port_free() { # PORT -> 0 when nothing listens on 127.0.0.1:PORT
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_port() { # a free loopback port below the kernel's ephemeral range, avoiding $1 if given
  # Not in the ephemeral range: there the kernel gives ports to outgoing connections, and one made
  # between this check and the daemon's bind takes the port (seen: ceph-mon's bind failed with
  # EADDRINUSE while the tests beside it were making S3 connections).
  local p low
  low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  [ "$low" -gt 12000 ] 2>/dev/null || low=32768
  for _ in $(seq 1 200); do
    p=$((10000 + RANDOM % (low - 10000)))
    [ "$p" != "${1:-}" ] && port_free "$p" && { echo "$p"; return 0; }
  done
  return 1
}

# A package counts as there when the program start runs from it is: dpkg's database is not always
# where the programs are (the nested KVM harness's L1 mounts the host's /usr and /etc, not /var).
declare -A package_command=([ceph-mon]=ceph-mon [ceph-osd]=ceph-osd [radosgw]=radosgw [ceph-common]=ceph [curl]=curl [uuid-runtime]=uuidgen)
missing_packages() {
  local p
  for p in "${packages[@]}"; do
    command -v "${package_command[$p]}" >/dev/null 2>&1 ||
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
  done
}

# Exit 3 (not 1) when the packages are missing and cannot be installed here, so a test can tell
# "this machine cannot run the store" (skip) from "the store failed" (fail).
check_installable() {
  local missing
  missing=$(missing_packages | tr '\n' ' ')
  [ -z "$missing" ] && return 0
  if ! command -v apt-get >/dev/null; then
    log "missing Debian packages (${missing% }) and no apt-get to install them"
    exit 3
  fi
  if [ "$(id -u)" != 0 ]; then
    log "missing Debian packages (${missing% }); installing them needs root"
    exit 3
  fi
}

install_packages() {
  local missing=()
  mapfile -t missing < <(missing_packages)
  [ ${#missing[@]} = 0 ] && return 0
  check_installable
  log "installing ${missing[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  # An empty package list (a fresh machine) finds nothing: update once, then install. Another
  # apt-get running (a test's, a helper's) would make this one fail at once: wait for it.
  local wait=(-o DPkg::Lock::Timeout=300)
  apt-get "${wait[@]}" update -qq >&2 || fail "apt-get update failed"
  apt-get "${wait[@]}" install -y -qq --no-install-recommends "${missing[@]}" >"$dir/apt.log" 2>&1 ||
    fail "apt-get install ${missing[*]} failed; see $dir/apt.log: $(tail -3 "$dir/apt.log")"
}

wait_for() { # DESCRIPTION LOGFILE COMMAND... : poll until COMMAND succeeds or the bound passes
  local what=$1 logfile=$2 deadline=$((SECONDS + readyTimeoutS))
  shift 2
  until "$@" >/dev/null 2>&1; do
    if [ $SECONDS -ge $deadline ]; then
      fail "$what not ready in ${readyTimeoutS} s; last lines of $logfile:
$(tail -n 15 "$logfile" 2>/dev/null)"
    fi
    sleep 0.3
  done
}

osd_up() { ceph_ osd dump 2>/dev/null | grep -q '^osd.0 up'; }
s3_answers() { curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$rgwPort/"; }

# The OSD's object store. bluestore keeps objects in a sparse file in the state directory, with
# small caches, so the store's memory stays near 100 MiB whatever the tests put in it (snapshots
# of guest RAM). memstore keeps them in the OSD's memory, at about 2.2x their size (256 MiB
# stored: the OSD at 560 MiB), and starts about 6 s sooner. docs/object-store.md has the figures.
backend=${OBJECT_STORE_BACKEND:-bluestore}
sizeMiB=${OBJECT_STORE_SIZE_MIB:-4096}
case $backend in memstore | bluestore) ;; *) fail "OBJECT_STORE_BACKEND must be memstore or bluestore, not '$backend'" ;; esac
[[ $sizeMiB =~ ^[1-9][0-9]{0,6}$ ]] || fail "OBJECT_STORE_SIZE_MIB must be a number of MiB, not '$sizeMiB'"
osd_store_conf() {
  case $backend in
    memstore) cat <<EOF
osd objectstore = memstore
memstore device bytes = $((sizeMiB * 1024 * 1024))
EOF
    ;;
    bluestore) cat <<EOF
osd objectstore = bluestore
bluestore block path = $dir/osd/block
bluestore block create = true
bluestore block size = $((sizeMiB * 1024 * 1024))
bluestore block db create = false
bluestore block wal create = false
osd memory target = 268435456
bluestore cache autotune = false
bluestore cache size = 67108864
EOF
    ;;
  esac
}

write_conf() {
  cat >"$(conf)" <<EOF
# Written by scripts/object-store.sh: a one-node Ceph cluster for tests, loopback only.
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$monPort
public network = 127.0.0.0/8
ms bind ipv6 = false
# No cephx: one machine, loopback only, state thrown away at stop. radosgw's monitor client
# asks for the 'secure' connection mode by default, which needs cephx's session key; allow crc.
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc secure
mon warn on insecure global id reclaim = false
mon warn on insecure global id reclaim allowed = false
# One OSD: pools of one replica, placement without a host level, few placement groups.
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon allow pool delete = true
# A client that cannot reach the monitor gives up instead of waiting the default 300 s.
client mount timeout = 30
run dir = $dir/run
admin socket = $dir/run/\$name.asok
log file = $dir/log/\$name.log
pid file = $dir/run/\$name.pid
[mon]
mon data = $dir/mon/\$cluster-\$id
# A lone monitor need not batch its map updates: the default 1 s batching made every pool that
# radosgw creates cost about 2 s.
paxos propose interval = 0.05
paxos min wait = 0.01
[osd]
osd data = $dir/osd/\$cluster-\$id
$(osd_store_conf)
[client.rgw]
# tcp_nodelay: without it a small answer (a page's range read, a manifest) waits for the client's
# delayed ACK after its headers: 45-48 ms for 4 KiB where 64 KiB took 5 ms (Nagle's algorithm;
# an object store in production answers at once, and so must this one for the restore figures).
rgw frontends = beast endpoint=127.0.0.1:$rgwPort tcp_nodelay=1
rgw data = $dir/rgw
# The default 512 request threads cost memory a test never uses.
rgw thread pool size = 16
EOF
}

start() {
  if running; then
    log "already running in $dir"
    env_lines
    return 0
  fi
  # Anything left of an earlier run that is not whole is ended and removed, then started anew.
  if [ -d "$dir" ]; then
    log "removing a stopped or partial store in $dir"
    stop
  fi
  check_installable
  mkdir -p "$dir"/{run,log,mon,osd/ceph-0,rgw}
  chmod 700 "$dir" # it will hold the S3 keys
  touch "$dir/.object-store"
  # From here on a failure ends what this start began; the logs stay for reading.
  trap 'rc=$?; if [ $rc != 0 ]; then stop_daemons; log "logs are in $dir/log; the next start or stop removes them"; fi' EXIT
  install_packages

  monPort=${OBJECT_STORE_MON_PORT:-$(free_port)} || fail "no free loopback port for the monitor"
  rgwPort=${OBJECT_STORE_PORT:-$(free_port "$monPort")} || fail "no free loopback port for S3"
  port_free "$monPort" || fail "port $monPort (monitor) is in use"
  port_free "$rgwPort" || fail "port $rgwPort (S3) is in use"
  fsid=$(uuidgen)
  write_conf

  log "monitor on 127.0.0.1:$monPort"
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$monPort]" "$dir/monmap" >"$dir/log/monmaptool.log" 2>&1 ||
    fail "monmaptool: $(cat "$dir/log/monmaptool.log")"
  ceph-mon -c "$(conf)" -i a --mkfs --monmap "$dir/monmap" >"$dir/log/mon-mkfs.log" 2>&1 ||
    fail "ceph-mon --mkfs: $(tail -5 "$dir/log/mon-mkfs.log")"
  ceph-mon -c "$(conf)" -i a >"$dir/log/mon-start.log" 2>&1 9<&- || fail "ceph-mon: $(tail -5 "$dir/log/mon-start.log")"
  wait_for "the Ceph monitor" "$dir/log/mon.a.log" ceph_ mon stat

  log "OSD ($backend)"
  local uuid id
  uuid=$(uuidgen)
  id=$(ceph_ osd new "$uuid" 2>"$dir/log/osd-new.log") || fail "ceph osd new: $(cat "$dir/log/osd-new.log")"
  [ "$id" = 0 ] || fail "ceph osd new gave id '$id', not 0"
  ceph-osd -c "$(conf)" -i 0 --mkfs --osd-uuid "$uuid" >"$dir/log/osd-mkfs.log" 2>&1 ||
    fail "ceph-osd --mkfs: $(tail -5 "$dir/log/osd-mkfs.log")"
  ceph-osd -c "$(conf)" -i 0 >"$dir/log/osd-start.log" 2>&1 9<&- || fail "ceph-osd: $(tail -5 "$dir/log/osd-start.log")"
  wait_for "the OSD" "$dir/log/osd.0.log" osd_up

  # radosgw detaches once it has reached the cluster.
  log "radosgw on 127.0.0.1:$rgwPort"
  radosgw -c "$(conf)" -n client.rgw >"$dir/log/rgw-start.log" 2>&1 9<&- ||
    fail "radosgw: $(tail -5 "$dir/log/rgw-start.log") $(tail -5 "$dir/log/client.rgw.log" 2>/dev/null)"
  wait_for "radosgw" "$dir/log/client.rgw.log" s3_answers

  # Keys made here, for this store only: it listens on loopback and dies at stop.
  local accessKey secretKey endpoint
  accessKey=PVISOR$(head -c 10 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr a-f A-F)
  secretKey=$(head -c 30 /dev/urandom | od -An -tx1 | tr -d ' \n')
  radosgw-admin -c "$(conf)" -n client.admin user create --uid=pvisor --display-name=pvisor \
    --access-key="$accessKey" --secret-key="$secretKey" >"$dir/log/user-create.log" 2>&1 ||
    fail "radosgw-admin user create: $(tail -5 "$dir/log/user-create.log")"
  endpoint=http://127.0.0.1:$rgwPort

  # curl 7.75+ signs SigV4 itself; rgw wants the payload hash header, which curl does not add.
  local code
  code=$(curl -sS -o "$dir/log/bucket-create.log" -w '%{http_code}' --max-time 30 -X PUT \
    --aws-sigv4 "aws:amz:$region:s3" --user "$accessKey:$secretKey" \
    -H 'x-amz-content-sha256: UNSIGNED-PAYLOAD' "$endpoint/$bucket") ||
    fail "creating bucket $bucket: curl failed"
  [ "$code" = 200 ] || fail "creating bucket $bucket: HTTP $code $(cat "$dir/log/bucket-create.log")"

  # AWS_REQUEST_CHECKSUM_CALCULATION: the AWS SDKs (JavaScript v3 since 3.729) otherwise send a
  # streamed body as aws-chunked with a trailing CRC32, which radosgw 16 refuses (411
  # MissingContentLength); 'when_required' sends plain bodies. docs/object-store.md.
  cat >"$dir/env" <<EOF
export AWS_ENDPOINT_URL=$endpoint
export AWS_ACCESS_KEY_ID=$accessKey
export AWS_SECRET_ACCESS_KEY=$secretKey
export AWS_REGION=$region
export AWS_REQUEST_CHECKSUM_CALCULATION=when_required
export AWS_RESPONSE_CHECKSUM_VALIDATION=when_required
EOF
  trap - EXIT
  log "ready in ${SECONDS} s: $endpoint, bucket $bucket"
  env_lines
}

# One start or stop at a time in this parent directory: two starts of one store would race.
# The daemons are started with fd 9 closed (9<&-), or they would hold the lock for their lives.
lock() {
  mkdir -p "$(dirname "$dir")"
  exec 9<"$(dirname "$dir")"
  flock -w 600 9 || fail "another object-store.sh kept $(dirname "$dir") locked for 600 s"
}

case $command in
  start) lock; start ;;
  stop) lock; stop ;;
  env) running || fail "not running (state: $dir)"; env_lines ;;
  status) running ;;
  check) check_installable ;;
  install) mkdir -p "$dir"; install_packages ;;
  *) echo "usage: $0 start|stop|env|status|check|install [--dir DIR]" >&2; exit 2 ;;
esac
