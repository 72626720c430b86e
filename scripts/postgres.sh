#!/usr/bin/env bash
# PostgreSQL for the tests and the benchmarks, from the distribution's packages:
#   scripts/postgres.sh install         install the server (a no-op when pg_ctl is already there)
#   scripts/postgres.sh bindir          print the folder holding pg_ctl and initdb
#   scripts/postgres.sh start DIR PORT  a throwaway cluster in DIR on 127.0.0.1:PORT (socket in DIR)
#   scripts/postgres.sh stop DIR        stop the cluster in DIR (fast shutdown)
# The tests and `make bench` start and stop their own server (benchmarks/pgcluster.py);
# start/stop are for trying things by hand. initdb refuses to run as root, so as root the
# cluster belongs to the `postgres` user that the package creates.
set -euo pipefail

bindir() {
    local found
    found=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -n "$found" ] && [ -x "$found/pg_ctl" ]; then
        echo "$found"
    elif command -v pg_ctl >/dev/null 2>&1; then
        dirname "$(command -v pg_ctl)"
    else
        return 1
    fi
}

as_owner() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

install() {
    if bindir >/dev/null; then
        return 0
    fi
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        sudo="sudo"
    fi
    export DEBIAN_FRONTEND=noninteractive
    # The package would create and start a system-wide cluster on port 5432; the tests run
    # their own, so ask for none (Debian's postgresql-common reads createcluster.d).
    $sudo mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" |
        $sudo tee /etc/postgresql-common/createcluster.d/nulltickets-tests.conf >/dev/null
    # The package lists may be missing or stale on a fresh machine: refresh only when the first
    # attempt cannot find the package.
    if ! $sudo apt-get install -y -q postgresql >/dev/null; then
        $sudo apt-get update -q >/dev/null
        $sudo apt-get install -y -q postgresql >/dev/null
    fi
    # Whatever cluster the package started anyway (an older postgresql-common) is stopped.
    if command -v pg_lsclusters >/dev/null 2>&1; then
        pg_lsclusters --no-header 2>/dev/null | while read -r version name _port status _rest; do
            if [ "$status" = online ]; then
                $sudo pg_ctlcluster "$version" "$name" stop || true
            fi
        done
    fi
    bindir >/dev/null || { echo "postgresql installed but no pg_ctl found" >&2; exit 1; }
}

start() {
    local dir=$1 port=$2 bin
    bin=$(bindir)
    mkdir -p "$dir"
    if [ "$(id -u)" = 0 ]; then
        chown postgres: "$dir"
    fi
    as_owner "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-locale >/dev/null
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -o \
        "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=on" start >/dev/null
    echo "postgresql://postgres@127.0.0.1:$port/postgres"
}

stop() {
    local dir=$1 bin
    bin=$(bindir)
    as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null
}

case "${1:-}" in
    install) install ;;
    bindir) bindir ;;
    start) start "${2:?DIR}" "${3:?PORT}" ;;
    stop) stop "${2:?DIR}" ;;
    *) echo "usage: $0 install | bindir | start DIR PORT | stop DIR" >&2; exit 2 ;;
esac
