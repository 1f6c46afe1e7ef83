#!/usr/bin/env bash
# Build the configurator image and the SSH test endpoint image locally, from packages the
# registries serve (Debian's mirror and PyPI; no container registry), once.
#
#   DOCKER_HOST=unix://... tests/docker/configurator.sh [configurator|sshd|jupyter|all]   (default: all)
#
# antidote/configurator:latest: a Debian bookworm rootfs (debootstrap --variant=minbase) with
#   python3, openssh-client and sshpass, and a virtualenv /opt/antidote (on PATH) holding
#   ansible-core and napalm from PyPI, plus /usr/local/bin/antidote-napalm (a NAPALM
#   load-merge-and-commit). Agents run python, ansible and napalm stage configurations in it
#   (agent-docker `--configurator-image`, agent-k8s `--configurator-image`). The rootfs tarball is
#   cached in ~/.cache/antidote/images/ (ANTIDOTE_IMAGE_CACHE) keyed by a hash of this script, so
#   it is built once per machine and only `docker import`ed into an engine that lacks it.
# antidote/sshd:latest: FROM scratch, Debian's static busybox plus Debian's dropbear and the
#   libraries it links (ldd): dropbear on 22 (user `antidote`, password `antidotepassword`,
#   logins logged to the container's stderr, so `docker logs` shows who logged in), busybox httpd
#   on 8080. The curriculum slug `sshd` names it.
# antidote/jupyter:latest: the configurator's Debian rootfs (its cached tarball, without the
#   configurator's virtualenv) with a virtualenv /opt/jupyter holding Jupyter Notebook from PyPI,
#   serving /antidote/guide on port 8888 with no token (learners reach it only through the
#   agent's entrypoint). Agents run a lesson's Jupyter guide endpoint in it and write the current
#   stage's notebook to /antidote/guide/guide.ipynb (agent-docker `--jupyter-image`). Its rootfs
#   tarball is cached beside the configurator's.
# Each image carries the label antidote.io/content-hash; an image whose label matches is kept.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WHAT=${1:-all}
CACHE=${ANTIDOTE_IMAGE_CACHE:-$HOME/.cache/antidote/images}
BUSYBOX=${ANTIDOTE_BUSYBOX:-/bin/busybox}
CONFIGURATOR_TAG=antidote/configurator:latest
SSHD_TAG=antidote/sshd:latest
JUPYTER_TAG=antidote/jupyter:latest
# What the configurator holds; part of the cache key.
DEBIAN_PACKAGES="python3,python3-venv,openssh-client,sshpass,ca-certificates"
PYPI_PACKAGES="ansible-core==2.19.* napalm==5.2.*"
JUPYTER_PACKAGES="notebook==7.*"
export DOCKER_BUILDKIT=0

