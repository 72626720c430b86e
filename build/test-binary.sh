#!/usr/bin/env bash
# The e2e suite (tests/e2e, the nullhub contract included) against a built executable:
#   bash build/test-binary.sh PYTHON BINARY
# PYTHON must have the package and pytest (installs the `dev` extra into it if pytest is
# missing); the tests import it only to compute expectations: every request goes to BINARY.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:?usage: build/test-binary.sh PYTHON BINARY}
binary=${2:?usage: build/test-binary.sh PYTHON BINARY}
"$py" -c 'import pytest' 2>/dev/null || "$py" -m pip install --quiet -c constraints.txt -e '.[dev]'
"$py" build/smoke.py "$binary"
# The onefile binary unpacks itself once into $XDG_CACHE_HOME (else ~/.cache); some tests point
# HOME at a temporary directory and check that nothing was written there, so the unpacked copy
# lives in dist/ for the run (it is packaging, not the server's state).
export XDG_CACHE_HOME=$PWD/dist/onefile-cache
# Unpacking is not safe against itself: a start that finds a file half written by another
# start rewrites it under that process's feet (SIGBUS). One start unpacks before the suite's
# workers start theirs at once.
"$binary" --version >/dev/null
NULLTICKETS_BINARY=$(cd "$(dirname "$binary")" && pwd)/$(basename "$binary") \
    "$py" -m pytest tests/e2e -n "${PYTEST_WORKERS:-4}" "${@:3}"
