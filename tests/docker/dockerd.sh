#!/usr/bin/env bash
# Private Docker engine for Antidote's tests (DESIGN.md §6).
#
#   dockerd.sh start   reuse an engine that answers (DOCKER_HOST, then the default socket, then
#                      our private one), else install docker.io if needed and start a private
#                      `dockerd --storage-driver=vfs` with iptables on. Last stdout line:
#                      DOCKER_HOST=unix://...
#   dockerd.sh stop    stop the private daemon (and its containerd and shims); never touches an
#                      engine this script did not start. Keeps the data root (images stay cached).
#   dockerd.sh env     print DOCKER_HOST=... if the private daemon answers (exit 1 otherwise).
#   dockerd.sh purge   stop, then delete the state dir (data root, images) as well.
#
# Environment: ANTIDOTE_DOCKER_STATE (state dir, default /tmp/antidote-dockerd),
#              ANTIDOTE_DOCKER_TIMEOUT (seconds to wait for the daemon, default 60).
set -euo pipefail

STATE=${ANTIDOTE_DOCKER_STATE:-/tmp/antidote-dockerd}
TIMEOUT=${ANTIDOTE_DOCKER_TIMEOUT:-60}
DEFAULT_SOCK=/var/run/docker.sock

log() { echo "dockerd.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

STATE=$(realpath -m -- "$STATE")
# libnetwork puts "<exec-root>/<64 hex>.sock" and containerd "<exec-root>/containerd/
# containerd.sock.ttrpc"; unix socket paths must stay < 108 bytes, so the exec root must be
# <= ~36 bytes. A long state dir gets a short side dir keyed by its path.
if (( ${#STATE} <= 30 )); then
  SHORT=$STATE
else
  SHORT=/tmp/adk-$(printf %s "$STATE" | sha256sum | cut -c1-10)
fi
EXEC_ROOT=$SHORT/r
SOCK=$SHORT/docker.sock
DATA_ROOT=$STATE/data
PIDFILE=$STATE/dockerd.pid
LOGFILE=$STATE/dockerd.log
SHIM_BIN=$STATE/bin
CONTAINERD_SOCK=$EXEC_ROOT/containerd/containerd.sock
PRIVATE_HOST=unix://$SOCK

# Answers within a few seconds? $1: a DOCKER_HOST value.
answers() {
  [[ -n $1 ]] || return 1
  command -v docker >/dev/null 2>&1 || return 1
  DOCKER_HOST=$1 DOCKER_CONTEXT= timeout 10 docker version --format '{{.Server.Version}}' \
    >/dev/null 2>&1
}

private_pid() {
  local pid
  [[ -s $PIDFILE ]] || return 1
  pid=$(<"$PIDFILE")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  [[ -r /proc/$pid/cmdline ]] || return 1
  # The pid must still be our dockerd (pids get reused).
  tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "--pidfile $PIDFILE" || return 1
  echo "$pid"
}

need_root() { [[ $(id -u) == 0 ]] || die "must run as root to start dockerd"; }

install_packages() {
  local missing=()
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  dpkg -s busybox-static >/dev/null 2>&1 || missing+=(busybox-static)
  command -v iptables >/dev/null 2>&1 || missing+=(iptables)
  (( ${#missing[@]} )) || return 0
  need_root
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  local apt=(apt-get install -y -q --no-install-recommends -o Dpkg::Use-Pty=0 "${missing[@]}")
  if [[ " ${missing[*]} " == *" docker.io "* ]]; then
    # dockerd missing: refresh the package lists once, then install.
    apt-get update -q -o Dpkg::Use-Pty=0 >&2
    "${apt[@]}" >&2
  else
    "${apt[@]}" >&2 || { apt-get update -q >&2 && "${apt[@]}" >&2; }
  fi
  command -v dockerd >/dev/null 2>&1 || die "dockerd still missing after installing docker.io"
}

# Docker runs `iptables` from PATH. Pick the variant that works here without touching the
# system's alternatives: legacy if legacy tables are already in use (never mix the two),
# else the default (nft on Debian 12), else the other one. Result: $SHIM_BIN/iptables*.
choose_iptables() {
  local candidates=() v
  if [[ -s /proc/net/ip_tables_names ]] && command -v iptables-legacy >/dev/null; then
    candidates+=(legacy)
  fi
  candidates+=(default nft legacy)
  mkdir -p "$SHIM_BIN"
  for v in "${candidates[@]}"; do
    local ipt ip6t save restore
    case $v in
      default) ipt=$(command -v iptables || true); ip6t=$(command -v ip6tables || true)
               save=$(command -v iptables-save || true); restore=$(command -v iptables-restore || true) ;;
      *)       ipt=$(command -v "iptables-$v" || true); ip6t=$(command -v "ip6tables-$v" || true)
               save=$(command -v "iptables-$v-save" || true)
               restore=$(command -v "iptables-$v-restore" || true) ;;
    esac
    [[ -n $ipt ]] || continue
    if "$ipt" -w -t nat -S >/dev/null 2>&1 && "$ipt" -w -t filter -S >/dev/null 2>&1; then
      ln -sfn "$ipt" "$SHIM_BIN/iptables"
      [[ -n $ip6t ]] && ln -sfn "$ip6t" "$SHIM_BIN/ip6tables"
      [[ -n $save ]] && ln -sfn "$save" "$SHIM_BIN/iptables-save"
      [[ -n $restore ]] && ln -sfn "$restore" "$SHIM_BIN/iptables-restore"
      log "iptables: $("$ipt" -V 2>/dev/null) ($v)"
      return 0
    fi
  done
  die "no working iptables (tried ${candidates[*]}); the kernel needs ip_tables or nf_tables with nat"
}

# Pids of our engine's leftovers: containerd and shims, found by our containerd socket path in
# their command line (so nothing else matches), plus the shims' children (container inits,
# whose death ends their whole pid namespace).
stray_pids() {
  local p cmd ppid shims=() inits=()
  for p in /proc/[0-9]*; do
    [[ ${p#/proc/} != "$$" ]] || continue
    cmd=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline") || continue
    [[ $cmd == *"$EXEC_ROOT/containerd/"* ]] && shims+=("${p#/proc/}")
  done
  (( ${#shims[@]} )) || return 1
  for p in /proc/[0-9]*; do
    ppid=$(awk '/^PPid:/ { print $2 }' 2>/dev/null <"$p/status") || continue
    [[ " ${shims[*]} " == *" $ppid "* ]] && inits+=("${p#/proc/}")
  done
  echo "${inits[*]} ${shims[*]}"
}

# Kill leftovers of a daemon that is gone (crashed or killed): containers first, then the
# shims and containerd. Returns 1 if there was nothing to kill.
kill_strays() {
  local pids deadline
  pids=$(stray_pids) || return 1
  log "killing leftovers of the private engine: $pids"
  # shellcheck disable=SC2086
  kill -KILL $pids 2>/dev/null || true
  deadline=$((SECONDS + 10))
  while pids=$(stray_pids) && (( SECONDS < deadline )); do sleep 0.2; done
  return 0
}

# Unmount whatever is left under our dirs (netns and shm mounts, the data root's own mount),
# deepest first. Only when our daemon is not running.
unmount_ours() {
  local d m
  for d in "$@"; do
    [[ -e $d ]] || continue
    awk -v r="$d" '$2 == r || index($2, r "/") == 1 { print $2 }' /proc/self/mounts | sort -r \
      | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  done
}

wait_ready() {
  local pid=$1 deadline=$((SECONDS + TIMEOUT))
  while (( SECONDS < deadline )); do
    if answers "$PRIVATE_HOST"; then return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      log "dockerd (pid $pid) exited; log follows:"; tail -n 60 "$LOGFILE" >&2 || true
      return 1
    fi
    sleep 0.3
  done
  log "dockerd did not answer within ${TIMEOUT}s; log follows:"
  tail -n 60 "$LOGFILE" >&2 || true
  return 1
}

cmd_start() {
  # 1. An engine that already answers.
  if [[ -n ${DOCKER_HOST:-} ]] && answers "$DOCKER_HOST"; then
    echo "DOCKER_HOST=$DOCKER_HOST"; return 0
  fi
  if [[ -S $DEFAULT_SOCK ]] && answers "unix://$DEFAULT_SOCK"; then
    echo "DOCKER_HOST=unix://$DEFAULT_SOCK"; return 0
  fi
  mkdir -p "$STATE" "$SHORT"
  exec 9>"$STATE/lock"
  flock -w $((TIMEOUT + 30)) 9 || die "could not lock $STATE/lock"
  # 2. Our private daemon, running (or still starting).
  local pid
  if pid=$(private_pid); then
    wait_ready "$pid" || die "private dockerd (pid $pid) does not answer"
    echo "DOCKER_HOST=$PRIVATE_HOST"; return 0
  fi
  # 3. Start it.
  need_root
  install_packages
  choose_iptables
  # Leftovers of a daemon that died: containers, shims, containerd, mounts, pidfile, socket.
  kill_strays || true
  unmount_ours "$EXEC_ROOT" "$DATA_ROOT"
  rm -f "$PIDFILE" "$SOCK"
  mkdir -p "$DATA_ROOT" "$EXEC_ROOT"
  # Our own (empty) config file, so /etc/docker/daemon.json cannot interfere.
  [[ -f $STATE/daemon.json ]] || echo '{}' >"$STATE/daemon.json"
  [[ -f $STATE/ip_forward.orig ]] || cat /proc/sys/net/ipv4/ip_forward >"$STATE/ip_forward.orig" 2>/dev/null || true
  local args=(
    --config-file "$STATE/daemon.json"
    --storage-driver=vfs
    --data-root "$DATA_ROOT"
    --exec-root "$EXEC_ROOT"
    --pidfile "$PIDFILE"
    --host "$PRIVATE_HOST"
    --iptables=true
    --ip-forward=true
    --userland-proxy=true
    --shutdown-timeout 5
    # Many small networks (one per lesson and per connection): 256 /24s instead of ~31.
    --default-address-pool base=10.213.0.0/16,size=24
  )
  log "starting dockerd (state $STATE, socket $SOCK, log $LOGFILE)"
  echo "=== $(date -Is) dockerd ${args[*]}" >>"$LOGFILE"
  PATH=$SHIM_BIN:$PATH setsid dockerd "${args[@]}" >>"$LOGFILE" 2>&1 </dev/null 9>&- &
  pid=$!
  if ! wait_ready "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    die "private dockerd failed to start"
  fi
  echo "DOCKER_HOST=$PRIVATE_HOST"
}

cmd_stop() {
  mkdir -p "$STATE"
  exec 9>"$STATE/lock"
  flock -w 60 9 || die "could not lock $STATE/lock"
  local pid deadline
  if pid=$(private_pid); then
    log "stopping dockerd (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then
      log "dockerd ignored SIGTERM for 30s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
      while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    fi
  else
    log "private dockerd is not running"
  fi
  # dockerd stops its containers and containerd; after a crash they linger.
  kill_strays || true
  # Safe leftovers: socket, pidfile, mounts, exec root (runtime state). The data root stays.
  rm -f "$PIDFILE" "$SOCK"
  unmount_ours "$EXEC_ROOT" "$DATA_ROOT"
  rm -rf "$EXEC_ROOT"
  # Restore the host's ip_forward if dockerd turned it on.
  if [[ -f $STATE/ip_forward.orig ]]; then
    cat "$STATE/ip_forward.orig" >/proc/sys/net/ipv4/ip_forward 2>/dev/null || true
    rm -f "$STATE/ip_forward.orig"
  fi
  [[ $SHORT != "$STATE" ]] && rmdir "$SHORT" 2>/dev/null || true
  return 0
}

cmd_env() {
  if private_pid >/dev/null && answers "$PRIVATE_HOST"; then
    echo "DOCKER_HOST=$PRIVATE_HOST"
  else
    log "private dockerd is not running"; return 1
  fi
}

cmd_purge() {
  cmd_stop
  rm -rf "$STATE"
}

case ${1:-} in
  start) cmd_start ;;
  stop)  cmd_stop ;;
  env)   cmd_env ;;
  purge) cmd_purge ;;
  *) echo "usage: $0 start|stop|env|purge" >&2; exit 2 ;;
esac
