#!/usr/bin/env bash
# A real single-node Kubernetes cluster for tests: the control plane of controlplane.sh (etcd,
# kube-apiserver, kube-controller-manager) plus a real node on this machine: kube-scheduler,
# kubelet, kube-proxy (iptables mode), a private containerd (Debian's, with runc), Debian's CNI
# plugins (bridge, host-local, loopback, portmap) under Multus (thin plugin), kube-router as the
# NetworkPolicy enforcer (firewall only) and CoreDNS as an ordinary pod behind Service kube-dns.
#
#   tests/k8s/cluster.sh build            build everything into the cache (once; background-friendly)
#   tests/k8s/cluster.sh start            build if needed, start, wait until the node is Ready,
#                                         DNS answers and NetworkPolicy/Multus are in place;
#                                         last stdout line: KUBECONFIG=<path>
#   tests/k8s/cluster.sh env              print KUBECONFIG=<path> if running (exit 1 if not)
#   tests/k8s/cluster.sh status           say whether it runs (exit 1 if not)
#   tests/k8s/cluster.sh import IMAGE...  copy images from the Docker engine $DOCKER_HOST names into
#                                         containerd's k8s.io namespace (skipped when up to date)
#   tests/k8s/cluster.sh stop             stop everything and remove all it made on the machine
#
# A started cluster's facts are in $ANTIDOTE_K8S_STATE/node/env (sourceable: NODE_IP, POD_CIDR,
# DNS_IP, KUBECONFIG, KUBECTL, APISERVER, CONTAINERD_SOCK, ...); tests/k8s/README.md has the rest.
#
# Environment:
#   ANTIDOTE_K8S_CACHE    binaries cache (default ~/.cache/antidote/k8s), shared with controlplane.sh
#   ANTIDOTE_K8S_STATE    state dir (default /tmp/antidote-k8s): the control plane's, with the
#                         node's in $ANTIDOTE_K8S_STATE/node
#   ANTIDOTE_K8S_NODE_IP  the node's address, put on lo as a /32 (default 10.99.0.1)
#
# One node per machine: the kubelet, kube-proxy and kube-router use fixed paths, iptables chains
# and ports, so a second start from another state dir refuses, naming the running one (a
# machine-wide lock, /run/antidote-k8s-node.lock, and owner file /run/antidote-k8s-node.owner).
# Everything comes from Debian packages and the Go module proxy; images are built locally.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CONTROLPLANE=$HERE/controlplane.sh

K8S_VERSION=$(sed -n 's/^K8S_VERSION=\([^[:space:]]*\).*/\1/p' "$CONTROLPLANE")
COREDNS_VERSION=v1.15.0        # github.com/coredns/coredns
KUBE_ROUTER_VERSION=v2.1.0     # github.com/cloudnativelabs/kube-router/v2 (the only v2 the proxy serves)
MULTUS_VERSION=v4.2.4          # gopkg.in/k8snetworkplumbingwg/multus-cni.v4 (v4.2.5 is refused)
PAUSE_VERSION=3.10.2           # build/pause of k8s.io/kubernetes at $K8S_VERSION (its Makefile's TAG)
NODE_RECIPE=1                  # bump when a node build changes (flags, image layout)

CACHE_ROOT=${ANTIDOTE_K8S_CACHE:-${HOME:-/root}/.cache/antidote/k8s}
K8S_BIN=$CACHE_ROOT/$K8S_VERSION/bin
NODE_CACHE=$CACHE_ROOT/node
STATE=${ANTIDOTE_K8S_STATE:-/tmp/antidote-k8s}
NS=$STATE/node
KUBECTL=$K8S_BIN/kubectl

NODE_IP=${ANTIDOTE_K8S_NODE_IP:-10.99.0.1}
NODE_NAME=antidote-node
CLUSTER_CIDR=10.244.0.0/16     # pods; the node gets a /24 of it
SERVICE_CIDR=10.96.0.0/16      # controlplane.sh's --service-cluster-ip-range
DNS_IP=10.96.0.10
CLUSTER_DOMAIN=cluster.local
LESSON_BRIDGE_PREFIX=adl       # agent-k8s's per-lesson Multus bridges: adl + 12 hex
PAUSE_IMAGE=registry.k8s.io/pause:$PAUSE_VERSION
COREDNS_IMAGE=antidote.local/coredns:$COREDNS_VERSION
FWD_CHAIN=ANTIDOTE-NODE-FWD
KUBELET_PORT=10250
KUBELET_HEALTHZ_PORT=10248
MACHINE_LOCK=/run/antidote-k8s-node.lock
MACHINE_OWNER=/run/antidote-k8s-node.owner
# The host sysctls the kubelet (and our forwarding) change: saved at start, restored at stop.
SYSCTLS=(kernel/panic_on_oops vm/overcommit_memory kernel/panic net/ipv4/ip_forward net/bridge/bridge-nf-call-iptables)
# Fixed paths outside the state dir that the kubelet, libcni, Multus and containerd 1.6 may
# create; those that did not exist at start are removed at stop.
FIXED_PATHS=(/var/lib/kubelet /var/log/containers /var/log/pods /var/lib/cni /etc/cni /opt/cni
  /run/containerd /var/lib/kube-router /usr/libexec/kubernetes /etc/kubernetes /opt/containerd
  /var/lib/containerd /run/netns /var/run/netns)
NODE_COMPONENTS=(containerd kube-scheduler kubelet kube-proxy kube-router)

