#!/usr/bin/env bash
# The command-line tools the tests use besides Python, from the distribution's packages:
# curl and jq (the examples of the README and the docs site, which tests/e2e/test_readme.py
# runs); node and npm (tests/e2e/test_mcp_typescript.py drives /mcp with the TypeScript MCP
# SDK's client, tests/mcp_ts); systemd-analyze (tests/integration/test_systemd_unit.py verifies
# deploy/systemd with it; no running systemd needed). A no-op when they are there; otherwise
# apt-get (as root, or through sudo). Then `npm ci` in tests/mcp_ts, once per change of its
# package-lock.json.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
for tool in curl jq; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
# Debian's package for node is nodejs; a node from elsewhere (NodeSource) brings its own npm.
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
if [ ${#missing[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    if ! $sudo apt-get install -y -q "${missing[@]}" >/dev/null; then
        $sudo apt-get update -q >/dev/null
        $sudo apt-get install -y -q "${missing[@]}" >/dev/null
    fi
fi
# The SDK at the version package-lock.json pins; the copy of the lock says which one is there.
loop=tests/mcp_ts
if ! cmp -s "$loop/package-lock.json" "$loop/node_modules/.installed-lock.json"; then
    (cd "$loop" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error >/dev/null)
    cp "$loop/package-lock.json" "$loop/node_modules/.installed-lock.json"
fi
