#!/usr/bin/env bash
# Installs what tests/e2e/browser.rs drives: Debian's chromium and chromium-driver (WebDriver),
# if missing. Idempotent; prints the two paths on its last lines as CHROMIUM=... and
# CHROMEDRIVER=... . tests/run runs it in the background; apt and dpkg locks held by another
# install running at the same time (tests/postgres/pg.sh, say) are waited for.
#
# Usage: tests/browser/chromium.sh
set -euo pipefail

have() { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }

if ! have; then
  export DEBIAN_FRONTEND=noninteractive
  # Another apt-get may hold the lists lock; DPkg::Lock::Timeout covers the dpkg one.
  for try in 1 2 3 4 5 6 7 8 9 10; do
    if apt-get update -qq -o DPkg::Lock::Timeout=300; then break; fi
    echo "tests/browser/chromium.sh: apt-get update failed (try $try); retrying in 5 s"
    sleep 5
  done
  apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 \
    chromium chromium-driver >/dev/null
fi
have || { echo "tests/browser/chromium.sh: chromium or chromedriver is still missing"; exit 1; }
chromium --version
echo "CHROMIUM=$(command -v chromium)"
echo "CHROMEDRIVER=$(command -v chromedriver)"