case $STATE in
  /*/*) ;;
  *) echo "ANTIDOTE_K8S_STATE must be an absolute path below /, not '$STATE'" >&2; exit 2 ;;
esac

log() { printf '[cluster] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# --- prerequisites -----------------------------------------------------------

apt_install() { # Debian packages...
  local sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo)
  command -v apt-get >/dev/null 2>&1 || die "missing Debian packages ($*) and no apt-get"
  log "installing with apt-get: $*"
  # Wait for another apt-get (tests/run runs some beside this) instead of failing.
  "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq >&2
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "$@" >&2
}

ensure_build_tools() {
  local missing=()
  command -v gcc >/dev/null 2>&1 || missing+=(gcc)
  [[ -f /usr/lib/x86_64-linux-gnu/libc.a || -n $(find /usr/lib -name libc.a -print -quit 2>/dev/null) ]] \
    || missing+=(libc6-dev)
  command -v flock >/dev/null 2>&1 || missing+=(util-linux)
  [[ ${#missing[@]} -eq 0 ]] || apt_install "${missing[@]}"
  command -v go >/dev/null 2>&1 || die "go is not installed (Go >= 1.26 builds the node's binaries)"
}

ensure_runtime_tools() { # command:package
  local missing=() cp c p
  for cp in containerd:containerd runc:runc ctr:containerd ipset:ipset iptables:iptables \
    conntrack:conntrack dig:dnsutils openssl:openssl curl:curl nsenter:util-linux; do
    c=${cp%%:*} p=${cp#*:}
    command -v "$c" >/dev/null 2>&1 || missing+=("$p")
  done
  [[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local && -x /usr/lib/cni/loopback && -x /usr/lib/cni/portmap ]] \
    || missing+=(containernetworking-plugins)
  [[ ${#missing[@]} -eq 0 ]] || apt_install $(printf '%s\n' "${missing[@]}" | sort -u)
  command -v containerd >/dev/null && command -v runc >/dev/null && [[ -x /usr/lib/cni/bridge ]] \
    || die "containerd, runc or the CNI plugins are still missing after apt-get install"
}

# --- build -------------------------------------------------------------------

stamp_ok() { [[ -f $1/.complete && $(head -n1 "$1/.complete") == "$2" ]]; }

go_env() {
  export GOFLAGS=-buildvcs=false GOWORK=off CGO_ENABLED=0
  export GOTOOLCHAIN=${GOTOOLCHAIN:-local}
  # A build cache of its own, removed after the build (as controlplane.sh does).
  export GOCACHE=$NODE_CACHE/go-build.tmp
}

module_dir() { # module@version -> its directory in the module cache (downloaded if missing)
  local out dir
  out=$(cd "$NODE_CACHE" && go mod download -json "$1") || die "go mod download $1 failed: $out"
  dir=$(printf '%s\n' "$out" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
  [[ -d $dir ]] || die "no directory for $1 (got '$dir')"
  echo "$dir"
}

# name module version package ldflags : builds $NODE_CACHE/<name>-<version>/<name> with `go build`
# in the module's own directory (`go install pkg@version` fails against this proxy).
build_go() {
  local name=$1 mod=$2 ver=$3 pkg=$4 ld=$5
  local dir=$NODE_CACHE/$name-$ver stamp="$name $mod@$ver recipe $NODE_RECIPE"
  stamp_ok "$dir" "$stamp" && [[ -x $dir/$name ]] && return 0
  local t0=$SECONDS src
  log "building $name $ver from $mod (a few minutes on a cold cache)"
  src=$(module_dir "$mod@$ver")
  rm -rf "$dir.tmp"
  mkdir -p "$dir.tmp"
  (cd "$src" && go build -trimpath -ldflags="-s -w $ld" -o "$dir.tmp/$name" "$pkg") >&2 \
    || die "go build of $name $ver failed"
  printf '%s\n%s\n' "$stamp" "$(go version)" >"$dir.tmp/.complete"
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
  log "$name $ver built in $((SECONDS - t0))s ($(du -h "$dir/$name" | cut -f1))"
}

# The NetworkAttachmentDefinition CRD, from the module's own deployment manifest.
build_nad_crd() {
  local dir=$NODE_CACHE/multus-$MULTUS_VERSION src
  [[ -s $dir/nad-crd.yaml ]] && return 0
  src=$(module_dir "gopkg.in/k8snetworkplumbingwg/multus-cni.v4@$MULTUS_VERSION")
  awk 'BEGIN { RS = "\n---\n" } /kind: CustomResourceDefinition/ { print; exit }' \
    "$src/deployments/multus-daemonset.yml" >"$dir/nad-crd.yaml.tmp"
  grep -q 'network-attachment-definitions.k8s.cni.cncf.io' "$dir/nad-crd.yaml.tmp" \
    || die "no NetworkAttachmentDefinition CRD in multus-daemonset.yml"
  mv "$dir/nad-crd.yaml.tmp" "$dir/nad-crd.yaml"
}

# oci_archive out.tar rootfs-dir image-name config-json-fragment : a one-layer OCI image archive
# (index.json, oci-layout, blobs), importable with `ctr images import` without Docker.
oci_archive() {
  local out=$1 rootfs=$2 name=$3 cfg=$4
  local w
  w=$(mktemp -d "$NODE_CACHE/.oci.XXXXXX")
  mkdir -p "$w/blobs/sha256"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=gnu -C "$rootfs" -cf "$w/layer.tar" .
  local ld ls
  ld=$(sha256sum "$w/layer.tar" | cut -c1-64)
  ls=$(stat -c %s "$w/layer.tar")
  mv "$w/layer.tar" "$w/blobs/sha256/$ld"
  printf '{"architecture":"amd64","os":"linux","config":%s,"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created_by":"tests/k8s/cluster.sh"}]}' \
    "$cfg" "$ld" >"$w/config.json"
  local cd cs
  cd=$(sha256sum "$w/config.json" | cut -c1-64)
  cs=$(stat -c %s "$w/config.json")
  mv "$w/config.json" "$w/blobs/sha256/$cd"
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"sha256:%s","size":%s}]}' \
    "$cd" "$cs" "$ld" "$ls" >"$w/manifest.json"
  local md ms
  md=$(sha256sum "$w/manifest.json" | cut -c1-64)
  ms=$(stat -c %s "$w/manifest.json")
  mv "$w/manifest.json" "$w/blobs/sha256/$md"
  printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
    "$md" "$ms" "$name" "${name##*:}" >"$w/index.json"
  printf '{"imageLayoutVersion":"1.0.0"}' >"$w/oci-layout"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$w" -cf "$out.tmp" oci-layout index.json blobs
  mv "$out.tmp" "$out"
  rm -rf "$w"
}

# The pause image: build/pause/linux/pause.c of the k8s module, `gcc -static`.
build_pause() {
  local dir=$NODE_CACHE/pause-$PAUSE_VERSION stamp="pause $PAUSE_VERSION k8s $K8S_VERSION recipe $NODE_RECIPE"
  stamp_ok "$dir" "$stamp" && [[ -s $dir/pause.oci.tar ]] && return 0
  local src
  src=$(module_dir "k8s.io/kubernetes@$K8S_VERSION")
  rm -rf "$dir.tmp"
  mkdir -p "$dir.tmp/rootfs"
  gcc -Os -Wall -Werror -static -DVERSION="v$PAUSE_VERSION-antidote" -o "$dir.tmp/rootfs/pause" \
    "$src/build/pause/linux/pause.c" >&2 || die "gcc -static pause.c failed"
  strip "$dir.tmp/rootfs/pause" 2>/dev/null || true
  oci_archive "$dir.tmp/pause.oci.tar" "$dir.tmp/rootfs" "$PAUSE_IMAGE" \
    '{"Entrypoint":["/pause"],"User":"65535:65535"}'
  printf '%s\n' "$stamp" >"$dir.tmp/.complete"
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
  log "pause image $PAUSE_IMAGE built"
}

# CoreDNS FROM scratch: the static binary alone.
build_coredns_image() {
  local dir=$NODE_CACHE/coredns-$COREDNS_VERSION stamp
  stamp="coredns image $COREDNS_VERSION $(head -n1 "$dir/.complete") recipe $NODE_RECIPE"
  [[ -s $dir/coredns.oci.tar && -f $dir/.image && $(<"$dir/.image") == "$stamp" ]] && return 0
  rm -rf "$dir/rootfs"
  mkdir -p "$dir/rootfs/etc/coredns"
  cp "$dir/coredns" "$dir/rootfs/coredns"
  oci_archive "$dir/coredns.oci.tar" "$dir/rootfs" "$COREDNS_IMAGE" \
    '{"Entrypoint":["/coredns"],"Cmd":["-conf","/etc/coredns/Corefile"],"ExposedPorts":{"53/udp":{},"53/tcp":{}}}'
  rm -rf "$dir/rootfs"
  printf '%s\n' "$stamp" >"$dir/.image"
  log "CoreDNS image $COREDNS_IMAGE built"
}

have_node_build() {
  stamp_ok "$NODE_CACHE/coredns-$COREDNS_VERSION" "coredns github.com/coredns/coredns@$COREDNS_VERSION recipe $NODE_RECIPE" &&
    stamp_ok "$NODE_CACHE/kube-router-$KUBE_ROUTER_VERSION" "kube-router github.com/cloudnativelabs/kube-router/v2@$KUBE_ROUTER_VERSION recipe $NODE_RECIPE" &&
    stamp_ok "$NODE_CACHE/multus-$MULTUS_VERSION" "multus gopkg.in/k8snetworkplumbingwg/multus-cni.v4@$MULTUS_VERSION recipe $NODE_RECIPE" &&
    [[ -s $NODE_CACHE/multus-$MULTUS_VERSION/nad-crd.yaml && -s $NODE_CACHE/coredns-$COREDNS_VERSION/coredns.oci.tar ]] &&
    stamp_ok "$NODE_CACHE/pause-$PAUSE_VERSION" "pause $PAUSE_VERSION k8s $K8S_VERSION recipe $NODE_RECIPE"
}

build() {
  # The control plane's binaries (with kube-scheduler, kubelet, kube-proxy), behind its own lock.
  "$CONTROLPLANE" build 5>&- 6>&- 7>&-
  mkdir -p "$NODE_CACHE"
  exec 7>"$NODE_CACHE/build.lock"
  flock 7
  if ! have_node_build; then
    ensure_build_tools
    local t0=$SECONDS
    go_env
    build_go coredns github.com/coredns/coredns "$COREDNS_VERSION" . \
      "-X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION"
    build_go kube-router github.com/cloudnativelabs/kube-router/v2 "$KUBE_ROUTER_VERSION" ./cmd/kube-router \
      "-X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION -X github.com/cloudnativelabs/kube-router/v2/pkg/version.BuildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    build_go multus gopkg.in/k8snetworkplumbingwg/multus-cni.v4 "$MULTUS_VERSION" ./cmd/multus \
      "-X gopkg.in/k8snetworkplumbingwg/multus-cni.v4/pkg/multus.version=$MULTUS_VERSION"
    build_nad_crd
    build_pause
    build_coredns_image
    rm -rf "$GOCACHE"
    log "node build done in $((SECONDS - t0))s"
  fi
  exec 7>&-
  log "node binaries and images in $NODE_CACHE"
}

# --- processes ---------------------------------------------------------------

pid_of() { # component -> pid, if its pid file names a live process running that binary
  local f=$NS/$1.pid pid exe
  [[ -f $f ]] || return 1
  pid=$(<"$f")
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
  [[ ${exe%" (deleted)"} == */"$1" ]] || return 1
  echo "$pid"
}

