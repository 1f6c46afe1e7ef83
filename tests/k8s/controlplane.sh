#!/usr/bin/env bash
# A real, local Kubernetes control plane for tests: etcd + kube-apiserver +
# kube-controller-manager on loopback only (no kubelet, no scheduler, so pods
# stay Pending). tests/k8s/cluster.sh starts it in node mode (ANTIDOTE_K8S_NODE_IP)
# beside a real node; the build also makes that node's kubelet, kube-proxy and
# kube-scheduler.
#
#   tests/k8s/controlplane.sh build   build the binaries into the cache (once)
#   tests/k8s/controlplane.sh start   build if needed, start, wait for /readyz;
#                                     last line printed: KUBECONFIG=<path>
#   tests/k8s/controlplane.sh env     print KUBECONFIG=<path> if running
#   tests/k8s/controlplane.sh stop    stop everything, remove the state dir
#   tests/k8s/controlplane.sh status  say whether it runs (exit 1 if not)
#
# Environment:
#   ANTIDOTE_K8S_CACHE  binaries cache (default ~/.cache/antidote/k8s); the
#                       binaries go to $ANTIDOTE_K8S_CACHE/<k8s version>/bin
#   ANTIDOTE_K8S_STATE  pids, certs, logs, etcd data (default /tmp/antidote-k8s)
#   ANTIDOTE_K8S_APISERVER_ARGS, ANTIDOTE_K8S_CONTROLLER_MANAGER_ARGS
#                       extra flags (split on spaces), e.g. --feature-gates=...
#   ANTIDOTE_K8S_STOP_GRACE  seconds stop waits for each process after SIGTERM (default 20)
#   ANTIDOTE_K8S_NODE_IP  node mode, set by tests/k8s/cluster.sh (which puts that address on lo
#                       first): the apiserver binds and advertises it (pods reach it through the
#                       `kubernetes` Service, so the endpoint reconciler stays on), talks to the
#                       kubelet with a client certificate, and the controller-manager allocates
#                       node pod CIDRs. Unset: loopback only, as before.
#
# Everything is built from the Go module proxy at pinned versions.
set -euo pipefail

K8S_VERSION=v1.37.2     # k8s.io/kubernetes
STAGING_VERSION=v0.37.2 # the k8s.io/* staging modules of that release
ETCD_VERSION=v3.7.0     # go.etcd.io/etcd/server/v3: what k8s v1.37.2 pins (go.mod, kubeadm's DefaultEtcdVersion)
RECIPE=3                # bump when the build itself changes (flags, packages) to force a rebuild
STAMP="kubernetes $K8S_VERSION staging $STAGING_VERSION etcd $ETCD_VERSION recipe $RECIPE"

CACHE_ROOT=${ANTIDOTE_K8S_CACHE:-${HOME:-/root}/.cache/antidote/k8s}
CACHE=$CACHE_ROOT/$K8S_VERSION
BIN=$CACHE/bin
STATE=${ANTIDOTE_K8S_STATE:-/tmp/antidote-k8s}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NODE_IP=${ANTIDOTE_K8S_NODE_IP:-}
API_HOST=${NODE_IP:-127.0.0.1}
CLUSTER_CIDR=10.244.0.0/16 # node mode: pod addresses, a /24 per node (tests/k8s/cluster.sh)
SERVICE_CIDR=10.96.0.0/16
BINARIES=(etcd kube-apiserver kube-controller-manager kubectl kube-scheduler kubelet kube-proxy)
# start order; stop goes the other way
COMPONENTS=(etcd kube-apiserver kube-controller-manager)

