#!/usr/bin/env bash
# The test job of .github/workflows/ci.yml, runnable as is on Linux, macOS and Windows (Git Bash):
# a virtual environment with the package and its dev tools, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m venv .venv-ci
if [ -x .venv-ci/Scripts/python.exe ]; then py=.venv-ci/Scripts/python.exe; else py=.venv-ci/bin/python; fi
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet -c constraints.txt -e '.[dev]'
"$py" -m pytest "$@"