running() {
  local c
  "$CONTROLPLANE" status >/dev/null 2>&1 || return 1
  for c in "${NODE_COMPONENTS[@]}"; do pid_of "$c" >/dev/null || return 1; done
  [[ -f $NS/ready ]]
}

launch() { # name binary args... : starts it in the background, logs in $NS/logs/<name>.log
  local name=$1 bin=$2
  shift 2
  # fd 9 (the machine lock) stays with this script, not with the daemons
  setsid "$bin" "$@" >>"$NS/logs/$name.log" 2>&1 </dev/null 9>&- &
  echo $! >"$NS/$name.pid"
}

wait_until() { # seconds what command... : retries the command every 0.5 s
  local limit=$1 what=$2 deadline
  shift 2
  deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= deadline)); then
      log "$what did not happen within ${limit}s"
      local f
      for f in "$NS"/logs/*.log; do [[ -f $f ]] && { log "--- ${f##*/}"; tail -n 15 "$f" >&2; }; done
      return 1
    fi
    sleep 0.5
  done
}

k() { "$KUBECTL" --kubeconfig "$STATE/admin.kubeconfig" "$@"; }

issue_cert() { # name CN O SAN usage : a certificate of the control plane's CA in $NS/pki
  local name=$1 cn=$2 o=$3 san=$4 usage=$5 pki=$STATE/pki
  openssl req -new -newkey rsa:2048 -nodes -keyout "$NS/pki/$name.key" -out "$NS/pki/$name.csr" \
    -subj "/CN=$cn${o:+/O=$o}" 2>/dev/null
  {
    echo "extendedKeyUsage=$usage"
    [[ -z $san ]] || echo "subjectAltName=$san"
  } >"$NS/pki/$name.ext"
  openssl x509 -req -in "$NS/pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 30 -extfile "$NS/pki/$name.ext" -out "$NS/pki/$name.crt" 2>/dev/null
  rm -f "$NS/pki/$name.csr" "$NS/pki/$name.ext"
}

