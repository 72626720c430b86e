#!/usr/bin/env bash
# The headless browser the dashboard's browser tests drive (tests/browser): Debian's chromium
# and chromium-driver packages. A no-op when both are there; otherwise apt-get (as root, or
# through sudo). The tests never download a browser.
set -euo pipefail
browser=""
for name in chromium chromium-browser; do
    command -v "$name" >/dev/null 2>&1 && browser="$name" && break
done
if [ -n "$browser" ] && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
if ! $sudo apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null; then
    $sudo apt-get update -q >/dev/null
    $sudo apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null
fi
