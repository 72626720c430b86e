#!/usr/bin/env bash
# `nulltickets ARGS...` served by the container image, for the e2e tests: scripts/image.sh
# points NULLTICKETS_BINARY here, so tests/server.py starts each server with
# `serve --port P --db DIR/NAME.db ...` through this script. The container shares this
# machine's network (the port the test chose, on 127.0.0.1), mounts the database's directory
# at the same path (handed to the image's user, 65534, which the container runs as), takes
# the NULLTICKETS_* environment (the test's home directory among it), and gets the test's
# signals: `podman run` passes them on to the server and exits with its status.
set -euo pipefail
image=${NULLTICKETS_TEST_IMAGE:?NULLTICKETS_TEST_IMAGE names the image to test}
db=""
prev=""
for arg in "$@"; do
    if [ "$prev" = --db ]; then db=$arg; fi
    prev=$arg
done
mounts=()
if [[ $db == /* ]]; then
    dir=$(dirname "$db")
    chown 65534:65534 "$dir"
    mounts=(-v "$dir:$dir")
fi
# The image listens on every address; here, as the tests' own servers do, on the loopback.
export NULLTICKETS_HOST=127.0.0.1
exec podman run --rm --network host --no-healthcheck --label nulltickets-test-image \
    --env 'NULLTICKETS_*' "${mounts[@]}" "$image" "$@"
