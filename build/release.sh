#!/usr/bin/env bash
# One release job's work, the same on every platform (Linux in manylinux containers or, for
# riscv64, in a Debian root filesystem under QEMU: build/emulated.sh), macOS, Windows under Git
# Bash), and what `.ci/run` does for linux x86_64:
#
#   bash build/release.sh PYTHON
#
# a fresh virtual environment from PYTHON; apsw built from its sdist against vendor/sqlite with
# build/sqlite-options.txt (build/build_apsw.py), so every binary carries the same SQLite; the
# package, its other dependencies and the `binary` extra; the Nuitka onefile build (build/binary.py) and
# the smoke test of the result (build/smoke.py). The binary ends up in dist/ under the name
# nullhub expects. Each step prints its elapsed seconds ("== release step NAME: N s").
#
# Nothing is downloaded but packages from the package index: build/build_apsw.py builds
# offline (proxies pointed at a closed port) and checks apsw used our amalgamation; build/binary.py runs
# Nuitka the same way.
#
# NULLTICKETS_FROM_SOURCE="granian uvloop ..." builds those packages from their source
# distributions, for targets with no wheel (granian: linux riscv64 and windows arm64, needing
# cargo).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:?usage: build/release.sh PYTHON}
venv=${NULLTICKETS_RELEASE_VENV:-.venv-release}

step() {
    local name=$1 started=$SECONDS
    shift
    echo "== release step $name: started $(date -u +%H:%M:%S)"
    "$@"
    echo "== release step $name: $((SECONDS - started)) s"
}

venv_setup() {
    "$python" -m venv "$venv"
    "$py" -m pip install --quiet --upgrade pip
}
if [ -x "$venv/Scripts/python.exe" ] || [ "${OS:-}" = Windows_NT ]; then
    py=$venv/Scripts/python.exe
else
    py=$venv/bin/python
fi

dependencies() {
    local pip_args=()
    if [ -n "${NULLTICKETS_FROM_SOURCE:-}" ]; then
        pip_args+=(--no-binary "$(echo "$NULLTICKETS_FROM_SOURCE" | tr ' ' ',')")
    fi
    # Editable: the package build compiles nulltickets._core in place (next to the sources)
    # where a compiler exists, and Nuitka compiles src/nulltickets, so it finds it there.
    # apsw==3.51.3.0 is installed already (ours), so pip keeps it.
    "$py" -m pip install "${pip_args[@]}" -c constraints.txt -e '.[binary]'
    "$py" build/build_apsw.py --verify
    "$py" -c 'import sys, granian, apsw, msgspec; print(sys.version); print("granian", granian.__version__, "apsw", apsw.apsw_version(), "SQLite", apsw.sqlite_lib_version())'
}

binary() {
    "$py" build/binary.py ${NULLTICKETS_BUILD_ARGS:-}
}

smoke() {
    local asset
    asset=$("$py" build/binary.py --print-path)
    # Releases ship the compiled core: every release runner has a C compiler.
    "$py" build/smoke.py "$asset" --expect-core compiled ${NULLTICKETS_SMOKE_ARGS:-}
}

step venv venv_setup
step apsw "$py" build/build_apsw.py
step dependencies dependencies
step binary binary
step smoke smoke
