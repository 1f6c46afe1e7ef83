#!/usr/bin/env bash
# Builds the Antidote book (docs/) with mdBook into target/book and checks every internal link
# and anchor of the built pages; fails naming the page and the link. Offline: no external URL is
# fetched.
#
# mdBook comes from crates.io at a pinned version, installed once with `cargo install --locked`
# into ~/.cache/antidote/mdbook (ANTIDOTE_MDBOOK_ROOT moves it), like the suite's other tools.
#
# Usage: docs/build.sh            (tests/run runs it in the background)
#        docs/build.sh serve      (mdbook serve, for writing)
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.5.4
root=${ANTIDOTE_MDBOOK_ROOT:-$HOME/.cache/antidote/mdbook/$version}
mdbook=$root/bin/mdbook
if [ ! -x "$mdbook" ]; then
  echo "docs/build.sh: installing mdbook $version into $root"
  t0=$(date +%s)
  # A target directory of its own, so this build never waits on the workspace's cargo lock.
  CARGO_TARGET_DIR=$root/build cargo install --locked --quiet mdbook --version "=$version" --root "$root"
  rm -rf "$root/build"
  echo "docs/build.sh: mdbook installed in $(( $(date +%s) - t0 )) s"
fi

if [ "${1:-}" = serve ]; then
  exec "$mdbook" serve docs
fi

rm -rf target/book
"$mdbook" build docs
python3 docs/linkcheck.py target/book
