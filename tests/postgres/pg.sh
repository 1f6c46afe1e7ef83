#!/usr/bin/env bash
# Private PostgreSQL 15 server for Antidote's tests.
#
#   pg.sh start   install Debian's postgresql-15 if missing (apt-get), create a cluster in the
#                 state dir (initdb, trust auth, as the `postgres` user when run as root) and
#                 start it on a fixed loopback port and a private unix socket dir; reuse it if
#                 it already answers. Last stdout line:
#                 ANTIDOTE_TEST_POSTGRES=postgres://postgres@127.0.0.1:PORT/postgres
#   pg.sh stop    stop the server this script started (keeps the cluster for the next start).
#   pg.sh env     print the ANTIDOTE_TEST_POSTGRES=... line if the server answers (exit 1
#                 otherwise).
#   pg.sh purge   stop, then delete the state dir.
#   pg.sh restart [fast|kill]
#                 a fault for the fault tests (tests/e2e/faults.rs): `fast` (the default) is
#                 `pg_ctl restart -m fast` (every session cut, the server back at once); `kill`
#                 sends SIGKILL to the postmaster, waits for its backends to die, then starts
#                 the server again (crash recovery). Run it on a private server (the variables
#                 below), never the one other tests share.
#
# Tests create a database of their own on it (CREATE DATABASE with a unique name) and drop it.
# Safe to call concurrently: starts are serialised by a lock file.
#
# Environment: ANTIDOTE_PG_STATE (state dir, default /tmp/antidote-pg),
#              ANTIDOTE_PG_PORT (TCP port on 127.0.0.1, default 54329),
#              ANTIDOTE_PG_TLS_DIR (when a new cluster is created: a directory holding
#              server.crt and server.key; the server then serves TLS with them and refuses
#              TCP clients that do not use it; the unix socket stays open to its owner),
#              ANTIDOTE_PG_STATEMENTS (1: the server loads pg_stat_statements, which counts
#              every statement it runs; `loadgen --store-compare` reports them. Off by default:
#              counting costs a little on every statement).
set -euo pipefail

STATE=$(realpath -m -- "${ANTIDOTE_PG_STATE:-/tmp/antidote-pg}")
PORT=${ANTIDOTE_PG_PORT:-54329}
BIN=/usr/lib/postgresql/15/bin
DATA=$STATE/data
SOCK=$STATE/sock
LOGFILE=$STATE/postgres.log
URL="postgres://postgres@127.0.0.1:$PORT/postgres"
# The server's options, for every start.
OPTIONS="-p $PORT -k $SOCK -c listen_addresses=127.0.0.1 -c max_connections=400"
if [[ ${ANTIDOTE_PG_STATEMENTS:-0} == 1 ]]; then
  OPTIONS+=" -c shared_preload_libraries=pg_stat_statements"
fi

