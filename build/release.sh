#!/usr/bin/env bash
# One release job's work, the same on every platform (Linux in manylinux containers, macOS,
# Windows under Git Bash), and what `.ci/run` does for linux x86_64:
#
#   bash build/release.sh PYTHON
#
# a fresh virtual environment from PYTHON with the package, its dependencies and the `binary`
# extra, the Nuitka onefile build (build/binary.py) and the smoke test of the result
# (build/smoke.py). The binary ends up in dist/ under the name nullhub expects.
#
# NULLTICKETS_FROM_SOURCE="granian apsw ..." builds those packages from their source
# distributions, for targets with no wheel (granian: linux riscv64 and windows arm64, needing
# cargo; apsw: linux riscv64, whose sdist build fetches the SQLite source it is pinned to).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:?usage: build/release.sh PYTHON}
venv=${NULLTICKETS_RELEASE_VENV:-.venv-release}

"$python" -m venv "$venv"
if [ -x "$venv/Scripts/python.exe" ]; then py=$venv/Scripts/python.exe; else py=$venv/bin/python; fi
"$py" -m pip install --quiet --upgrade pip
pip_args=()
if [ -n "${NULLTICKETS_FROM_SOURCE:-}" ]; then
    pip_args+=(--no-binary "$(echo "$NULLTICKETS_FROM_SOURCE" | tr ' ' ',')")
fi
# Editable: the package build compiles nulltickets._core in place (next to the sources) where a
# compiler exists, and Nuitka compiles src/nulltickets, so it finds the extension there.
"$py" -m pip install "${pip_args[@]}" -c constraints.txt -e '.[binary]'
"$py" -c 'import sys, granian, apsw, msgspec; print(sys.version); print("granian", granian.__version__, "apsw", apsw.apsw_version(), "SQLite", apsw.sqlite_lib_version())'

"$py" build/binary.py ${NULLTICKETS_BUILD_ARGS:-}
asset=$("$py" build/binary.py --print-path)
# Releases ship the compiled core: every release runner has a C compiler.
"$py" build/smoke.py "$asset" --expect-core compiled ${NULLTICKETS_SMOKE_ARGS:-}
