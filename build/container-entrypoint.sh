#!/bin/sh
# The container image's entrypoint: `nulltickets ARGS...`, after one decision. Unless
# NULLTICKETS_HOST says where to listen, the server listens on every address of the container
# when NULLTICKETS_TOKEN is set, and otherwise on the container's loopback only, as the
# original's image does: a server reachable from a network needs a token (16 characters or
# more; it refuses to start without one), and an image started without one still runs.
set -eu

# Whether ARGS start the server and leave the address to the environment.
serving() {
    case "${1:-serve}" in
        serve | gateway | nulltickets) ;;
        -h | --help | --version | --export-manifest | --from-json) return 1 ;;
        -*) ;;
        *) return 1 ;;
    esac
    case " $* " in
        *" --host "* | *" --host="* | *" --token "* | *" --token="*) return 1 ;;
    esac
}

if [ -z "${NULLTICKETS_HOST:-}" ]; then
    if [ -n "${NULLTICKETS_TOKEN:-}" ]; then
        NULLTICKETS_HOST=0.0.0.0
    else
        NULLTICKETS_HOST=127.0.0.1
        if serving "$@"; then
            hint="no NULLTICKETS_TOKEN, so listening on the container's loopback only; set NULLTICKETS_TOKEN (16+ characters) to serve on its network"
            if [ "${NULLTICKETS_LOG_FORMAT:-}" = json ]; then
                printf '{"level": "warning", "logger": "entrypoint", "message": "%s"}\n' "$hint" >&2
            else
                printf 'WARNING entrypoint: %s\n' "$hint" >&2
            fi
        fi
    fi
    export NULLTICKETS_HOST
fi
exec /opt/nulltickets/bin/nulltickets "$@"