kubeconfig_for() { # out cert key
  local b64 server
  b64() { base64 -w0 <"$1"; }
  server=$(sed -n 's/^[[:space:]]*server: //p' "$STATE/admin.kubeconfig" | head -n1)
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: antidote
  cluster:
    server: $server
    certificate-authority-data: $(b64 "$STATE/pki/ca.crt")
users:
- name: node
  user:
    client-certificate-data: $(b64 "$2")
    client-key-data: $(b64 "$3")
contexts:
- name: antidote
  context: {cluster: antidote, user: node}
current-context: antidote
EOF
}

free_port() { # a loopback port nobody listens on, below the ephemeral range
  local p
  while :; do
    p=$((20000 + RANDOM % 12000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
  done
}

machine_claim() { # one node per machine: refuse while another state dir's node runs
  machine_lock
  if [[ -f $MACHINE_OWNER ]]; then
    local other
    other=$(<"$MACHINE_OWNER")
    if [[ $other != "$STATE" ]]; then
      if ANTIDOTE_K8S_STATE=$other "$0" status >/dev/null 2>&1; then
        die "a test node of another checkout runs on this machine (state dir $other, owner file $MACHINE_OWNER): one node per machine; stop it with ANTIDOTE_K8S_STATE=$other $0 stop"
      fi
      if [[ -d $other/node ]]; then
        # a dead node's leftovers (chains, bridges, mounts) would collide with ours
        log "cleaning up the leftovers of a dead test node in $other"
        ANTIDOTE_K8S_STATE=$other ANTIDOTE_K8S_MACHINE_LOCKED=1 "$0" stop 9>&- || true
      fi
    fi
  fi
  echo "$STATE" >"$MACHINE_OWNER"
}

save_host_state() {
  mkdir -p "$NS"
  local s
  : >"$NS/sysctls"
  for s in "${SYSCTLS[@]}"; do
    [[ -f /proc/sys/$s ]] && echo "$s $(<"/proc/sys/$s")" >>"$NS/sysctls"
  done
  : >"$NS/new-paths"
  for s in "${FIXED_PATHS[@]}"; do [[ -e $s ]] || echo "$s" >>"$NS/new-paths"; done
  [[ -z ${1:-} ]] || echo "$1" >"$NS/node-ip-added"
}

write_containerd_config() {
  mkdir -p "$NS/containerd" "$NS/cni/bin" "$NS/cni/net.d" "$NS/runc"
  cat >"$NS/containerd/config.toml" <<EOF
version = 2
root = "$NS/containerd/root"
state = "$NS/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "$NS/containerd/containerd.sock"
[ttrpc]
  address = "$NS/containerd/containerd.sock.ttrpc"
[debug]
  address = "$NS/containerd/debug.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # root here lacks CAP_SYS_RESOURCE: without this every sandbox fails (oom_score_adj)
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$NS/cni/bin"
    conf_dir = "$NS/cni/net.d"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "$NS/runc"
        SystemdCgroup = false
EOF
  local b
  for b in /usr/lib/cni/*; do ln -sf "$b" "$NS/cni/bin/${b##*/}"; done
  ln -sf "$NODE_CACHE/multus-$MULTUS_VERSION/multus" "$NS/cni/bin/multus"
}

write_cni_config() { # pod-cidr : the pod network (bridge cni0) under Multus, once the node has its CIDR
  local cidr=$1
  cat >"$NS/cni/bridge.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "antidote-pods", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$cidr"}]], "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": "$NS/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
  cp "$STATE/admin.kubeconfig" "$NS/multus.kubeconfig"
  # The pod network inline as Multus's delegate: given as a file path (clusterNetwork), Multus
  # 4.2.4 caches a re-encoded copy without host-local's ranges, and every pod's delete then
  # fails ("no IP ranges specified"), leaving namespaces Terminating for ever.
  {
    printf '{"cniVersion": "0.4.0", "name": "multus-cni-network", "type": "multus",\n'
    printf ' "kubeconfig": "%s", "cniDir": "%s", "binDir": "%s",\n' "$NS/multus.kubeconfig" "$NS/cni/multus" "$NS/cni/bin"
    printf ' "logFile": "%s", "logLevel": "error", "delegates": [\n' "$NS/logs/multus.log"
    cat "$NS/cni/bridge.conflist"
    printf ']}\n'
  } >"$NS/cni/net.d/00-multus.conf.tmp"
  mv "$NS/cni/net.d/00-multus.conf.tmp" "$NS/cni/net.d/00-multus.conf"
}

