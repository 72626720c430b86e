#!/usr/bin/env bash
# deploy/kube/nulltickets.yaml brought up here with podman kube play (tests/deploy):
#   scripts/deploy-test.sh PYTHON
# Builds what the manifest runs, where no registry is reachable: the server's image
# (scripts/image.sh, once) and, on the same locally made Debian base, stand-ins for the
# registry's postgres and haproxy images from Debian's packages (tests/deploy/images), under
# the names the manifest uses. Then runs tests/deploy with podman set up as scripts/image.sh
# sets it up for this machine (runc, no default ulimits).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:?usage: scripts/deploy-test.sh PYTHON}
base=localhost/nulltickets-base:bookworm

eval "$(bash scripts/image.sh env | tail -n 1)"
if ! podman image exists localhost/nulltickets:latest || ! podman image exists "$base"; then
    PYTHON=$py bash scripts/image.sh build
fi
manifest=deploy/kube/nulltickets.yaml
for name in postgres haproxy; do
    image=$(sed -n "s|^ *image: \(docker.io/library/$name:[^ ]*\)$|\1|p" "$manifest")
    if ! podman image exists "$image"; then
        echo "making a stand-in for $image from Debian's $name"
        podman build --quiet --network host --build-arg "BASE=$base" \
            -f "tests/deploy/images/$name.Containerfile" -t "$image" tests/deploy/images > /dev/null
    fi
done
# Podman 4.3 can leave its lock table saying a lock is free while a pod still holds it (a race
# between removing containers, as `make test-image` just did, and their cleanup); `kube play`
# then gives that lock to a new container and waits for itself for ever, inside the pod's lock.
# Renumbering, while no container runs, rebuilds the table from what exists.
if [ -z "$(podman ps -q)" ]; then
    podman system renumber
fi
"$py" -m pytest -p no:cacheprovider tests/deploy -q -s
