#!/usr/bin/env bash
# The container image (Containerfile), built and tested on this machine with podman:
#   scripts/image.sh build          the image nulltickets:<version> (and :latest, and the
#                                   release-root target as nulltickets:<version>-root)
#   scripts/image.sh test PYTHON    build, then tests/image/test_image.py (volume, restart,
#                                   SIGTERM, user) and the agent-contract e2e tests against it,
#                                   on SQLite and on PostgreSQL
#   scripts/image.sh base           only the base image (made once, then kept)
#   scripts/image.sh env            print the CONTAINERS_CONF line for using podman by hand
#
# Installs podman, runc and debootstrap from Debian when they are missing. No registry is
# needed: the base image (Debian 12 slim) is made here once with debootstrap and imported
# into podman's storage as $BASE_NAME; later builds reuse it (`podman rmi` it to remake it).
# podman runs with runc (crun cannot start containers under every cgroup setup) and without
# default ulimits, from a containers.conf of our own in $work.
set -euo pipefail
cd "$(dirname "$0")/.."

work=${NULLTICKETS_IMAGE_DIR:-/var/tmp/nulltickets-image}
mirror=${NULLTICKETS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
BASE_NAME=localhost/nulltickets-base:bookworm
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' src/nulltickets/__init__.py)
IMAGE=${NULLTICKETS_IMAGE:-localhost/nulltickets:$version}

# The agent contract: the claim -> run -> transition/fail loop with its leases, fences and
# expiry, checkpoints, and the shared store; what every agent depends on.
AGENT_CONTRACT_TESTS="tests/e2e/test_claims.py tests/e2e/test_runs.py tests/e2e/test_checkpoints.py"
AGENT_CONTRACT_TESTS+=" tests/e2e/test_store.py tests/e2e/test_lease_expiry.py tests/e2e/test_fences.py"

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

tools() {
    local missing=()
    command -v podman >/dev/null || missing+=(podman)
    command -v runc >/dev/null || missing+=(runc)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing ${missing[*]}"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
    mkdir -p "$work"
    cat > "$work/containers.conf" <<'EOF'
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
    export CONTAINERS_CONF=$work/containers.conf
}

base() {
    if podman image exists "$BASE_NAME"; then
        return 0
    fi
    local root=$work/rootfs started=$SECONDS
    echo "making the base image $BASE_NAME (debootstrap bookworm from $mirror)"
    as_root rm -rf "$root"
    as_root debootstrap --variant=minbase bookworm "$root" "$mirror" > "$work/debootstrap.log" 2>&1 \
        || { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
    # As debian:bookworm-slim: the updates and security suites, and no documentation,
    # manual pages or translations (dpkg leaves them out of later installs too).
    as_root tee "$root/etc/apt/sources.list" > /dev/null <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
    as_root tee "$root/etc/dpkg/dpkg.cfg.d/slim" > /dev/null <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
EOF
    as_root find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
    as_root find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias \
        -exec rm -rf {} +
    as_root rm -rf "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/lib/apt/lists/* \
        "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*.log
    as_root tar -C "$root" --numeric-owner -c . | podman import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["bash"]' - "$BASE_NAME" > /dev/null
    as_root rm -rf "$root"
    echo "base image made in $((SECONDS - started)) s"
}

# pip inside the build: when this machine's pip goes through a TLS-inspecting proxy (its
# `cert` setting) or a package index of its own (http/https URLs), the build does the same.
pip_args() {
    local py=${PYTHON:-python3} cert index extra
    cert=${PIP_CERT:-$("$py" -m pip config get global.cert 2>/dev/null || true)}
    index=$("$py" -m pip config get global.index-url 2>/dev/null || true)
    extra=$("$py" -m pip config get global.extra-index-url 2>/dev/null || true)
    if [ -n "$cert" ] && [ -f "$cert" ]; then
        printf '%s\n' -v "$cert:/run/host-ca.pem:ro" --build-arg PIP_CERT=/run/host-ca.pem
    fi
    if [[ $index == http* ]]; then
        printf '%s\n' --build-arg "PIP_INDEX_URL=$index"
    fi
    extra=$(tr ' ' '\n' <<< "$extra" | grep '^http' | tr '\n' ' ' || true)
    if [ -n "${extra// /}" ]; then
        printf '%s\n' --build-arg "PIP_EXTRA_INDEX_URL=$extra"
    fi
}

build() {
    tools
    base
    local started=$SECONDS args=()
    mapfile -t args < <(pip_args)
    # --format docker: the OCI format has no HEALTHCHECK. --network host: apt and pip reach
    # their servers as this machine does.
    podman build --format docker --network host --build-arg "BASE=$BASE_NAME" "${args[@]}" \
        -f Containerfile -t "$IMAGE" -t localhost/nulltickets:latest .
    podman build --format docker --network host --build-arg "BASE=$BASE_NAME" "${args[@]}" \
        -f Containerfile --target release-root -t "$IMAGE-root" . > /dev/null
    echo "built $IMAGE in $((SECONDS - started)) s: $(podman image inspect -f '{{.Size}}' "$IMAGE" \
        | awk '{printf "%.1f MB", $1 / 1e6}') ($BASE_NAME alone: $(podman image inspect \
        -f '{{.Size}}' "$BASE_NAME" | awk '{printf "%.1f MB", $1 / 1e6}'))"
}

cleanup() {
    # Containers a test killed (SIGKILL to `podman run` leaves its container running).
    podman ps -a -q --filter label=nulltickets-test-image | xargs -r podman rm -f -t 0 > /dev/null
}

test_image() {
    local py=${1:?usage: scripts/image.sh test PYTHON}
    PYTHON=$py build
    trap cleanup EXIT
    local started=$SECONDS
    export NULLTICKETS_TEST_IMAGE=$IMAGE
    "$py" -m pytest -p no:cacheprovider tests/image -q
    # Every server of these tests is a container of the image (tests/image/serve.sh stands in
    # for the binary: tests/server.py runs it with the server's arguments): on SQLite files in
    # the tests' directories, then on databases of a PostgreSQL the tests start.
    for backend in sqlite postgres; do
        echo "agent-contract e2e tests against $IMAGE, on $backend"
        NULLTICKETS_TEST_BACKEND=$backend NULLTICKETS_BINARY=$PWD/tests/image/serve.sh \
            "$py" -m pytest -p no:cacheprovider -q -n "${PYTEST_WORKERS:-2}" $AGENT_CONTRACT_TESTS
    done
    echo "image tests passed in $((SECONDS - started)) s"
}

case ${1:-} in
    base) tools && base ;;
    build) build ;;
    test) test_image "${2:-}" ;;
    env) tools && echo "export CONTAINERS_CONF=$CONTAINERS_CONF" ;;
    *)
        echo "usage: scripts/image.sh build | test PYTHON | base | env" >&2
        exit 2
        ;;
esac
