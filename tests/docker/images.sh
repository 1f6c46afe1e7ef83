#!/usr/bin/env bash
# Build the example curriculum's images locally, FROM scratch, no registry.
#
#   DOCKER_HOST=unix://... tests/docker/images.sh [IMAGES_DIR]
#
# IMAGES_DIR defaults to deploy/curriculum/images. For every slug in IMAGES_DIR/*/image.meta.yaml
# it builds antidote/<slug>:latest: Debian's static busybox (busybox-static) with its applets
# installed as symlinks in /bin, and an entrypoint (PID 1) that
#   - serves /www with `httpd -f -p 8080 -h /www` (writes /www/index.html if missing),
#   - answers TCP port 22 with an SSH banner (`nc -ll -p 22 -e`): busybox has no sshd, this only
#     satisfies readiness probes,
#   - tries net.ipv4.ip_forward=1 when the meta says enableForwarding: true (best effort: /proc/sys
#     is read-only in unprivileged containers, so the agent must set the sysctl itself),
#   - exits at once on SIGTERM/SIGINT and reaps orphans.
# Labels: antidote.io/image=<slug>, antidote.io/content-hash=<sha256 of the build context>.
# An image whose content-hash label matches is not rebuilt.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
IMAGES_DIR=${1:-$HERE/../../deploy/curriculum/images}
BUSYBOX=${ANTIDOTE_BUSYBOX:-/bin/busybox}
export DOCKER_BUILDKIT=0 # the legacy builder: no buildx plugin here, no registry either