case $STATE in
  /*/*) ;;
  *) echo "ANTIDOTE_K8S_STATE must be an absolute path below /, not '$STATE'" >&2; exit 2 ;;
esac

log() { printf '[controlplane] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# --- prerequisites -----------------------------------------------------------

ensure_tools() { # Debian packages named like the command they bring
  local missing=() t
  for t in "$@"; do command -v "$t" >/dev/null 2>&1 || missing+=("$t"); done
  # Go (module downloads) and curl need the CA bundle too
  [[ -f /etc/ssl/certs/ca-certificates.crt ]] || missing+=(ca-certificates)
  [[ ${#missing[@]} -eq 0 ]] && return 0
  command -v apt-get >/dev/null 2>&1 || die "missing tools (${missing[*]}) and no apt-get"
  local sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  log "installing with apt-get: ${missing[*]}"
  "${sudo[@]}" apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
  for t in "$@"; do command -v "$t" >/dev/null 2>&1 || die "$t still missing after apt-get install"; done
}

# --- build -------------------------------------------------------------------

have_binaries() {
  local b
  for b in "${BINARIES[@]}"; do [[ -x $BIN/$b ]] || return 1; done
  [[ -f $BIN/.complete && $(head -n1 "$BIN/.complete") == "$STAMP" ]]
}

build() {
  mkdir -p "$CACHE_ROOT"
  # one build at a time per cache, whichever state dirs the callers use
  exec 8>"$CACHE_ROOT/$K8S_VERSION.lock"
  flock 8
  if ! have_binaries; then do_build; fi
  exec 8>&-
  log "binaries for $K8S_VERSION (etcd $ETCD_VERSION) in $BIN"
}

do_build() {
  command -v go >/dev/null 2>&1 || die "go is not installed (Go >= 1.26 is needed to build Kubernetes $K8S_VERSION)"
  local start=$SECONDS
  local src=$CACHE/src
  mkdir -p "$src"

  # Sane, explicit Go settings: no inherited -race/-tags/-mod from GOFLAGS, no
  # workspace, static binaries (Kubernetes releases build these with cgo off).
  export GOFLAGS=-buildvcs=false GOWORK=off CGO_ENABLED=0
  export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
  # A build cache of its own, removed once the binaries are cached: Kubernetes leaves about 4 GB
  # of compiled packages that nothing reuses (the binaries themselves are kept in $BIN).
  export GOCACHE=$CACHE/go-build.tmp

  log "building Kubernetes $K8S_VERSION + etcd $ETCD_VERSION with $(go version) (takes a while on a cold cache)"
  local kmod
  kmod=$(cd "$src" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION") \
    || die "go mod download k8s.io/kubernetes@$K8S_VERSION failed: $kmod"
  local gomodfile
  gomodfile=$(printf '%s\n' "$kmod" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
  [[ -f $gomodfile ]] || die "cannot find k8s.io/kubernetes@$K8S_VERSION go.mod (got '$gomodfile')"

  # k8s.io/kubernetes's go.mod replaces every staging module with
  # ./staging/src/k8s.io/<name>, which only works inside its own repo. Point
  # each one at its published version instead; the list comes from that go.mod.
  local staging
  staging=$(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/src/.*#\1#p' "$gomodfile")
  [[ -n $staging ]] || die "no staging replace directives found in $gomodfile"

  {
    echo "// Generated by tests/k8s/controlplane.sh: a throwaway module to build"
    echo "// the control plane binaries at pinned versions."
    echo "module antidote.local/k8s-controlplane"
    echo
    echo "go 1.26.0"
    echo
    echo "require ("
    echo "	k8s.io/kubernetes $K8S_VERSION"
    echo "	go.etcd.io/etcd/server/v3 $ETCD_VERSION"
    echo ")"
    echo
    echo "replace ("
    local m
    for m in $staging; do echo "	$m => $m $STAGING_VERSION"; done
    echo ")"
  } >"$src/go.mod"
  : >"$src/go.sum"

  local pkgs=(
    go.etcd.io/etcd/server/v3
    k8s.io/kubernetes/cmd/kube-apiserver
    k8s.io/kubernetes/cmd/kube-controller-manager
    k8s.io/kubernetes/cmd/kubectl
    # The real node's binaries (tests/k8s/cluster.sh), in the same build: they share nearly every
    # package with the control plane, so they add about 2.5 min here against 8 min on their own.
    k8s.io/kubernetes/cmd/kube-scheduler
    k8s.io/kubernetes/cmd/kubelet
    k8s.io/kubernetes/cmd/kube-proxy
  )
  # Resolve the module graph and fill go.sum for exactly these packages. Each
  # gets its explicit @version: a bare `go get pkg` means @upgrade, which would
  # lift etcd to its newest patch and drag newer golang.org/x/* along.
  local p pinned=()
  for p in "${pkgs[@]}"; do
    case $p in
      go.etcd.io/*) pinned+=("$p@$ETCD_VERSION") ;;
      *) pinned+=("$p@$K8S_VERSION") ;;
    esac
  done
  (cd "$src" && go get "${pinned[@]}") >&2 || die "go get failed"
  # go get may raise the pins through MVS; refuse silently-drifted versions.
  local got
  got=$(cd "$src" && go list -m -f '{{.Path}} {{.Version}}' k8s.io/kubernetes go.etcd.io/etcd/server/v3 k8s.io/api)
  [[ $got == *"k8s.io/kubernetes $K8S_VERSION"* && $got == *"go.etcd.io/etcd/server/v3 $ETCD_VERSION"* ]] \
    || die "module versions drifted: $got"

  # Version stamps, as hack/lib/version.sh does for a release build.
  local minor=${K8S_VERSION#v1.}
  minor=${minor%%.*}
  local vpkg ld="-s -w"
  for vpkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    ld+=" -X $vpkg.gitVersion=$K8S_VERSION -X $vpkg.gitMajor=1 -X $vpkg.gitMinor=$minor"
    ld+=" -X $vpkg.gitTreeState=clean -X $vpkg.gitCommit= -X $vpkg.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  done
  local tmp=$CACHE/bin.tmp
  rm -rf "$tmp"
  mkdir -p "$tmp"
  # Same tags as Kubernetes' release build (hack/lib/golang.sh).
  (cd "$src" && go build -trimpath -tags=selinux,notest,grpcnotrace -ldflags="$ld" -o "$tmp/" "${pkgs[@]}") >&2 \
    || die "go build failed"
  # go.etcd.io/etcd/server/v3's main package gets named after its module path.
  local n
  for n in server v3; do if [[ -x $tmp/$n ]]; then mv "$tmp/$n" "$tmp/etcd"; fi; done
  local b
  for b in "${BINARIES[@]}"; do [[ -x $tmp/$b ]] || die "build produced no $b"; done
  printf '%s\n%s\n' "$STAMP" "$(go version)" >"$tmp/.complete"
  rm -rf "$BIN"
  mv "$tmp" "$BIN"
  rm -rf "$GOCACHE"
  log "built in $((SECONDS - start))s: $(cd "$BIN" && du -sh -- * | tr '\t\n' ': ' )"
}

# --- processes ---------------------------------------------------------------

pid_of() { # component -> pid, if its pid file names a live process of ours
  local f=$STATE/$1.pid pid
  [[ -f $f ]] || return 1
  pid=$(<"$f")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  # guard against a recycled pid: it must still run our binary
  local exe
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  [[ ${exe%" (deleted)"} == */"$1" ]] || return 1
  echo "$pid"
}

