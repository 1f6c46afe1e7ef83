#!/usr/bin/env bash
# Build Antidote's deploy image (deploy/Dockerfile's runtime stage) locally, with no registry and
# the legacy builder: the workspace's own binaries on a Debian bookworm base made from this
# (bookworm) machine, tagged like the Dockerfile's image so that deploy/k8s runs it unchanged.
#
#   DOCKER_HOST=unix://... tests/k8s/antidote-image.sh [--import]
#
# --import: also copy the image into the test node's containerd (tests/k8s/cluster.sh import),
# where deploy/k8s's `imagePullPolicy: IfNotPresent` finds it.
#
# deploy/Dockerfile pulls node:22, rust:1.95 and debian:bookworm-slim, which no machine here can
# reach. Its last stage is rebuilt here instead, path for path (tests/e2e/k8s_deploy.rs exports
# the image and checks it against that stage: binaries, curriculum, user, directories and their
# owners, USER, WORKDIR, EXPOSE, CMD):
#   - the base: the shared libraries the binaries link (ldd: libc, libm, libgcc_s and the
#     loader, from this machine's Debian packages), /etc/passwd and /etc/group with the
#     `antidote` user and group 10001 as the Dockerfile's useradd/groupadd make them, an
#     nsswitch.conf like Debian's, /tmp, and the CA bundle of Debian's ca-certificates (the
#     Mozilla roots of /usr/share/ca-certificates/mozilla, never this machine's local
#     additions). No shell and no package manager: nothing in the image runs them.
#   - the binaries: scheduler-svc, agent-docker, agent-k8s, agent-k8s-node-gc and antidotectl
#     from the cargo target directory ($CARGO_TARGET_DIR or target/): the release build when all
#     five are there and
#     none is older than its debug build, else the debug build (what `cargo build --workspace
#     --bins`, and so tests/run, makes; larger and slower, but the same code).
#     ANTIDOTE_IMAGE_PROFILE=release|debug picks one.
#   - deploy/curriculum at /usr/share/antidote/curriculum, without what
#     deploy/Dockerfile.dockerignore keeps out of the Dockerfile's context.
# The image is made by `docker import` of that tree (so owners are exact without a RUN step)
# and carries the labels antidote.io/deploy-image=scheduler-svc and antidote.io/content-hash (a
# hash of this script, the binaries, the libraries, the CA bundle and the curriculum): an
# image whose label matches is kept, so a warm run only hashes (a few seconds for the debug
# binaries) and imports nothing new. Runs are serialised by a lock beside the image cache
# (ANTIDOTE_IMAGE_CACHE, default ~/.cache/antidote/images).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CACHE=${ANTIDOTE_IMAGE_CACHE:-$HOME/.cache/antidote/images}
TARGET=${CARGO_TARGET_DIR:-$REPO/target}
IMPORT=0
case ${1:-} in
  --import) IMPORT=1 ;;
  "") ;;
  *) echo "usage: $0 [--import]" >&2; exit 2 ;;
esac

# deploy/Dockerfile's runtime stage, one fact a line (tests/e2e/k8s_deploy.rs compares the built
# image with the Dockerfile, so neither can drift silently).
TAG=ghcr.io/antidote-labs/scheduler-svc:0.1.0
BINARIES="scheduler-svc agent-docker agent-k8s agent-k8s-node-gc antidotectl"
BIN_DIR=/usr/local/bin
CURRICULUM_DIR=/usr/share/antidote/curriculum
DATA_DIR=/var/lib/antidote
CONFIG_DIR=/etc/antidote
USER_NAME=antidote
USER_ID=10001
USER_HOME=/var/lib/antidote
USER_SHELL=/usr/sbin/nologin
WORKDIR=/var/lib/antidote
EXPOSE="7070 8080 7071 7072 9090"
CMD='["scheduler-svc", "serve", "--config", "/etc/antidote/antidote.toml"]'
# debian:bookworm-slim's PATH (docker import sets none).
PATH_ENV=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export DOCKER_BUILDKIT=0

