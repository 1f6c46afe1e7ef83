#!/usr/bin/env bash
# Private Docker engine for Antidote's tests.
#
#   dockerd.sh start   reuse an engine that answers (DOCKER_HOST, then the default socket, then
#                      our private one), else install docker.io if needed and start a private
#                      `dockerd --storage-driver=vfs` with iptables on. Last stdout line:
#                      DOCKER_HOST=unix://...
#   dockerd.sh stop    stop the private daemon (and its containerd and shims); never touches an
#                      engine this script did not start. Keeps the data root (images stay cached).
#   dockerd.sh env     print DOCKER_HOST=... if the private daemon answers (exit 1 otherwise).
#   dockerd.sh purge   stop, then delete the state dir (data root, images) too, and Docker's
#                      iptables rules and idle bridges if no other dockerd runs.
#   dockerd.sh sweep   remove the containers and networks of the e2e tests' instances (label
#                      antidote.io/instance=e2e-*) from the engine DOCKER_HOST names: what a
#                      broken run left behind, which a later run's "all removed" checks would
#                      count. Only for an engine no other test run is using.
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
PRIVATE_HOST=unix://$SOCK

# Answers within a few seconds? $1: a DOCKER_HOST value.
answers() {
  [[ -n $1 ]] || return 1
  command -v docker >/dev/null 2>&1 || return 1
  DOCKER_HOST=$1 DOCKER_CONTEXT='' timeout 10 docker version --format '{{.Server.Version}}' \
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

# Running and not a zombie (this VM's init reaps orphans late; `kill -0` succeeds on zombies).
alive() {
  local st
  st=$(sed 's/.*) //' 2>/dev/null <"/proc/$1/stat" | cut -d' ' -f1) || return 1
  [[ -n $st && $st != Z ]]
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

# Docker runs `iptables` from PATH. Pick a variant (nft or legacy) without touching the
# system's alternatives, and link it into $SHIM_BIN, which goes first in dockerd's PATH:
#   1. the variant of our previous start, if it still works (the rules left from it live there);
#   2. a variant that already has Docker's chains;
#   3. the system default (`iptables`, nft on Debian 12), then nft, then legacy.
# Docker's rules must not be split across the two: the stale FORWARD policy DROP of an engine
# that used the other variant drops our traffic, even between containers of one network (this
# kernel has br_netfilter, so bridged packets traverse iptables too; seen here). So Docker's
# leftovers in the other variant are removed, unless another dockerd is running.
ipt_works() { "$1" -w -t nat -S >/dev/null 2>&1 && "$1" -w -t filter -S >/dev/null 2>&1; }
ipt_has_docker() { command -v "iptables-$1-save" >/dev/null && "iptables-$1-save" -t filter 2>/dev/null | grep -q '^:DOCKER'; }

# Any dockerd running that is not ours?
foreign_dockerd() {
  local f p
  for f in $(grep -lsx dockerd /proc/[0-9]*/comm); do
    p=${f#/proc/}; p=${p%/comm}
    alive "$p" || continue
    tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | grep -qF -- "--pidfile $PIDFILE" && continue
    return 0
  done
  return 1
}

# Remove Docker's rules (DOCKER* chains, rules naming docker0/br-<id>, jumps to DOCKER*,
# masquerading of our address pool) from one iptables variant, and set FORWARD back to ACCEPT.
# Only call it when no dockerd uses that variant. Other rules are kept (save, filter, restore).
ipt_clean_docker() {
  local v=$1 t dump
  command -v "iptables-$v-save" >/dev/null || return 0
  for t in filter nat; do
    dump=$("iptables-$v-save" -t "$t" 2>/dev/null) || continue
    grep -qE '^:DOCKER|docker0|br-[0-9a-f]{12}' <<<"$dump" || continue
    grep -vE '^:DOCKER|-j DOCKER|^-A DOCKER|docker0|br-[0-9a-f]{12}|-s 10\.213\.[0-9.]+/[0-9]+ .*-j MASQUERADE' \
      <<<"$dump" | sed -E 's/^:FORWARD DROP/:FORWARD ACCEPT/' | "iptables-$v-restore" -w \
      || log "warning: could not clean Docker's rules from iptables-$v ($t)"
  done
}

choose_iptables() {
  local candidates=() v def=""
  [[ -s $STATE/iptables-variant ]] && candidates+=("$(<"$STATE/iptables-variant")")
  ipt_has_docker nft && candidates+=(nft)
  ipt_has_docker legacy && candidates+=(legacy)
  if command -v iptables >/dev/null; then
    case $(iptables -V 2>/dev/null) in
      *nf_tables*) def=nft ;;
      *legacy*) def=legacy ;;
    esac
  fi
  [[ -n $def ]] && candidates+=("$def")
  candidates+=(nft legacy)
  mkdir -p "$SHIM_BIN"
  for v in "${candidates[@]}"; do
    [[ $v == nft || $v == legacy ]] || continue
    command -v "iptables-$v" >/dev/null || continue
    ipt_works "iptables-$v" || continue
    local t
    for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
      if command -v "${t/tables/tables-$v}" >/dev/null; then
        ln -sfn "$(command -v "${t/tables/tables-$v}")" "$SHIM_BIN/$t"
      fi
    done
    echo "$v" >"$STATE/iptables-variant"
    log "iptables: $("iptables-$v" -V 2>/dev/null)"
    local other=legacy
    [[ $v == legacy ]] && other=nft
    if ipt_has_docker "$other"; then
      if foreign_dockerd; then
        log "warning: iptables-$other has Docker rules and another dockerd runs; leaving them"
      else
        log "removing stale Docker rules from iptables-$other"
        ipt_clean_docker "$other"
      fi
    fi
    return 0
  done
  die "no working iptables (tried ${candidates[*]}); the kernel needs ip_tables or nf_tables with nat"
}

# Pids of our engine's leftovers: containerd and shims, found by our containerd socket path in
# their command line (so nothing else matches), plus the shims' children (container inits,
# whose death ends their whole pid namespace).
stray_pids() {
  local f p ppid shims=() inits=()
  # The pattern goes through a file so that grep's own command line does not match.
  printf '%s\n' "$EXEC_ROOT/containerd/" >"$STATE/.stray-pattern"
  for f in $(grep -lsFf "$STATE/.stray-pattern" /proc/[0-9]*/cmdline); do
    p=${f#/proc/}; p=${p%/cmdline}
    [[ $p != "$$" && $p != "$BASHPID" ]] && shims+=("$p")
  done
  (( ${#shims[@]} )) || return 1
  while IFS=: read -r f _ ppid; do
    p=${f#/proc/}; p=${p%/status}
    [[ " ${shims[*]} " == *" ${ppid//[[:space:]]/} "* ]] && inits+=("$p")
  done < <(grep -s '^PPid:' /proc/[0-9]*/status)
  echo "${inits[*]} ${shims[*]}"
}

# Kill leftovers of a daemon that is gone (crashed or killed): containers, shims, containerd;
# SIGTERM, then SIGKILL after 3 s. Returns 1 if there was nothing to kill.
kill_strays() {
  local pids p left deadline
  pids=$(stray_pids) || return 1
  log "killing leftovers of the private engine: $pids"
  # shellcheck disable=SC2086
  kill -TERM $pids 2>/dev/null || true
  deadline=$((SECONDS + 3))
  while :; do
    left=()
    for p in $pids; do alive "$p" && left+=("$p"); done
    (( ${#left[@]} )) || break
    if (( SECONDS >= deadline )); then
      kill -KILL "${left[@]}" 2>/dev/null || true
      deadline=$((SECONDS + 5)) # wait a little for the kills, then give up
      while :; do
        left=()
        for p in $pids; do alive "$p" && left+=("$p"); done
        (( ${#left[@]} && SECONDS < deadline )) || break
        sleep 0.1
      done
      break
    fi
    sleep 0.1
  done
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
    if ! alive "$pid"; then
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
  # shellcheck disable=SC2054 # the commas belong to --default-address-pool
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
    while alive "$pid" && (( SECONDS < deadline )); do sleep 0.1; done
    if alive "$pid"; then
      log "dockerd ignored SIGTERM for 30s; killing it"
      kill -KILL "$pid" 2>/dev/null || true
      while alive "$pid"; do sleep 0.1; done
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

# stop, then delete the state dir and, unless another dockerd runs, Docker's iptables rules and
# idle docker0/br-<id> bridges (dockerd leaves both behind at exit; a later start recreates them).
cmd_purge() {
  cmd_stop
  if ! foreign_dockerd; then
    local v l
    for v in nft legacy; do ipt_has_docker "$v" && ipt_clean_docker "$v"; done
    for l in $(ip -o link show type bridge 2>/dev/null | awk -F': ' '{ print $2 }'); do
      [[ $l == docker0 || $l =~ ^br-[0-9a-f]{12}$ ]] || continue
      [[ -z $(ls -A "/sys/class/net/$l/brif" 2>/dev/null) ]] && ip link delete "$l" 2>/dev/null || true
    done
  fi
  rm -rf "$STATE"
}

cmd_sweep() {
  [[ -n ${DOCKER_HOST:-} ]] || die "sweep: DOCKER_HOST is not set"
  local label='antidote.io/instance' ids
  ids=$(docker ps -a --filter "label=$label" --format "{{.ID}} {{.Label \"$label\"}}" \
    | awk '$2 ~ /^e2e-/ { print $1 }')
  if [[ -n $ids ]]; then
    log "sweep: removing $(wc -w <<<"$ids") containers of e2e instances"
    # shellcheck disable=SC2086 # one id per word
    docker rm -f $ids >/dev/null
  fi
  ids=$(docker network ls --filter "label=$label" --format "{{.ID}} {{.Label \"$label\"}}" \
    | awk '$2 ~ /^e2e-/ { print $1 }')
  if [[ -n $ids ]]; then
    log "sweep: removing $(wc -w <<<"$ids") networks of e2e instances"
    # shellcheck disable=SC2086
    docker network rm $ids >/dev/null
  fi
}

case ${1:-} in
  start) cmd_start ;;
  stop)  cmd_stop ;;
  env)   cmd_env ;;
  purge) cmd_purge ;;
  sweep) cmd_sweep ;;
  *) echo "usage: $0 start|stop|env|purge|sweep" >&2; exit 2 ;;
esac