log() { echo "images.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

command -v docker >/dev/null || die "docker CLI not found (run tests/docker/dockerd.sh start)"
[[ -d $IMAGES_DIR ]] || die "no images dir $IMAGES_DIR"
if ! file -L "$BUSYBOX" 2>/dev/null | grep -q 'statically linked'; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    log "installing busybox-static"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends busybox-static >&2
  fi
  [[ -x $BUSYBOX ]] || die "$BUSYBOX missing: apt-get install busybox-static"
fi
timeout 20 docker version --format '{{.Server.Version}}' >/dev/null 2>&1 \
  || die "no Docker engine answers at ${DOCKER_HOST:-the default socket}"

# slug and enableForwarding from each image.meta.yaml (flat YAML keys, no parser needed).
meta_value() { sed -n -E "s/^$2:[[:space:]]*[\"']?([^\"' #]+)[\"']?.*/\1/p" "$1" | head -n 1; }

WORK=$(mktemp -d /tmp/antidote-images.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

make_context() { # $1 dir, $2 slug, $3 forwarding (0|1)
  local ctx=$1 slug=$2 fwd=$3 r=$1/rootfs
  mkdir -p "$r/bin" "$r/usr" "$r/etc" "$r/www" "$r/root" "$r/home/antidote" "$r/tmp" \
    "$r/antidote" "$r/proc" "$r/sys" "$r/dev" "$r/run" "$r/var"
  cp "$BUSYBOX" "$r/bin/busybox"
  ln -s bin "$r/sbin"; ln -s ../bin "$r/usr/bin"; ln -s ../bin "$r/usr/sbin"
  printf 'root:x:0:0:root:/root:/bin/sh\nantidote:x:1000:1000:antidote:/home/antidote:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$r/etc/passwd"
  printf 'root:x:0:\nantidote:x:1000:\nnogroup:x:65534:\n' >"$r/etc/group"
  echo "$slug" >"$r/etc/antidote-image"
  cat >"$r/www/index.html" <<EOF
<!DOCTYPE html>
<html><head><title>antidote/$slug</title></head>
<body><h1>antidote/$slug</h1><p>Served by busybox httpd from /www.</p></body></html>
EOF
  # SSH identification string (RFC 4253 §4.2: no '-' in softwareversion, CR LF at the end).
  cat >"$r/antidote/ssh-banner" <<'EOF'
#!/bin/sh
printf 'SSH-2.0-antidote_busybox\r\n'
# Keep the connection open a little so a client can send its own banner before we close.
read -t 3 _line || true
EOF
  printf 'ANTIDOTE_IMAGE=antidote/%s\nANTIDOTE_FORWARDING=%s\n' "$slug" "$fwd" >"$r/antidote/image.env"
  cat >"$r/antidote/entrypoint.sh" <<'EOF'
#!/bin/sh
# PID 1 of the antidote busybox images: httpd on 8080 (/www), an SSH banner on 22.
. /antidote/image.env
mkdir -p /www
[ -e /www/index.html ] || echo "<html><body><h1>$ANTIDOTE_IMAGE</h1></body></html>" >/www/index.html
if [ "${ANTIDOTE_FORWARDING:-0}" = 1 ]; then
  sysctl -w net.ipv4.ip_forward=1 >/dev/null 2>&1 || true
fi
httpd -f -p 8080 -h /www &
HTTPD=$!
nc -ll -p 22 -e /antidote/ssh-banner &
SSHD=$!
SLEEP=
trap 'kill $HTTPD $SSHD $SLEEP 2>/dev/null; exit 0' TERM INT HUP
# `wait` is interrupted by trapped signals, and while waiting ash reaps every child that
# exits, including orphans reparented to PID 1.
while :; do
  sleep 2147483647 &
  SLEEP=$!
  wait $SLEEP
done
EOF
  chmod 0755 "$r/bin/busybox" "$r/antidote/ssh-banner" "$r/antidote/entrypoint.sh"
  chmod 1777 "$r/tmp"
  # Few steps on purpose: with the legacy builder and vfs every step costs about a second.
  # Docker's default PATH (for the entrypoint and `docker exec`) already has /bin.
  cat >"$ctx/Dockerfile" <<'EOF'
FROM scratch
COPY rootfs/ /
RUN ["/bin/busybox", "sh", "-c", "/bin/busybox --install -s /bin && chown 1000:1000 /home/antidote /www /www/index.html && chmod 1777 /tmp"]
ENTRYPOINT ["/bin/sh", "/antidote/entrypoint.sh"]
EOF
}

context_hash() { # deterministic over names, modes, link targets and contents
  (cd "$1" && tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
    --format=gnu -cf - Dockerfile rootfs) | sha256sum | cut -c1-64
}

built=0 skipped=0
declare -A seen=()
shopt -s nullglob
metas=("$IMAGES_DIR"/*/image.meta.yaml)
(( ${#metas[@]} )) || die "no $IMAGES_DIR/*/image.meta.yaml"
for meta in "${metas[@]}"; do
  slug=$(meta_value "$meta" slug)
  [[ -n $slug ]] || slug=$(basename "$(dirname "$meta")")
  [[ $slug =~ ^[a-z0-9][a-z0-9._-]*$ ]] || die "bad slug '$slug' in $meta"
  [[ -z ${seen[$slug]:-} ]] || continue
  seen[$slug]=1
  fwd=0
  [[ $(meta_value "$meta" enableForwarding) == true ]] && fwd=1
  ctx=$WORK/$slug
  mkdir -p "$ctx"
  make_context "$ctx" "$slug" "$fwd"
  hash=$(context_hash "$ctx")
  tag=antidote/$slug:latest
  have=$(docker image inspect -f '{{ index .Config.Labels "antidote.io/content-hash" }}' "$tag" \
    2>/dev/null || true)
  if [[ $have == "$hash" ]]; then
    log "$tag is up to date (${hash:0:12})"
    skipped=$((skipped + 1))
    continue
  fi
  log "building $tag (${hash:0:12})"
  # One LABEL step, added after hashing so that the hash does not cover itself.
  printf 'LABEL antidote.io/image="%s" antidote.io/content-hash="%s"\n' "$slug" "$hash" \
    >>"$ctx/Dockerfile"
  if ! docker build -q --force-rm --no-cache -t "$tag" "$ctx" >"$WORK/$slug.log" 2>&1; then
    cat "$WORK/$slug.log" >&2
    die "build of $tag failed"
  fi
  built=$((built + 1))
  # Drop the image this one replaced, if it is now untagged.
  docker image prune -f --filter "label=antidote.io/image=$slug" >/dev/null 2>&1 || true
done
log "done: $built built, $skipped up to date"
