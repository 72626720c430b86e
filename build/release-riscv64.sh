#!/usr/bin/env bash
# The linux riscv64 release job: build/release.sh inside a riscv64 manylinux container under
# QEMU user emulation (docker/setup-qemu-action registers it). granian, apsw, uvloop and
# zstandard have no riscv64 wheels and are compiled from their sdists: granian with the
# distribution's cargo; apsw's sdist build fetches the SQLite release it is pinned to (its
# setup.apsw says which), so the job needs nothing else. Slow: plan on hours, not minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
image=${NULLTICKETS_RISCV64_IMAGE:-quay.io/pypa/manylinux_2_39_riscv64}
docker run --rm --platform linux/riscv64 \
    -v "$PWD":/src -w /src \
    -e NULLTICKETS_FROM_SOURCE="granian apsw uvloop zstandard" \
    -e NULLTICKETS_SMOKE_ARGS="--timeout 600 --no-uvloop-check" \
    -e CARGO_NET_GIT_FETCH_WITH_CLI=true \
    "$image" bash -euo pipefail -c '
        dnf install -y cargo rust autoconf automake libtool
        cargo --version
        git config --global --add safe.directory /src
        bash build/release.sh /opt/python/cp312-cp312/bin/python
    '