log() { echo "pg.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

# Runs a command as the cluster's owner: `postgres` when we are root (PostgreSQL refuses to run
# as root), ourselves otherwise.
as_owner() {
  if [[ $(id -u) == 0 ]]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

answers() {
  [[ -x $BIN/pg_isready ]] || return 1
  "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT" -t 3
}

install() {
  [[ -x $BIN/initdb ]] && return 0
  [[ $(id -u) == 0 ]] || die "postgresql-15 is not installed and installing it needs root"
  log "installing postgresql-15"
  export DEBIAN_FRONTEND=noninteractive
  # tests/run starts this in the background beside its own apt-gets: wait for their locks
  # (DPkg::Lock::Timeout covers dpkg's; the lists lock is retried), as tests/browser/chromium.sh.
  local try
  for try in 1 2 3 4 5 6 7 8 9 10; do
    if apt-get update -qq -o DPkg::Lock::Timeout=300 >&2; then break; fi
    log "apt-get update failed (try $try); retrying in 5 s"
    sleep 5
  done
  for try in 1 2 3; do
    if apt-get install -y -q --no-install-recommends -o Dpkg::Use-Pty=0 \
      -o DPkg::Lock::Timeout=600 postgresql-15 >&2; then break; fi
    [[ $try == 3 ]] && die "apt-get install postgresql-15 failed"
    log "apt-get install postgresql-15 failed (try $try); retrying in 5 s"
    sleep 5
  done
  # Debian's package creates and starts a cluster of its own on port 5432; it is not ours and
  # not needed.
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    pg_ctlcluster 15 main stop >/dev/null 2>&1 || true
  fi
}

# TLS with the certificate and key in ANTIDOTE_PG_TLS_DIR, copied into the cluster (the key
# must belong to the server's user, mode 0600), and TCP only over TLS.
tls_only() {
  local dir=$ANTIDOTE_PG_TLS_DIR
  [[ -r $dir/server.crt && -r $dir/server.key ]] ||
    die "ANTIDOTE_PG_TLS_DIR=$dir holds no server.crt and server.key"
  log "TLS only on TCP, with $dir/server.crt"
  # (`command`: this script's own `install` installs PostgreSQL.)
  command install -m 0644 "$dir/server.crt" "$DATA/server.crt"
  command install -m 0600 "$dir/server.key" "$DATA/server.key"
  if [[ $(id -u) == 0 ]]; then
    chown postgres: "$DATA/server.crt" "$DATA/server.key"
  fi
  cat >>"$DATA/postgresql.conf" <<CONF
ssl = on
ssl_cert_file = 'server.crt'
ssl_key_file = 'server.key'
CONF
  cat >"$DATA/pg_hba.conf" <<CONF
local   all all               trust
hostssl all all 127.0.0.1/32  trust
hostssl all all ::1/128       trust
CONF
}

start() {
  if answers; then
    echo "ANTIDOTE_TEST_POSTGRES=$URL"
    return 0
  fi
  install
  mkdir -p "$STATE" "$SOCK"
  if [[ $(id -u) == 0 ]]; then
    chown postgres: "$STATE" "$SOCK"
  fi
  if [[ ! -s $DATA/PG_VERSION ]]; then
    log "creating a cluster in $DATA"
    as_owner "$BIN/initdb" -D "$DATA" --auth=trust --username=postgres --encoding=UTF8 \
      --no-sync >&2 9>&-
    if [[ -n ${ANTIDOTE_PG_TLS_DIR:-} ]]; then
      tls_only
    fi
  fi
  log "starting PostgreSQL on 127.0.0.1:$PORT (socket dir $SOCK)"
  # Many test databases at once, each with a pool of its own: room for their connections.
  if ! as_owner "$BIN/pg_ctl" -D "$DATA" -l "$LOGFILE" -w -t 60 \
    -o "$OPTIONS" start \
    >&2 9>&-; then
    tail -n 30 "$LOGFILE" >&2 || true
    die "PostgreSQL did not start; see $LOGFILE"
  fi
  answers || die "PostgreSQL started but does not answer on 127.0.0.1:$PORT"
  echo "ANTIDOTE_TEST_POSTGRES=$URL"
}

stop() {
  if [[ -s $DATA/postmaster.pid ]]; then
    as_owner "$BIN/pg_ctl" -D "$DATA" -m fast -w -t 60 stop >&2 || true
  fi
}

# The postmaster's pid (first line of postmaster.pid), if it runs.
postmaster() {
  local pid
  pid=$(head -n 1 "$DATA/postmaster.pid" 2>/dev/null) || return 1
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

restart() {
  local how=${1:-fast}
  [[ -s $DATA/PG_VERSION ]] || die "no cluster in $DATA: start it first"
  case $how in
    fast)
      log "restarting PostgreSQL on 127.0.0.1:$PORT (pg_ctl restart -m fast)"
      as_owner "$BIN/pg_ctl" -D "$DATA" -l "$LOGFILE" -m fast -w -t 60 \
        -o "$OPTIONS" restart \
        >&2 9>&- || die "pg_ctl restart failed; see $LOGFILE"
      ;;
    kill)
      local pid
      pid=$(postmaster) || die "PostgreSQL is not running in $DATA"
      local children
      children=$(pgrep -P "$pid" 2>/dev/null | tr '\n' ' ' || true)
      log "kill -9 of the postmaster (pid $pid) on 127.0.0.1:$PORT"
      kill -s KILL -- "$pid"
      # Its backends notice the postmaster's death and exit (a busy one after its query);
      # until they have, a new postmaster refuses to start (they still hold the old shared
      # memory): wait for them (up to 60 s), then retry starting for as long again.
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
      local c left
      for _ in $(seq 1 300); do
        left=0
        for c in $children; do kill -0 "$c" 2>/dev/null && left=1; done
        [[ $left == 0 ]] && break
        sleep 0.2
      done
      local i
      for i in $(seq 1 300); do
        if as_owner "$BIN/pg_ctl" -D "$DATA" -l "$LOGFILE" -w -t 60 \
          -o "$OPTIONS" start \
          >&2 9>&-; then
          break
        fi
        [[ $i == 300 ]] && die "PostgreSQL did not start again after kill -9; see $LOGFILE"
        sleep 0.2
      done
      ;;
    *) die "usage: pg.sh restart [fast|kill]" ;;
  esac
  answers || die "PostgreSQL restarted but does not answer on 127.0.0.1:$PORT"
}

cmd=${1:-}
case $cmd in
  start)
    mkdir -p "$STATE"
    # One start at a time: tests that find no server call this concurrently.
    exec 9>"$STATE.lock"
    flock 9
    start
    ;;
  stop) stop ;;
  env)
    answers || exit 1
    echo "ANTIDOTE_TEST_POSTGRES=$URL"
    ;;
  restart) restart "${2:-fast}" ;;
  purge)
    stop
    rm -rf -- "$STATE"
    ;;
  *) die "usage: pg.sh start|stop|env|restart [fast|kill]|purge" ;;
esac