log() { echo "configurator.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

command -v docker >/dev/null || die "docker CLI not found (run tests/docker/dockerd.sh start)"
timeout 20 docker version --format '{{.Server.Version}}' >/dev/null 2>&1 \
  || die "no Docker engine answers at ${DOCKER_HOST:-the default socket}"

need_package() { # $1 command, $2 Debian package
  command -v "$1" >/dev/null && return 0
  [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || die "$1 missing: apt-get install $2"
  log "installing $2"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$2" >&2 \
    || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$2" >&2; }
}

label_of() { docker image inspect -f '{{ index .Config.Labels "antidote.io/content-hash" }}' "$1" 2>/dev/null || true; }

# The Debian mirror this machine's apt uses (debootstrap needs one).
mirror() {
  local m=""
  if [[ -r /etc/apt/sources.list.d/debian.sources ]]; then
    m=$(sed -n -E 's/^URIs:[[:space:]]*([^[:space:]]+).*/\1/p' /etc/apt/sources.list.d/debian.sources | grep -v security | head -n 1)
  fi
  if [[ -z $m && -r /etc/apt/sources.list ]]; then
    m=$(awk '$1 == "deb" && $2 !~ /security/ { print $2; exit }' /etc/apt/sources.list)
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

# The NAPALM driver script: the configuration file merged and committed on the endpoint.
# Credentials come from the environment, never the command line.
NAPALM_SCRIPT='#!/opt/antidote/bin/python3
"""antidote-napalm FILE: load FILE as a merge candidate on $ANTIDOTE_HOST with the NAPALM
driver $ANTIDOTE_NAPALM_DRIVER (port $ANTIDOTE_NAPALM_PORT, default 22), logging in as
$ANTIDOTE_CONFIG_USER / $ANTIDOTE_CONFIG_PASSWORD, and commit it."""
import os
import sys

import napalm


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: antidote-napalm FILE")
    path = sys.argv[1]
    host = os.environ["ANTIDOTE_HOST"]
    name = os.environ["ANTIDOTE_NAPALM_DRIVER"]
    port = int(os.environ.get("ANTIDOTE_NAPALM_PORT", "22"))
    user = os.environ.get("ANTIDOTE_CONFIG_USER", "")
    password = os.environ.get("ANTIDOTE_CONFIG_PASSWORD", "")
    driver = napalm.get_network_driver(name)
    device = driver(hostname=host, username=user, password=password, timeout=60,
                    optional_args={"port": port})
    print(f"antidote-napalm: {name} on {host}:{port} as {user}: opening", flush=True)
    device.open()
    try:
        device.load_merge_candidate(filename=path)
        diff = device.compare_config()
        print(diff or "(no changes)", flush=True)
        device.commit_config()
        print("antidote-napalm: committed", flush=True)
    finally:
        device.close()


if __name__ == "__main__":
    main()
'

# The configurator's cache key: this script's configurator part and its packages (so a change
# to the Jupyter image alone rebuilds nothing here).
configurator_key() {
  { sed -n '/^NAPALM_SCRIPT=/,/^# END CONFIGURATOR/p' "${BASH_SOURCE[0]}"; echo "$DEBIAN_PACKAGES $PYPI_PACKAGES"; } \
    | sha256sum | cut -c1-16
}

# Makes sure the configurator's rootfs tarball is cached; prints its path.
configurator_rootfs() {
  local key tarball started
  key=$(configurator_key)
  tarball=$CACHE/configurator-$key.tar.gz
  started=$(date +%s)
  if [[ ! -s $tarball ]]; then
    [[ $(id -u) == 0 ]] || die "building the configurator rootfs needs root (debootstrap, chroot)"
    need_package debootstrap debootstrap
    mkdir -p "$CACHE"
    local root
    root=$(mktemp -d "$CACHE/.rootfs.XXXXXX")
    # shellcheck disable=SC2064
    trap "umount '$root/proc' 2>/dev/null || true; rm -rf '$root'" EXIT
    log "debootstrap bookworm from $(mirror) (about a minute)"
    debootstrap --variant=minbase --include="$DEBIAN_PACKAGES" bookworm "$root" "$(mirror)" \
      >"$root.log" 2>&1 || { tail -n 30 "$root.log" >&2; die "debootstrap failed"; }
    rm -f "$root.log"
    # pip inside the chroot trusts what this machine trusts (a proxy's CA, for one), and uses
    # this machine's pip settings.
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/antidote-build-ca.crt"
    mount -t proc proc "$root/proc"
    log "pip install $PYPI_PACKAGES (about half a minute)"
    chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
      PIP_CERT=/etc/ssl/certs/antidote-build-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
      PIP_DEFAULT_TIMEOUT=180 ${PIP_INDEX_URL:+PIP_INDEX_URL=$PIP_INDEX_URL} \
      sh -c "python3 -m venv /opt/antidote && /opt/antidote/bin/pip install --no-cache-dir -q $PYPI_PACKAGES" \
      >&2 || die "pip install in the configurator rootfs failed"
    umount "$root/proc"
    rm -f "$root/etc/ssl/certs/antidote-build-ca.crt"
    printf '%s' "$NAPALM_SCRIPT" >"$root/usr/local/bin/antidote-napalm"
    chmod 0755 "$root/usr/local/bin/antidote-napalm"
    mkdir -p "$root/antidote"
    # Endpoints are new on every live lesson: their host keys are never known before.
    mkdir -p "$root/etc/ssh/ssh_config.d"
    printf 'Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n' \
      >"$root/etc/ssh/ssh_config.d/antidote.conf"
    printf 'nameserver 127.0.0.11\n' >"$root/etc/resolv.conf"
    rm -rf "$root/var/cache/apt/archives"/*.deb "$root/var/lib/apt/lists"/* "$root/usr/share/doc" \
      "$root/usr/share/man" "$root/usr/share/locale"
    tar --numeric-owner -C "$root" -czf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
    trap - EXIT
    log "rootfs cached in $tarball ($(du -h "$tarball" | cut -f1)) after $(( $(date +%s) - started )) s"
  fi
  echo "$tarball"
}

build_configurator() {
  local key tarball have started
  key=$(configurator_key)
  have=$(label_of "$CONFIGURATOR_TAG")
  if [[ $have == "$key" ]]; then
    log "$CONFIGURATOR_TAG is up to date ($key)"
    return 0
  fi
  started=$(date +%s)
  tarball=$(configurator_rootfs)
  log "importing $CONFIGURATOR_TAG"
  docker import \
    --change 'ENV PATH=/opt/antidote/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV ANSIBLE_HOST_KEY_CHECKING=False' \
    --change 'ENV ANSIBLE_NOCOLOR=1' \
    --change 'ENV PYTHONUNBUFFERED=1' \
    --change 'WORKDIR /antidote' \
    --change 'CMD ["sleep", "infinity"]' \
    --change "LABEL antidote.io/image=configurator antidote.io/content-hash=$key" \
    "$tarball" "$CONFIGURATOR_TAG" >/dev/null
  docker image prune -f --filter "label=antidote.io/image=configurator" >/dev/null 2>&1 || true
  log "$CONFIGURATOR_TAG ready after $(( $(date +%s) - started )) s"
}
# END CONFIGURATOR

# How the Jupyter image serves the guide: no token or password (the agent's entrypoint admits
# learners), any origin (it is reached through that proxy), files under /antidote/guide.
JUPYTER_CMD='["jupyter", "notebook", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--allow-root", "--ServerApp.root_dir=/antidote/guide", "--IdentityProvider.token=", "--ServerApp.password=", "--ServerApp.allow_origin=*", "--ServerApp.allow_remote_access=True", "--ServerApp.disable_check_xsrf=True"]'

build_jupyter() {
  local base key tarball have started root
  started=$(date +%s)
  key=$( { configurator_key; sed -n '/^# END CONFIGURATOR/,$p' "${BASH_SOURCE[0]}"; echo "$JUPYTER_PACKAGES"; } \
    | sha256sum | cut -c1-16)
  have=$(label_of "$JUPYTER_TAG")
  if [[ $have == "$key" ]]; then
    log "$JUPYTER_TAG is up to date ($key)"
    return 0
  fi
  tarball=$CACHE/jupyter-$key.tar.gz
  if [[ ! -s $tarball ]]; then
    [[ $(id -u) == 0 ]] || die "building the jupyter rootfs needs root (chroot)"
    base=$(configurator_rootfs)
    root=$(mktemp -d "$CACHE/.jupyter.XXXXXX")
    # shellcheck disable=SC2064
    trap "umount '$root/proc' 2>/dev/null || true; rm -rf '$root'" EXIT
    tar --numeric-owner -C "$root" -xzf "$base"
    rm -rf "$root/opt/antidote" "$root/usr/local/bin/antidote-napalm"
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/antidote-build-ca.crt"
    mount -t proc proc "$root/proc"
    log "pip install $JUPYTER_PACKAGES (about a minute)"
    chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
      PIP_CERT=/etc/ssl/certs/antidote-build-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
      PIP_DEFAULT_TIMEOUT=180 ${PIP_INDEX_URL:+PIP_INDEX_URL=$PIP_INDEX_URL} \
      sh -c "python3 -m venv /opt/jupyter && /opt/jupyter/bin/pip install --no-cache-dir -q $JUPYTER_PACKAGES" \
      >&2 || die "pip install in the jupyter rootfs failed"
    umount "$root/proc"
    rm -f "$root/etc/ssl/certs/antidote-build-ca.crt"
    printf 'nameserver 127.0.0.11\n' >"$root/etc/resolv.conf"
    mkdir -p "$root/antidote/guide"
    find "$root/opt/jupyter" -name __pycache__ -type d -prune -exec rm -rf {} +
    tar --numeric-owner -C "$root" -czf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
    trap - EXIT
    log "rootfs cached in $tarball ($(du -h "$tarball" | cut -f1)) after $(( $(date +%s) - started )) s"
  fi
  log "importing $JUPYTER_TAG"
  docker import \
    --change 'ENV PATH=/opt/jupyter/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PYTHONUNBUFFERED=1' \
    --change 'ENV HOME=/root' \
    --change 'WORKDIR /antidote/guide' \
    --change "CMD $JUPYTER_CMD" \
    --change 'EXPOSE 8888' \
    --change "LABEL antidote.io/image=jupyter antidote.io/content-hash=$key" \
    "$tarball" "$JUPYTER_TAG" >/dev/null
  docker image prune -f --filter "label=antidote.io/image=jupyter" >/dev/null 2>&1 || true
  log "$JUPYTER_TAG ready after $(( $(date +%s) - started )) s"
}

build_sshd() {
  need_package dropbear dropbear-bin
  if ! file -L "$BUSYBOX" 2>/dev/null | grep -q 'statically linked'; then
    need_package busybox busybox-static
  fi
  local work ctx r dropbear key have
  work=$(mktemp -d /tmp/antidote-sshd.XXXXXX)
  ctx=$work/ctx r=$work/ctx/rootfs
  mkdir -p "$r/bin" "$r/etc/dropbear" "$r/www" "$r/home/antidote" "$r/root" "$r/tmp" \
    "$r/antidote" "$r/proc" "$r/sys" "$r/dev" "$r/run" "$r/var/log"
  cp "$BUSYBOX" "$r/bin/busybox"
  ln -s bin "$r/sbin"; mkdir -p "$r/usr"; ln -s ../bin "$r/usr/bin"; ln -s ../bin "$r/usr/sbin"
  dropbear=$(command -v dropbear || echo /usr/sbin/dropbear)
  cp "$dropbear" "$r/bin/dropbear"
  # The libraries dropbear links, at the paths the loader looks for them.
  ldd "$dropbear" | awk '/=>/ { print $3 } /^\t\/lib/ { print $1 }' | while read -r lib; do
    [[ -e $lib ]] || continue
    mkdir -p "$r$(dirname "$lib")"
    cp -L "$lib" "$r$lib"
  done
  [[ -e /lib64/ld-linux-x86-64.so.2 ]] && mkdir -p "$r/lib64" && cp -L /lib64/ld-linux-x86-64.so.2 "$r/lib64/"
  local hash
  hash=$(openssl passwd -6 -salt antidotesalt antidotepassword)
  printf 'root:x:0:0:root:/root:/bin/sh\nantidote:x:1000:1000:antidote:/home/antidote:/bin/sh\n' >"$r/etc/passwd"
  printf 'root:*:19000:0:99999:7:::\nantidote:%s:19000:0:99999:7:::\n' "$hash" >"$r/etc/shadow"
  printf 'root:x:0:\nantidote:x:1000:\n' >"$r/etc/group"
  printf '/bin/sh\n' >"$r/etc/shells"
  echo sshd >"$r/etc/antidote-image"
  echo '<html><body><h1>antidote/sshd</h1></body></html>' >"$r/www/index.html"
  cat >"$r/antidote/entrypoint.sh" <<'EOF'
#!/bin/sh
# PID 1 of antidote/sshd: dropbear on 22 (logging to stderr: `docker logs` shows every login),
# busybox httpd on 8080.
mkdir -p /www /etc/dropbear
httpd -f -p 8080 -h /www &
HTTPD=$!
# -R: host keys made on first use; -F: foreground; -E: log to stderr; -p 22.
dropbear -R -F -E -p 22 &
SSHD=$!
SLEEP=
trap 'kill $HTTPD $SSHD $SLEEP 2>/dev/null; exit 0' TERM INT HUP
while :; do
  sleep 2147483647 &
  SLEEP=$!
  wait $SLEEP
done
EOF
  chmod 0755 "$r/bin/busybox" "$r/bin/dropbear" "$r/antidote/entrypoint.sh"
  chmod 0640 "$r/etc/shadow"
  chmod 1777 "$r/tmp"
  cat >"$ctx/Dockerfile" <<'EOF'
FROM scratch
COPY rootfs/ /
RUN ["/bin/busybox", "sh", "-c", "/bin/busybox --install -s /bin && chown 1000:1000 /home/antidote && chmod 1777 /tmp"]
ENTRYPOINT ["/bin/sh", "/antidote/entrypoint.sh"]
EOF
  key=$( (cd "$ctx" && tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
    --format=gnu -cf - Dockerfile rootfs) | sha256sum | cut -c1-16)
  have=$(label_of "$SSHD_TAG")
  if [[ $have == "$key" ]]; then
    log "$SSHD_TAG is up to date ($key)"
  else
    printf 'LABEL antidote.io/image="sshd" antidote.io/content-hash="%s"\n' "$key" >>"$ctx/Dockerfile"
    docker build -q --force-rm --no-cache -t "$SSHD_TAG" "$ctx" >"$work/build.log" 2>&1 \
      || { cat "$work/build.log" >&2; rm -rf "$work"; die "build of $SSHD_TAG failed"; }
    docker image prune -f --filter "label=antidote.io/image=sshd" >/dev/null 2>&1 || true
    log "$SSHD_TAG built ($key)"
  fi
  rm -rf "$work"
}

case $WHAT in
  configurator) build_configurator ;;
  sshd) build_sshd ;;
  jupyter) build_jupyter ;;
  all) build_sshd; build_configurator; build_jupyter ;;
  *) die "unknown image '$WHAT' (configurator, sshd, jupyter or all)" ;;
esac