forward_rules() { # Docker's FORWARD policy is DROP: accept pod traffic after everyone else's rules
  iptables -N "$FWD_CHAIN" 2>/dev/null || iptables -F "$FWD_CHAIN"
  iptables -A "$FWD_CHAIN" -i cni0 -o cni0 -j ACCEPT
  # agent-k8s's lesson bridges: traffic bridged within one of them (one link of one lesson)
  iptables -A "$FWD_CHAIN" -m physdev --physdev-is-bridged -i "$LESSON_BRIDGE_PREFIX+" -o "$LESSON_BRIDGE_PREFIX+" -j ACCEPT
  iptables -C FORWARD -j "$FWD_CHAIN" 2>/dev/null || iptables -A FORWARD -j "$FWD_CHAIN"
}

node_configs() {
  mkdir -p "$NS/pki" "$NS/kubelet" "$NS/kubelet-root" "$NS/pod-logs" "$NS/logs"
  issue_cert kubelet "system:node:$NODE_NAME" system:nodes "" clientAuth
  issue_cert kubelet-serving "system:node:$NODE_NAME" system:nodes "IP:$NODE_IP,DNS:$NODE_NAME" serverAuth
  kubeconfig_for "$NS/kubelet.kubeconfig" "$NS/pki/kubelet.crt" "$NS/pki/kubelet.key"
  cat >"$NS/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$NS/containerd/containerd.sock
address: $NODE_IP
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
tlsCertFile: $NS/pki/kubelet-serving.crt
tlsPrivateKeyFile: $NS/pki/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $STATE/pki/ca.crt}
authorization: {mode: Webhook}
resolvConf: ""
clusterDNS: [$DNS_IP]
clusterDomain: $CLUSTER_DOMAIN
podLogsDir: $NS/pod-logs
podPidsLimit: 512
volumePluginDir: $NS/volume-plugins
maxPods: 110
failSwapOn: false
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%", "nodefs.inodesFree": "1%"}
EOF
  cat >"$NS/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $STATE/admin.kubeconfig}
hostnameOverride: $NODE_NAME
mode: iptables
clusterCIDR: $CLUSTER_CIDR
nodePortAddresses: ["$NODE_IP/32"]
iptables: {localhostNodePorts: false}
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
metricsBindAddress: 127.0.0.1:$(free_port)
healthzBindAddress: 127.0.0.1:$(free_port)
EOF
}

coredns_manifest() {
  cat <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "antidote:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "antidote:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "antidote:coredns"}
