#!/usr/bin/env bash
# The test job of .github/workflows/ci.yml, runnable as is on Linux, macOS and Windows (Git Bash):
# a virtual environment with the package and its dev tools, the tests' other tools, then the
# whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m venv .venv-ci
if [ -x .venv-ci/Scripts/python.exe ]; then py=.venv-ci/Scripts/python.exe; else py=.venv-ci/bin/python; fi
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet -c constraints.txt -e '.[dev]'
# curl, jq, node and the TypeScript MCP SDK the tests drive besides Python (the runners have
# the tools; this installs the SDK at its locked version).
bash scripts/test-tools.sh
"$py" -m pytest "$@"
