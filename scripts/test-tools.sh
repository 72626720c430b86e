#!/usr/bin/env bash
# The command-line tools the tests use besides Python, from the distribution's packages:
# curl and jq (the examples of the README and the docs site, which tests/e2e/test_readme.py
# runs). A no-op when they are there; otherwise apt-get (as root, or through sudo).
set -euo pipefail
missing=()
for tool in curl jq; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
if ! $sudo apt-get install -y -q "${missing[@]}" >/dev/null; then
    $sudo apt-get update -q >/dev/null
    $sudo apt-get install -y -q "${missing[@]}" >/dev/null
fi
