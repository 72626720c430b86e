#!/usr/bin/env bash
# Wheels for the release, into wheelhouse/:
#   bash build/wheels.sh pure      the sdist and the pure-Python wheel (py3-none-any)
#   bash build/wheels.sh platform  cibuildwheel's wheels with the compiled core for this runner
#                                  ([tool.cibuildwheel] in pyproject.toml)
# `pip install nulltickets` takes the platform wheel where there is one, else the pure wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: build/wheels.sh pure|platform}
python -m pip install --quiet build==1.6.1 cibuildwheel==4.3.5
case $mode in
    pure)
        NULLTICKETS_PURE_PYTHON_BUILD=1 python -m build --sdist --wheel --outdir wheelhouse
        ls -l wheelhouse
        ;;
    platform)
        python -m cibuildwheel --output-dir wheelhouse
        ls -l wheelhouse
        ;;
    *)
        echo "usage: build/wheels.sh pure|platform" >&2
        exit 2
        ;;
esac