subjects: [{kind: ServiceAccount, name: coredns, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:53 {
        errors
        health :8080
        ready :8181
        kubernetes $CLUSTER_DOMAIN in-addr.arpa ip6.arpa {
            fallthrough in-addr.arpa ip6.arpa
        }
        cache 30
    }
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  replicas: 1
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      serviceAccountName: coredns
      dnsPolicy: Default
      containers:
      - name: coredns
        image: $COREDNS_IMAGE
        imagePullPolicy: Never
        args: ["-conf", "/etc/coredns/Corefile"]
        ports:
        - {containerPort: 53, name: dns, protocol: UDP}
        - {containerPort: 53, name: dns-tcp, protocol: TCP}
        readinessProbe: {httpGet: {path: /ready, port: 8181}, periodSeconds: 2}
        resources: {requests: {cpu: 50m, memory: 32Mi}, limits: {memory: 128Mi}}
        volumeMounts: [{name: config, mountPath: /etc/coredns, readOnly: true}]
      volumes: [{name: config, configMap: {name: coredns}}]
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  selector: {k8s-app: kube-dns}
  clusterIP: $DNS_IP
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
EOF
}

ctr_() { ctr -a "$NS/containerd/containerd.sock" -n k8s.io "$@"; }

pod_cidr() { [[ -n $(k get node "$NODE_NAME" -o 'jsonpath={.spec.podCIDR}' 2>/dev/null) ]]; }
node_ready() { [[ $(k get node "$NODE_NAME" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}') == True ]]; }
dns_answers() { dig +short +time=1 +tries=1 "@$DNS_IP" "kubernetes.default.svc.$CLUSTER_DOMAIN" | grep -q '^10\.96\.0\.1$'; }

start() {
  if running; then env_line; return 0; fi
  [[ $(id -u) -eq 0 ]] || die "the test node needs root (kubelet, containerd, iptables)"
  build
  ensure_runtime_tools
  machine_claim
  local t0=$SECONDS
  [[ ! -d $NS ]] || { log "cleaning up a stale node state in $NS"; stop_node; }
  # The node IP goes on lo before the apiserver binds it.
  local added_ip=""
  if ! ip -o -4 addr show dev lo | grep -q " $NODE_IP/32 "; then
    ip addr add "$NODE_IP/32" dev lo
    added_ip=$NODE_IP
  fi
  # A control plane started alone (loopback only) is restarted in node mode. Its start cleans
  # a stale state dir, so the node's own state is made only afterwards.
  if [[ $(cat "$STATE/mode" 2>/dev/null) != "$NODE_IP" ]] && "$CONTROLPLANE" status >/dev/null 2>&1; then
    log "restarting the control plane (running on loopback only) in node mode"
    ANTIDOTE_K8S_CLUSTER_STOPPING=1 "$CONTROLPLANE" stop 9>&- >/dev/null
  fi
  local cp_log
  cp_log=$(mktemp /tmp/antidote-cluster-cp.XXXXXX)
  if ! ANTIDOTE_K8S_NODE_IP=$NODE_IP "$CONTROLPLANE" start 9>&- >"$cp_log" 2>&1; then
    tail -n 30 "$cp_log" >&2
    rm -f "$cp_log"
    [[ -z $added_ip ]] || ip addr del "$added_ip/32" dev lo 2>/dev/null || true
    die "the control plane did not start"
  fi
  save_host_state "$added_ip"
  mkdir -p "$NS/logs"
  mv "$cp_log" "$NS/logs/controlplane-start.log"
  modprobe br_netfilter 2>/dev/null || true
  echo 1 >/proc/sys/net/ipv4/ip_forward
  [[ -f /proc/sys/net/bridge/bridge-nf-call-iptables ]] && echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables
  write_containerd_config
  node_configs
  forward_rules
  launch containerd "$(command -v containerd)" --config "$NS/containerd/config.toml"
  wait_until 30 "containerd answering" ctr_ version
  ctr_ images import "$NODE_CACHE/pause-$PAUSE_VERSION/pause.oci.tar" >/dev/null
  ctr_ images import "$NODE_CACHE/coredns-$COREDNS_VERSION/coredns.oci.tar" >/dev/null
  local sched_port
  sched_port=$(free_port)
  launch kube-scheduler "$K8S_BIN/kube-scheduler" --kubeconfig "$STATE/admin.kubeconfig" \
    --authentication-kubeconfig "$STATE/admin.kubeconfig" --authorization-kubeconfig "$STATE/admin.kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --secure-port="$sched_port" --profiling=false
  launch kubelet "$K8S_BIN/kubelet" --config "$NS/kubelet/config.yaml" --kubeconfig "$NS/kubelet.kubeconfig" \
    --root-dir "$NS/kubelet-root" --cert-dir "$NS/pki" --node-ip "$NODE_IP" --hostname-override "$NODE_NAME"
  wait_until 60 "the node registering with a pod CIDR" pod_cidr
  local cidr
  cidr=$(k get node "$NODE_NAME" -o 'jsonpath={.spec.podCIDR}')
  write_cni_config "$cidr"
  launch kube-proxy "$K8S_BIN/kube-proxy" --config "$NS/kube-proxy.yaml"
  # kube-router syncs on every pod and policy event, and replaces the whole filter table at
  # each (iptables-save, then iptables-restore without --noflush), which dockerd and
  # agent-docker write too; a sync it aborts waits for the next event, or the periodic sync
  # (every 15 s here, 5 min by default). `-v=1` logs each sync, its time and why one was
  # aborted (the isolation test prints them when it fails).
  launch kube-router "$NODE_CACHE/kube-router-$KUBE_ROUTER_VERSION/kube-router" \
    --kubeconfig "$STATE/admin.kubeconfig" --hostname-override "$NODE_NAME" \
    --run-firewall=true --run-router=false --run-service-proxy=false --run-loadbalancer=false \
    --service-cluster-ip-range="$SERVICE_CIDR" --metrics-port=0 --health-port="$(free_port)" \
    --iptables-sync-period=15s -v=1
  wait_until 60 "the node becoming Ready" node_ready
  k apply --server-side -f "$NODE_CACHE/multus-$MULTUS_VERSION/nad-crd.yaml" >/dev/null
  coredns_manifest | k apply --server-side -f - >/dev/null
  wait_until 30 "the NetworkAttachmentDefinition CRD being established" \
    k wait --for=condition=Established --timeout=2s crd/network-attachment-definitions.k8s.cni.cncf.io
  wait_until 90 "CoreDNS answering at $DNS_IP" dns_answers
  cat >"$NS/env" <<EOF
NODE_IP=$NODE_IP
NODE_NAME=$NODE_NAME
POD_CIDR=$cidr
CLUSTER_CIDR=$CLUSTER_CIDR
SERVICE_CIDR=$SERVICE_CIDR
DNS_IP=$DNS_IP
CONTAINERD_SOCK=$NS/containerd/containerd.sock
LESSON_BRIDGE_PREFIX=$LESSON_BRIDGE_PREFIX
CLUSTER_DOMAIN=$CLUSTER_DOMAIN
KUBECONFIG=$STATE/admin.kubeconfig
KUBECTL=$KUBECTL
$(grep '^APISERVER=' "$STATE/endpoints")
CNI_BIN_DIR=$NS/cni/bin
CNI_CONF_DIR=$NS/cni/net.d
PAUSE_IMAGE=$PAUSE_IMAGE
COREDNS_IMAGE=$COREDNS_IMAGE
LOGS=$NS/logs
EOF
  touch "$NS/ready"
  exec 9>&-
  log "cluster up in $((SECONDS - t0))s: node $NODE_NAME at $NODE_IP, pods $cidr, DNS $DNS_IP; logs in $NS/logs"
  env_line
}

env_line() { echo "KUBECONFIG=$STATE/admin.kubeconfig"; }

import_images() { # images... from $DOCKER_HOST's engine into containerd (k8s.io), when changed
  running || die "the test cluster is not running (tests/k8s/cluster.sh start)"
  mkdir -p "$NS/imported"
  local image id mark
  for image in "$@"; do
    id=$(docker image inspect -f '{{.Id}}' "$image") || die "no image $image in the Docker engine at ${DOCKER_HOST:-the default socket}"
    mark=$NS/imported/$(printf '%s' "$image" | tr '/:' '__')
    [[ -f $mark && $(<"$mark") == "$id" ]] && continue
    docker save "$image" | ctr_ images import --all-platforms - >/dev/null || die "importing $image into containerd failed"
    echo "$id" >"$mark"
    log "imported $image"
  done
}

kill_component() { # name : TERM, then KILL after 10 s
  local pid i
  pid=$(pid_of "$1") || return 0
  kill "$pid" 2>/dev/null || true
  for i in $(seq 1 50); do alive "$pid" || return 0; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
  for i in $(seq 1 25); do alive "$pid" || return 0; sleep 0.2; done
}

# Running and not a zombie: this VM's init reaps orphans late, and `kill -0` succeeds on zombies.
alive() {
  local st
  st=$(sed 's/.*) //' 2>/dev/null <"/proc/$1/stat" | cut -d' ' -f1) || return 1
  [[ -n $st && $st != Z ]]
}

strip_iptables() { # iptables-save|restore without our, kube-proxy's, kube-router's and CNI's chains
  local cmd=$1 t dump
  command -v "$cmd-save" >/dev/null || return 0
  for t in filter nat mangle raw; do
    # (a variable, not a pipe into grep -q: with pipefail, a save cut short by SIGPIPE "fails")
    dump=$("$cmd-save" -t "$t" 2>/dev/null) || continue
    grep -qE "^:(KUBE-|CNI-|$FWD_CHAIN )" <<<"$dump" || continue
    awk -v fwd="$FWD_CHAIN" '
      /^:(KUBE-|CNI-)/ || $0 ~ "^:" fwd " " { next }
      /^-A (KUBE-|CNI-)/ || $0 ~ "^-A " fwd " " { next }
      / -[jg] (KUBE-|CNI-)/ || $0 ~ " -j " fwd "( |$)" { next }
      { print }' <<<"$dump" | "$cmd-restore" -w -T "$t" || log "could not clean $cmd table $t"
  done
}

# Pids of our containerd's shims (found by our socket in their command line, read from /proc:
# no pattern matching on process names) and of every process below them (the containers).
shim_tree_pids() {
  local f p pp shims=() all=()
  for f in /proc/[0-9]*/cmdline; do
    p=${f#/proc/}; p=${p%/cmdline}
    [[ $(tr '\0' ' ' 2>/dev/null <"$f") == *containerd-shim*" -address $NS/containerd/containerd.sock"* ]] && shims+=("$p")
  done
  ((${#shims[@]})) || return 0
  all=("${shims[@]}")
  local grew=1
  while ((grew)); do
    grew=0
    for f in /proc/[0-9]*/stat; do
      p=${f#/proc/}; p=${p%/stat}
      [[ " ${all[*]} " == *" $p "* ]] && continue
      pp=$(sed 's/.*) //' "$f" 2>/dev/null | cut -d' ' -f2) || continue
      if [[ " ${all[*]} " == *" $pp "* ]]; then all+=("$p"); grew=1; fi
    done
  done
  echo "${all[*]}"
}

# /run/containerd/s holds the shims' sockets of every containerd 1.6 on the machine (Docker's
# too): remove only the dead ones (no listener in /proc/net/unix), then empty directories.
clean_run_containerd() {
  [[ -d /run/containerd ]] || return 0
  local f listening
  listening=$(awk 'NR > 1 && $8 != "" { print $8 }' /proc/net/unix)
  for f in /run/containerd/s/*; do
    [[ -S $f ]] || continue
    grep -qxF "$f" <<<"$listening" || rm -f "$f"
  done
  find /run/containerd -depth -type d -empty -delete 2>/dev/null || true
}

# The kubelet's cgroups (cgroupfs driver, cgroup v1: kubepods in every hierarchy), deepest first.
clean_cgroups() {
  local d
  for d in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
    [[ -d $d ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
}

other_dockerd() { grep -qsx dockerd /proc/[0-9]*/comm; }

stop_phase() { log "stop: $1 ($((SECONDS - STOP_T0))s)"; }

stop_node() {
  local c pids
  STOP_T0=$SECONDS
  for c in kube-router kube-proxy kubelet kube-scheduler; do kill_component "$c"; done
  stop_phase "node daemons stopped"
  # Every container and shim of our containerd, then containerd itself.
  if [[ -d $NS/runc/k8s.io ]]; then
    local id
    for id in $(runc --root "$NS/runc/k8s.io" list -q 2>/dev/null); do runc --root "$NS/runc/k8s.io" kill "$id" KILL 2>/dev/null || true; done
  fi
  pids=$(shim_tree_pids)
  # shellcheck disable=SC2086
  [[ -z $pids ]] || kill -9 $pids 2>/dev/null || true
  kill_component containerd
  stop_phase "containerd stopped"
  pids=$(shim_tree_pids)
  # shellcheck disable=SC2086
  [[ -z $pids ]] || kill -9 $pids 2>/dev/null || true
  # Mounts under the state dir (kubelet pod volumes, netns, overlay rootfs, shm), deepest first.
  local m
  for _ in 1 2 3; do
    for m in $(awk -v p="$NS/" 'index($2 "/", p) == 1 { print $2 }' /proc/mounts | sort -r); do
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
  done
  stop_phase "mounts gone"
  # Interfaces: the pod bridge and agent-k8s's lesson bridges (adl*), with the veths still on
  # them (the others go with their network namespaces). Other veths (Docker's) stay.
  local bridges b
  bridges=$(ip -o link show type bridge | awk -F': ' '{print $2}' | sed 's/@.*//' \
    | grep -xE "cni0|$LESSON_BRIDGE_PREFIX[0-9a-z]+" || true)
  for b in $bridges; do
    for c in $(ip -o link show master "$b" | awk -F': ' '{print $2}' | sed 's/@.*//'); do ip link del "$c" 2>/dev/null || true; done
    ip link del "$b" 2>/dev/null || true
  done
  strip_iptables iptables
  stop_phase "interfaces gone"
  strip_iptables ip6tables
  iptables -D FORWARD -j "$FWD_CHAIN" 2>/dev/null || true
  iptables -F "$FWD_CHAIN" 2>/dev/null && iptables -X "$FWD_CHAIN" 2>/dev/null || true
  if command -v ipset >/dev/null; then
    for c in $(ipset list -n 2>/dev/null | grep -E '^(inet6:)?(KUBE-|kube-)' || true); do ipset destroy "$c" 2>/dev/null || true; done
  fi
  if [[ -f $NS/node-ip-added ]]; then ip addr del "$(<"$NS/node-ip-added")/32" dev lo 2>/dev/null || true; fi
  clean_cgroups
  stop_phase "iptables and ipsets clean"
  if [[ -f $NS/sysctls ]]; then
    local name value
    while read -r name value; do
      # Docker needs forwarding and bridge netfilter as long as one of its engines runs
      case $name in net/ipv4/ip_forward | net/bridge/*) ! other_dockerd || continue ;; esac
      echo "$value" >"/proc/sys/$name" 2>/dev/null || true
    done <"$NS/sysctls"
  fi
  if [[ -f $NS/new-paths ]]; then
    while read -r m; do
      [[ -n $m && $m != /run/containerd ]] || continue
      for c in $(awk -v p="$m/" 'index($2 "/", p) == 1 { print $2 }' /proc/mounts | sort -r); do umount -l "$c" 2>/dev/null || true; done
      rm -rf --one-file-system "$m"
    done <"$NS/new-paths"
  fi
  clean_run_containerd
  if awk -v p="$NS/" 'index($2 "/", p) == 1 { found = 1 } END { exit !found }' /proc/mounts; then
    die "mounts are left under $NS; not removing it"
  fi
  rm -rf --one-file-system "$NS"
  stop_phase "host state restored"
  # the control plane last: its stop removes the whole state dir
  # The apiserver would wait a minute for the watches of pods killed above; nothing of it is kept.
  ANTIDOTE_K8S_CLUSTER_STOPPING=1 ANTIDOTE_K8S_STOP_GRACE=3 "$CONTROLPLANE" stop >/dev/null 2>&1 || true
  if [[ -f $MACHINE_OWNER && $(<"$MACHINE_OWNER") == "$STATE" ]]; then rm -f "$MACHINE_OWNER"; fi
}

machine_lock() { # serialise starts and stops of test nodes on this machine
  [[ -n ${ANTIDOTE_K8S_MACHINE_LOCKED:-} ]] && return 0
  exec 9>"$MACHINE_LOCK"
  flock 9
}

case ${1:-} in
  build) build ;;
  start) start ;;
  env) if running; then env_line; else log "not running"; exit 1; fi ;;
  status) if running; then log "running ($NS)"; else log "not running"; exit 1; fi ;;
  import) shift; import_images "$@" ;;
  stop)
    t0=$SECONDS
    machine_lock
    if [[ -f $MACHINE_OWNER && $(<"$MACHINE_OWNER") != "$STATE" ]] \
      && ANTIDOTE_K8S_STATE=$(<"$MACHINE_OWNER") "$0" status >/dev/null 2>&1; then
      # the node's chains, bridges and fixed paths belong to that one: leave them alone
      log "the test node on this machine is $(<"$MACHINE_OWNER")'s, not $STATE's: nothing to stop here"
      exit 0
    fi
    stop_node
    log "stopped in $((SECONDS - t0))s"
    ;;
  *)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
