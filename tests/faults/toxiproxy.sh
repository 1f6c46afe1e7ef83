#!/usr/bin/env bash
# Shopify's toxiproxy, the TCP fault proxy of the fault tests (tests/e2e/faults.rs): built from
# Go modules at a pinned version into a cache outside the repository, run on loopback.
#
#   toxiproxy.sh build   build toxiproxy-server into the cache (once; later calls return at
#                        once). Safe to call concurrently: builds are serialised by a lock file.
#   toxiproxy.sh start   build if needed, start the server on 127.0.0.1:PORT (reused if one
#                        already answers there). Last stdout line:
#                        ANTIDOTE_TEST_TOXIPROXY=http://127.0.0.1:PORT
#   toxiproxy.sh env     print that line if the server answers (exit 1 otherwise)
#   toxiproxy.sh stop    stop the server this script started
#   toxiproxy.sh path    print the binary's path (after a build)
#
# Tests drive it over its HTTP API (POST /proxies, /proxies/NAME/toxics, DELETE ...).
#
# Environment: ANTIDOTE_TEST_TOXIPROXY_CACHE (default ~/.cache/antidote/toxiproxy),
#              ANTIDOTE_TEST_TOXIPROXY_STATE (pid and log, default /tmp/antidote-toxiproxy),
#              ANTIDOTE_TEST_TOXIPROXY_PORT (API port on 127.0.0.1, default 58474).
set -euo pipefail

# `@latest` resolves to an old 2.5.0 (later tags are not in the proxy's version list but are
# served when named), so the version is pinned.
VERSION=v2.12.0
MODULE=github.com/Shopify/toxiproxy/v2
CACHE_ROOT=${ANTIDOTE_TEST_TOXIPROXY_CACHE:-${HOME:-/root}/.cache/antidote/toxiproxy}
BIN=$CACHE_ROOT/$VERSION
SERVER=$BIN/toxiproxy-server
STATE=${ANTIDOTE_TEST_TOXIPROXY_STATE:-/tmp/antidote-toxiproxy}
PORT=${ANTIDOTE_TEST_TOXIPROXY_PORT:-58474}
URL="http://127.0.0.1:$PORT"

log() { echo "toxiproxy.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

answers() {
  # /version answers once the API listens; bash's /dev/tcp keeps curl optional.
  (exec 3<>"/dev/tcp/127.0.0.1/$PORT" && printf 'GET /version HTTP/1.0\r\n\r\n' >&3 \
    && head -n 1 <&3 | grep -q ' 200') 2>/dev/null
}

build() {
  mkdir -p "$CACHE_ROOT"
  exec 8>"$CACHE_ROOT/build.lock"
  flock 8
  if [[ -x $SERVER ]]; then
    exec 8>&-
    return 0
  fi
  command -v go >/dev/null 2>&1 || die "go is not installed (needed to build toxiproxy $VERSION)"
  log "building toxiproxy-server $VERSION from Go modules ($(go version))"
  local started=$SECONDS
  # The main package is cmd/server; GOBIN gets it as `server`, renamed below. Explicit Go
  # settings: no inherited flags or workspace, a static binary.
  rm -rf "$BIN.tmp"
  mkdir -p "$BIN.tmp"
  GOBIN=$BIN.tmp GOFLAGS=-buildvcs=false GOWORK=off CGO_ENABLED=0 \
    go install "$MODULE/cmd/server@$VERSION" >&2 || die "go install $MODULE/cmd/server@$VERSION failed"
  mv "$BIN.tmp/server" "$BIN.tmp/toxiproxy-server"
  rm -rf "$BIN"
  mv "$BIN.tmp" "$BIN"
  log "built $SERVER in $((SECONDS - started)) s"
  exec 8>&-
}

start() {
  if answers; then
    echo "ANTIDOTE_TEST_TOXIPROXY=$URL"
    return 0
  fi
  build
  mkdir -p "$STATE"
  log "starting toxiproxy-server on $URL"
  # setsid: the server outlives the shell that started it (tests/run's background step); it
  # must not inherit the lock files' descriptors (it would hold the locks for its life).
  setsid "$SERVER" -host 127.0.0.1 -port "$PORT" >"$STATE/toxiproxy.log" 2>&1 </dev/null 8>&- 9>&- &
  echo $! >"$STATE/pid"
  local i
  for i in $(seq 1 100); do
    answers && break
    kill -0 "$(cat "$STATE/pid")" 2>/dev/null || { tail -n 20 "$STATE/toxiproxy.log" >&2; die "toxiproxy-server exited"; }
    sleep 0.1
  done
  answers || die "toxiproxy-server does not answer on $URL; see $STATE/toxiproxy.log"
  echo "ANTIDOTE_TEST_TOXIPROXY=$URL"
}

stop() {
  [[ -s $STATE/pid ]] || return 0
  local pid
  pid=$(cat "$STATE/pid")
  # Only the process we started, and only if it still is toxiproxy.
  if [[ $(cat "/proc/$pid/comm" 2>/dev/null) == toxiproxy-serve* ]]; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -f "$STATE/pid"
}

case ${1:-} in
  build) build; log "toxiproxy-server $VERSION in $SERVER" ;;
  start)
    mkdir -p "$STATE"
    exec 9>"$STATE.lock"
    flock 9
    start
    ;;
  env)
    answers || exit 1
    echo "ANTIDOTE_TEST_TOXIPROXY=$URL"
    ;;
  stop) stop ;;
  path) [[ -x $SERVER ]] || exit 1; echo "$SERVER" ;;
  *) die "usage: toxiproxy.sh build|start|env|stop|path" ;;
esac