running() {
  local c
  for c in "${COMPONENTS[@]}"; do pid_of "$c" >/dev/null || return 1; done
  [[ -f $STATE/admin.kubeconfig ]]
}

env_line() { echo "KUBECONFIG=$STATE/admin.kubeconfig"; }

launch() { # component args... ; detached, own session, pid file, log file
  local c=$1
  shift
  # setsid: survive the caller's process group; the inner shell writes the
  # pid of the process that then execs the binary. 9>&-: the daemon must not
  # inherit (and so hold forever) the start/stop lock (8: the build lock).
  # shellcheck disable=SC2016 # $$ and $1 belong to the inner shell
  setsid bash -c 'echo $$ >"$1"; shift; exec "$@"' _ "$STATE/$c.pid" "$BIN/$c" "$@" \
    </dev/null >"$STATE/logs/$c.log" 2>&1 8>&- 9>&- &
  local i
  for i in $(seq 50); do [[ -s $STATE/$c.pid ]] && return 0; sleep 0.1; done
  fail "$c" "did not start"
}

fail() { # component message
  log "error: $1: $2"
  if [[ -f $STATE/logs/$1.log ]]; then
    log "last lines of $STATE/logs/$1.log:"
    tail -n 40 "$STATE/logs/$1.log" >&2 || true
  fi
  log "stopping what was started; logs and certs stay in $STATE until the next start or stop"
  kill_all >/dev/null 2>&1 || true
  exit 1
}

wait_for() { # component seconds command... (a function or a program)
  local c=$1 secs=$2
  shift 2
  local deadline=$((SECONDS + secs))
  while ((SECONDS < deadline)); do
    pid_of "$c" >/dev/null || fail "$c" "exited during startup"
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.3
  done
  fail "$c" "not ready after ${secs}s"
}

etcd_healthy() { # client port
  local got
  got=$(curl -sf --max-time 2 "http://127.0.0.1:$1/health") && [[ $got == *'"health":"true"'* ]]
}