log() { echo "antidote-image.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

command -v docker >/dev/null || die "docker CLI not found (run tests/docker/dockerd.sh start)"
timeout 20 docker version --format '{{.Server.Version}}' >/dev/null 2>&1 \
  || die "no Docker engine answers at ${DOCKER_HOST:-the default socket}"
[[ $(id -u) == 0 ]] || die "building the image tree needs root (files owned by $USER_ID)"

mkdir -p "$CACHE"
exec 9>"$CACHE/antidote-image.lock"
flock 9

started=$(date +%s)

# The release build if complete and not older than the debug one.
profile=${ANTIDOTE_IMAGE_PROFILE:-}
if [[ -z $profile ]]; then
  profile=release
  for bin in $BINARIES; do
    if [[ ! -x $TARGET/release/$bin ]] \
      || { [[ -x $TARGET/debug/$bin ]] && [[ $TARGET/debug/$bin -nt $TARGET/release/$bin ]]; }; then
      profile=debug
      break
    fi
  done
fi
[[ $profile == release || $profile == debug ]] || die "ANTIDOTE_IMAGE_PROFILE=$profile: release or debug"
for bin in $BINARIES; do
  [[ -x $TARGET/$profile/$bin ]] || die "$TARGET/$profile/$bin is missing: build the workspace's binaries first"
done

# The libraries every binary links, with the loader, as the paths ldd reports.
libraries() {
  for bin in $BINARIES; do
    ldd "$TARGET/$profile/$bin" | awk '/=>/ { print $3 } /^\t\/lib/ { print $1 }'
  done | sort -u
}
LIBS=$(libraries)
[[ -n $LIBS ]] || die "ldd found no libraries for $TARGET/$profile/scheduler-svc"
CA_CERTS=/usr/share/ca-certificates/mozilla
[[ -d $CA_CERTS ]] || die "$CA_CERTS missing: apt-get install ca-certificates"

# What the image is made of, for its content-hash label.
key=$( {
  cat "${BASH_SOURCE[0]}"
  echo "$profile"
  for bin in $BINARIES; do sha256sum "$TARGET/$profile/$bin"; done
  for lib in $LIBS; do sha256sum "$(readlink -f "$lib")"; done
  cat "$CA_CERTS"/*.crt | sha256sum
  (cd "$REPO/deploy" && find curriculum -type f ! -path '*/__pycache__/*' ! -path '*/.venv/*' \
    ! -name '*.db' ! -name '*.db-wal' ! -name '*.db-shm' -print0 | sort -z | xargs -0 sha256sum)
} | sha256sum | cut -c1-16)

have=$(docker image inspect -f '{{ index .Config.Labels "antidote.io/content-hash" }}' "$TAG" 2>/dev/null || true)
if [[ $have == "$key" ]]; then
  log "$TAG is up to date ($key, $profile binaries)"
else
  work=$(mktemp -d /tmp/antidote-image.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  r=$work/rootfs
  # Debian bookworm's merged /usr: /bin, /sbin, /lib and /lib64 point into /usr.
  mkdir -p "$r/usr/bin" "$r/usr/sbin" "$r/usr/lib" "$r/usr/lib64" "$r$BIN_DIR" \
    "$r/etc/ssl/certs" "$r$CONFIG_DIR" "$r$DATA_DIR" "$r$(dirname "$CURRICULUM_DIR")" "$r/tmp" \
    "$r/proc" "$r/sys" "$r/dev" "$r/run" "$r/root"
  ln -s usr/bin "$r/bin"; ln -s usr/sbin "$r/sbin"; ln -s usr/lib "$r/lib"; ln -s usr/lib64 "$r/lib64"
  for lib in $LIBS; do
    mkdir -p "$r/usr$(dirname "${lib#/usr}")"
    cp -L "$lib" "$r/usr${lib#/usr}"
  done
  for bin in $BINARIES; do
    install -m 0755 "$TARGET/$profile/$bin" "$r$BIN_DIR/$bin"
  done
  # groupadd --system --gid 10001 antidote; useradd --system --uid 10001 --gid 10001
  # --home-dir /var/lib/antidote --no-create-home --shell /usr/sbin/nologin antidote.
  printf 'root:x:0:0:root:/root:/bin/bash\n%s:x:%s:%s::%s:%s\n' \
    "$USER_NAME" "$USER_ID" "$USER_ID" "$USER_HOME" "$USER_SHELL" >"$r/etc/passwd"
  printf 'root:x:0:\n%s:x:%s:\n' "$USER_NAME" "$USER_ID" >"$r/etc/group"
  printf 'passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n' \
    >"$r/etc/nsswitch.conf"
  cat "$CA_CERTS"/*.crt >"$r/etc/ssl/certs/ca-certificates.crt"
  mkdir -p "$work/curriculum"
  tar -C "$REPO/deploy" --exclude=__pycache__ --exclude=.venv --exclude='*.db' \
    --exclude='*.db-wal' --exclude='*.db-shm' -cf - curriculum | tar -C "$work" -xf -
  mv "$work/curriculum" "$r$CURRICULUM_DIR"
  chmod -R u=rwX,go=rX "$r$CURRICULUM_DIR"
  chmod 1777 "$r/tmp"
  chmod 0700 "$r/root"
  chown -R 0:0 "$r"
  chown "$USER_ID:$USER_ID" "$r$DATA_DIR"
  log "importing $TAG ($profile binaries, $(du -sh "$r" | cut -f1))"
  # shellcheck disable=SC2086 # one port per word
  tar --numeric-owner -C "$r" -cf - . | docker import \
    --change "ENV PATH=$PATH_ENV" \
    --change "USER $USER_ID:$USER_ID" \
    --change "WORKDIR $WORKDIR" \
    --change "EXPOSE $EXPOSE" \
    --change "CMD $CMD" \
    --change "LABEL antidote.io/deploy-image=scheduler-svc antidote.io/content-hash=$key antidote.io/profile=$profile" \
    - "$TAG" >/dev/null
  docker image prune -f --filter "label=antidote.io/deploy-image=scheduler-svc" >/dev/null 2>&1 || true
  log "$TAG built ($key) after $(( $(date +%s) - started )) s"
fi

if [[ $IMPORT == 1 ]]; then
  "$HERE/cluster.sh" import "$TAG"
  log "$TAG in the test node after $(( $(date +%s) - started )) s"
fi