body_is() { # expected command... : the command prints exactly the expected text
  local want=$1 got
  shift
  got=$("$@") && [[ $got == "$want" ]]
}

port_free() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && ! (exec 3<>"/dev/tcp/$API_HOST/$1") 2>/dev/null
}

USED_PORTS=" "
free_port() { # a loopback port nobody listens on, below the ephemeral range
  local p i
  for i in $(seq 200); do
    p=$((20000 + RANDOM % 12000))
    [[ $USED_PORTS == *" $p "* ]] && continue
    if port_free "$p"; then
      USED_PORTS+="$p "
      echo "$p"
      return 0
    fi
  done
  die "no free port found"
}

stop_all() {
  kill_all
  rm -rf "$STATE"
}

kill_all() {
  # seconds to wait for each to exit on SIGTERM before SIGKILL; cluster.sh, whose pods were
  # killed with their connections to the apiserver still open, sets it short (a minute otherwise)
  local grace=${ANTIDOTE_K8S_STOP_GRACE:-20}
  local i c pid pids=()
  for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do
    c=${COMPONENTS[i]}
    if pid=$(pid_of "$c"); then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
      # the apiserver should drain before etcd goes away
      [[ $c == etcd ]] || wait_gone "$grace" "$pid"
    fi
  done
  [[ ${#pids[@]} -eq 0 ]] || wait_gone "$grace" "${pids[@]}"
  for pid in "${pids[@]}"; do
    if alive "$pid"; then
      log "pid $pid ignored SIGTERM, killing"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  [[ ${#pids[@]} -eq 0 ]] || wait_gone 10 "${pids[@]}"
  for pid in "${pids[@]}"; do
    if alive "$pid"; then die "pid $pid is still alive"; fi
  done
  return 0
}

# Running and not a zombie: this VM's init reaps orphans late, and `kill -0` succeeds on zombies.
alive() {
  local st
  st=$(sed 's/.*) //' 2>/dev/null <"/proc/$1/stat" | cut -d' ' -f1) || return 1
  [[ -n $st && $st != Z ]]
}

wait_gone() { # seconds pids...
  local deadline=$((SECONDS + $1)) p alive
  shift
  while ((SECONDS < deadline)); do
    alive=0
    for p in "$@"; do alive "$p" && alive=1; done
    ((alive)) || return 0
    sleep 0.2
  done
}

# --- certificates and kubeconfigs ---------------------------------------------

gen_certs() {
  local d=$STATE/pki
  mkdir -p "$d"
  (
    cd "$d"
    umask 077
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 -keyout ca.key -out ca.crt \
      -subj "/CN=antidote-test-ca" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"

    # name CN O extendedKeyUsage [subjectAltName]
    issue() {
      local name=$1 cn=$2 o=$3 eku=$4 san=${5:-} subj="/CN=$2"
      [[ -n $o ]] && subj="/O=$o/CN=$cn"
      openssl req -new -newkey rsa:2048 -nodes -sha256 -keyout "$name.key" -out "$name.csr" -subj "$subj"
      {
        echo "basicConstraints=critical,CA:FALSE"
        echo "keyUsage=critical,digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=$eku"
        [[ -z $san ]] || echo "subjectAltName=$san"
      } >"$name.ext"
      openssl x509 -req -sha256 -days 3650 -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
        -extfile "$name.ext" -out "$name.crt"
      rm -f "$name.csr" "$name.ext"
    }
    issue apiserver kube-apiserver "" serverAuth \
      "IP:127.0.0.1,IP:10.96.0.1,${NODE_IP:+IP:$NODE_IP,}DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
    issue admin antidote-admin system:masters clientAuth
    issue controller-manager system:kube-controller-manager "" clientAuth
    # the apiserver's identity towards kubelets (exec, logs, port-forward); the kubelet's
    # webhook authorizer lets system:masters do all
    issue apiserver-kubelet-client kube-apiserver-kubelet-client system:masters clientAuth

    # front proxy (aggregation layer): its own CA, as kubeadm does; without
    # it the controller-manager's delegated authentication logs errors
    # about a missing requestheader-client-ca-file forever
    openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 -keyout front-proxy-ca.key -out front-proxy-ca.crt \
      -subj "/CN=antidote-test-front-proxy-ca" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"
    openssl req -new -newkey rsa:2048 -nodes -sha256 -keyout front-proxy-client.key -out front-proxy-client.csr \
      -subj "/CN=front-proxy-client"
    printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature,keyEncipherment" \
      "extendedKeyUsage=clientAuth" >front-proxy-client.ext
    openssl x509 -req -sha256 -days 3650 -in front-proxy-client.csr -CA front-proxy-ca.crt -CAkey front-proxy-ca.key \
      -CAcreateserial -extfile front-proxy-client.ext -out front-proxy-client.crt
    rm -f front-proxy-client.csr front-proxy-client.ext

    # service-account token signing key pair
    openssl genrsa -out sa.key 2048
    openssl rsa -in sa.key -pubout -out sa.pub
  ) >"$STATE/logs/openssl.log" 2>&1 || fail openssl "certificate generation failed"
}

write_kubeconfig() { # file user cert key
  local b64='base64 -w0'
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: antidote
  cluster:
    server: https://$API_HOST:$APISERVER_PORT
    certificate-authority-data: $($b64 <"$STATE/pki/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $($b64 <"$3")
    client-key-data: $($b64 <"$4")
contexts:
- name: $2@antidote
  context:
    cluster: antidote
    user: $2
    namespace: default
current-context: $2@antidote
EOF
  chmod 600 "$1"
}

# --- start -------------------------------------------------------------------

api() { # path -> body (admin credentials)
  curl -sf --max-time 5 --cacert "$STATE/pki/ca.crt" --cert "$STATE/pki/admin.crt" --key "$STATE/pki/admin.key" \
    "https://$API_HOST:$APISERVER_PORT$1"
}

start() {
  if running; then
    env_line
    return 0
  fi
  # a half-dead earlier run: clean it up first
  if [[ -d $STATE ]]; then
    log "cleaning up a stale state dir $STATE"
    stop_all
  fi
  if [[ -d $STATE/node && -z $NODE_IP ]]; then
    die "$STATE/node holds a node's state: run tests/k8s/cluster.sh stop (or start) first"
  fi
  ensure_tools openssl curl
  if [[ -n $NODE_IP ]]; then
    [[ $NODE_IP =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "ANTIDOTE_K8S_NODE_IP '$NODE_IP' is not an IPv4 address"
    ip -o -4 addr show to "$NODE_IP/32" | grep -q . || die "node mode: $NODE_IP is on no interface (tests/k8s/cluster.sh puts it on lo)"
  fi
  build
  local t0=$SECONDS
  mkdir -p "$STATE"/{logs,etcd,apiserver-certs,kcm-certs}
  chmod 700 "$STATE" "$STATE/etcd"
  gen_certs
  local pki=$STATE/pki
  local api_extra=() kcm_extra=()
  read -ra api_extra <<<"${ANTIDOTE_K8S_APISERVER_ARGS:-}"
  read -ra kcm_extra <<<"${ANTIDOTE_K8S_CONTROLLER_MANAGER_ARGS:-}"
  local api_mode=() kcm_mode=()
  if [[ -n $NODE_IP ]]; then
    # A real node (tests/k8s/cluster.sh): pods reach the apiserver through the `kubernetes`
    # Service, whose endpoint the lease reconciler keeps at $NODE_IP; the apiserver reaches the
    # kubelet by its InternalIP (not its name through the machine's resolver), checks its
    # serving certificate against our CA and identifies itself with a client certificate.
    api_mode=(--bind-address="$NODE_IP" --advertise-address="$NODE_IP"
      --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt"
      --kubelet-client-key="$pki/apiserver-kubelet-client.key"
      --kubelet-certificate-authority="$pki/ca.crt"
      --kubelet-preferred-address-types=InternalIP)
    kcm_mode=(--allocate-node-cidrs=true --cluster-cidr="$CLUSTER_CIDR" --node-cidr-mask-size=24
      --service-cluster-ip-range="$SERVICE_CIDR")
  else
    # Loopback endpoints for the `kubernetes` Service are invalid: no reconciler (the
    # apiserver's own test server does the same).
    api_mode=(--bind-address=127.0.0.1 --advertise-address=127.0.0.1 --endpoint-reconciler-type=none)
  fi

  local etcd_client etcd_peer
  etcd_client=$(free_port)
  etcd_peer=$(free_port)
  APISERVER_PORT=$(free_port)
  local kcm_port
  kcm_port=$(free_port)

  launch etcd --name=antidote --data-dir="$STATE/etcd" \
    --listen-client-urls="http://127.0.0.1:$etcd_client" --advertise-client-urls="http://127.0.0.1:$etcd_client" \
    --listen-peer-urls="http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls="http://127.0.0.1:$etcd_peer" \
    --initial-cluster="antidote=http://127.0.0.1:$etcd_peer" --initial-cluster-state=new \
    --unsafe-no-fsync=true --log-level=warn
  wait_for etcd 30 etcd_healthy "$etcd_client"

  launch kube-apiserver \
    "${api_mode[@]}" --secure-port="$APISERVER_PORT" \
    --cert-dir="$STATE/apiserver-certs" \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" \
    --authorization-mode=Node,RBAC \
    --etcd-servers="http://127.0.0.1:$etcd_client" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$pki/sa.pub" \
    --service-account-signing-key-file="$pki/sa.key" \
    --requestheader-client-ca-file="$pki/front-proxy-ca.crt" \
    --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User \
    --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$pki/front-proxy-client.crt" \
    --proxy-client-key-file="$pki/front-proxy-client.key" \
    --allow-privileged=true \
    --profiling=false \
    "${api_extra[@]}"
  wait_for kube-apiserver 120 body_is ok api /readyz

  write_kubeconfig "$STATE/controller-manager.kubeconfig" system:kube-controller-manager \
    "$pki/controller-manager.crt" "$pki/controller-manager.key"
  local kcmcfg=$STATE/controller-manager.kubeconfig
  launch kube-controller-manager \
    --kubeconfig="$kcmcfg" --authentication-kubeconfig="$kcmcfg" --authorization-kubeconfig="$kcmcfg" \
    --bind-address=127.0.0.1 --secure-port="$kcm_port" --cert-dir="$STATE/kcm-certs" \
    --controllers='*' --use-service-account-credentials=true \
    --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
    --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
    --leader-elect=false --profiling=false \
    --flex-volume-plugin-dir="$STATE/kcm-flexvolume" \
    "${kcm_mode[@]}" "${kcm_extra[@]}"
  # its serving cert is self-signed (in --cert-dir), hence -k for this probe
  wait_for kube-controller-manager 60 body_is ok curl -skf --max-time 2 "https://127.0.0.1:$kcm_port/healthz"
  # The controllers really run once the service account controller has made
  # default/default (pods can only be created after that).
  wait_for kube-controller-manager 60 api /api/v1/namespaces/default/serviceaccounts/default

  write_kubeconfig "$STATE/admin.kubeconfig.tmp" antidote-admin "$pki/admin.crt" "$pki/admin.key"
  mv "$STATE/admin.kubeconfig.tmp" "$STATE/admin.kubeconfig"
  echo "${NODE_IP:-loopback}" >"$STATE/mode"
  cat >"$STATE/endpoints" <<EOF
APISERVER=https://$API_HOST:$APISERVER_PORT
ETCD=http://127.0.0.1:$etcd_client
CONTROLLER_MANAGER=https://127.0.0.1:$kcm_port
CA=$pki/ca.crt
ADMIN_CERT=$pki/admin.crt
ADMIN_KEY=$pki/admin.key
EOF
  log "control plane up in $((SECONDS - t0))s: apiserver https://$API_HOST:$APISERVER_PORT, etcd 127.0.0.1:$etcd_client, controller-manager 127.0.0.1:$kcm_port"
  log "kubectl: $BIN/kubectl; details: $STATE/endpoints; logs: $STATE/logs"
  env_line
}

# --- main --------------------------------------------------------------------

lock() { # serialise concurrent start/stop calls (e.g. parallel tests)
  exec 9>"${STATE%/}.lock"
  flock 9
}

case ${1:-} in
  build)
    ensure_tools
    build
    ;;
  start)
    lock
    start
    ;;
  env)
    running || die "not running (state dir $STATE)"
    env_line
    ;;
  status)
    if running; then
      log "running"
      env_line
    else
      log "not running"
      exit 1
    fi
    ;;
  stop)
    if [[ -d $STATE/node && -z ${ANTIDOTE_K8S_CLUSTER_STOPPING:-} ]]; then
      # a node runs beside this control plane: its stop also unmounts, deletes interfaces and
      # iptables rules, and then stops the control plane
      exec "$HERE/cluster.sh" stop
    fi
    lock
    stop_all
    log "stopped"
    ;;
  *)
    echo "usage: $0 build|start|env|status|stop" >&2
    exit 2
    ;;
esac
